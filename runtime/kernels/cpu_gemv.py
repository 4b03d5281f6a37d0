"""CPU path of the serving layout: numba kernels that rebuild `tiles` rows as they use them.

CPU decode is memory-bound too, so for small batches each W row is rebuilt eight weights at a time
and multiplied with every row of x as it is rebuilt, never materialising W (`tiles_gemv_cpu`). The
same rebuild serves gathers of whole rows (`tiles_rows_cpu`: embedding lookups, and the
decode-then-matmul pipeline), producing fp32 or BF16 directly, the dtype the CPU computes in
(exact either way: every BF16 value is an fp32 value).

The launchers: `tiles_gemv_cpu`, `tiles_grouped_gemv_cpu`, `tiles_rows_cpu` and `gemv_plan` take
W as one `TilesWeight` (weight.py), check their arguments and hand the streams' addresses to the
x86 kernels when the CPU and the layout allow (cpu_avx512.py's 64-weight chunks for BF16 and fp32
x where the CPU has AVX-512 VBMI2 and GFNI, else cpu_avx2.py's 8-weight groups), else the arrays to
the portable ones (cpu_reference.py).
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from numba import config

from .cpu_avx2 import (
    BF16_DOT,
    FAST_PATH,
    _gemv_fused_at,
    _gemv_fused_bf16_at,
    _gemv_fused_bf16_one,
    _gemv_fused_one,
    _gemv_grouped_at,
    _rows_fused_at,
    _rows_fused_bf16_at,
)
from .cpu_avx512 import (
    CHUNK_DOT,
    CHUNKS,
    _gemv_chunk_bf16_at,
    _gemv_chunk_bf16_one,
    _gemv_chunk_bf16_to_bf16_at,
    _gemv_chunk_bf16_to_bf16_one,
    _gemv_chunk_f32_at,
    _gemv_chunk_f32_one,
    _gemv_grouped_chunk_bf16_at,
    _gemv_grouped_chunk_f32_at,
    _rows_chunk_bf16_at,
)
from .cpu_reference import LOWBIT, SPREAD, _gemv_portable, _rows_portable
from .weight import TilesWeight

ROWS_PER_PART = 16  # rows a thread takes at least: fewer parts than this many rows each cost more than they save
# Row ranges the fused kernels split a call into: one per thread numba launches (set_num_threads
# may run fewer; each thread then takes several ranges). Cheaper than numba.get_num_threads(),
# whose call in a kernel would also stop numba from caching it.
_THREADS = max(1, config.NUMBA_NUM_THREADS)

# numba's default threading layer must not be entered from two Python threads at once, and one
# call already uses every core: parallel kernels are called under this lock.
_PARALLEL = threading.Lock()


def _args(w: TilesWeight) -> tuple:
    return w.sm.numpy(), w.codes.numpy(), w.esc.numpy(), w.esc_index.numpy()


def _addresses(codes, esc, esc_index) -> tuple:
    """(address, length) of the codes, escapes and escape index, as the fused kernels take them."""
    return codes.data_ptr(), codes.numel(), esc.data_ptr(), esc.numel(), esc_index.data_ptr(), esc_index.numel()


def _fast_layout(sm, codes, esc, esc_index, in_features: int) -> bool:
    """Whether the fused (AVX2) kernels take these streams: they read them by address, so the
    streams must lie on the CPU as tile_tensors makes them, rows a multiple of 8 long."""
    return (
        FAST_PATH
        and in_features
        and not in_features & 7
        and sm.is_cpu
        and sm.is_contiguous()
        and codes.is_contiguous()
        and esc.is_contiguous()
        and esc_index.is_contiguous()
        and esc_index.dtype is torch.int64
        and sm.dtype is torch.uint8
    )


def _parts(rows: int) -> int:
    from numba import get_num_threads

    return max(1, min(get_num_threads(), rows // ROWS_PER_PART))


# Each fused GEMV kernel as (parallel, serial): a call of one part takes the serial one, which
# enters no parallel region (about a microsecond a call, even with one thread) and needs no lock.
_FP32 = (_gemv_fused_at, _gemv_fused_one)
_BF16 = (_gemv_fused_bf16_at, _gemv_fused_bf16_one)
_CHUNK_BF16 = (_gemv_chunk_bf16_at, _gemv_chunk_bf16_one)
_CHUNK_BF16_TO_BF16 = (_gemv_chunk_bf16_to_bf16_at, _gemv_chunk_bf16_to_bf16_one)
_CHUNK_F32 = (_gemv_chunk_f32_at, _gemv_chunk_f32_one)


def _fused_kernel(x: torch.Tensor, bf16_out: bool) -> tuple:
    """(the fused GEMV kernels for x as (parallel, serial), x as they read it, y's dtype):
    vdpbf16ps for BF16 x on an AVX512_BF16 CPU (64-weight chunks where it has them, writing BF16 y
    if `bf16_out`), else fp32 FMAs on x in fp32 (on 64-weight chunks where the CPU has them)."""
    if x.dtype is torch.bfloat16 and BF16_DOT:
        if not CHUNK_DOT:
            kernels, dtype = _BF16, torch.float32
        else:
            kernels, dtype = (_CHUNK_BF16_TO_BF16, x.dtype) if bf16_out else (_CHUNK_BF16, torch.float32)
    else:
        kernels, dtype = _CHUNK_F32 if CHUNKS else _FP32, torch.float32
        if x.dtype is not torch.float32:
            x = x.float()
    return kernels, x if x.is_contiguous() else x.contiguous(), dtype


def _fused_parts(rows: int) -> int:
    """Row ranges a fused call splits into: one per thread, each at least ROWS_PER_PART rows."""
    parts = rows // ROWS_PER_PART
    return _THREADS if parts > _THREADS else parts or 1


def tiles_gemv_cpu(x: torch.Tensor, w: TilesWeight, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """y = x @ W^T in fp32 for x (..., in_features) on the CPU, W (out_features, in_features) in the
    serving layout; with `rows` (r0, r1), only W's rows [r0, r1): y is (..., r1 - r0) (one expert
    of a stacked MoE weight). BF16 x on a CPU with AVX512_BF16 goes through vdpbf16ps: products of
    BF16 pairs summed in fp32, as a BF16 GEMM sums them; any other x is multiplied in fp32."""
    sm, codes, esc, esc_index = w.sm, w.codes, w.esc, w.esc_index
    out_features, in_features, base = w.rows, w.cols, w.base
    bpr = -(-in_features // w.block)
    if rows is None:
        r0, n_out = 0, out_features
    else:
        r0, r1 = rows
        if not 0 <= r0 <= r1 <= out_features:
            raise ValueError(f"rows [{r0}, {r1}) lie outside the weight's {out_features} rows")
        n_out = r1 - r0
    # The fused kernels take the streams' addresses, so the streams must be laid out as
    # tile_tensors makes them. (Every line here is written for speed: a small layer's GEMV takes
    # tens of microseconds, and each Python-level step costs a tenth of one.)
    if x.is_cpu and _fast_layout(sm, codes, esc, esc_index, in_features):
        m = x.numel() // in_features
        lead = x.shape[:-1]
        kernels, x, _ = _fused_kernel(x, False)
        y = torch.from_numpy(np.empty((m, n_out), dtype=np.float32))
        if m and n_out:
            parts = _fused_parts(n_out)
            args = (x.data_ptr(), m, sm.data_ptr(), *_addresses(codes, esc, esc_index), out_features, in_features)
            if parts == 1:
                kernels[1](*args, bpr, base, r0, n_out, y.data_ptr(), 1)
            else:
                with _PARALLEL:
                    kernels[0](*args, bpr, base, r0, n_out, y.data_ptr(), parts)
        return y if len(lead) == 1 else y.view(*lead, n_out)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features).to(torch.float32).contiguous().numpy()
    y = np.empty((x2.shape[0], n_out), dtype=np.float32)
    if x2.shape[0] and n_out:
        with _PARALLEL:
            _gemv_portable(x2, *_args(w), in_features, bpr, base, y, r0, SPREAD, LOWBIT, _parts(n_out))
    return torch.from_numpy(y).reshape(*lead, n_out)


def gemv_plan(w: TilesWeight):
    """tiles_gemv_cpu of all of W for a layer's repeated calls: a function x -> x @ W^T for a CPU x
    (..., in_features), the layout checked and the streams' addresses read once (a forward of a
    small layer takes tens of microseconds, and those steps took several), or None where the x86
    kernels do not take the streams. y is BF16 for BF16 x on the 64-weight chunk kernels (each fp32
    sum rounded to nearest even, as .to(torch.bfloat16) rounds it), fp32 otherwise. Valid while the
    streams stay where they are: the caller keys it by the value `w` (a layer makes a new value
    whenever its streams move)."""
    sm, codes, esc, esc_index = w.sm, w.codes, w.esc, w.esc_index
    if not _fast_layout(sm, codes, esc, esc_index, w.cols):
        return None
    n, k = w.rows, w.cols
    streams = _streams(w)
    parts = _fused_parts(n)

    def gemv(x: torch.Tensor) -> torch.Tensor:
        kernels, x, dtype = _fused_kernel(x, True)
        m = x.numel() // k
        # (positional sizes: a tuple costs torch.empty a third of a microsecond more)
        y = torch.empty(m, n, dtype=dtype) if x.dim() == 2 else torch.empty((*x.shape[:-1], n), dtype=dtype)
        if not (m and n):
            return y
        if parts == 1:
            kernels[1](x.data_ptr(), m, *streams, y.data_ptr(), 1)
        else:
            with _PARALLEL:
                kernels[0](x.data_ptr(), m, *streams, y.data_ptr(), parts)
        return y

    return gemv


def _streams(w: TilesWeight) -> tuple:
    """The fused kernels' arguments that describe all of W (its streams' addresses and sizes)."""
    n, k = w.rows, w.cols
    return (w.sm.data_ptr(), *_addresses(w.codes, w.esc, w.esc_index), n, k, -(-k // w.block), w.base, 0, n)


def gemv_call(w: TilesWeight, dtype: torch.dtype) -> tuple | None:
    """The fused GEMV of all of W for contiguous CPU x in `dtype`, written in that same dtype, as a
    caller that holds `_PARALLEL` makes it (a decode step's plan, runtime/model/native_step.py):
    (kernel, streams, parts), y = x @ W^T being `kernel(x address, rows of x, *streams, y address,
    parts)` with y (rows, out_features) contiguous. The bits of gemv_plan's y. None where the x86 kernels do
    not take the streams or write y in another dtype (BF16 x without the chunk kernels' vdpbf16ps).
    Valid while the streams stay where they are (the caller keys it by the value `w`)."""
    if not _fast_layout(w.sm, w.codes, w.esc, w.esc_index, w.cols):
        return None
    if dtype is torch.bfloat16:
        if not CHUNK_DOT:
            return None
        kernels = _CHUNK_BF16_TO_BF16
    elif dtype is torch.float32:
        kernels = _CHUNK_F32 if CHUNKS else _FP32
    else:
        return None
    parts = _fused_parts(w.rows)
    return kernels[0] if parts > 1 else kernels[1], _streams(w), parts


def tiles_grouped_gemv_cpu(
    x: torch.Tensor, w: TilesWeight, starts: np.ndarray, rows0: np.ndarray, rows: int
) -> torch.Tensor:
    """y (P, rows) in fp32: for each group g, rows [starts[g], starts[g + 1]) of x (P, in_features)
    times W's rows [rows0[g], rows0[g] + rows) transposed, W (out_features, in_features) in the
    serving layout: the experts of a MoE layer stacked, each group the pairs routed to one expert,
    in one call. starts (G + 1,) rises from 0 to P; each rows0[g] + rows lies within W (checked).
    BF16 x goes through vdpbf16ps where the CPU has the 64-weight chunks and AVX512_BF16 (products
    of BF16 pairs summed in fp32), else in fp32 like any other x."""
    starts, rows0 = np.ascontiguousarray(starts, np.int64), np.ascontiguousarray(rows0, np.int64)
    out_features, in_features = w.rows, w.cols
    p = x.shape[0]
    if len(starts) != len(rows0) + 1 or starts[0] != 0 or starts[-1] != p or np.any(np.diff(starts) < 0):
        raise ValueError(f"group starts {starts.tolist()} do not split {p} rows of x into {len(rows0)} groups")
    if len(rows0) and (rows0.min() < 0 or rows0.max() + rows > out_features):
        raise ValueError(f"row ranges of {rows} from {rows0.tolist()} lie outside the weight's {out_features} rows")
    sm, codes, esc, esc_index = w.sm, w.codes, w.esc, w.esc_index
    if not (x.is_cpu and _fast_layout(sm, codes, esc, esc_index, in_features)):
        parts = [tiles_gemv_cpu(x[a:b], w, rows=(r0, r0 + rows)) for a, b, r0 in zip(starts[:-1], starts[1:], rows0)]
        return torch.cat(parts) if parts else torch.empty(0, rows)
    if x.dtype is torch.bfloat16 and CHUNK_DOT:  # vdpbf16ps, as tiles_gemv_cpu's BF16 x
        kernel, x = _gemv_grouped_chunk_bf16_at, x.contiguous()
    else:  # fp32 FMAs (BF16 x converted: exact)
        kernel, x = _gemv_grouped_chunk_f32_at if CHUNKS else _gemv_grouped_at, x.float().contiguous()
    y = torch.from_numpy(np.empty((p, rows), dtype=np.float32))
    if p and rows:
        per = _fused_parts(rows)  # parts of each group's rows: the groups are few
        with _PARALLEL:
            kernel(
                x.data_ptr(),
                p,
                sm.data_ptr(),
                *_addresses(codes, esc, esc_index),
                out_features,
                in_features,
                -(-in_features // w.block),
                w.base,
                starts,
                rows0,
                rows,
                y.data_ptr(),
                per,
            )
    return y


def tiles_rows_cpu(
    w: TilesWeight,
    ids: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows `ids` of W (all rows if None) as a (len(ids), in_features) tensor in `dtype`, exact in
    fp32 and BF16 (every BF16 value is an fp32 value), written into `out` if given (contiguous, of
    that shape and dtype). The fused kernels write fp32 or BF16 directly; another dtype is converted
    from fp32. The caller checks that ids lie in [0, out_features)."""
    sm, codes, esc, esc_index = w.sm, w.codes, w.esc, w.esc_index
    out_features, in_features, base = w.rows, w.cols, w.base
    bpr = -(-in_features // w.block)
    r = out_features if ids is None else ids.numel()
    if out is not None and (out.shape != (r, in_features) or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {(r, in_features)}")
    if dtype in (torch.float32, torch.bfloat16) and _fast_layout(sm, codes, esc, esc_index, in_features):
        idx = torch.arange(out_features) if ids is None else ids.reshape(-1).to("cpu", torch.int64).contiguous()
        if out is None:
            out = torch.empty(r, in_features, dtype=dtype)
        if r:
            parts = _fused_parts(r)
            if dtype is torch.float32:
                kernel = _rows_fused_at
            else:
                kernel = _rows_chunk_bf16_at if CHUNKS else _rows_fused_bf16_at
            with _PARALLEL:
                kernel(
                    sm.data_ptr(),
                    sm.numel(),
                    *_addresses(codes, esc, esc_index),
                    in_features,
                    bpr,
                    base,
                    idx.data_ptr(),
                    r,
                    out.data_ptr(),
                    parts,
                )
        return out
    if out is not None:
        return out.copy_(tiles_rows_cpu(w, ids))
    idx = np.arange(out_features, dtype=np.int64) if ids is None else ids.reshape(-1).to(torch.int64).numpy()
    out = np.empty((len(idx), in_features), dtype=np.uint32)
    if len(idx) and in_features:
        with _PARALLEL:
            _rows_portable(*_args(w), in_features, bpr, base, idx, out, SPREAD, LOWBIT, _parts(len(idx)))
    return torch.from_numpy(out.view(np.float32)).to(dtype)
