"""benchmarks/device_run.py, the one-shot GPU script, rehearsed on the GPU machine's own software as
far as a CPU allows: a virtual environment with only that machine's packages (triton 3.6.0,
transformers 5.17.0, ...; torch 2.13 CPU for its torch 2.11 CUDA), the carried wheels installed the
way the script installs them there, every stage in its --dry-run (tiny shapes, Triton's interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from envs import gpu_stack_env

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "device_run.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
import device_run  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gpu_python() -> Path:
    return gpu_stack_env()


def fetch(python: Path, dst: Path, version: str) -> list[Path]:
    cmd = [python, SCRIPT, "--fetch-wheels", "--python-version", version, "--wheels", dst]
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return sorted(dst.glob("*.whl"))


def top_level(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {n.split("/")[0].removesuffix(".py") for n in z.namelist() if ".dist-info/" not in n}


def test_the_tree_and_its_wheels_fit_what_the_device_tool_carries(tmp_path, gpu_python):
    """The GPU machine's Python is 3.12: its wheels, fetched as the script's --fetch-wheels does,
    with every file the tool would copy, stay under 64 MiB."""
    wheels = fetch(gpu_python, tmp_path, "3.12")
    assert {w.name.split("-")[0] for w in wheels} == {r.split("==")[0] for r in device_run.CARRIED}
    assert all("cp312" in w.name or "py3-none" in w.name for w in wheels)
    assert device_run.carried_bytes(tmp_path) < device_run.TREE_LIMIT


def test_dry_run_on_the_gpu_machines_stack(tmp_path, gpu_python):
    wheels = fetch(gpu_python, tmp_path / "wheels", "3.11")  # this rehearsal's python is 3.11
    out, imports = tmp_path / "out", tmp_path / "imports"
    cmd = [gpu_python, SCRIPT, "--dry-run", "--out", out, "--wheels", tmp_path / "wheels", "--record-imports", imports]
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=3000)  # past the boxes' sum
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]

    # what comes back: at most 8 files, each stage ok and recorded
    assert len(list(out.iterdir())) <= 8
    record = json.loads((out / "device_run.json").read_text())
    assert "triton 3.6.0" in record["versions"]
    stages = record["stages"]
    assert list(stages) == [s.name for s in device_run.STAGES]
    assert all(s["status"] == "ok" for s in stages.values()), stages
    assert "| kernel_tests | ok |" in (out / "summary.md").read_text()
    env = stages["env"]["results"]
    assert env["triton"].startswith("3.6.0") and env["transformers"].startswith("5.17.0")
    assert "unweight-device-site-" in env["zstandard"]  # from the carried wheel, in the scratch site
    tests = stages["kernel_tests"]["results"]
    assert tests["passed"] >= 3 and "failed" not in tests and not tests["failures"]

    # kernel_bench: correctness then timings at every batch, the compile-only predictions mapped
    bench = json.loads((out / "kernel_bench.json").read_text())
    assert {(r["shape"].split()[0], r["batch"]) for r in bench["rows"]} == {("q/o", b) for b in (1, 9, 40)}
    assert all(("fused_speedup" in r) == (r["batch"] <= 32) and r["decode_matmul_speedup"] > 0 for r in bench["rows"])
    assert all(r["predicted_fused_speedup"] for r in bench["rows"] if r["batch"] <= 32)

    # int4_bench: the W4A16 GEMV, plain and coded scales, checked then timed on both shapes and weights
    int4 = json.loads((out / "int4_gpu_bench.json").read_text())
    assert {(r["shape"].split()[0], r["weights"]) for r in int4["rows"]} == {
        (s, w) for s in ("w13", "w2") for w in ("gaussian", "student-t")
    }
    assert all(r[f"{k}_speedup"] > 0 and r[f"{k}_top8_speedup"] > 0 for r in int4["rows"] for k in ("plain", "coded"))
    assert stages["int4_bench"]["results"]["table"][0].startswith("shape ")

    # the runtime's decode step, compressed and dense, and transformers' beside it
    decode = stages["decode"]["results"]
    assert {(r["variant"], r["mode"], r["batch"]) for r in decode["rows"]} == {
        (v, m, b) for v in ("bf16", "unweight") for m in ("off", "eager") for b in (1, 8)
    }
    assert all(r["predicted_ratio"] > 1.2 for r in decode["rows"] if r["variant"] == "unweight")
    assert [r["batch"] for r in stages["hf_decode"]["results"]["transformers"]] == [1, 8]

    # every module a stage imported is the Python's own, the GPU machine's, a carried wheel's or the project's
    site = next(gpu_python.parent.parent.glob("lib/python3*/site-packages"))
    machine = {p.name.split(".")[0].split("-")[0] for p in site.iterdir()}
    carried = set().union(*(top_level(w) for w in wheels))
    ours = {"unweight", "sitecustomize", "conftest", "helpers"}
    ours.add("cython_runtime")  # not a package: the module Cython's compiled extensions register as they load
    ours |= {p.stem for p in (ROOT / "benchmarks").glob("*.py")} | {p.stem for p in (ROOT / "tests").glob("*.py")}
    recorded = set().union(*(set(f.read_text().split()) for f in imports.glob("*.txt")))
    assert {"torch", "triton", "unweight", "zstandard", "hypothesis"} <= recorded
    stdlib = set(sys.stdlib_module_names)
    strays = {m for m in recorded - stdlib - machine - carried - ours if not m.startswith("_") and "__" not in m}
    assert not strays, f"imported, but neither on the GPU machine nor carried: {sorted(strays)}"
    assert recorded & set(device_run.GPU_MACHINE["absent"]) <= carried


def test_kernel_isa_budgets_hold_under_triton_36(tmp_path, gpu_python):
    """The compile-only check with the GPU machine's triton (its bundled ptxas): every sm_90a
    variant compiles without spills, and the batch-1 GEMV keeps its budget."""
    out, site = tmp_path / "isa.json", tmp_path / "site"
    device_run.project_site(site)  # the project as the device script lays it out
    cmd = [gpu_python, ROOT / "benchmarks" / "kernel_isa.py", "--quick", "--targets", "90", "--json", out]
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "triton 3.6.0" in done.stdout
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["ok"] and not r["problems"] and r["spill_st"] == 0 for r in rows)
    gemv1 = [r for r in rows if r["variant"].startswith("sm90 gemv ") and r["variant"].endswith("M=1")]
    assert gemv1 and all(r["per_w"] <= 10 and r["ldg_per_w"] <= 0.5 for r in gemv1)
