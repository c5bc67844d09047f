"""Atomic writes (utils/io.py) give files and folders the modes the umask says; a folder replace cut between its
renames keeps the old folder."""
from __future__ import annotations

import pytest
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


def test_a_stop_between_the_renames_of_replace_dir_puts_the_old_folder_back(tmp_path, monkeypatch):
    """Ctrl-C (or the CLI's SIGTERM exception) after the old folder was moved aside and before the new one took its
    name: the old one is put back (before: nothing under the name, the old one hidden as .NAME.old)."""
    import os as _os

    from bertrain.utils import io as bio

    old, new = tmp_path / "out", tmp_path / ".out.new"
    old.mkdir(), new.mkdir()
    (old / "f").write_text("old"), (new / "f").write_text("new")
    real, calls = _os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the new folder into place
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(bio.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        bio.replace_dir(new, old)
    monkeypatch.undo()
    assert (old / "f").read_text() == "old" and not (tmp_path / ".out.old").exists()
