"""Shared test setup: the `gpu` marker skips cleanly without a supported CUDA GPU."""

from __future__ import annotations

import os

import pytest
import torch


def _has_sm90() -> bool:
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() == (9, 0)


HAS_SM90 = _has_sm90()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs an SM90 CUDA GPU (none found)")
    for item in items:
        if "gpu" in item.keywords and not HAS_SM90:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    # Every test gets its own disk cache so tests never see each other's (or the user's) entries.
    if "CUTE_ATTN_TEST_SHARED_CACHE" not in os.environ:
        monkeypatch.setenv("CUTE_ATTN_CACHE_DIR", str(tmp_path / "cute_attn_cache"))
    yield


@pytest.fixture
def seed():
    torch.manual_seed(0)
    return 0


@pytest.fixture
def built_bwd_keys(monkeypatch):
    """The BwdKeys the backward asks for during a test, in order (a spy on build_bwd), so a
    test can check that the variant it meant ran."""
    import cute_attn.bwd_sm90 as host

    built = []
    build = host.build_bwd

    def spy(key):
        built.append(key)
        return build(key)

    monkeypatch.setattr(host, "build_bwd", spy)
    return built


@pytest.fixture
def grouped_heads(monkeypatch, built_bwd_keys):
    """Force the GQA backward's group_heads variant (a CTA per KV head walking its query
    heads) whenever there is a group, whatever the grid size; yields the BwdKeys built."""
    import cute_attn.bwd_sm90 as host

    monkeypatch.setattr(host, "bwd_group_heads", lambda group, *_: group > 1)
    yield built_bwd_keys
