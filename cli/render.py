"""Rendering library results for the terminal (rich tables, progress bars) and as JSON."""

from __future__ import annotations

import re
from collections.abc import Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from unweight.report import CompressReport, Totals

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(value) -> str:
    """`value` as text with its control characters shown as escapes: no terminal sequences and no
    line breaks from a name or path."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(value))


def safe(value) -> str:
    """`value` as text that rich prints literally: printable(), and markup escaped (a tensor named
    `[/]` or `[link=...]` is a name, not a style)."""
    return escape(printable(value))


class BarProgress:
    """The library's Progress protocol drawn as one rich bar (bytes of original tensors)."""

    def __init__(self, console: Console, verb: str, enabled: bool = True):
        self._bar = Progress(
            TextColumn(f"[bold]{verb}[/]"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.description}", style="dim"),
            console=console,
            transient=True,
            disable=not enabled,
        )
        self._task = None

    def __enter__(self) -> BarProgress:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)

    def start(self, total_bytes: int) -> None:
        self._task = self._bar.add_task("", total=total_bytes)

    def advance(self, label: str, nbytes: int) -> None:
        short = label if len(label) <= 48 else "…" + label[-47:]
        self._bar.update(self._task, advance=nbytes, description=safe(short))


def _row(label: str, t: Totals) -> list[str]:
    return [
        label,
        f"{t.tensors:,}",
        f"{t.original_bytes / 1e6:,.2f}",
        f"{t.stored_bytes / 1e6:,.2f}",
        f"{100 * t.saving:.2f} %",
        f"{t.bits_per_weight:.3f}",
    ]


def compress_table(report: CompressReport) -> Table:
    table = Table(title=f"{safe(report.source)} → {safe(report.destination)}  ({report.seconds:.1f} s)")
    for col in ("tensors", "count", "original MB", "stored MB", "saving", "bits/weight"):
        table.add_column(col, justify="left" if col == "tensors" else "right")
    for cls, t in report.by_class().items():
        table.add_row(*_row(cls, t))
    for dtype, t in report.by_dtype().items():
        table.add_row(*_row(f"dtype {safe(dtype)}", t), style="dim")
    table.add_row(*_row("total", report.totals()), style="bold")
    return table


def _optional(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


INSPECT_COLUMNS = (
    *("tensor", "dtype", "shape", "codec", "original KB", "stored KB"),
    *("bits/w", "exp H", "order-0 bound", "gap"),
)


def inspect_lines(stats: list) -> Iterator[str]:
    """The per-tensor table as plain aligned text, a line per tensor: rich drew 100k rows in over a
    minute, and a table that long is read with a pager or grep rather than as a box."""
    rows = [
        (
            printable(s.name),
            s.dtype,
            "x".join(map(str, s.shape)) or "()",
            printable(s.codec),
            f"{s.original_bytes / 1e3:,.1f}",
            f"{s.stored_bytes / 1e3:,.1f}",
            f"{s.bits_per_weight:.3f}",
            _optional(s.exponent_entropy),
            _optional(s.order0_bound),
            _optional(s.gap_to_bound),
        )
        for s in stats
    ]
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(INSPECT_COLUMNS)]
    left = {0, 1, 3}  # the text columns; numbers are right-aligned

    def line(cells) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    yield line(INSPECT_COLUMNS)
    yield "  ".join("-" * w for w in widths)
    for r in rows:
        yield line(r)


def inspect_groups_table(groups: list, file_count: int) -> Table:
    """The statistics by layer type (layer and expert numbers as `*`), with a total per class:
    a few dozen rows whatever the number of tensors."""
    count = sum(g.tensors for g in groups)
    table = Table(title=f"by layer type ({count:,} tensors in {file_count} file(s); --tensors for each one)")
    for col in (
        "layer type",
        "count",
        "dtype",
        "codec",
        "original MB",
        "stored MB",
        "bits/w",
        "exp H",
        "order-0 bound",
        "gap",
    ):
        table.add_column(col, justify="left" if col in ("layer type", "dtype", "codec") else "right")

    def row(label, g, style=None):
        table.add_row(
            safe(label),
            f"{g.tensors:,}",
            safe(",".join(g.dtypes)),
            safe(",".join(g.codecs)),
            f"{g.original_bytes / 1e6:,.2f}",
            f"{g.stored_bytes / 1e6:,.2f}",
            f"{g.bits_per_weight:.3f}",
            _optional(g.exponent_entropy),
            _optional(g.order0_bound),
            _optional(g.gap_to_bound),
            style=style,
        )

    from unweight.inspection import GroupStats

    classes: dict[str, GroupStats] = {}
    for g in groups:
        row(g.layer_type, g)
        c = classes.setdefault(g.tensor_class, GroupStats(g.tensor_class, g.tensor_class, [], []))
        c.merge(g)
    total = GroupStats("total", "total", [], [])
    for cls, c in classes.items():
        row(f"{cls} (all)", c, "dim")
        total.merge(c)
    row("total", total, "bold")
    return table


