"""Compiling the CPU kernels ahead (runtime/warmup.py): a command on a machine whose numba cache
is empty compiles them first, says so in one line, and the next command does not; the stamp lives
in numba's cache, so clearing that cache clears it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from unweight.runtime.warmup import _tiny_llama

LINE = "compiling the CPU kernels for this machine"


def _cold_env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "UNWEIGHT_NO_WARMUP"}
    return env | {"NUMBA_CACHE_DIR": str(cache), "COLUMNS": "200"}


def _python(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=900)


def test_stamp_follows_numba_cache(tmp_path):
    r = _python(_cold_env(tmp_path / "numba"), "-c", "from unweight.runtime import warmup; print(warmup.compiled())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False"]


def test_sources_are_listed_alike_wherever_installed():
    """The stamp's digest reads the sources by folder and file name, not by path: an editable checkout
    (runtime/ before unweight/codec/) and an installed package (codec/ before runtime/) name one stamp,
    so that neither takes the other's compiled kernels for stale."""
    from unweight.runtime.warmup import _sources

    names = [(f.parent.name, f.name) for f in _sources()]
    assert names == sorted(names) and {folder for folder, _ in names} == {"codec", "kernels"}


def test_compiling_starts_from_an_empty_cache(tmp_path):
    """Compiling drops every cached codec and kernel function and the stamps of earlier sources: numba
    would keep a kernel whose inlined helper's file alone changed. Other files stay."""
    script = """
import sys
from pathlib import Path
from unweight.runtime import warmup
folders = warmup._cache_folders()
assert {f.name.split("_")[0] for f in folders} == {"codec", "kernels"}, folders
planted = ["cpu_int4._rows-10.py311.nbi", "cpu_int4._rows-10.py311.0.nbc", "unweight-warm-0123456789abcdef.stamp"]
for folder in folders:
    folder.mkdir(parents=True, exist_ok=True)
    for name in [*planted, "keep.txt"]:
        (folder / name).write_text("x")
print(warmup.purge(), *sorted(p.name for f in folders for p in f.iterdir()))
"""
    r = _python(_cold_env(tmp_path / "numba"), "-c", script)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["6", "keep.txt", "keep.txt"]


@pytest.mark.slow
def test_first_command_compiles_ahead_once(tmp_path):
    cache = tmp_path / "numba"
    env = _cold_env(cache)
    src = _tiny_llama(tmp_path / "src")
    first = _python(env, "-m", "unweight.cli.main", "compress", str(src), str(tmp_path / "a"), "--quiet")
    assert first.returncode == 0, first.stderr
    assert first.stderr.count(LINE) == 1, first.stderr
    # numba's cache now holds the codec's kernels and the runtime's, and the stamp beside them
    cached = {p.parent.name.split("_")[0] for p in cache.rglob("*.nbi")}  # numba names them codec_<hash>, ...
    assert {"codec", "kernels"} <= cached, sorted(cached)
    # ... the fp32 GEMV's parallel kernel (the tiny model's layers) and its serial one (one part),
    # on 64-weight chunks where this CPU has them, else on 8-weight groups
    from unweight.runtime.kernels.cpu_gemv import CHUNKS

    module, kernel = ("cpu_avx512", "_gemv_chunk_f32") if CHUNKS else ("cpu_avx2", "_gemv_fused")
    gemvs = {p.name.split(".")[1].split("-")[0] for p in cache.rglob(f"{module}.{kernel}*.nbi")}
    assert {f"{kernel}_at", f"{kernel}_one"} <= gemvs, sorted(gemvs)
    grouped = "_gemv_grouped_chunk_f32_at" if CHUNKS else "_gemv_grouped_at"  # the MoE experts' GEMV
    assert list(cache.rglob(f"{module}.{grouped}-*.nbi")), grouped
    assert list(cache.rglob("unweight-warm-*.stamp"))
    again = _python(env, "-m", "unweight.cli.main", "compress", str(src), str(tmp_path / "b"), "--quiet")
    assert again.returncode == 0, again.stderr
    assert LINE not in again.stderr
    r = _python(env, "-m", "unweight.runtime.warmup")
    assert r.returncode == 0 and "already compiled" in r.stdout, r.stdout + r.stderr
