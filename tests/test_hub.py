"""Hub repo ids resolve through huggingface_hub's local cache, offline (tests never reach the Hub)."""

from __future__ import annotations

import pytest

from helpers import fake_hub_cache, random_bf16, run_cli, write_checkpoint


@pytest.mark.slow
def test_repo_id_from_the_local_cache_offline(tmp_path, monkeypatch):
    src = write_checkpoint(tmp_path / "src" / "model.safetensors", {"w": random_bf16(128, 64)}).parent
    (src / "config.json").write_text("{}")
    cache = tmp_path / "hub"
    fake_hub_cache(cache, "acme/tiny", src)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run_cli("compress", "acme/tiny", tmp_path / "out", "--json")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "config.json").exists()
    assert run_cli("verify", tmp_path / "out", "--against", src).returncode == 0


def test_unknown_repo_offline_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run_cli("compress", "acme/missing", tmp_path / "out")
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "acme/missing" in r.stderr and "HF_HUB_OFFLINE" in r.stderr
