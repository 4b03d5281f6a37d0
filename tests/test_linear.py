"""UnweightLinear on the CPU: both pipelines agree with nn.Linear, the autotuner caches and obeys
UNWEIGHT_PIPELINE, and resident memory is the compressed size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import random_bf16
from unweight.runtime.layers import autotune
from unweight.runtime.layers.autotune import KEEP_VERSIONS, VERSIONS_KEY, Autotuner, batch_bucket, code_version
from unweight.runtime.layers.linear import UnweightLinear


@pytest.fixture()
def layer(tmp_path):
    w = random_bf16(96, 160, seed=4)
    b = random_bf16(96, seed=5)
    return UnweightLinear.from_weight(w, b, autotuner=Autotuner(tmp_path / "tune.json")), w, b


def test_decoded_weight_is_bit_exact_and_not_kept(layer):
    mod, w, _ = layer
    assert torch.equal(mod.decoded_weight().view(torch.int16), w.view(torch.int16))
    assert mod.stored_bytes < 0.75 * w.numel() * 2  # no hidden BF16 copy among the buffers
    assert all(buf.dtype in (torch.uint8, torch.int64) for buf in mod.buffers())


@pytest.mark.parametrize("pipeline", ["decode_matmul", "fused"])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_pipelines_match_f_linear(layer, monkeypatch, pipeline, m):
    mod, w, b = layer
    monkeypatch.setenv("UNWEIGHT_PIPELINE", pipeline)
    x = torch.randn(2, m, 160, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    y = mod(x)
    ref = F.linear(x.float(), w.float(), b.float())
    assert y.shape == (2, m, 96) and y.dtype == torch.bfloat16
    # y is rounded to bf16 (2^-8 relative) after fp32 accumulation in either pipeline
    assert torch.allclose(y.float(), ref, rtol=2**-7, atol=1e-3)


def test_autotuner_caches_choice_on_disk(layer, tmp_path, monkeypatch):
    mod, _, _ = layer
    monkeypatch.delenv("UNWEIGHT_PIPELINE", raising=False)
    monkeypatch.setattr(autotune, "preemptions", lambda: 0)  # a quiet machine (CI's may be busy)
    mod(torch.randn(3, 160).to(torch.bfloat16))
    saved = json.loads((tmp_path / "tune.json").read_text())
    assert saved.pop(VERSIONS_KEY) == code_version()
    ((key, choice),) = saved.items()
    assert key.endswith(f"|96x160|m{batch_bucket(3)}|bfloat16|{code_version()}") and choice in (
        "decode_matmul",
        "fused",
    )
    again = Autotuner(tmp_path / "tune.json")
    assert again.choose(key, {"decode_matmul": lambda: None, "fused": lambda: None}, torch.device("cpu")) == (
        choice,
        None,
    )


def test_the_autotune_file_keeps_the_versions_tuned_last(tmp_path, monkeypatch):
    """Choices timed on other kernels stay for KEEP_VERSIONS - 1 other code versions (another checkout
    may share the file), the most recently tuned first; older ones go at the next save. A file from
    before the list keeps its versions as far as there is room."""
    monkeypatch.delenv("UNWEIGHT_PIPELINE", raising=False)
    monkeypatch.setattr(autotune, "preemptions", lambda: 0)  # a quiet machine: every choice is saved (CI's may be busy)
    path, now = tmp_path / "tune.json", code_version()
    old = [f"{i:012x}" for i in range(KEEP_VERSIONS + 1)]  # most recent first
    choices = {f"cpu-2|8x8|m1|bfloat16|{v}": "fused" for v in old} | {VERSIONS_KEY: " ".join(old)}
    path.write_text(json.dumps(choices))
    candidates = {"decode_matmul": lambda: None, "fused": lambda: None}
    Autotuner(path).choose(f"cpu-2|8x16|m1|bfloat16|{now}", candidates, torch.device("cpu"))
    saved = json.loads(path.read_text())
    kept = [now, *old[: KEEP_VERSIONS - 1]]
    assert saved.pop(VERSIONS_KEY) == " ".join(kept)
    assert sorted(saved) == sorted([f"cpu-2|8x16|m1|bfloat16|{now}"] + [f"cpu-2|8x8|m1|bfloat16|{v}" for v in kept[1:]])

    path.write_text(json.dumps({f"cpu-2|8x8|m1|bfloat16|{v}": "fused" for v in old[:2]} | {"not a key": "fused"}))
    Autotuner(path).choose(f"cpu-2|8x16|m1|bfloat16|{now}", candidates, torch.device("cpu"))
    saved = json.loads(path.read_text())
    assert saved.pop(VERSIONS_KEY).split() == [now, *old[:2]] and len(saved) == 3


class _Preempting:
    """Stands in for autotune.preemptions and for its clock: a run whose candidate is `victim` (every
    run if None) is preempted for its first `first` runs, and a preempted run takes 20x its time, as a
    parallel kernel waits out a scheduler slice. The clock is ours, not the host's: a busy CI host's
    wake-up latency (milliseconds) must not decide which candidate is faster."""

    def __init__(self, victim: str | None = None, first: int = 10**9, others: float = 1.0):
        self.victim, self.first, self.count, self.runs, self.now = victim, first, 0, 0, 0.0
        self.others = others  # the share of the cores other processes take (autotune.other_cpu)

    def __call__(self) -> int:
        return self.count

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(autotune, "preemptions", self)
        monkeypatch.setattr(autotune, "time", SimpleNamespace(perf_counter=lambda: self.now))
        monkeypatch.setattr(autotune, "other_cpu", lambda: self.now * self.others * os.cpu_count())

    def candidate(self, name: str, seconds: float):
        def run():
            if self.victim in (None, name) and self.runs < self.first:
                self.runs += 1
                self.count += 1
                self.now += seconds * 20
            else:
                self.now += seconds

        return run


def test_a_run_preempted_by_another_process_does_not_count(tmp_path, monkeypatch):
    """The fast pipeline's first runs are all preempted (each 20x its time, as on a busy 2-core host):
    the fastest of its first five would lose; its clean runs from then on win, and the choice is saved."""
    monkeypatch.delenv("UNWEIGHT_PIPELINE", raising=False)
    clock = _Preempting(victim="fused", first=7)
    clock.install(monkeypatch)
    candidates = {"decode_matmul": clock.candidate("decode_matmul", 0.004), "fused": clock.candidate("fused", 0.001)}
    path, key = tmp_path / "tune.json", f"cpu-2|8x8|m1|bfloat16|{code_version()}"
    assert Autotuner(path).choose(key, candidates, torch.device("cpu"))[0] == "fused"
    assert json.loads(path.read_text())[key] == "fused"


@pytest.mark.parametrize("others", [0.0, 0.5])
def test_preemptions_on_a_quiet_machine_are_this_process_own(tmp_path, monkeypatch, others):
    """Every run of the slow pipeline preempted, as numba's and torch's thread pools preempt each other
    on an idle host: where other processes took no CPU over the rounds, the runs count and the choice
    is saved; where they took half the cores, it is not (the next process times it again)."""
    monkeypatch.delenv("UNWEIGHT_PIPELINE", raising=False)
    clock = _Preempting(victim="decode_matmul", others=others)
    clock.install(monkeypatch)
    candidates = {"decode_matmul": clock.candidate("decode_matmul", 0.004), "fused": clock.candidate("fused", 0.001)}
    path, key = tmp_path / "tune.json", f"cpu-2|8x8|m1|bfloat16|{code_version()}"
    assert Autotuner(path).choose(key, candidates, torch.device("cpu"))[0] == "fused"
    assert clock.now * os.cpu_count() >= autotune.QUIET_WINDOW_S  # long enough to tell
    assert (json.loads(path.read_text()).get(key) if path.exists() else None) == ("fused" if others == 0 else None)


BUSY_HALF_SECOND = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\n"


def test_other_processes_cpu_time_is_read():
    """other_cpu() counts a child's busy half second of CPU time and not this process's own: the two
    windows differ by about the child's half second, whatever else the machine runs (CI's workers)."""
    if autotune.other_cpu() is None:
        pytest.skip("no /proc/stat on this OS: every preempted run counts as disturbed there")
    before = autotune.other_cpu()
    exec(BUSY_HALF_SECOND)  # this process's own
    own = autotune.other_cpu() - before
    before = autotune.other_cpu()
    subprocess.run([sys.executable, "-c", BUSY_HALF_SECOND], check=True)
    child = autotune.other_cpu() - before
    assert child - own > 0.25, (own, child)


def test_a_choice_timed_under_load_holds_for_the_process_only(tmp_path, monkeypatch, caplog):
    """Every run preempted: the choice serves this tuner, is not saved (nor by a later save of
    another key), and the next process's tuner times it again."""
    monkeypatch.delenv("UNWEIGHT_PIPELINE", raising=False)
    busy = _Preempting()
    busy.install(monkeypatch)
    path, key = tmp_path / "tune.json", f"cpu-2|8x8|m1|bfloat16|{code_version()}"
    tuner = Autotuner(path)
    candidates = {"decode_matmul": busy.candidate("decode_matmul", 0.0002), "fused": busy.candidate("fused", 0.0001)}
    with caplog.at_level("INFO", logger=autotune.__name__):
        assert tuner.choose(key, candidates, torch.device("cpu")) == ("fused", None)
    assert busy.runs == 2 * (autotune.MAX_ROUNDS + 1) and "not saved" in caplog.text
    assert not path.exists()
    assert tuner.choose(key, {"decode_matmul": None, "fused": None}, torch.device("cpu")) == ("fused", None)

    monkeypatch.setattr(autotune, "preemptions", lambda: 0)  # quiet again: another key is saved
    tuner.choose(key.replace("8x8", "8x16"), {"fused": lambda: None}, torch.device("cpu"))
    assert list(json.loads(path.read_text())) == [key.replace("8x8", "8x16"), VERSIONS_KEY]
    runs = []
    Autotuner(path).choose(key, {"decode_matmul": lambda: runs.append(1), "fused": lambda: None}, torch.device("cpu"))
    assert runs  # timed again


