"""`load`: a compressed checkpoint folder -> a `CausalLM` whose linears stay compressed.

The offline transform (`unweight compress`) and this runtime swap are separate pieces: the model
is built on the meta device, then each module is filled from the checkpoint by name (module names
mirror Hugging Face's, so the map is a table of suffixes, not branches):
- every linear (and the embedding, which is a matrix read by rows) becomes an `UnweightLinear`
  (layout "serving": the `tiles` streams, transcoded at load from the archive layout if need be)
  or an `ArchiveLinear` (layout "archive": the streams as stored, decoded at every use);
- norms and biases are decoded once into the compute dtype (they are a few KB a layer).
With tied embeddings, `lm_head` is the embedding module itself: one copy of the streams.

Every tensor is checked once, here (docs/runtime.md, "What load checks"): one decoded at load (a
transcode, a stacked matrix, a norm) by the CRC-32 of its original bytes; one kept as stored by
the CRC-32s of its streams, or, in a format 1.0 container that has none, by one decode. Damage is
a CorruptDataError naming the file and tensor; `model.load_report` says what was checked and what
the checks cost.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from unweight.errors import FormatError, SourceError
from unweight.reader import CompressedCheckpoint

from ..layers.linear import ArchiveLinear, UnweightLinear, compute_dtype
from .config import ModelConfig, UnsupportedModelError
from .llama import CausalLM, RMSNorm

log = logging.getLogger(__name__)
LAYOUTS = ("serving", "archive")
# Our stacked modules -> the checkpoint modules whose rows they hold, in order.
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# how decode steps run (CausalLM.set_decode_graph): graph (CUDA graphs; the default on CUDA), compile,
# eager, or off (sequence by sequence; the default on the CPU)
DECODE_GRAPH_ENV = "UNWEIGHT_DECODE_GRAPH"
DEFAULT_CACHE_TOKENS = 8192  # KV cache room over all sequences, unless the caller says otherwise
# vLLM's --dtype names for the compute; "auto" (None): auto_dtype(device)
DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32}
# vLLM's --kv-cache-dtype names; "auto" (None) follows the compute dtype
KV_CACHE_DTYPES = DTYPES


@dataclass(frozen=True)
class LoadReport:
    """How long `load` took and what it checked (`model.load_report`; also logged at INFO)."""

    seconds: float  # the whole load
    check_seconds: float  # the checks that decode nothing for the model: stream CRC-32s, 1.0 decodes
    stream_checked: int  # tensors kept as stored, checked by the CRC-32s of their streams
    stream_bytes: int  # the stored bytes those CRCs covered
    decode_checked: int  # tensors checked by the CRC-32 of their decoded bytes
    decode_only_to_check: int  # of those, decoded only to be checked (1.0 containers: no stream CRCs)
    original_bytes: int = 0  # the checkpoint's tensors uncompressed (what the resident weights stand for)

    def __str__(self) -> str:
        return (
            f"loaded in {self.seconds:.2f} s; checked {self.stream_checked + self.decode_checked} tensors: "
            f"{self.stream_checked} by stream CRC-32 ({self.stream_bytes / 1e6:.1f} MB), {self.decode_checked} "
            f"by the CRC-32 of their decoded bytes ({self.decode_only_to_check} decoded only for it); "
            f"the checks took {self.check_seconds:.3f} s"
        )


def _device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: only cpu and cuda are supported")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available on this machine")
    return dev


def auto_dtype(device: str | torch.device) -> torch.dtype:
    """What dtype="auto" computes in: the checkpoint's own BF16 where the hardware multiplies BF16 (CUDA,
    and a CPU with AVX512_BF16's vdpbf16ps, which AMX hosts have too), as vLLM's auto keeps a BF16
    model's dtype; FP32 on other CPUs, where BF16 activations would only add conversions."""
    from ..kernels.cpu_avx2 import BF16_DOT

    return torch.bfloat16 if torch.device(device).type == "cpu" and BF16_DOT else compute_dtype(device)


