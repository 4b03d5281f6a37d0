"""The compile-only kernel check (benchmarks/kernel_isa.py, quick mode): every variant the
launchers produce compiles for sm_90a and sm_80 with the bundled ptxas, spills nothing, keeps
every 32-bit index in range and stays within its instruction budget. No GPU needed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def triton_cache(tmp_path_factory) -> Path:
    """One Triton cache for the module: empty for the first run (so ptxas -v runs), then reused."""
    return tmp_path_factory.mktemp("triton-cache")


@pytest.mark.slow
def test_kernels_compile_within_budget(tmp_path, triton_cache):
    out = tmp_path / "isa.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "kernel_isa.py"), "--quick", "--json", str(out)]
    done = subprocess.run(
        [*cmd, "--cache-dir", str(triton_cache)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["cc"] for r in rows} == {80, 90}
    kernels = {r["variant"].split()[1] for r in rows}
    # experts: the grouped GEMV (qtiles_experts_linear); int4_gemv and "int4 experts": the W4A16 GEMV
    assert kernels == {"gemv", "dot", "decode", "experts", "int4_gemv", "int4"}
    for r in rows:
        assert r["ok"] and not r["problems"], r
        assert r["spill_st"] == 0
    gemv1 = [
        r for r in rows if r["cc"] == 90 and r["variant"].startswith("sm90 gemv ") and r["variant"].endswith("M=1")
    ]
    experts = [r for r in rows if r["cc"] == 90 and r["variant"].startswith("sm90 experts ")]
    assert {r["variant"].split()[-2] for r in experts} == {"X_DIV=1", "X_DIV=8"}  # top-1 and top-8
    for r in gemv1 + experts:  # the grouped GEMV keeps the batch-1 budget
        assert r["per_w"] <= 10 and r["ldg_per_w"] <= 0.5 and r["warps_per_sm"] >= 16, r
    assert gemv1 and max(r["per_w"] for r in experts) <= max(r["per_w"] for r in gemv1) + 0.1
    assert all(r["mma"] > 0 for r in rows if " dot " in r["variant"])  # the tensor cores do the products
    int4 = [r for r in rows if r["cc"] == 90 and "int4" in r["variant"]]  # BF16 and coded scales, alone and grouped
    assert {("SCALES=1" in r["variant"], " experts " in r["variant"]) for r in int4} == {
        (s, g) for s in (False, True) for g in (False, True)
    }
    assert all(r["per_w"] <= 4.2 for r in int4)  # an H200's bandwidth at 0.54 bytes a weight


@pytest.mark.slow
def test_check_fails_on_a_budget_it_misses(triton_cache):
    """The check is not a formality: with every budget tightened below what the kernels take, it
    exits 1 and names the variants (the variants come from the cache the first test filled)."""
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "kernel_isa.py"),
            "--quick",
            "--targets",
            "90",
            "--max-per-weight",
            "1",
            "--cache-dir",
            str(triton_cache),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 1
    assert "gemv BM=1" in done.stdout and "misses the budget 1" in done.stdout


def test_check_names_an_int32_overflow():
    """The index check on its own: a launch whose escape list passes 2^31 entries is flagged."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import kernel_isa
    finally:
        sys.path.pop(0)
    import torch

    huge = torch.zeros(1, dtype=torch.uint8).expand(2**31 + 5)
    rec = {
        "kernel": "qtiles_gemv_kernel",
        "grid": (512, 1, 1),
        "bound": {"M": 1, "G": 128, "BLOCK_N": 8, "BLOCK_M": 1, "esc_exp_ptr": huge},
    }
    assert any("escape entry" in p and "int32" in p for p in kernel_isa.check_launch(rec))
    rec["bound"]["esc_exp_ptr"] = huge[:1000]
    assert kernel_isa.check_launch(rec) == []
    rec["grid"] = (1, 70000, 1)
    assert any("grid" in p for p in kernel_isa.check_launch(rec))
