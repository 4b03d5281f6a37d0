"""`ModelConfig`: the few numbers of a Llama-family model, read from a Hugging Face config.json.

One skeleton covers Llama 2/3/3.1 (rope scaling), Mistral (sliding window), Qwen2/2.5 (q/k/v bias)
and Qwen3 (q/k RMS norms); the switches are fields here. Which linears have a bias is the config's
to say, as transformers' modules say it (`biases`): the loader refuses a checkpoint that lacks one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# Hugging Face model_type -> the family switches it turns on.
FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"qk_norm": True},
}
ROPE_TYPES = ("default", "linear", "llama3")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def config_biases(model_type: str, cfg: dict) -> frozenset[str]:
    """The linears (by their Hugging Face names) that transformers' module for `model_type` gives a
    bias: Qwen2 q/k/v always; Llama's and Qwen3's attention with attention_bias, Llama's MLP with
    mlp_bias; Mistral none."""
    flags = {}
    for key in ("attention_bias", "mlp_bias"):
        v = cfg.get(key, False)
        if not isinstance(v, bool):
            raise ValueError(f"config {key} must be true or false, not {v!r}")
        flags[key] = v
    if model_type == "qwen2":
        return frozenset(ATTENTION[:3])
    if model_type == "mistral":
        return frozenset()
    out = set(ATTENTION) if flags["attention_bias"] else set()
    if model_type == "llama" and flags["mlp_bias"]:
        out |= set(MLP)
    return frozenset(out)


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or settings are outside what the runtime implements."""


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": ..., factor, ...}
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None  # attend to at most this many most recent positions
    eos_token_ids: tuple[int, ...] = ()
    biases: frozenset[str] = frozenset()  # the linears with a bias (config_biases)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"config {name} must be a positive integer, not {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(f"rms_norm_eps {self.rms_norm_eps} and rope_theta {self.rope_theta} must be positive")
        rope_type = self.rope_scaling.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, not {self.sliding_window}")

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """From the parsed config.json of a Llama, Mistral, Qwen2 or Qwen3 checkpoint."""
        mt = cfg.get("model_type")
        if mt not in FAMILIES:
            archs = ", ".join(cfg.get("architectures") or []) or "unknown"
            raise UnsupportedModelError(
                f"model_type {mt!r} ({archs}) is not supported; supported: {', '.join(FAMILIES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu)")
        try:
            heads = cfg["num_attention_heads"]
            hidden = cfg["hidden_size"]
            # transformers 5 nests rope settings in rope_parameters; older configs use rope_theta + rope_scaling
            rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
            if "type" in rope and "rope_type" not in rope:
                rope["rope_type"] = rope.pop("type")
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window", mt == "mistral") else None
            eos = cfg.get("eos_token_id")
            return cls(
                model_type=mt,
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or hidden // heads,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                rope_theta=float(theta),
                rope_scaling=rope,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                sliding_window=window,
                eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
                biases=config_biases(mt, cfg),
                **FAMILIES[mt],
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks {e.args[0]!r}") from None
        except TypeError as e:
            raise ValueError(f"config.json has a value of the wrong type: {e}") from None

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        from unweight.folder import read_json

        f = Path(path) / "config.json"
        if not f.exists():
            raise FileNotFoundError(f"{path}: no config.json (not a model folder)")
        return cls.from_hf(read_json(f))  # SourceError naming the file: not JSON, not a regular file
