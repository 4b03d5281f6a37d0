"""The serving-layout kernels on an NVIDIA GPU (the target: an H200) against torch.matmul on BF16.

One run, in this order, writing JSON and the tables to --out:
  1. correctness, before anything is timed: for every Llama-3.1-8B shape (q/o, k/v, stacked qkv,
     gate/up, stacked gate_up, down, lm_head) the decode kernel is bit-exact against the numpy
     decoder, and each pipeline at every batch (every fused variant the launcher picks) matches
     F.linear on the decoded weight within the fp32 summation bound K * 2^-24 * sum|x w| (plus
     the output's BF16 rounding); the first failure stops the script with exit status 1;
  2. per shape and batch, medians of triton.testing.do_bench: torch.matmul on dense BF16 (the
     baseline), `fused` (the qtiles kernels, batches <= 32) and `decode_matmul` (decode kernel,
     then cuBLAS); each one's speed-up, the best pipeline's, and beside it the speed-up that the
     compile-only counts predict (benchmarks/kernel_isa.py: instructions per weight against the
     SMs' issue rate, bytes per weight against the measured copy bandwidth).
The whole decode step is benchmarks/decode_bench.py's; benchmarks/device_run.py runs both on the GPU.

--dry-run runs all of it on the CPU at tiny shapes through Triton's interpreter (no timing worth
reading: each pipeline is timed by one call): it checks the script itself. On the GPU machine it
runs in device_run.py's kernel_bench stage, boxed to that stage's seconds.

Run:  python benchmarks/kernel_bench.py --out DIR [--dry-run] [--batches 1,2,4] [--shapes q/o,down]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_isa  # noqa: E402  (its constants; it runs in a process of its own)

from unweight.runtime.kernels import qtiles  # noqa: E402
from unweight.runtime.kernels.qtiles_decode import qtiles_decode  # noqa: E402
from unweight.runtime.kernels.qtiles_matmul import MAX_M, qtiles_linear  # noqa: E402
from unweight.runtime.kernels.weight import QTilesWeight  # noqa: E402

BATCHES = (1, 2, 4, 8, 12, 16, 32, 64, 256, 1024, 4096)
DRY_SHAPES = {"q/o 96x64": (96, 64), "down 40x200": (40, 200)}
DRY_BATCHES = (1, 3, 8, 17, 32, 40)
ISSUE = {
    "H200": (132, 1.98e9),
    "H100": (132, 1.98e9),
    "A100": (108, 1.41e9),
}  # SMs, boost clock; 128 thread-instructions per SM per clock


def make_weight(out_f: int, in_f: int, seed: int, device: str) -> torch.Tensor:
    """Trained-like BF16 weights, N(0, 0.02), made on the device."""
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(out_f, in_f, generator=g, device=device) * 0.02).to(torch.bfloat16)


def resident(w: torch.Tensor) -> QTilesWeight:
    rows, cols = w.shape
    host = w.view(torch.int16).cpu().numpy().view(np.uint16)
    return QTilesWeight.from_streams(qtiles.encode(host, rows, cols), rows, cols, device=w.device)


def time_ms(fn, device: str) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=30, return_mode="median"))
    if not DRY:  # a warm-up; the interpreter's times mean nothing, and one call checks that the pipeline runs
        fn()
    times = []
    for _ in range(1 if DRY else 3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy (read + write): the napkin bound."""
    n = (1 << 30) if device == "cuda" else (1 << 24)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * n / (time_ms(lambda: b.copy_(a), device) / 1e3)


def pipelines(q, out_f: int, in_f: int, m: int):
    """`q`: a QTilesWeight, its mode on the host as UnweightLinear's value holds it."""
    pipes = {"decode_matmul": lambda x: F.linear(x, qtiles_decode(q))}
    if m <= MAX_M:
        pipes["fused"] = lambda x: qtiles_linear(x, q)
    return pipes


def fail(msg: str) -> None:
    print(f"FAIL {msg}", flush=True)
    sys.exit(1)


