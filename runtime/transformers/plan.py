"""`LoadPlan`: which checkpoint tensors fill which tensor of a transformers model, and how.

Checkpoint names become model names through transformers' own conversion mapping (its renamings,
the base-model prefix, and the converters that merge per-expert tensors into 3-D ones), so a
folder loads into whatever class transformers would load it into. Every tensor the model holds in
its state dict must get a source, or be tied to one that has; the plan says which are missing
before anything is decoded, and compares shapes first too (a wrong shape names both).

Each target is filled one of three ways (`Target.kind`):
- `linear`, `embedding`: a 2-D BF16 weight of an nn.Linear / nn.Embedding, kept compressed;
- `experts`: the two 3-D BF16 weights of a MoE experts module (a layout `_experts_kind` knows), compressed
  as one UnweightExperts;
- `dense`: anything else (norms, biases, non-BF16 tensors, modules of no known kind), decoded once
  into the model's dtype for it.
"""

from __future__ import annotations

import inspect
import logging
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from unweight.errors import SourceError

log = logging.getLogger(__name__)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu"}  # config.hidden_act -> UnweightExperts'
MERGE_OPS = ("MergeModulelist", "Concatenate")  # the converter operations a plan carries out itself


@dataclass
class Target:
    """One tensor of the model (module `module`, attribute `attr`) and where its value comes from."""

    module: str
    attr: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    buffer: bool
    # checkpoint tensors in the order they combine: for a converter, one list per source pattern,
    # each in expert order; otherwise one list of one name
    sources: list[list[str]]
    concat_dim: int | None = None  # converters: the dim the patterns' stacks join on (None: one pattern)
    kind: str = "dense"

    @property
    def key(self) -> str:
        return f"{self.module}.{self.attr}" if self.module else self.attr

    @property
    def names(self) -> list[str]:
        return [n for group in self.sources for n in group]


@dataclass
class LoadPlan:
    targets: dict[str, Target] = field(default_factory=dict)  # by model key
    tied: dict[str, str] = field(default_factory=dict)  # model key -> the model key whose value it shares
    unused: list[str] = field(default_factory=list)  # checkpoint tensors no model tensor takes
    experts: dict[str, tuple[str, str]] = field(default_factory=dict)  # experts module -> (layout kind, activation)


def _conversions(model) -> tuple[list, list, dict]:
    """transformers' renamings and converters for this model, and its rename function."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # a transformers without the conversion machinery: names as they are, prefix aside
        return [], [], {}
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    return renamings, converters, {"rename": rename_source_key}


def _rename(key: str, renamings, converters, fns, prefix: str, meta: dict) -> tuple[str, str | None]:
    """(model key, the converter source pattern that matched or None), as transformers' loader renames."""
    if not fns:
        if key in meta:
            return key, None
        stripped = key.removeprefix(f"{prefix}.")
        return (stripped if stripped in meta else f"{prefix}.{key}"), None
    rename = fns["rename"]
    renamed, pattern = rename(key, renamings, converters, prefix, meta)
    if renamed not in meta and key in meta:
        renamed, pattern = rename(key, [], [], prefix, meta)
    return renamed, (pattern if any(pattern in c.source_patterns for c in converters) else None)


def _index_in(key: str, pattern: str) -> int:
    """The expert number that stands for `*` in a converter's source pattern."""
    rx = re.escape(pattern).replace(r"\*", r"(\d+)")
    m = re.search(rx, key)
    return int(m.group(1)) if m and m.groups() else 0


def _converter_layout(converter, target: str) -> int | None:
    """The concatenation dim of a merge converter (None when it only stacks); other converters are
    refused by name: the plan would have to reimplement them."""
    names = [type(op).__name__ for op in converter.operations]
    if not names or names[0] != "MergeModulelist" or any(n not in MERGE_OPS for n in names):
        raise SourceError(
            f"{target}: the checkpoint's layout needs transformers' conversion {' + '.join(names) or '(none)'}, "
            "which the unweight quantizer does not carry out"
        )
    concat = [op for op in converter.operations if type(op).__name__ == "Concatenate"]
    return concat[0].dim if concat else None