def test_bad_forced_pipeline_and_bad_weights(layer, monkeypatch):
    mod, _, _ = layer
    monkeypatch.setenv("UNWEIGHT_PIPELINE", "magic")
    with pytest.raises(ValueError, match="decode_matmul, fused"):
        mod(torch.randn(1, 160).to(torch.bfloat16))
    with pytest.raises(ValueError, match="2-D bfloat16"):
        UnweightLinear.from_weight(torch.randn(4, 4))
    from unweight.codec import tiles

    values = np.where(np.arange(64) % 2, 0x0001, 0x3F80).astype(np.uint16)  # exponents 0 and 127:
    p, s = tiles.encode(values, 8, 8, 8)  # one of them escapes, four per row
    with pytest.raises(ValueError, match="sm stream"):
        UnweightLinear(8, 8, dict(s, sm=s["sm"][:-1]), p.to_json())
    codes = s["codes"].copy()
    codes[5] = 0  # plane 2 of row 1: its escapes lose their code 7
    with pytest.raises(ValueError, match="esc_index entry 2"):
        UnweightLinear(8, 8, dict(s, codes=codes), p.to_json())


def test_batch_buckets():
    assert [batch_bucket(m) for m in (0, 1, 2, 3, 16, 17, 4096)] == [1, 1, 2, 4, 16, 32, 4096]


def test_from_entry_takes_serving_tiles_and_transcodes_archive():
    from unweight.codec import CodecOptions, encode_tensor

    w = random_bf16(64, 48, seed=8)
    data = w.view(torch.int16).numpy().view(np.uint8).ravel()
    for layout, codec in (("serving", "tiles"), ("archive", "rans")):
        entry, streams = encode_tensor("w", "BF16", (64, 48), data, CodecOptions(layout=layout))
        assert entry.codec == codec
        mod = UnweightLinear.from_entry(entry, streams)
        assert torch.equal(mod.decoded_weight().view(torch.int16), w.view(torch.int16))