def load(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    layout: str = "serving",
    *,
    threads: int | None = None,
    max_cache_tokens: int | None = None,
    kv_cache_dtype: str = "auto",
    dtype: str = "auto",
) -> CausalLM:
    """Load a compressed Llama-family checkpoint (a folder made by `unweight compress`); `dtype`
    is the compute dtype (activations, norms; the weights are BF16 and exact in either)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    dev = _device(device)
    t0 = time.perf_counter()
    path = Path(path)
    if not path.is_dir():
        raise SourceError(f"{path}: not a folder (load takes the folder `unweight compress` wrote)")
    cfg = model_config(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    with CompressedCheckpoint(path, threads) as ckpt:
        work = DTYPES[dtype] or auto_dtype(dev)
        transcoded = _fill(model, ckpt, dev, layout, threads, work)
        original = sum(ckpt.entry(name).nbytes for name in ckpt.keys())
    tokens = max_cache_tokens or min(cfg.max_position_embeddings, DEFAULT_CACHE_TOKENS)
    model.init_cache(tokens, work, kv_dtype=KV_CACHE_DTYPES[kv_cache_dtype])
    # the archive layout decodes on the host at every forward: no CUDA graph can hold it
    mode = os.environ.get(DECODE_GRAPH_ENV) or ("graph" if dev.type == "cuda" and layout == "serving" else "off")
    if mode not in ("off", "graph", "compile", "eager"):
        raise ValueError(f"{DECODE_GRAPH_ENV}={mode!r} is not one of off, graph, compile, eager")
    model.set_decode_graph(None if mode == "off" else mode)
    model.eval()
    st = ckpt.integrity
    model.load_report = LoadReport(
        time.perf_counter() - t0,
        st.seconds,
        st.by_stream_crc,
        st.stream_bytes,
        st.by_decode + st.decoded + transcoded,
        st.by_decode,
        original,
    )
    log.info("%s: %s; computing in %s", path, model.load_report, str(work).removeprefix("torch."))
    return model


def model_config(path: str | os.PathLike) -> ModelConfig:
    """The folder's ModelConfig as `load` builds its model with: config.json, and the end-of-turn
    ids that generation_config.json adds."""
    cfg = ModelConfig.from_folder(path)
    cfg.eos_token_ids = tuple(dict.fromkeys(cfg.eos_token_ids + _generation_eos(Path(path))))
    return cfg


def _generation_eos(path: Path) -> tuple[int, ...]:
    """End-of-turn ids from generation_config.json (chat models often list several)."""
    from unweight.folder import read_json

    f = path / "generation_config.json"
    if not f.exists():
        return ()
    gen = read_json(f)  # SourceError naming the file: not JSON, not a regular file (a FIFO would hang)
    eos = gen.get("eos_token_id") if isinstance(gen, dict) else None
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


# generation_config.json's sampling fields that a server takes as defaults (vLLM's `--generation-config
# auto`: what its get_diff_sampling_param reads), with transformers' own defaults, which say nothing,
# and the bounds a request's field has (serve/api.py)
SAMPLING_FIELDS = {
    "temperature": (1.0, 0.0, 2.0),
    "top_p": (1.0, 0.0, 1.0),
    "top_k": (50, -1, None),
    "min_p": (None, 0.0, 1.0),
    "repetition_penalty": (1.0, 0.0, 1000.0),
}


def sampling_defaults(path: str | os.PathLike) -> dict:
    """The sampling settings the model's makers recommend in generation_config.json (temperature,
    top_p, top_k, min_p, repetition_penalty), where they differ from transformers' defaults: what
    vLLM serves a request that leaves them out. {} without the file. SourceError names a field of the
    wrong type or out of bounds."""
    from unweight.folder import read_json

    f = Path(path) / "generation_config.json"
    if not f.exists():
        return {}
    gen = read_json(f)
    if not isinstance(gen, dict):
        raise SourceError(f"{f}: not a JSON object")
    out = {}
    for name, (neutral, low, high) in SAMPLING_FIELDS.items():
        v = gen.get(name)
        if v is None or v == neutral:
            continue
        integer = name == "top_k"
        if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
            raise SourceError(f"{f}: {name} is {v!r}, not {'an integer' if integer else 'a number'}")
        if not low <= v <= (high if high is not None else v) or (name in ("top_p", "repetition_penalty") and v == 0):
            raise SourceError(f"{f}: {name} is {v!r}, out of bounds")
        out[name] = v
    return out


def _fill(
    model: CausalLM, ckpt: CompressedCheckpoint, dev: torch.device, layout: str, threads: int | None, dtype: torch.dtype
) -> int:
    """Fill the model (norms and biases in `dtype`); returns how many weights were decoded (CRC-32
    checked) to be re-encoded."""
    transcoded, ignored = 0, []
    tied = "lm_head.weight" not in ckpt
    if tied and not model.config.tie_word_embeddings:
        raise SourceError(f"{ckpt.path}: no lm_head.weight, and the config does not tie embeddings")
    for name, module in list(model.named_modules()):
        if name == "lm_head" and tied:
            continue
        if isinstance(module, (nn.Linear, nn.Embedding)):
            linear, n = _linear(
                ckpt, name, tuple(module.weight.shape), dev, layout, threads, dtype, model.config, ignored
            )
            _set(model, name, linear)
            transcoded += n
        elif isinstance(module, RMSNorm):
            module.weight = nn.Parameter(
                _dense(ckpt, f"{name}.weight", (module.weight.shape[0],), dtype, dev), requires_grad=False
            )
    if tied:
        model.lm_head = model.model.embed_tokens
    if ignored:  # as transformers leaves a checkpoint's tensors that its modules have no place for
        log.warning("%s: biases the config gives these layers none of, not used: %s", ckpt.path, ", ".join(ignored))
    return transcoded


def _linear(
    ckpt: CompressedCheckpoint,
    name: str,
    shape: tuple[int, int],
    dev: torch.device,
    layout: str,
    threads: int | None,
    dtype: torch.dtype,
    cfg: ModelConfig,
    ignored: list[str],
) -> tuple[nn.Module, int]:
    """The module `name` of shape (out, in) (for the embedding: (vocab, hidden)), from one
    checkpoint weight or from the several that PACKED stacks into it, and how many of those were
    decoded to be re-encoded (which checks the CRC-32 of their original bytes). Its bias is there
    where the config gives the layer one (a missing one is refused); a bias the config gives it
    none of is left, its name added to `ignored`."""
    parent, _, leaf = name.rpartition(".")
    sources = [f"{parent}.{p}" for p in PACKED[leaf]] if leaf in PACKED else [name]
    entries, biases = [], []
    for src in sources:
        wname = f"{src}.weight"
        if wname not in ckpt:
            raise SourceError(f"{ckpt.path}: the checkpoint lacks {wname}")
        entry = ckpt.entry(wname)
        if entry.dtype != "BF16":
            raise UnsupportedModelError(f"{wname} is {entry.dtype}; the runtime serves BF16 checkpoints")
        entries.append(entry)
        bname, wanted = f"{src}.bias", src.rpartition(".")[2] in cfg.biases
        if wanted and bname not in ckpt:
            raise SourceError(f"{ckpt.path}: the checkpoint lacks {bname}, which a {cfg.model_type} config gives it")
        if wanted:
            biases.append(_dense(ckpt, bname, (entry.shape[0],), dtype, dev))
        elif bname in ckpt:
            ignored.append(bname)
    # A weight kept as stored (the archive layout; a lone tiles weight) is checked by its stream
    # CRC-32s; one that is decoded here to be re-encoded, by the CRC-32 of its decoded bytes.
    decoded = layout != "archive" and (len(entries) > 1 or entries[0].codec != "tiles")
    parts = [(e, ckpt.streams(e.name, check=not decoded)) for e in entries]
    got = (sum(e.shape[0] for e, _ in parts), parts[0][0].shape[1])
    if got != shape or any(e.shape[1] != shape[1] for e, _ in parts):
        raise SourceError(
            f"{ckpt.path}: {', '.join(e.name for e, _ in parts)} have shapes {[list(e.shape) for e, _ in parts]}, the "
            f"config implies {list(shape)}"
        )
    if biases and len(biases) != len(parts):  # (a config that gives some of a stack a bias: no family does)
        raise SourceError(f"{ckpt.path}: only some of {', '.join(sources)} have a bias")
    bias = torch.cat(biases) if biases else None
    try:
        if layout == "archive":
            return ArchiveLinear(parts, bias, threads), 0
        return UnweightLinear.from_entries(parts, bias, threads, dev).to(dev), len(
            parts
        ) if decoded else 0  # encoded once, in the layout dev reads
    except FormatError as e:  # the codec names the tensor; name its file too
        if e.path is not None or e.tensor not in ckpt:
            raise
        raise type(e)(ckpt.file_of(e.tensor), e.reason, e.tensor) from None


def _dense(
    ckpt: CompressedCheckpoint, name: str, shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device
) -> torch.Tensor:
    if name not in ckpt:
        raise SourceError(f"{ckpt.path}: the checkpoint lacks {name}")
    e = ckpt.entry(name)  # compared before anything is decoded: a tensor may declare gigabytes
    if tuple(e.shape) != shape or e.dtype not in ("BF16", "F16", "F32", "F64"):
        raise SourceError(
            f"{ckpt.file_of(name)}: {name} is {e.dtype}{list(e.shape)}, expected a float tensor of shape {list(shape)}"
        )
    return ckpt.get_tensor(name).to(device=dev, dtype=dtype)


def _set(model: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, leaf = dotted.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)
