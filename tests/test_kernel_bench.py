"""benchmarks/kernel_bench.py, the one-shot GPU script, in its --dry-run: tiny shapes through
Triton's interpreter on the CPU, so that a device run does not fail on the script itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_kernel_bench_dry_run(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "kernel_bench.py"),
        "--dry-run",
        "--out",
        str(tmp_path),
        "--batches",
        "1,4,9,30,40",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "FAIL" not in done.stdout and done.stdout.count("  ok  ") == 2
    result = json.loads((tmp_path / "kernel_bench.json").read_text())
    rows = result["rows"]
    assert {(r["shape"].split()[0], r["batch"]) for r in rows} == {
        (s, b) for s in ("q/o", "down") for b in (1, 4, 9, 30, 40)
    }
    assert all(("fused_speedup" in r) == (r["batch"] <= 32) and r["decode_matmul_speedup"] > 0 for r in rows)
    assert all(
        r["predicted_fused_speedup"] for r in rows if r["batch"] <= 32
    )  # kernel_isa.py ran and its counts were mapped
    assert {(s["batch"], s["model"]) for s in result["decode_step"]} == {
        (b, m) for b in (1, 8) for m in ("bf16", "unweight")
    }
