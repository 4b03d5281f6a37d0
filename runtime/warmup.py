"""Compiling the CPU kernels once, ahead of the first run.

The codec and the CPU kernels are numba functions, compiled for this machine's CPU the first time
they run and kept in numba's cache after that. Compiled on first use, they made a fresh install's
first `unweight compress` take 17.6 s against 2.8 s warm, and its first `unweight generate` wait
10.4 s for its first token against 0.3 s, saying nothing. `make install` runs `python -m
unweight.runtime.warmup`, which compiles them all by running each path once on a tiny random
checkpoint: compress (both layouts), verify, load (both layouts), a prefill, decode steps of one,
nine and sixteen sequences (the fused kernels' passes, the decode attention), in FP32 and, where
the CPU has AVX512_BF16, in BF16 too (its vdpbf16ps kernels), else in FP32 over a BF16 KV cache
(the decode attention's other cache dtype), then the GEMVs of one part (their serial kernels) and
a MoE layer's grouped GEMV (its routed experts), with this machine's CPU. The CLI does the
same, with one line saying so, when it finds them not compiled yet (an install without `make`).

`compiled()` reads a stamp kept beside numba's own cache of the codec, named for the codec's and the
kernels' sources, numba's version and the CPU: clearing numba's cache clears the stamp with it. It
imports neither torch nor the runtime's kernels, so a command that needs neither stays as small.

Compiling starts by dropping numba's cached codec and kernels (`purge`): numba keys each cached
function on its own file only, so a kernel that inlines a helper from another file (the INT4 rows
inline cpu_int4_avx512's intrinsics) would load stale machine code from the cache after that
helper's file alone changed (an edited checkout; an install rewrites every file). The stamp sees
every source, so a change anywhere compiles everything anew. `make check` and `make test` run this
module first for that reason.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

_STAMP = "unweight-warm-{}.stamp"
_busy = False  # compile_kernels runs compress and load, which must not start it again


def _sources() -> list[Path]:
    """The codec's and the CPU kernels' source files (found without importing the kernels), in an
    order that is the same wherever they are installed (an editable checkout lists runtime/ before
    unweight/codec/, an installed package codec/ before runtime/)."""
    codec = importlib.util.find_spec("unweight.codec").submodule_search_locations[0]
    kernels = Path(importlib.util.find_spec(__package__).submodule_search_locations[0]) / "kernels"
    return sorted((f for d in (Path(codec), kernels) for f in d.glob("*.py")), key=lambda f: (f.parent.name, f.name))


@functools.cache
def _stamp() -> Path | None:
    """The stamp's path in numba's cache folder of the codec (None where numba keeps none)."""
    import numba
    from llvmlite import binding

    from unweight.codec.tiles import _decode

    digest = hashlib.sha1()
    for f in _sources():
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    cpu = f"{binding.get_host_cpu_name()}|{binding.get_host_cpu_features().flatten()}"
    digest.update(f"{numba.__version__}|{cpu}".encode())
    try:
        folder = Path(_decode._cache._cache_path)
    except AttributeError:  # a numba without a file cache for it
        return None
    return folder / _STAMP.format(digest.hexdigest()[:16])


def _cache_folders() -> list[Path]:
    """numba's cache folders of the codec and of the runtime's kernels (each holds only their files)."""
    from unweight.codec.tiles import _decode

    from .kernels.int4_encode import _histogram

    return [Path(f._cache._cache_path) for f in (_decode, _histogram) if hasattr(f._cache, "_cache_path")]


def purge() -> int:
    """Drop numba's cached codec and kernels, and the stamps of earlier sources; returns the files removed."""
    removed = 0
    for folder in _cache_folders():
        for f in [*folder.glob("*.nbi"), *folder.glob("*.nbc"), *folder.glob(_STAMP.format("*"))]:
            try:
                f.unlink()
                removed += 1
            except OSError:
                pass  # gone already (another process purging), or a read-only cache
    return removed


def compiled() -> bool:
    """Whether the kernels were compiled for this CPU, from these sources, into numba's cache."""
    stamp = _stamp()
    return stamp is None or stamp.exists()


