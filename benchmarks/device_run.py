"""The one-shot GPU run: what a borrowed H200 should check and measure, in one command.

    python benchmarks/device_run.py --fetch-wheels   # here, once: what the GPU machine lacks, as cp312 wheels
    python benchmarks/device_run.py                  # there; results under $OUT (or --out)
    python benchmarks/device_run.py --dry-run        # here: every stage at tiny shapes, on the CPU through
                                                     # Triton's interpreter (tests/test_device_run.py)

The GPU machine runs its own software (GPU_MACHINE below) and nothing can be installed there from
outside. The project reaches it as its working tree; what the stages import beyond that machine's
packages travels as wheels in benchmarks/device_wheels/ (ignored by git; pass it to the device
tool's `carry`), installed with `pip install --no-index --no-deps --target` into a scratch folder.
The project itself is put on the path as its installed layout would be (pyproject.toml's
package-dir: `unweight.runtime` is runtime/, ...), by symlinks into the tree: no build, no pip.

Stages, in this order, each in a process of its own with its own time box (seconds on an H200),
so one that fails or runs out of time loses only itself; the run as a whole stops at --budget:
  env            versions, the GPU, the carried wheels installed, the project importable
  kernel_tests   the kernel tests on the GPU (tests/test_kernels.py, test_experts_kernel.py,
                 test_linear.py, and test_graph_step.py's CUDA graph replay against the eager step):
                 every kernel variant at every batch bucket, bit-exact decode, fused products
                 within the fp32 bound, the GPU-only tests (a dry run: a sample)
  kernel_bench   benchmarks/kernel_bench.py: correctness again at the 8B shapes, then each kernel
                 against torch.matmul, with the speed-ups the compile-only counts predict
  int4_bench     benchmarks/int4_gpu_bench.py: the W4A16 GEMV (codes as stored, BF16 or coded
                 scales) within the fp32 bound, then against torch.matmul on Kimi's expert shapes
  decode         benchmarks/decode_bench.py: the runtime's decode step at batch 1, 8 and 32,
                 compressed against dense BF16 weights in the same runtime
  hf_decode      the same shape decoded by transformers (static cache, torch.compile): the anchor

What comes back (at most 8 files): summary.md (a row per stage, then each stage's table),
device_run.json (each stage's status, seconds and results), log.txt (every stage's output), and
kernel_bench's kernel_bench.json, kernel_isa.json and kernel_isa.txt, and int4_gpu_bench.json. Both summary files are
rewritten after every stage.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / "benchmarks" / "device_wheels"
# What the stages import that the GPU machine does not have: exact versions, fetched by --fetch-wheels.
# zstandard: the codec imports it (unweight.codec); hypothesis (with sortedcontainers): the kernel tests.
CARRIED = ("zstandard==0.25.0", "hypothesis==6.170.17", "sortedcontainers==2.4.0")
# The GPU machine's own packages, as seen there (../shared/tools/README.md), by import name. Its
# torch, triton and transformers bring their own dependencies (sympy, tokenizers, ...).
GPU_MACHINE = {
    "python": "3.12.3",
    "packages": {
        "torch": "2.11.0",
        "triton": "3.6.0",
        "transformers": "5.17.0",
        "accelerate": None,
        "peft": None,
        "numba": None,
        "numpy": "2.5",
        "safetensors": "0.8",
        "huggingface_hub": None,
        "typer": None,
        "rich": None,
        "pytest": None,
    },
    "absent": ("zstandard", "isal", "zmq", "fastapi", "uvicorn", "vllm"),
}
GPU_BUDGET = 480  # seconds: 8 of the 15 minutes a borrowed H200 gives, the rest for its start and a second try
TREE_LIMIT = 64 << 20  # the device tool carries at most this much: tracked files, untracked ones, the wheels


@dataclass
class Stage:
    name: str
    box_s: int  # on an H200
    dry_box_s: int  # on a CPU through the interpreter
    what: str
    results: dict = field(default_factory=dict)


STAGES = (
    Stage("env", 30, 120, "versions, GPU, wheels, imports"),
    # dry boxes: 10-20x a stage's time alone on 2 idle cores (48, 23, 16 and 27 s): CI's three workers on
    # its 2 cores stretched the whole dry run 4.5x (553 s against 123)
    Stage("kernel_tests", 120, 600, "kernel tests on the device"),
    Stage("kernel_bench", 150, 900, "kernels against torch.matmul"),  # dry: ptxas and the interpreter on a busy CI host
    Stage("int4_bench", 60, 450, "the W4A16 GEMV against torch.matmul"),
    Stage("decode", 120, 450, "the runtime's decode step, compressed against BF16"),
    Stage("hf_decode", 90, 300, "transformers' own BF16 decode (the anchor)"),
)


# -- here: the wheels -------------------------------------------------------------------------------


def fetch_wheels(dst: Path, python_version: str = "3.12") -> list[Path]:
    """Download CARRIED as binary wheels for the GPU machine's Python into dst (emptied first)."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", python_version, "--implementation", "cp", "-d", str(dst)]
    cmd += ["--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64", *CARRIED]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"pip download failed: {done.stderr.strip()[-800:]}")
    return sorted(dst.glob("*.whl"))


