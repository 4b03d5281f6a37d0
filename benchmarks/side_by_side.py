"""What the side-by-side benchmarks (hf_bench.py, vllm_bench.py) share: the CPU they ran on, and the
table of medians and ranges of a baseline's runs against ours, pooled over rounds and repetitions."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path


def _cache_size(level: int, kind: str) -> str:
    """The size of CPU 0's cache of `level` and `kind` (Data, Unified) in KiB ("32K"), or "?"."""
    from unweight.codec.simd import cache_bytes

    size = cache_bytes(level, kind)
    return "?" if size is None else f"{size >> 10}K"


def cpu_flags() -> str:
    """The CPU's model (name, and family/model, as a VM's name may hide the generation: AMD's
    family 25 is Zen 3 and 4, 26 Zen 5), its core count, its L1D and L2 sizes and its SIMD flags
    (tables are not comparable across them)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"unknown CPU, {os.cpu_count()} CPUs"
    fields: dict[str, str] = {}
    for line in info.splitlines():
        if not line.strip():
            break  # the first CPU's block
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    simd = [f for f in fields.get("flags", "").split() if f.startswith(("avx", "amx", "fma", "gfni"))]
    return (
        f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')}), "
        f"{os.cpu_count()} CPUs, L1D {_cache_size(1, 'Data')}, L2 {_cache_size(2, 'Unified')}, {' '.join(simd)}"
    )


def write_record(out: str | Path, record: dict) -> None:
    """A benchmark's JSON record, with the CPU it ran on, to `out` (its folder made), and say so."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**record, "cpu": cpu_flags()}, indent=2))
    print(f"wrote {out}")


def pooled(runs: list[dict], key: str) -> list[float]:
    """Every value of `key` over the runs (a run holds one value or a list of repetitions)."""
    return [v for run in runs for v in (run[key] if isinstance(run[key], list) else [run[key]])]


def table(base: list[dict], ours: list[dict], rows: list[tuple[str, str]], names: tuple[str, str]) -> dict:
    """Print a markdown table, one row per (label, key): the medians (ranges) of both sides and the
    ratio ours / base; returns {key: {names[0]: median, names[1]: median, "ratio": ...}}. Keys
    holding "bytes" print in MiB."""
    print(f"| figure | {names[0]} median (range) | {names[1]} median (range) | {names[1]} / {names[0]} |")
    print("| --- | ---: | ---: | ---: |")
    summary = {}
    for label, key in rows:
        a, b = pooled(base, key), pooled(ours, key)
        ma, mb = statistics.median(a), statistics.median(b)
        summary[key] = {names[0]: ma, names[1]: mb, "ratio": mb / ma}

        def fmt(v: float) -> str:
            return f"{v / 2**20:,.1f} MiB" if "bytes" in key else f"{v:.3f}"

        print(
            f"| {label} | {fmt(ma)} ({fmt(min(a))}–{fmt(max(a))}) | {fmt(mb)} ({fmt(min(b))}–{fmt(max(b))}) "
            f"| {mb / ma:.2f}x |"
        )
    return summary