def _tiny_llama(dst: Path) -> Path:
    """A random two-layer Llama in BF16, its weights spread like trained ones (normal, std 0.02),
    with shapes whose rows are a multiple of 8 (the fused kernels' fast path)."""
    import torch
    from safetensors.torch import save_file

    hidden, inter, layers, vocab, heads, kv_heads, head_dim = 64, 128, 2, 512, 4, 2, 16
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": w(vocab, hidden), "lm_head.weight": w(vocab, hidden)}
    tensors["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        }
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _run_model(path: Path, layout: str, tmp: Path, dtype: str = "float32", kv_cache_dtype: str = "auto") -> None:
    """A prefill, then decode steps of one sequence, of nine and of sixteen (the fused kernels' passes
    of up to 8 rows of x, and of 16 with AVX-512), in the model at `path` computing in `dtype`."""
    import torch

    from unweight.runtime.layers.autotune import Autotuner
    from unweight.runtime.layers.linear import UnweightLinear
    from unweight.runtime.model.loader import load

    model = load(path, "cpu", layout, max_cache_tokens=1024, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    tuner = Autotuner(tmp / "autotune.json")  # tiny shapes' choices stay out of the user's cache
    for module in model.modules():
        if isinstance(module, UnweightLinear):
            module.autotuner = tuner
    seqs = [model.new_sequence() for _ in range(16)]
    for i, seq in enumerate(seqs):
        model.prefill(seq, torch.arange(3, 20 + i))
    for batch in (seqs[:1], seqs[:9], seqs):
        model.decode_step(batch, torch.full((len(batch),), 5))
    for seq in seqs:
        model.free(seq)


def _run_one_part_gemvs() -> None:
    """The fused GEMVs of one part (a layer of fewer than 32 rows, or numba with one thread, as in
    vLLM-CPU's worker), which take the serial kernels: on a machine of several cores the tiny
    model's layers all take the parallel ones. In fp32 and in BF16, to fp32 y and to x's dtype."""
    import torch

    from .kernels.cpu_gemv import tiles_gemv_cpu
    from .layers.linear import UnweightLinear

    layer = UnweightLinear.from_weight(
        (torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    )
    plan = layer._cpu_gemv()
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.ones(2, 64, dtype=dtype)
        tiles_gemv_cpu(x, layer.compressed_weight)
        if plan is not None:
            plan(x)


def _run_experts() -> None:
    """A MoE layer's fused pipeline (the experts' grouped GEMV), in fp32 and in BF16: the tiny model
    has no experts."""
    import numpy as np
    import torch

    from .layers.experts import UnweightExperts

    e, h, i = 2, 64, 32
    w = (torch.randn(e * (2 * i * h + h * i), generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    bits = w.view(torch.int16).numpy().view(np.uint16)
    layer = UnweightExperts.from_values(bits[: e * 2 * i * h], bits[e * 2 * i * h :], e, h, i)
    ids, weights = torch.tensor([[0, 1], [1, 0], [1, 0]]), torch.full((3, 2), 0.5)
    for dtype in (torch.float32, torch.bfloat16):
        layer.run("fused", torch.ones(3, h, dtype=dtype), weights, ids, "silu", False)


def compile_kernels() -> float:
    """Compile every kernel of the common paths for this CPU into numba's cache, anew (`purge` first);
    returns the seconds it took."""
    global _busy
    import unweight

    t0 = time.perf_counter()
    _busy = True
    purge()
    try:
        with tempfile.TemporaryDirectory(prefix="unweight-warmup-") as d:
            tmp = Path(d)
            src = _tiny_llama(tmp / "bf16")
            for layout in ("archive", "serving"):
                dst = tmp / f"uw-{layout}"
                unweight.compress(src, dst, layout=layout)
                unweight.verify(dst, against=src)
                _run_model(dst, layout, tmp)
            from .kernels.cpu_avx2 import BF16_DOT

            if BF16_DOT:  # BF16 activations take the vdpbf16ps kernels there
                _run_model(dst, "serving", tmp, "bfloat16")
            else:
                _run_model(dst, "serving", tmp, kv_cache_dtype="bfloat16")
            _run_one_part_gemvs()
            _run_experts()
    finally:
        _busy = False
    stamp = _stamp()
    if stamp is not None:
        try:
            stamp.parent.mkdir(parents=True, exist_ok=True)
            stamp.write_text(f"{time.perf_counter() - t0:.1f} s\n")
        except OSError:
            pass  # a read-only cache: numba recompiles in each process there anyway
    return time.perf_counter() - t0


def ensure_compiled(say=None) -> None:
    """Compile the kernels now if they are not yet, after one line through `say` (default: stderr)."""
    if _busy or os.environ.get("UNWEIGHT_NO_WARMUP") or compiled():
        return
    (say or (lambda m: print(m, file=sys.stderr, flush=True)))(
        "unweight: compiling the CPU kernels for this machine, once (a minute or two; `make install` does it ahead)"
    )
    compile_kernels()


def main() -> None:
    """python -m unweight.runtime.warmup: compile the kernels (what `make install` runs)."""
    if compiled():
        print("unweight: CPU kernels already compiled for this machine")
        return
    print("unweight: compiling the CPU kernels for this machine (numba), once ...", flush=True)
    print(f"unweight: compiled in {compile_kernels():.0f} s; later runs load them from numba's cache")


if __name__ == "__main__":
    main()