def carried_bytes(wheels: Path = WHEELS) -> int:
    """What the device tool would carry: the files git tracks or does not ignore, and the wheels."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    tree = sum((ROOT / os.fsdecode(p)).stat().st_size for p in listed if p and (ROOT / os.fsdecode(p)).is_file())
    return tree + sum(w.stat().st_size for w in wheels.glob("*.whl"))


# -- there: the environment ---------------------------------------------------------------------------


def project_site(site: Path) -> None:
    """Lay the project out in `site` as installing it would (pyproject's package-dir), by symlinks."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg.get("package-dir", {})
    top = ROOT / dirs.get("unweight", "unweight")
    pkg = site / "unweight"
    pkg.mkdir(parents=True)
    for child in top.iterdir():
        if child.name != "__pycache__":
            (pkg / child.name).symlink_to(child)
    for name, src in dirs.items():
        if name.count(".") == 1:  # unweight.runtime -> runtime/, ...
            (pkg / name.split(".")[1]).symlink_to(ROOT / src)


def install_wheels(wheels: Path, site: Path) -> list[str]:
    found = sorted(wheels.glob("*.whl"))
    if found:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        subprocess.run([*cmd, "--target", str(site), *map(str, found)], check=True, capture_output=True)
    return [w.name for w in found]


RECORDER = """import atexit, os, sys
def _unweight_record():
    with open(os.path.join(os.environ["UNWEIGHT_IMPORTS"], f"{os.getpid()}.txt"), "w") as f:
        f.write("\\n".join(sorted({m.split(".")[0] for m in list(sys.modules)})))
atexit.register(_unweight_record)
"""


def stage_command(stage: str, dry: bool, out: Path) -> list[str]:
    py = sys.executable
    if stage == "env":
        return [py, str(Path(__file__)), "--env-report"]
    if stage == "kernel_tests":
        tests = ["tests/test_kernels.py", "tests/test_experts_kernel.py", "tests/test_linear.py"]
        tests.append("tests/test_int4_matmul.py")
        tests.append("tests/test_graph_step.py::test_cuda_graph_replay_equals_the_eager_step")
        pick = (
            ["-k", "bit_exact and 16-64-0 or every_pipeline or experts_linear_matches and 2- or replay or grouped_gemv"]
            if dry
            else []
        )
        # -P: not the tree's root first on the path (its unweight/ is not the package as laid out)
        return [py, "-P", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests, *pick]
    if stage == "kernel_bench":
        dry_args = ["--dry-run", "--shapes", "q/o", "--batches", "1,9,40"] if dry else []
        return [py, str(ROOT / "benchmarks" / "kernel_bench.py"), "--out", str(out), *dry_args]
    if stage == "int4_bench":
        return [py, str(ROOT / "benchmarks" / "int4_gpu_bench.py"), "--out", str(out), *(["--dry-run"] if dry else [])]
    bench = [py, str(ROOT / "benchmarks" / "decode_bench.py"), "--json", str(out / f".{stage}.json")]
    tiny = ["--tiny", "--device", "cpu", "--steps", "3", "--batches", "1,8", "--modes", "off,eager"]
    tiny = tiny if dry else ["--batches", "1,8,32"]
    if stage == "decode":
        return [*bench, *tiny]
    # transformers compiles a graph per batch size: two of them fit its box
    return [*bench, *(tiny if dry else ["--batches", "1,8"]), "--hf-only"]


def env_report() -> None:
    """The env stage: what is installed, where it comes from, and whether the project imports."""
    import importlib

    report = {"python": platform.python_version()}
    for mod in [*GPU_MACHINE["packages"], *GPU_MACHINE["absent"]]:
        try:
            m = importlib.import_module(mod)
            report[mod] = f"{getattr(m, '__version__', '?')} ({Path(m.__file__).parent})"
        except ImportError:
            report[mod] = None
    import torch

    report["cuda"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    import unweight.runtime.model.llama  # noqa: F401  (the runtime, the codec and the kernels' launchers)
    from unweight.runtime.kernels import qtiles_matmul  # noqa: F401

    print(json.dumps(report))


def run_stage(stage: Stage, cmd: list[str], env: dict, box: float, log) -> dict:
    t0 = time.perf_counter()
    log.write(f"\n===== {stage.name}: {' '.join(cmd)} (time box {box:.0f} s)\n")
    log.flush()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines: list[str] = []
    status = "ok"
    try:
        deadline = t0 + box
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                status = "timed out"
                break
            if sel.select(timeout=min(left, 5)):
                line = proc.stdout.readline()
                if not line:
                    break
                lines.append(line)
                log.write(line)
                log.flush()
                sys.stdout.write(f"[{stage.name}] {line}")
                sys.stdout.flush()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    if status == "ok" and rc != 0:
        status = f"failed (exit {rc})"
    return {"status": status, "seconds": round(time.perf_counter() - t0, 1), "output": lines}


def results_of(stage: str, out: Path, lines: list[str]) -> dict:
    text = "".join(lines)
    if stage == "env":
        js = [ln for ln in lines if ln.startswith("{")]
        return json.loads(js[-1]) if js else {}
    if stage == "kernel_tests":
        counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", text)}
        return {**counts, "failures": re.findall(r"^FAILED (\S+)", text, re.M)}
    if stage in ("kernel_bench", "int4_bench"):  # its table: from the header to the first blank line
        start = next((i for i, ln in enumerate(lines) if ln.startswith("shape ")), len(lines))
        end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
        return {"table": [ln.rstrip() for ln in lines[start:end] if not ln.startswith("  ok ")]}
    f = out / f".{stage}.json"
    if f.exists():
        rec = json.loads(f.read_text())
        f.unlink()  # folded into device_run.json: the files that come back are few
        return rec
    return {}


def write_summary(out: Path, meta: dict, done: list[tuple[Stage, dict]]) -> None:
    md = [f"# device run {meta['date']}", "", f"{meta['device']}; {meta['versions']}", ""]
    md += ["| stage | status | seconds | what |", "| --- | --- | ---: | --- |"]
    md += [f"| {s.name} | {r['status']} | {r['seconds']} | {s.what} |" for s, r in done]
    for s, r in done:
        res = r.get("results", {})
        if s.name == "kernel_tests":
            md += ["", f"kernel tests: {json.dumps({k: v for k, v in res.items() if k != 'failures'})}"]
            md += [f"- FAILED {f}" for f in res.get("failures", [])]
        if res.get("table"):
            md += ["", f"## {s.name}", "", *res["table"]]
    tmp = out / ".summary.md"
    tmp.write_text("\n".join(md) + "\n")
    tmp.replace(out / "summary.md")
    record = {**meta, "stages": {s.name: {k: v for k, v in r.items() if k != "output"} for s, r in done}}
    tmp = out / ".device_run.json"
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(out / "device_run.json")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "device-out")))
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU through Triton's interpreter")
    ap.add_argument("--stages", default=",".join(s.name for s in STAGES), help="comma-separated, in the order above")
    ap.add_argument(
        "--budget", type=float, default=None, help="seconds for the whole run (default 480; a dry run: the boxes' sum)"
    )
    ap.add_argument("--wheels", type=Path, default=WHEELS, help="the carried wheels (default benchmarks/device_wheels)")
    ap.add_argument("--fetch-wheels", action="store_true", help="download CARRIED for the GPU machine, then stop")
    ap.add_argument("--python-version", default="3.12", help="with --fetch-wheels: the Python to fetch for")
    ap.add_argument("--record-imports", type=Path, default=None, help="each stage's processes list their imports here")
    ap.add_argument("--env-report", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.env_report:
        env_report()
        return 0
    if args.fetch_wheels:
        got = fetch_wheels(args.wheels, args.python_version)
        print("\n".join(f"{w.name} ({w.stat().st_size / 1e6:.1f} MB)" for w in got))
        print(f"tree and wheels: {carried_bytes(args.wheels) / 2**20:.1f} MiB of {TREE_LIMIT >> 20} MiB")
        return 0
    wanted = args.stages.split(",")
    unknown = set(wanted) - {s.name for s in STAGES}
    if unknown:
        ap.error(f"unknown stages {', '.join(sorted(unknown))}; stages: {', '.join(s.name for s in STAGES)}")
    stages = [s for s in STAGES if s.name in wanted]
    budget = args.budget or (sum(s.dry_box_s for s in stages) if args.dry_run else GPU_BUDGET)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    site = Path(tempfile.mkdtemp(prefix="unweight-device-site-"))
    project_site(site)
    wheels = install_wheels(args.wheels, site)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env["PYTHONUNBUFFERED"] = "1"
    env["TRITON_INTERPRET"] = "1" if args.dry_run else "0"
    if args.record_imports:
        args.record_imports.mkdir(parents=True, exist_ok=True)
        (site / "sitecustomize.py").write_text(RECORDER)
        env["UNWEIGHT_IMPORTS"] = str(args.record_imports.resolve())
    import torch
    import triton

    meta = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.dry_run else "cpu (dry run)",
        "versions": f"python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}",
        "dry_run": args.dry_run,
        "wheels": wheels,
    }
    done: list[tuple[Stage, dict]] = []
    with open(out / "log.txt", "a") as log:
        for stage in stages:
            left = budget - (time.perf_counter() - t_start)
            box = min(stage.dry_box_s if args.dry_run else stage.box_s, left)
            if box < 10:
                done.append((stage, {"status": "skipped: out of time", "seconds": 0}))
                continue
            r = run_stage(stage, stage_command(stage.name, args.dry_run, out), env, box, log)
            try:
                r["results"] = results_of(stage.name, out, r["output"])
            except (OSError, ValueError) as e:
                r["results"] = {"error": f"{type(e).__name__}: {e}"}
            done.append((stage, r))
            write_summary(out, {**meta, "seconds": round(time.perf_counter() - t_start, 1)}, done)
    shutil.rmtree(site, ignore_errors=True)
    ran = ", ".join(f"{s.name} {r['status']}" for s, r in done)
    print(f"\nstages: {ran}; results in {out}")
    return 0 if all(r["status"] == "ok" for _, r in done) else 1


if __name__ == "__main__":
    sys.exit(main())