def _experts_kind(module: nn.Module, shapes: dict[str, tuple]) -> str | None:
    """The experts layout (modules.py: "top_k" or "llama4") of a module whose tensors are exactly
    gate_up_proj and down_proj, both 3-D; None for any other."""
    if set(shapes) != {"gate_up_proj", "down_proj"} or any(len(s) != 3 for s in shapes.values()):
        return None
    e, a, b = shapes["gate_up_proj"]
    params = [p for p in inspect.signature(type(module).forward).parameters if p != "self"]
    if params[:3] == ["hidden_states", "top_k_index", "top_k_weights"] and a % 2 == 0:
        kind, want = "top_k", (e, b, a // 2)  # down (E, H, I)
    elif params == ["hidden_states"] and b % 2 == 0:
        kind, want = "llama4", (e, b // 2, a)  # down (E, I, H)
    else:
        return None
    return kind if shapes["down_proj"] == want else None


def make_plan(model: nn.Module, ckpt, dtype_plan: dict | None = None) -> LoadPlan:
    """The plan for filling `model` (on the meta device) from the CompressedCheckpoint `ckpt`."""
    meta = model.state_dict(keep_vars=True)
    prefix = getattr(model, "base_model_prefix", "") or ""
    renamings, converters, fns = _conversions(model)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    groups: dict[str, dict[str | None, list[tuple[int, str]]]] = {}
    plan = LoadPlan()
    for name in ckpt.keys():
        key, pattern = _rename(name, renamings, converters, fns, prefix, meta)
        if key not in meta:
            plan.unused.append(name)
            continue
        groups.setdefault(key, {}).setdefault(pattern, []).append((_index_in(name, pattern) if pattern else 0, name))
    buffers = {k for k, _ in model.named_buffers()}
    dtype_rx = [(re.compile(p), d) for p, d in (dtype_plan or {}).items()]
    for key, by_src in groups.items():
        t = meta[key]
        module, _, attr = key.rpartition(".")
        dtype = next((d for rx, d in dtype_rx if rx.search(key)), t.dtype)
        target = Target(module, attr, tuple(t.shape), dtype, key in buffers, [])
        patterns = [p for p in by_src if p is not None]
        if patterns and None in by_src:
            names = ", ".join(n for group in by_src.values() for _, n in group)
            raise SourceError(f"{ckpt.path}: {names} all load into {key}, as it is and merged")
        if patterns:
            conv = by_pattern[patterns[0]]
            target.concat_dim = _converter_layout(conv, key)
            order = [p for p in conv.source_patterns if p in by_src]
            for p in order:  # each pattern's tensors are experts 0 .. n-1, each once
                if [i for i, _ in sorted(by_src[p])] != list(range(len(by_src[p]))):
                    numbers = sorted(i for i, _ in by_src[p])
                    raise SourceError(
                        f"{ckpt.path}: {key} merges tensors numbered {numbers}, not 0 to {len(numbers) - 1}"
                    )
            target.sources = [[n for _, n in sorted(by_src[p])] for p in order]
        else:
            if len(by_src[None]) > 1:
                names = ", ".join(n for _, n in by_src[None])
                raise SourceError(f"{ckpt.path}: {names} all load into {key}")
            target.sources = [[by_src[None][0][1]]]
        plan.targets[key] = target
    _check_complete(model, ckpt, meta, plan)
    _choose_kinds(model, ckpt, plan)
    return plan


def _check_complete(model, ckpt, meta: dict, plan: LoadPlan) -> None:
    """Every tensor of the state dict gets a value, or shares a tied one: never a random one."""
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_missing", None) or [])]
    missing = []
    for key in meta:
        if key in plan.targets or any(rx.search(key) for rx in ignore):
            continue
        if tied.get(key) in plan.targets:
            plan.tied[key] = tied[key]
        else:
            missing.append(key)
    # a tie whose source the checkpoint lacks but whose target it has: tie the other way round
    for key, source in tied.items():
        if key in plan.targets and source not in plan.targets and source in missing:
            missing.remove(source)
            plan.tied[source] = key
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise SourceError(
            f"{ckpt.path}: the checkpoint has no tensor for {missing[0]}{more}, which {type(model).__name__} needs"
        )


def _choose_kinds(model: nn.Module, ckpt, plan: LoadPlan) -> None:
    """Mark what stays compressed; compare every shape before any byte is decoded."""
    for t in plan.targets.values():
        entries = [ckpt.entry(n) for n in t.names]
        _check_shape(ckpt, t, entries)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    act = ACTIVATIONS.get(getattr(config, "hidden_act", None))

    def bf16(t: Target | None) -> bool:
        return t is not None and all(ckpt.entry(n).dtype == "BF16" for n in t.names)

    for name, module in model.named_modules():
        own = {a: plan.targets.get(f"{name}.{a}" if name else a) for a in ("weight", "gate_up_proj", "down_proj")}
        w = own["weight"]
        if bf16(w) and len(w.shape) == 2 and len(w.names) == 1:
            if isinstance(module, nn.Linear):
                w.kind = "linear"
            elif isinstance(module, nn.Embedding) and module.max_norm is None:
                w.kind = "embedding"
        gu, down = own["gate_up_proj"], own["down_proj"]
        if not (bf16(gu) and bf16(down)):
            continue
        tensors = {a for a, _ in module.named_parameters(recurse=False)}
        tensors |= {a for a, _ in module.named_buffers(recurse=False)}
        kind = (
            _experts_kind(module, {"gate_up_proj": gu.shape, "down_proj": down.shape})
            if tensors == {"gate_up_proj", "down_proj"}
            else None
        )
        if kind is None or act is None:
            log.info(
                "%s: %s is not a MoE experts layout the runtime knows; its experts are decoded once",
                name,
                type(module).__name__,
            )
            continue
        gu.kind = down.kind = "experts"
        plan.experts[name] = (kind, act)


def _check_shape(ckpt, t: Target, entries) -> None:
    """The shape the sources combine into must be the model tensor's."""
    if t.concat_dim is None and len(t.sources) == 1 and len(t.sources[0]) == 1:
        got = tuple(entries[0].shape)
    else:
        shapes = {tuple(e.shape) for e in entries}
        if len(shapes) != 1:
            raise SourceError(f"{ckpt.path}: {', '.join(t.names)} have different shapes; {t.key} stacks them")
        one = list(shapes.pop())
        stacked = [len(t.sources[0]), *one]
        if t.concat_dim is not None:
            stacked[t.concat_dim] *= len(t.sources)
        got = tuple(stacked)
    if got != t.shape:
        names = t.names[0] if len(t.names) == 1 else f"{t.names[0]} ... ({len(t.names)} tensors)"
        raise SourceError(f"{ckpt.path}: {names} gives {t.key} the shape {list(got)}; the model has {list(t.shape)}")