def check(label: str, w: torch.Tensor, q, batches, device: str) -> None:
    out_f, in_f = w.shape
    if not torch.equal(qtiles_decode(q).view(torch.int16), w.view(torch.int16)):
        fail(f"{label}: the decode kernel is not bit-exact")
    rows = torch.tensor([out_f - 1, 0, out_f // 2], device=device)
    if not torch.equal(qtiles_decode(q, rows).view(torch.int16), w[rows].view(torch.int16)):
        fail(f"{label}: the decode kernel's row gather is not bit-exact")
    wf = w.float()
    host = {k: t.cpu().numpy() for k, t in q.streams().items()} | {"mode": np.array([q.mode], np.uint8)}
    stand = (
        torch.from_numpy(qtiles.stand_ins_reference(host, out_f, in_f).view(np.int16))
        .view(torch.bfloat16)
        .to(device)
        .float()
    )
    terms = (
        in_f + int(np.diff(host["esc_row"]).max(initial=0)) + 1
    )  # K stand-in products and each row's escape corrections
    for m in batches:
        x = torch.randn(m, in_f, device=device).to(torch.bfloat16)
        ref = F.linear(x.float(), wf)
        # fp32 summation over the stand-ins and the corrections x (w - w0) (tests/test_kernels.py:check_product),
        # + the BF16 output's rounding: to nearest on a GPU (2^-8), truncated by the interpreter (2^-7)
        bound = (
            terms * 2.0**-24 * F.linear(x.float().abs(), stand.abs() + (wf - stand).abs())
            + (2.0**-7 if DRY else 2.0**-8) * ref.abs()
        )
        for name, fn in pipelines(q, out_f, in_f, m).items():
            err = (fn(x).float() - ref).abs()
            if not torch.all(err <= bound):
                fail(f"{label} m={m} {name}: error {err.max().item():.3g} over the bound")
    print(
        f"  ok  {label}: decode bit-exact; pipelines within the fp32 bound at batches {', '.join(map(str, batches))}",
        flush=True,
    )


def predictions(
    out: Path, shapes: dict, batches: tuple[int, ...], device_name: str, bandwidth: float
) -> dict[tuple[str, int], float]:
    """(shape, batch) -> the fused speed-up that the compile-only counts predict: time per weight
    max(bytes / bandwidth, instructions / issue rate) against BF16's 2 bytes / bandwidth."""
    key = next((k for k in ISSUE if k in device_name), "H200")
    sms, clock = ISSUE[key]
    issue = sms * 128 * clock
    json_path = out / "kernel_isa.json"
    fused = ",".join(str(m) for m in batches if m <= MAX_M) or "1"
    cmd = [
        sys.executable,
        str(Path(kernel_isa.__file__)),
        "--targets",
        "90",
        "--json",
        str(json_path),
        "--batches",
        fused,
        "--shapes",
        ",".join(label.split()[0] + " " for label in shapes),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    (out / "kernel_isa.txt").write_text(done.stdout + done.stderr)
    if not json_path.exists():
        print(f"  kernel_isa.py failed (exit {done.returncode}): no predictions", flush=True)
        return {}
    kind = {
        label.split()[0]: label for label in shapes
    }  # "q/o", "down", ...: the dry run's small shapes take the 8B ones' counts
    pred = {}
    for row in json.loads(json_path.read_text())["rows"]:
        for case in row["cases"] if row.get("ok") else ():
            if case.endswith(" mode=1"):  # N(0, 0.02) weights take mode 0, as trained ones do
                continue
            isa_label, m = case.removeprefix("fused ").rsplit(" m=", 1) if case.startswith("fused ") else ("", 0)
            if isa_label.split(" ")[0] in kind:
                in_f = kernel_isa.SHAPES[isa_label][1]
                bytes_w = (
                    1.0 + 3 / 8 + kernel_isa.ESCAPE_RATE * 3 + 5 / in_f
                )  # sm, codes, listed escapes, row base and index
                per_w = row["per_w"] + row.get("esc_per_w", 0.0)
                pred[(kind[isa_label.split(" ")[0]], int(m))] = (2 / bandwidth) / max(
                    bytes_w / bandwidth, per_w / issue
                )
    return pred


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, required=True, help="folder for kernel_bench.json, kernel_isa.json and the table"
    )
    ap.add_argument(
        "--dry-run", action="store_true", help="tiny shapes on the CPU through Triton's interpreter: checks the script"
    )
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes")
    ap.add_argument(
        "--shapes",
        default=None,
        help="comma-separated shape labels (prefixes of: " + ", ".join(kernel_isa.SHAPES) + ")",
    )
    args = ap.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU machine, or with --dry-run")
    shapes = DRY_SHAPES if args.dry_run else kernel_isa.SHAPES
    if args.shapes:
        wanted = args.shapes.split(",")
        shapes = {k: v for k, v in shapes.items() if any(k.startswith(w) for w in wanted)}
        if not shapes:
            sys.exit(f"no shape matches {args.shapes!r}")
    batches = (
        tuple(int(b) for b in args.batches.split(",")) if args.batches else (DRY_BATCHES if args.dry_run else BATCHES)
    )
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run: Triton interpreter)"
    bw = copy_bandwidth(device)
    print(f"device {name}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)

    print("correctness:", flush=True)
    prepared = {}
    for i, (label, (out_f, in_f)) in enumerate(shapes.items()):
        w = make_weight(out_f, in_f, seed=i, device=device)
        q = resident(w)
        check(label, w, q, batches, device)
        prepared[label] = (w, q, q.stored_bytes)

    print("compile-only predictions (benchmarks/kernel_isa.py) ...", flush=True)
    pred = predictions(args.out, shapes, batches, name, bw)

    rows = []
    hdr = (
        f"{'shape':<22} {'batch':>5} {'bf16 ms':>9} {'fused x':>8} {'predicted':>9} "
        f"{'dec+mm x':>8} {'best':>14} {'fused GB/s':>10}"
    )
    print("\n" + hdr, flush=True)
    for label, (w, q, stored) in prepared.items():
        out_f, in_f = w.shape
        for m in batches:
            x = torch.randn(m, in_f, device=device).to(torch.bfloat16)
            base = time_ms(lambda: torch.matmul(x, w.T), device)
            row = {
                "shape": label,
                "out": out_f,
                "in": in_f,
                "batch": m,
                "bf16_ms": base,
                "stored_bytes_per_weight": stored / w.numel(),
                "predicted_fused_speedup": pred.get((label, m)),
            }
            for pname, fn in pipelines(q, out_f, in_f, m).items():
                ms = time_ms(lambda: fn(x), device)
                row[f"{pname}_ms"], row[f"{pname}_speedup"] = ms, base / ms
                row[f"{pname}_GBps"] = stored / ms / 1e6
            row["best"] = max(
                (p for p in ("fused", "decode_matmul") if f"{p}_speedup" in row), key=lambda p: row[f"{p}_speedup"]
            )
            rows.append(row)
            f = f"{row['fused_speedup']:>8.2f}" if "fused_speedup" in row else f"{'-':>8}"
            pr = f"{row['predicted_fused_speedup']:>9.2f}" if row["predicted_fused_speedup"] else f"{'-':>9}"
            gb = f"{row['fused_GBps']:>10.0f}" if "fused_GBps" in row else f"{'-':>10}"
            print(
                f"{label:<22} {m:>5} {base:>9.4f} {f} {pr} {row['decode_matmul_speedup']:>8.2f} "
                f"{row['best'] + ' ' + format(row[row['best'] + '_speedup'], '.2f'):>14} {gb}",
                flush=True,
            )

    result = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": name,
        "dry_run": args.dry_run,
        "copy_bandwidth_GBps": bw / 1e9,
        "rows": rows,
        "seconds": time.perf_counter() - t_start,
    }
    (args.out / "kernel_bench.json").write_text(json.dumps(result, indent=2))
    print(f"\nresults written to {args.out / 'kernel_bench.json'} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
