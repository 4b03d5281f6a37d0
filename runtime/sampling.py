"""Sampling settings and the token choice from a row of logits (or, `sample_rows`, a batch of them).

temperature 0 is greedy (argmax, ties to the lowest id, as torch.argmax does). Otherwise logits are
divided by the temperature, cut to the top_k best (0: no cut), then to the smallest set whose
probability reaches top_p, and one token is drawn with the request's own torch.Generator, so a
seed gives the same tokens whatever else runs in the same batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, not {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, not {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 turns it off), not {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2^63), not {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, not {self.stop!r}")

    def generator(self) -> torch.Generator | None:
        """The request's random source (None when greedy)."""
        if self.temperature == 0:
            return None
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from fp32 logits (vocab,)."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scores = logits.float().cpu() / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p  # always keeps the best token
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token id per row of fp32 logits (batch, vocab), as `sample` gives each row, with one
    transfer from the device for the whole batch instead of one wait per row: the greedy rows'
    argmax on the device, the others' logits copied to the host together."""
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    drawn = [i for i, p in enumerate(params) if p.temperature != 0]
    out = [0] * len(params)
    if greedy:
        for i, t in zip(greedy, torch.argmax(logits[greedy], dim=-1).tolist()):
            out[i] = t
    if drawn:
        host = logits[drawn].float().cpu()
        for i, row in zip(drawn, host):
            out[i] = sample(row, params[i], generators[i])
    return out
