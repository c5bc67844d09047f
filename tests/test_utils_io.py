"""Atomic writes (utils/io.py) give files and folders the modes the umask says."""
from __future__ import annotations

from helpers import permissions

from bertrain.utils.io import atomic_dir, atomic_write_bytes, atomic_write_json


def test_atomic_writes_honour_the_umask(tmp_path, umask):
    atomic_write_bytes(tmp_path / "a.bin", b"x")
    atomic_write_json(tmp_path / "b.json", {"a": 1})
    with atomic_dir(tmp_path / "folder") as d:
        (d / "inner.txt").write_text("y")
    assert permissions(tmp_path / "a.bin") == permissions(tmp_path / "b.json") == 0o666 & ~umask
    assert permissions(tmp_path / "folder") == 0o777 & ~umask
    assert permissions(tmp_path / "folder" / "inner.txt") == 0o666 & ~umask  # a plain open(): as before
