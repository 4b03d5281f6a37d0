"""Peak memory of every checkpoint command against the target: 1.5 × the largest tensor + 256 MiB.

Builds a checkpoint of one large BF16 matrix of N(0, 0.02) weights (the shape of a trained linear
layer's; its exponents spread as real ones do) plus a small F32 norm, written as a real
safetensors file, then runs each command in its own process through the CLI:

  compress                 unweight compress SRC ARCHIVE
  compress --layout serving unweight compress SRC SERVING --layout serving
  verify                   unweight verify ARCHIVE
  verify --against         unweight verify ARCHIVE --against SRC
  decompress               unweight decompress ARCHIVE OUT (then compared with SRC byte for byte)
  inspect                  unweight inspect ARCHIVE --json
  verify serving, decompress serving, inspect serving: the same on the tiles layout

and reads the child's own peak resident set (ru_maxrss from wait4, through
tests/peak_rss.py's run_measured). "python" is the interpreter with unweight and its codec imported
and nothing done: the floor every command starts from. Peak RSS is
memory, not time: a busy machine does not change it.

Run:  python benchmarks/memory_bench.py [--mib 1024] [--threads 0] [--workdir /tmp]
          [--out benchmarks/results/memory_bench.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

MiB = 1 << 20
SLACK = 256 * MiB
FACTOR = 1.5
COLS = 4096


def make_checkpoint(folder: Path, nbytes: int, seed: int = 0) -> int:
    """Write folder/model.safetensors: a (nbytes / 2 / COLS, COLS) BF16 weight and a small F32
    norm; returns the size of the largest tensor in bytes."""
    rows = max(1, nbytes // (2 * COLS))
    rng = np.random.default_rng(seed)

    def weight_rows():  # 64 rows at a time: the parent's memory stays small too
        for r0 in range(0, rows, 64):
            block = rng.normal(0.0, 0.02, size=(min(64, rows - r0), COLS)).astype(np.float32)
            yield (block.view(np.uint32) >> 16).astype(np.uint16)  # BF16 by truncation

    folder.mkdir(parents=True, exist_ok=True)
    norm = rng.normal(1.0, 0.1, size=COLS).astype(np.float32)
    entries = [("model.norm.weight", "F32", [COLS]), ("model.layers.0.mlp.up_proj.weight", "BF16", [rows, COLS])]
    _write(folder / "model.safetensors", entries, norm, weight_rows())
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": COLS}))
    return rows * COLS * 2


def _write(path: Path, entries, norm: np.ndarray, row_blocks) -> None:
    """A safetensors file (the header formats.write_safetensors builds for these entries) whose
    weight is streamed in row blocks: write_safetensors takes each tensor's bytes whole."""
    import struct

    from unweight.formats.dtypes import tensor_nbytes
    from unweight.formats.safetensors_file import encode_header

    cursor, rows = 0, []
    for name, dtype, shape in entries:
        n = tensor_nbytes(dtype, shape)
        rows.append((name, dtype, shape, cursor, cursor + n))
        cursor += n
    head = encode_header(rows, None)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        f.write(norm.tobytes())
        for block in row_blocks:
            f.write(block.tobytes())


def run_child(args: list[str]) -> tuple[int, int, str]:
    """(exit status, peak RSS in bytes, stderr tail) of one process: its own peak, not this
    process's (tests/peak_rss.py says why that needs care)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test support: envs, hosts, peak_rss
    from peak_rss import run_measured

    code, peak, _, err = run_measured(args)
    return code, peak, err[-2000:]


def commands(work: Path, threads: int) -> list[tuple[str, list[str]]]:
    cli = [sys.executable, "-m", "unweight.cli.main"]
    t = ["--threads", str(threads)]
    src, arc, srv = str(work / "src"), str(work / "archive"), str(work / "serving")
    return [
        ("python", [sys.executable, "-c", "import unweight.checkpoint, unweight.codec.rans, unweight.cli.main"]),
        ("compress", cli + ["compress", src, arc, "-q", "--json"] + t),
        ("compress --layout serving", cli + ["compress", src, srv, "--layout", "serving", "-q", "--json"] + t),
        ("verify", cli + ["verify", arc, "-q"] + t),
        ("verify --against", cli + ["verify", arc, "--against", src, "-q"] + t),
        ("decompress", cli + ["decompress", arc, str(work / "restored"), "-q"] + t),
        ("inspect", cli + ["inspect", arc, "--json"] + t),
        ("verify (serving)", cli + ["verify", srv, "-q"] + t),
        ("decompress (serving)", cli + ["decompress", srv, str(work / "restored-serving"), "-q"] + t),
        ("inspect (serving)", cli + ["inspect", srv, "--json"] + t),
    ]


def same_file(a: Path, b: Path) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(16 * MiB), fb.read(16 * MiB)
            if x != y:
                return False
            if not x:
                return True


def measure(nbytes: int, workdir: str | None, threads: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="unweight-memory-", dir=workdir))
    try:
        largest = make_checkpoint(work / "src", nbytes)
        target = FACTOR * largest + SLACK
        rows = []
        for label, args in commands(work, threads):
            code, peak, err = run_child(args)
            row = {
                "command": label,
                "exit": code,
                "peak_rss": peak,
                "ratio": peak / largest,
                "ok": code == 0 and peak <= target,
            }
            if code:
                row["stderr"] = err
            rows.append(row)
            print(
                f"  {label:<28} exit {code}  peak {peak / MiB:8.1f} MiB  {peak / largest:5.2f}× the tensor"
                f"  {'ok' if row['ok'] else 'OVER' if code == 0 else 'FAILED'}",
                flush=True,
            )
        for name in ("restored", "restored-serving"):
            restored = work / name / "model.safetensors"
            rows.append(
                {
                    "command": f"{name} == source",
                    "ok": restored.exists() and same_file(restored, work / "src" / "model.safetensors"),
                }
            )
        return {"largest_tensor": largest, "target": target, "rows": rows}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_table(result: dict) -> None:
    largest, target = result["largest_tensor"], result["target"]
    print(
        f"\nlargest tensor {largest / MiB:,.0f} MiB; target {FACTOR} × that + {SLACK // MiB} MiB = "
        f"{target / MiB:,.0f} MiB"
    )
    print("| command | peak RSS (MiB) | × largest tensor | within target |")
    print("|---|---:|---:|:---:|")
    for r in result["rows"]:
        if "peak_rss" in r:
            verdict = "yes" if r["ok"] else ("no" if r["exit"] == 0 else f"failed (exit {r['exit']})")
            print(f"| `{r['command']}` | {r['peak_rss'] / MiB:,.0f} | {r['ratio']:.2f} | {verdict} |")
        else:
            print(f"| {r['command']} | | | {'yes' if r['ok'] else 'NO'} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=float, default=1024, help="size of the BF16 weight in MiB (default 1024)")
    p.add_argument("--threads", type=int, default=0, help="--threads of every command (0: all CPUs)")
    p.add_argument("--workdir", default=None, help="where the checkpoints go (default: the temp folder); removed after")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/memory_bench.json"))
    args = p.parse_args(argv)
    result = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).as_posix()] + (sys.argv[1:] if argv is None else argv)),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__},
    }
    result.update(measure(int(args.mib * MiB), args.workdir, args.threads))
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"results written to {args.out}")
    return 0 if all(r["ok"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