def test_from_entry_names_a_corrupt_tensor():
    from unweight import CorruptDataError
    from unweight.codec import CodecOptions, encode_tensor

    values = random_bf16(32, 16, seed=2).view(torch.int16).numpy().view(np.uint8).ravel()
    entry, streams = encode_tensor("layers.0.q.weight", "BF16", (32, 16), values, CodecOptions(layout="serving"))
    broken = dict(streams, esc_index=np.zeros_like(streams["esc_index"]))
    broken["esc_index"][:4] = 1  # row 0 claims an escape before its first element
    with pytest.raises(CorruptDataError, match=r"layers\.0\.q\.weight.*esc_index entry 0"):
        UnweightLinear.from_entry(entry, broken)


@pytest.mark.parametrize("shape", [(10, 13), (7, 8), (3, 1)])
def test_fused_cpu_gemv_on_rows_not_aligned_to_code_groups(shape, monkeypatch, tmp_path):
    """K % 8 != 0 puts row starts inside code groups: the element-wise path of the GEMV."""
    monkeypatch.setenv("UNWEIGHT_PIPELINE", "fused")
    w = random_bf16(*shape, seed=11, std=1.0)
    w.view(torch.int16)[0, 0] = 0x0001  # an escape in the first row
    mod = UnweightLinear.from_weight(w, autotuner=Autotuner(tmp_path / "t.json"))
    x = torch.randn(3, shape[1], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert torch.allclose(mod(x).float(), F.linear(x.float(), w.float()), rtol=2**-7, atol=1e-3)


def _x86_kernels(chunks: bool, monkeypatch):
    """Run the x86 kernels of 64-weight chunks (AVX-512 VBMI2 and GFNI) or, with chunks False, the
    8-weight groups of cpu_avx2 even where the CPU has the former; skip where it has neither."""
    from unweight.runtime.kernels import cpu_gemv

    if chunks and not cpu_gemv.CHUNKS:
        pytest.skip("the 64-weight chunk kernels need AVX-512 BW, VBMI, VBMI2 and GFNI, which this CPU lacks")
    if not chunks:
        monkeypatch.setattr(cpu_gemv, "CHUNKS", False)
        monkeypatch.setattr(cpu_gemv, "CHUNK_DOT", False)


@pytest.mark.parametrize("chunks", [True, False], ids=["chunks", "groups"])
@pytest.mark.parametrize(
    "rows,cols,m",
    [(70, 200, 1), (33, 64, 5), (16, 1536, 9), (20, 100, 2), (40, 576, 16), (24, 64, 37), (12, 120, 3), (3, 12296, 3)],
)
def test_cpu_fast_and_portable_paths_agree(rows, cols, m, chunks, monkeypatch):
    """The x86 kernels (where the CPU has them; with AVX-512, passes of 16 rows of x at m = 16 and
    37; fp32 x and BF16 rows in 64-weight chunks or in groups of 8; with the chunks, x in column
    segments (X_SEGMENT_BYTES_F32, 24 or 36 KiB) at 1536 columns in 9 rows' pass of 8 and at 12296
    columns in 3 rows' padded pass of 4) against the portable numba ones: rows bit-exact, the
    GEMV within fp32 accumulation-order tolerance; both against the reference decoder, rows
    written in fp32 and straight in BF16 (every row of W too, eight at a time, so the tails of each
    thread's range are met)."""
    import numpy as np

    from unweight.codec import tiles
    from unweight.runtime.kernels import cpu_gemv

    _x86_kernels(chunks, monkeypatch)

    g = torch.Generator().manual_seed(rows * cols)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    w.view(torch.int16).view(-1)[::11] = 0x0001  # subnormal escapes
    w.view(torch.int16).view(-1)[3::17] = -15872  # 0xC200 = -32.0, above the window
    lin = UnweightLinear.from_weight(w)
    s = lin.compressed_weight
    x = torch.randn(m, cols, generator=g)
    ids = torch.tensor([rows - 1, 0, rows // 2, rows - 1])
    whole = torch.empty(rows, cols, dtype=torch.bfloat16)
    fast = (
        cpu_gemv.tiles_gemv_cpu(x, s),
        cpu_gemv.tiles_rows_cpu(s, ids),
        cpu_gemv.tiles_rows_cpu(s, ids, torch.bfloat16),
        cpu_gemv.tiles_rows_cpu(s, None, torch.bfloat16, out=whole),
    )
    assert fast[3] is whole
    monkeypatch.setattr(cpu_gemv, "FAST_PATH", False)
    slow = (
        cpu_gemv.tiles_gemv_cpu(x, s),
        cpu_gemv.tiles_rows_cpu(s, ids),
        cpu_gemv.tiles_rows_cpu(s, ids, torch.bfloat16),
        cpu_gemv.tiles_rows_cpu(s, None, torch.bfloat16, out=torch.empty_like(whole)),
    )
    for got in (fast[2], fast[3][ids], slow[2], slow[3][ids]):
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), w[ids].view(torch.int16))
    with pytest.raises(ValueError, match="out must be a contiguous torch.bfloat16 tensor of shape"):
        cpu_gemv.tiles_rows_cpu(s, ids, torch.bfloat16, out=whole)
    ref = tiles.decode_reference(
        {k: v.numpy() for k, v in s.streams().items() if k != "esc_index"}
        | {"esc_index": s.esc_index.numpy().astype("<u4").view(np.uint8)},
        s.params,
        rows,
        cols,
    )
    ref_rows = torch.from_numpy(ref.view(np.int16)).view(torch.bfloat16).reshape(rows, cols)[ids].float()
    assert torch.equal(fast[1].view(torch.int32), ref_rows.view(torch.int32)) and torch.equal(
        slow[1].view(torch.int32), ref_rows.view(torch.int32)
    )
    exact = torch.nn.functional.linear(x, w.float())
    bound = cols * 2.0**-23 * torch.nn.functional.linear(x.abs(), w.float().abs())
    for y in (fast[0], slow[0]):
        assert torch.all((y - exact).abs() <= bound)


@pytest.mark.parametrize("chunks", [True, False], ids=["chunks", "groups"])
@pytest.mark.parametrize(
    "rows,cols",
    [(40, 576), (24, 72), (64, 136), (33, 584), (20, 8), (18, 80), (27, 88), (16, 24), (9, 16)]
    + [(12, 40), (33, 48), (21, 104), (10, 120)]
    + [(20, 1544), (20, 3080), (6, 3080), (6, 6152), (3, 12296), (3, 24584)],
)
def test_cpu_bf16_kernel_sums_bf16_products_in_fp32(rows, cols, chunks, monkeypatch):
    """BF16 x on an AVX512_BF16 CPU: the vdpbf16ps kernels (64-weight chunks of W, whose last chunk
    holds 1 to 8 groups, or four groups a 512-bit quad, with group counts of every remainder mod
    4; passes of 16, 8, 4, 2 and 1 rows of x, padded ones among them, two to four passes of 16
    meeting W decoded once, and the tail rows of W; with the chunks, x wider than a pass keeps in
    L1 (X_SEGMENT_BYTES, 24 KiB or 48 KiB: 1544 or 3080 columns for passes of 16 and 8 rows, 3080
    or 6152 for 4, 12296 or 24584 for 2 and 1) in segments whose last one ends in a short chunk)
    are within fp32 accumulation-order tolerance of the exact product of the BF16 values, like the
    fp32 kernel."""
    from unweight.runtime.kernels import cpu_gemv

    if not cpu_gemv.BF16_DOT:
        pytest.skip("the vdpbf16ps kernel needs AVX512_BF16 and AVX512VL, which this CPU lacks")
    _x86_kernels(chunks, monkeypatch)
    calls = []
    name = "_CHUNK_BF16" if chunks else "_BF16"  # (parallel, serial): fewer than 32 rows take the serial one

    def counted(kernel):
        return lambda *a: calls.append(a[1]) or kernel(*a)

    monkeypatch.setattr(cpu_gemv, name, tuple(map(counted, getattr(cpu_gemv, name))))
    g = torch.Generator().manual_seed(rows + cols)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    w.view(torch.int16).view(-1)[3::17] = -15872  # escapes
    lin = UnweightLinear.from_weight(w)
    s = lin.compressed_weight
    for m in (1, 3, 9, 16, 37, 31, 10, 53, 64):
        x = torch.randn(m, cols, generator=g).to(torch.bfloat16)
        y = cpu_gemv.tiles_gemv_cpu(x, s)
        exact = x.double() @ w.double().T
        bound = cols * 2.0**-23 * (x.double().abs() @ w.double().abs().T)
        assert y.dtype == torch.float32 and torch.all((y.double() - exact).abs() <= bound)
    assert calls == [1, 3, 9, 16, 37, 31, 10, 53, 64]


@pytest.mark.parametrize(
    "rows,cols,m", [(80, 1536, 300), (200, 584, 267), (48, 576, 256), (250, 1536, 272), (200, 1536, 256)]
)
def test_cpu_bf16_prompt_gemm_sums_bf16_products_in_fp32(rows, cols, m):
    """A prompt of GEMM_ROWS rows or more: W decoded in blocks of 48 rows into the pairs layout,
    several to a slab (a short last block and slab among them; at 1536 columns a slab is two
    blocks, so 250 and 200 rows take several slabs even split over two threads), x read where it
    lies, its last chunk short of 64 columns (584), its last rows short of a block of 8: within fp32
    accumulation-order tolerance of the exact product; BF16 y is those sums rounded to nearest
    even, and a range of W's rows gives those columns' bits."""
    from unweight.runtime.kernels import cpu_avx512, cpu_gemv

    if not cpu_avx512.CHUNK_DOT:
        pytest.skip("the prompt GEMM needs AVX512_BF16 and the AVX-512 chunk kernels, which this CPU lacks")
    assert m >= cpu_avx512.GEMM_ROWS
    g = torch.Generator().manual_seed(rows + cols)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    w.view(torch.int16).view(-1)[3::17] = -15872  # escapes
    lin = UnweightLinear.from_weight(w)
    s = lin.compressed_weight
    x = torch.randn(m, cols, generator=g).to(torch.bfloat16)
    y = cpu_gemv.tiles_gemv_cpu(x, s)
    exact = x.double() @ w.double().T
    bound = cols * 2.0**-23 * (x.double().abs() @ w.double().abs().T)
    assert y.dtype == torch.float32 and torch.all((y.double() - exact).abs() <= bound)
    assert torch.equal(lin.run("fused", x).view(torch.int16), y.to(torch.bfloat16).view(torch.int16))
    part = cpu_gemv.tiles_gemv_cpu(x, s, rows=(17, rows - 5))
    assert torch.equal(part.view(torch.int32), y[:, 17 : rows - 5].contiguous().view(torch.int32))


@pytest.mark.parametrize("fast", [True, False])
def test_cpu_gemv_of_a_row_range_is_those_rows_of_the_whole(fast, monkeypatch):
    """`rows=(r0, r1)` (one expert of a stacked MoE weight) gives exactly columns [r0, r1) of the
    whole GEMV, the last rows of the tensor (the kernels' tail path) included; a range outside
    the weight is refused."""
    from unweight.runtime.kernels import cpu_gemv

    monkeypatch.setattr(cpu_gemv, "FAST_PATH", fast and cpu_gemv.FAST_PATH)
    rows, cols = 96, 64
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    w.view(torch.int16).view(-1)[5::13] = -15872  # escapes
    lin = UnweightLinear.from_weight(w)
    s = lin.compressed_weight
    for m in (1, 3, 9):
        x = torch.randn(m, cols, generator=g)
        whole = cpu_gemv.tiles_gemv_cpu(x, s)
        for r0, r1 in ((0, 32), (32, 64), (64, 96), (50, 51), (7, 7)):
            part = cpu_gemv.tiles_gemv_cpu(x, s, rows=(r0, r1))
            assert part.shape == (m, r1 - r0)
            assert torch.equal(part.view(torch.int32), whole[:, r0:r1].contiguous().view(torch.int32))
    with pytest.raises(ValueError, match="outside"):
        cpu_gemv.tiles_gemv_cpu(x, s, rows=(90, 100))


# Run in a child: each stream of a layer copied to the end of a page that an unreadable page follows,
# then the CPU kernels' GEMV (every pass size) and row decode. A read past a stream's end is a
# segfault there, a failed test here.
_GUARDED_CHILD = """
import ctypes, mmap
import torch
from unweight.runtime.layers.linear import UnweightLinear
PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(None, use_errno=True)
keep = []

def guarded(t):
    n = t.numel() * t.element_size()
    pages = -(-n // PAGE)
    m = mmap.mmap(-1, (pages + 1) * PAGE)
    keep.append(m)
    start = ctypes.addressof(ctypes.c_char.from_buffer(m))
    assert libc.mprotect(ctypes.c_void_p(start + pages * PAGE), PAGE, 0) == 0, ctypes.get_errno()
    out = torch.frombuffer(memoryview(m)[pages * PAGE - n : pages * PAGE], dtype=torch.uint8)
    out.copy_(t.contiguous().view(-1).view(torch.uint8))
    return out.view(t.dtype).view(t.shape)

g = torch.Generator().manual_seed(3)
for rows, cols in ((5, 64), (9, 576), (3, 136)):
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    w.view(torch.int16).view(-1)[rows * cols - 1] = -15872  # an escape in the last chunk
    lin = UnweightLinear.from_weight(w)
    s = lin.compressed_weight
    lin.assign_weight(s.with_streams({role: guarded(t) for role, t in s.streams().items()}))
    assert torch.equal(lin.decoded_weight().view(torch.int16), w.view(torch.int16))
    for m in (1, 2, 4, 8, 16):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, cols, generator=g).to(dtype)
            lin.run("fused", x)
print("ok")
"""


@pytest.mark.slow
def test_cpu_kernels_read_nothing_past_a_stream():
    """Every stream ends where an unreadable page begins: the fused GEMV (passes of 1 to 16 rows,
    fp32 and BF16 x) and the row decode read none of it (the 64-weight chunk kernels load a
    chunk's 24 code bytes by a plain 64-byte load only where the stream holds 64 bytes)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _GUARDED_CHILD], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert done.stdout.startswith("ok")


@pytest.mark.parametrize("fast", [True, False])
def test_cpu_grouped_gemv_is_each_groups_row_range(fast, monkeypatch):
    """One call for the experts of a MoE layer: group g's rows of x times W's rows [rows0[g],
    rows0[g] + R), the same bits as one row-range GEMV a group; empty groups, a range at the
    weight's end, and groups whose 64-weight chunk pass is padded (3 rows in a pass of 4 reading the
    next group's row, 5 in a pass of 8 reading past x) included, for fp32 and BF16 x; bad groups
    are refused."""
    import numpy as np

    from unweight.runtime.kernels import cpu_gemv

    monkeypatch.setattr(cpu_gemv, "FAST_PATH", fast and cpu_gemv.FAST_PATH)
    rows, cols, r = 96, 64, 24
    g = torch.Generator().manual_seed(9)
    w = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
    w.view(torch.int16).view(-1)[5::13] = -15872
    lin = UnweightLinear.from_weight(w)
    s = lin.compressed_weight
    x = torch.randn(12, cols, generator=g)
    starts, rows0 = np.array([0, 3, 3, 7, 12]), np.array([72, 0, 24, 48])
    for xv in (x, x.bfloat16()):  # BF16 x: vdpbf16ps where the CPU has it, as tiles_gemv_cpu
        y = cpu_gemv.tiles_grouped_gemv_cpu(xv, s, starts, rows0, r)
        assert y.shape == (12, r) and y.dtype == torch.float32
        for a, b, r0 in zip(starts[:-1], starts[1:], rows0):
            want = cpu_gemv.tiles_gemv_cpu(xv[a:b], s, rows=(r0, r0 + r))
            assert torch.equal(y[a:b].view(torch.int32), want.view(torch.int32))
    with pytest.raises(ValueError, match="do not split 12 rows"):
        cpu_gemv.tiles_grouped_gemv_cpu(x, s, np.array([0, 3, 6]), rows0[:2], r)
    with pytest.raises(ValueError, match="outside the weight"):
        cpu_gemv.tiles_grouped_gemv_cpu(x, s, np.array([0, 12]), np.array([80]), r)


def test_archive_linear_stacks_parts_of_any_size_and_codec_bit_exactly():
    """Parts decode into their rows of one buffer; a part that starts off an 8-byte boundary (5 rows
    of 3 BF16 = 30 bytes before it) takes the copying path."""
    from unweight.codec import CodecOptions, encode_tensor
    from unweight.runtime.layers.linear import ArchiveLinear

    weights = [random_bf16(5, 3, seed=11), torch.zeros(7, 3, dtype=torch.bfloat16), random_bf16(4000, 3, seed=12)]
    parts = []
    for i, w in enumerate(weights):
        data = w.view(torch.int16).numpy().view(np.uint8).ravel()
        parts.append(encode_tensor(f"p{i}", "BF16", tuple(w.shape), data, CodecOptions(threads=1)))
    assert len({e.codec for e, _ in parts}) >= 2  # more than one codec among them
    mod = ArchiveLinear(parts, threads=1)
    want = torch.cat(weights)
    assert torch.equal(mod.decoded_weight().view(torch.int16), want.view(torch.int16))
    x = random_bf16(2, 3, seed=13)
    assert torch.equal(mod(x).view(torch.int16), F.linear(x, want).view(torch.int16))


def test_archive_linear_rows_and_fp32_forward_in_row_blocks(monkeypatch):
    """rows(ids) across stacked parts gives the rows bit-exactly; the fp32 forward, W converted a
    few rows at a time (a block size that leaves a short last block), matches F.linear on W."""
    from unweight.codec import CodecOptions, encode_tensor
    from unweight.runtime.layers import linear as L
    from unweight.runtime.layers import workspace

    weights = [random_bf16(300, 64, seed=21), random_bf16(37, 64, seed=22)]
    parts = [
        encode_tensor(
            f"p{i}", "BF16", tuple(w.shape), w.view(torch.int16).numpy().view(np.uint8).ravel(), CodecOptions(threads=1)
        )
        for i, w in enumerate(weights)
    ]
    mod = L.ArchiveLinear(parts, threads=1)
    want = torch.cat(weights)
    ids = torch.tensor([[336, 0], [299, 300], [5, 5]])
    got = mod.rows(ids)
    assert got.shape == (6, 64) and torch.equal(got.view(torch.int16), want[ids.reshape(-1)].view(torch.int16))
    assert torch.equal(mod.rows(ids, torch.float32), want[ids.reshape(-1)].float())
    assert mod.rows(torch.tensor([], dtype=torch.long)).shape == (0, 64)
    with pytest.raises(ValueError, match=r"\[0, 337\)"):
        mod.rows(torch.tensor([337]))
    monkeypatch.setattr(workspace, "ROW_BLOCK_BYTES", 64 * 4 * 50)  # 50 rows a block: 7 blocks, the last of 37
    for shape in ((64,), (3, 64), (2, 5, 64)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(23))
        y = mod(x)
        assert y.shape == shape[:-1] + (337,) and y.dtype == torch.float32
        assert torch.allclose(y, F.linear(x, want.float()), rtol=1e-5, atol=1e-6)


def test_archive_linear_forwards_share_one_workspace_and_return_their_own_tensors(monkeypatch):
    """Layers decode W into one buffer per thread, grown to the largest W and then reused; what a
    forward returns does not alias it, and decoded_weight() still hands out a fresh copy."""
    import threading

    from unweight.codec import CodecOptions, encode_tensor
    from unweight.runtime.layers import linear as L
    from unweight.runtime.layers import workspace

    def layer(w):
        return L.ArchiveLinear(
            [
                encode_tensor(
                    "w",
                    "BF16",
                    tuple(w.shape),
                    w.view(torch.int16).numpy().view(np.uint8).ravel(),
                    CodecOptions(threads=1),
                )
            ],
            threads=1,
        )

    monkeypatch.setattr(workspace, "WORKSPACE", workspace.Workspace())  # empty, whatever ran before in this process
    small, big = random_bf16(64, 128, seed=41), random_bf16(512, 128, seed=42)
    a, b = layer(small), layer(big)
    x = random_bf16(3, 128, seed=43)
    ya = a(x)
    yb = b(x)
    buf = workspace.WORKSPACE.buf
    assert buf is not None and buf.nbytes == big.numel() * 2
    ya2 = a(x)
    assert workspace.WORKSPACE.buf is buf  # a smaller W reuses the larger buffer
    for y, w in ((ya, small), (yb, big), (ya2, small)):  # ya survived b's decode into the workspace
        assert torch.equal(y.view(torch.int16), F.linear(x, w).view(torch.int16))
    assert torch.allclose(b(x.float()), F.linear(x.float(), big.float()), rtol=1e-5, atol=1e-6)
    w = b.decoded_weight()
    a(x)
    assert torch.equal(w.view(torch.int16), big.view(torch.int16))
    other = []
    t = threading.Thread(target=lambda: (a(x), other.append(workspace.WORKSPACE.buf)))
    t.start()
    t.join()
    assert other[0] is not buf and other[0].nbytes == small.numel() * 2  # a thread has its own
    for dtype in (torch.bfloat16, torch.float32):  # autograd keeps W for backward: not the workspace's bytes
        xg = x.to(dtype, copy=True).requires_grad_()
        yg = a(xg)
        b(x)  # overwrites the workspace between the forward and the backward
        yg.sum().backward()
        want = x.to(dtype, copy=True).requires_grad_()
        F.linear(want, small.to(dtype)).sum().backward()
        assert torch.equal(xg.grad, want.grad)


def test_cpu_decode_matmul_decodes_into_the_workspace_in_xs_dtype(monkeypatch):
    """UnweightLinear's CPU decode-then-matmul writes W in x's dtype into the thread's workspace and
    multiplies it as F.linear does, bit for bit; layers take turns there, their results do not alias
    it; a W over WORKSPACE_MAX_BYTES, or one autograd keeps, gets fresh memory."""
    from unweight.runtime.layers import workspace as W

    monkeypatch.setattr(W, "WORKSPACE", W.Workspace())
    small, big = random_bf16(64, 128, seed=51), random_bf16(300, 128, seed=52)
    a, b = UnweightLinear.from_weight(small), UnweightLinear.from_weight(big)
    for dtype in (torch.bfloat16, torch.float32):
        x = random_bf16(7, 128, seed=53).to(dtype)
        ya, yb, ya2 = a.run("decode_matmul", x), b.run("decode_matmul", x), a.run("decode_matmul", x)
        assert W.WORKSPACE.buf.nbytes == 300 * 128 * x.element_size()  # the largest W seen, in x's dtype
        for y, w in ((ya, small), (yb, big), (ya2, small)):
            assert torch.equal(y.view(torch.int16), F.linear(x, w.to(dtype)).view(torch.int16))
    monkeypatch.setattr(W, "WORKSPACE_MAX_BYTES", 64 * 128 * 2)
    monkeypatch.setattr(W, "WORKSPACE", W.Workspace())
    x = random_bf16(7, 128, seed=54)
    b.run("decode_matmul", x)
    assert W.WORKSPACE.buf is None  # too large for it
    xg = x.clone().requires_grad_()
    a.run("decode_matmul", xg).sum().backward()
    assert W.WORKSPACE.buf is None and xg.grad is not None


@pytest.mark.gpu
def test_archive_linear_answers_on_the_inputs_device():
    """The streams stay on the CPU; rows and products come back where the ids and x are."""
    from unweight.codec import CodecOptions, encode_tensor
    from unweight.runtime.layers.linear import ArchiveLinear

    w = random_bf16(40, 32, seed=31)
    mod = ArchiveLinear(
        [
            encode_tensor(
                "w", "BF16", (40, 32), w.view(torch.int16).numpy().view(np.uint8).ravel(), CodecOptions(threads=1)
            )
        ]
    )
    ids = torch.tensor([7, 39], device="cuda")
    got = mod.rows(ids)
    assert got.device.type == "cuda" and torch.equal(got.cpu().view(torch.int16), w[[7, 39]].view(torch.int16))
    x = random_bf16(2, 32, seed=32).cuda()
    assert mod(x).device.type == "cuda"


def test_moving_to_a_gpu_transcodes_the_streams_and_back():
    """On a GPU the layer holds the resident qtiles layout (runtime/kernels/qtiles.py), on the CPU the
    stored tiles layout; the switch is bit-exact both ways. Checked here through the transcode
    that `.to("cuda")` runs, without a GPU."""
    from unweight.runtime.kernels import qtiles

    w = random_bf16(40, 96, seed=3)
    w.view(torch.int16).view(-1)[::7] = 0x0001
    w.view(torch.int16).view(-1)[2::9] = -15872
    lin = UnweightLinear.from_weight(w)
    tiles_bytes = lin.stored_bytes
    lin._transcode("cuda")
    assert set(lin.compressed_weight.streams()) == set(qtiles.ROLES) and "qtiles" in repr(lin)
    q = {k: v.numpy() for k, v in lin.compressed_weight.streams().items()}
    assert lin.compressed_weight.mode == 1  # one weight in seven is a subnormal: the zero code lists none of them
    assert np.array_equal(
        qtiles.decode_reference({**q, "mode": np.array([lin.compressed_weight.mode])}, 40, 96),
        w.view(torch.int16).numpy().view(np.uint16),
    )
    assert lin.stored_bytes < w.numel() * 2  # (11 % of these weights are listed escapes)
    lin._transcode("cpu")
    assert (
        set(lin.compressed_weight.streams()) == {"sm", "codes", "esc", "esc_index"} and lin.stored_bytes == tiles_bytes
    )
    assert torch.equal(lin.decoded_weight().view(torch.int16), w.view(torch.int16))
    assert lin.to("cpu") is lin and set(lin.compressed_weight.streams()) == {
        "sm",
        "codes",
        "esc",
        "esc_index",
    }  # no transcode to the same kind


@pytest.mark.gpu
def test_layer_on_gpu_matches_f_linear_every_pipeline(monkeypatch):
    w = random_bf16(300, 512, seed=4)
    lin = UnweightLinear.from_weight(w).to("cuda")
    for pipeline in ("fused", "decode_matmul"):
        monkeypatch.setenv("UNWEIGHT_PIPELINE", pipeline)
        for m in (1, 3, 8, 40):
            x = torch.randn(m, 512, device="cuda").to(torch.bfloat16)
            ref = F.linear(x.float(), w.cuda().float())
            assert torch.allclose(lin(x).float(), ref, rtol=2**-7, atol=1e-3)
    assert torch.equal(lin.cpu().decoded_weight().view(torch.int16), w.view(torch.int16))


def test_a_layer_built_for_a_gpu_is_encoded_once_in_its_layout():
    """from_weight / from_entry with a GPU device encode W straight into qtiles (no tiles encode
    and decode first); the streams are what the transcode would give, and .to('cpu') brings the
    layer back to tiles, bit-exact. Runs without a GPU: the layer is built, not moved, there."""
    from unweight.runtime.kernels import qtiles

    w = random_bf16(24, 160, seed=8)
    values = w.view(torch.int16).numpy().view(np.uint16)
    lin = UnweightLinear.from_weight(w, device="cuda")
    assert lin.compressed_weight.ROLES == qtiles.ROLES
    want = qtiles.encode(values, 24, 160)
    assert lin.compressed_weight.mode == int(want.pop("mode")[0])
    assert all(np.array_equal(lin.compressed_weight.streams()[k].numpy(), want[k]) for k in want)
    lin.to("cpu")
    assert lin.compressed_weight.ROLES != qtiles.ROLES and torch.equal(
        lin.decoded_weight().view(torch.int16), w.view(torch.int16)
    )


@pytest.mark.parametrize("rows,cols,m", [(48, 64, 5), (24, 1544, 16)])
def test_cpu_gemv_plan_follows_its_streams(rows, cols, m, tmp_path, monkeypatch):
    """The fused CPU GEMV's plan reads the streams by address: streams moved in memory (to shared
    memory here) are planned again; each plan gives the same bits as the launcher without a plan,
    BF16 y rounded as .to(torch.bfloat16) rounds (x in column segments too, at 1544 columns)."""
    from unweight.runtime.kernels import cpu_gemv

    monkeypatch.setenv("UNWEIGHT_PIPELINE", "fused")
    w = random_bf16(rows, cols, seed=5, std=0.02)
    mod = UnweightLinear.from_weight(w, autotuner=Autotuner(tmp_path / "t.json"))
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(3, cols, generator=g), torch.randn(m, cols, generator=g).to(torch.bfloat16)]
    s = mod.compressed_weight
    want = [cpu_gemv.tiles_gemv_cpu(x, s).to(x.dtype) for x in xs]

    def same(layer):
        return all(torch.equal(layer(x).view(torch.int16), y.view(torch.int16)) for x, y in zip(xs, want))

    assert same(mod)
    key = mod._plan_key
    mod.share_memory()
    assert same(mod) and mod._plan_key not in (None, key)


@pytest.mark.parametrize("m", [3, 5, 13, 16, 43, 172, 260])
def test_cpu_gemv_serial_kernels_give_the_parallel_ones_bits(m):
    """A GEMV of one part runs each kernel's serial variant (no parallel region): on the same call
    it writes the bits the parallel kernel writes over two and three row ranges, for every kernel
    this CPU has (fp32 x in groups of 8 and in 64-weight chunks; BF16 x in groups of 8 and in
    64-weight chunks, to fp32 y and BF16 y). With the chunks, 3, 5 and 13 rows of x take one padded
    pass (of 4, 8 and 16 rows), 43 and 172 three and eleven passes of 16 (BF16 x: W decoded once
    for all of them, the last pass padded), and 260 the prompt GEMM (BF16 x: W decoded in slabs of
    blocks of 48 rows):
    nothing is written past y's m rows."""
    from unweight.runtime.kernels import cpu_gemv

    if not cpu_gemv.FAST_PATH:
        pytest.skip("the x86 kernels need AVX2 and FMA, which this CPU lacks")
    rows, cols = 72, 1544  # columns in segments at 16 rows of x
    w = random_bf16(rows, cols, seed=9, std=0.02)
    w.view(torch.int16).view(-1)[5::23] = -15872  # escapes
    lin = UnweightLinear.from_weight(w)
    s = lin.compressed_weight
    streams = (s.sm.data_ptr(), *cpu_gemv._addresses(s.codes, s.esc, s.esc_index), rows, cols)
    streams += (-(-cols // s.block), s.base, 0, rows)
    pairs = [("fp32", cpu_gemv._FP32, torch.float32, torch.float32)]
    if cpu_gemv.CHUNKS:
        pairs.append(("fp32 chunks", cpu_gemv._CHUNK_F32, torch.float32, torch.float32))
    if cpu_gemv.BF16_DOT:
        pairs.append(("bf16 groups", cpu_gemv._BF16, torch.bfloat16, torch.float32))
    if cpu_gemv.CHUNK_DOT:
        pairs.append(("bf16 chunks", cpu_gemv._CHUNK_BF16, torch.bfloat16, torch.float32))
        pairs.append(("bf16 chunks to bf16", cpu_gemv._CHUNK_BF16_TO_BF16, torch.bfloat16, torch.bfloat16))
    x32 = torch.randn(m, cols, generator=torch.Generator().manual_seed(4))
    for name, (parallel, serial), x_dtype, y_dtype in pairs:
        x = x32.to(x_dtype)
        ys = [torch.full((m + 16, rows), float("nan"), dtype=y_dtype) for _ in range(3)]  # 16 rows to spare
        serial(x.data_ptr(), m, *streams, ys[0].data_ptr(), 1)
        for y, parts in zip(ys[1:], (2, 3)):
            with cpu_gemv._PARALLEL:
                parallel(x.data_ptr(), m, *streams, y.data_ptr(), parts)
        assert not ys[0][:m].isnan().any(), name
        assert all(torch.equal(ys[0].view(torch.int16), y.view(torch.int16)) for y in ys[1:]), name
        nan = torch.full((16, rows), float("nan"), dtype=y_dtype).view(torch.int16)
        assert all(torch.equal(y[m:].view(torch.int16), nan) for y in ys), name


def test_a_layer_deep_copies_and_pickles_after_its_forwards(tmp_path):
    """copy.deepcopy and pickle of a layer that has run (its autotuner holds a lock, its CPU GEMV a
    plan over the streams' addresses): the copies multiply as the original, from their own streams,
    the original gone."""
    import copy
    import gc
    import pickle

    w = random_bf16(40, 64, seed=8, std=0.02)
    mod = UnweightLinear.from_weight(w, autotuner=Autotuner(tmp_path / "t.json"))
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    want = mod(x)
    copies = [copy.deepcopy(mod), pickle.loads(pickle.dumps(mod))]
    del mod
    gc.collect()
    for twin in copies:
        assert torch.equal(twin(x).view(torch.int16), want.view(torch.int16))


def test_cpu_streams_lie_in_the_arena_aligned_and_outlive_its_chunks(monkeypatch):
    """On the CPU tile_tensors copies each layer's streams into one block of the stream arena, each
    stream on a 64-byte boundary, bit-equal to what it was given, layers apart from each other; a
    block over a quarter of a chunk gets a mapping of its own; a layer's streams stay readable
    after the arena has moved on to new chunks and dropped its reference to theirs."""
    import gc

    from unweight.codec import tiles
    from unweight.runtime.kernels import tile_tensors as tt

    monkeypatch.setattr(tt, "ARENA", tt.StreamArena())
    monkeypatch.setattr(tt.StreamArena, "CHUNK", 1 << 20)
    layers, given = [], []
    for seed, (rows, cols) in enumerate([(40, 64), (24, 72), (600, 1024), (40, 64)]):
        w = random_bf16(rows, cols, seed=seed, std=0.02)
        streams = tiles.encode(w.view(torch.int16).numpy().view(np.uint16).ravel(), rows, cols)[1]
        given.append({k: np.array(v) for k, v in streams.items()})
        layers.append(tt.tile_tensors(streams))
    spans = []
    for placed, src in zip(layers, given):
        assert set(placed) == {"sm", "codes", "esc", "esc_index"}
        assert all(t.data_ptr() % 64 == 0 for t in placed.values())
        for k in ("sm", "codes"):
            assert np.array_equal(placed[k].numpy(), src[k])
        assert np.array_equal(placed["esc_index"].numpy(), tiles.esc_index_entries(src["esc_index"]))
        ptrs = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in placed.values()]
        spans.append((min(p[0] for p in ptrs), max(p[1] for p in ptrs)))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two layers share bytes
    monkeypatch.setattr(tt, "ARENA", tt.StreamArena())  # the old arena and its chunk references go
    gc.collect()
    for placed, src in zip(layers, given):
        assert np.array_equal(placed["sm"].numpy(), src["sm"])


def test_the_stream_arena_unmaps_a_dropped_models_chunk(monkeypatch):
    """The arena holds the chunk it fills by a weak reference: once the layers placed in it are
    dropped, its mapping leaves the process (its huge pages go back to the system), and the arena
    places the next layer in a new chunk."""
    import gc
    import mmap
    from pathlib import Path

    from unweight.codec import tiles
    from unweight.runtime.kernels import tile_tensors as tt

    maps = Path("/proc/self/maps")
    if not maps.exists() or not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("needs Linux's /proc/self/maps and huge-page mappings")

    def mapped(address: int) -> bool:
        spans = (line.split()[0].split("-") for line in maps.read_text().splitlines())
        return any(int(a, 16) <= address < int(b, 16) for a, b in spans)

    monkeypatch.setattr(tt, "ARENA", tt.StreamArena())
    monkeypatch.setattr(tt.StreamArena, "CHUNK", 4 << 20)
    w = random_bf16(40, 64, seed=3, std=0.02)
    streams = tiles.encode(w.view(torch.int16).numpy().view(np.uint16).ravel(), 40, 64)[1]
    layers = [tt.tile_tensors(streams) for _ in range(3)]
    address = layers[0]["sm"].data_ptr()
    assert mapped(address)
    del layers[:2]
    gc.collect()
    assert mapped(address)  # one layer still lives in the chunk
    del layers
    gc.collect()
    assert not mapped(address)
    again = tt.tile_tensors(streams)
    assert np.array_equal(again["sm"].numpy(), np.asarray(streams["sm"]))