def generation_stats(r, weight_bytes: int, load=None) -> str:
    """One line: prompt tokens, generated tokens, time to first token, tokens/s, resident weights;
    with `load` (the model's LoadReport), beside the checkpoint's uncompressed size, and the load
    time with what its checksums took."""
    line = (
        f"prompt {r.prompt_tokens} tokens · generated {len(r.token_ids)} ({r.finish_reason}) · "
        f"first token {r.time_to_first_token_s * 1e3:.0f} ms · {r.decode_tokens_per_s:.1f} tokens/s · "
        f"weights {weight_bytes / 1e6:.1f} MB resident"
    )
    if load is not None:
        if load.original_bytes:
            line += (
                f" (uncompressed {load.original_bytes / 1e6:.1f} MB: {100 * weight_bytes / load.original_bytes:.0f} %)"
            )
        checked = load.stream_checked + load.decode_checked
        separate = load.stream_checked or load.decode_only_to_check  # checks that are not part of a decode
        extra = f", {load.check_seconds:.3f} s of it for checks alone" if separate else ""
        line += f" · loaded in {load.seconds:.2f} s ({checked} tensors checksummed{extra})"
    return line


def plan_tables(p, model: str, utilization: float) -> list[Table]:
    """`unweight plan`: the model's weights by tensor class, then one GPU's budget."""
    weights = Table(title=f"{safe(model)} ({safe(p.model_type)}): weights")
    for col in ("tensors", "params (B)", "dtype", "stored GB", "unweight resident GB"):
        weights.add_column(col, justify="left" if col in ("tensors", "dtype") else "right")
    for w in p.weights:
        if w.params:
            weights.add_row(
                w.name,
                f"{w.params / 1e9:,.3f}",
                safe(w.dtype),
                f"{w.stored_bytes / 1e9:,.2f}",
                f"{w.resident_bytes / 1e9:,.2f}",
            )
    total = (sum(w.params for w in p.weights), sum(w.stored_bytes for w in p.weights))
    resident = sum(w.resident_bytes for w in p.weights)
    weights.add_row(
        "total", f"{total[0] / 1e9:,.3f}", "", f"{total[1] / 1e9:,.2f}", f"{resident / 1e9:,.2f}", style="bold"
    )
    parallel = f"TP={p.tp}, PP={p.pp}" + (f", DP={p.dp}" if p.dp > 1 else "") + (", EP" if p.expert_parallel else "")
    budget = Table(title=f"one GPU of {p.gpus} ({parallel}), {p.gpu_bytes / 2**30:,.2f} GiB at {utilization:.0%}")
    for col in ("", "as stored", "unweight"):
        budget.add_column(col, justify="left" if not col else "right")
    usable = int(p.gpu_bytes * utilization)
    budget.add_row("weights GB", f"{p.gpu_weights_stored / 1e9:,.2f}", f"{p.gpu_weights_resident / 1e9:,.2f}")
    budget.add_row("vLLM's reserve GB (estimate)", *[f"{p.reserve_bytes / 1e9:,.2f}"] * 2)
    free = [(usable - w - p.reserve_bytes) / 1e9 for w in (p.gpu_weights_stored, p.gpu_weights_resident)]
    budget.add_row("left for the KV cache GB", *[f"{f:,.2f}" if f > 0 else "does not fit" for f in free])
    budget.add_row(
        f"KV cache tokens ({p.kv_bytes_per_token:,} bytes each)",
        f"{p.kv_tokens_stored:,}",
        f"{p.kv_tokens_resident:,}",
        style="bold",
    )
    return [weights, budget]
