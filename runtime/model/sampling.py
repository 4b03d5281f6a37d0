"""Sampling: a request's settings (`SamplingParams`), its generation state and stop decision
(`Sequence`), and the token choice for a batch of them (`choose_rows`).

The choice for one row of fp32 logits, in order:
1. logits processors: `logit_bias` is added; while fewer than `min_tokens` tokens are made, the
   stop tokens (EOS unless `ignore_eos`, and `stop_token_ids`) are masked out;
2. penalties: `repetition_penalty` (over prompt and output tokens, dividing positive logits and
   multiplying negative ones, as transformers and vLLM do), then OpenAI's `frequency_penalty`
   and `presence_penalty` over the output tokens (logit - count * frequency - (count > 0) * presence);
3. temperature below GREEDY_BELOW is greedy (argmax, ties to the lowest id). Otherwise logits are
   divided by the temperature, cut to the `top_k` best (0 or -1: no cut), to the smallest set whose
   probability reaches `top_p`, and to the tokens with at least `min_p` times the best one's
   probability; one token is drawn with the sequence's own torch.Generator, so a seed gives the
   same tokens whatever else runs in the same batch.

Every accepted setting gives a valid distribution. Should the model's logits themselves hold no
finite value (a broken checkpoint), the choice falls back to the argmax instead of failing.

Log-probabilities (`logprobs`) are those of the model's own distribution (log-softmax of the raw
logits, before processors, penalties and temperature), which is what evaluation harnesses
compare and vLLM reports by default.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, fields

import torch

GREEDY_BELOW = 1e-5  # temperatures under this are greedy (vLLM's threshold too): 1/T would overflow the softmax
MAX_LOGPROBS = 20  # alternatives reported per token, OpenAI's limit for chat
INT64 = (-(2**63), 2**63)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax of logits (rows, vocab) or (vocab,): the first of equal maxima, a NaN
    before any number, as torch.argmax gives it. Float32 logits on the host go through numpy's
    argmax, ten times faster on a 49k vocabulary (2.6 against 28 us) and free of torch's thread
    pool, which a CPU decode step has just left to its own kernels."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        out = logits.numpy().argmax(axis=-1)
    else:
        out = torch.argmax(logits, dim=-1)
    return out.tolist() if logits.dim() > 1 else [int(out)]


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = (
        0  # stop tokens cannot be chosen, and stop strings do not count, before this many tokens (as vLLM)
    )
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = (
        None  # alternatives to report with each token (0: the chosen token's only); None: no logprobs
    )

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, not {self.max_new_tokens!r}")
        if not _is_num(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, not {self.temperature!r}")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or 0 or -1 to turn it off, not {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not INT64[0] <= self.seed < INT64[1]):
            raise ValueError(f"seed must be a 64-bit signed integer, not {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, not {self.stop!r}")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], not {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], not {v!r}")
        if not _is_num(self.repetition_penalty) or not 0 < self.repetition_penalty <= 1e3:
            raise ValueError(f"repetition_penalty must be in (0, 1000], not {self.repetition_penalty!r}")
        if not isinstance(self.logit_bias, dict) or not all(
            _is_int(k) and k >= 0 and _is_num(v) and -100 <= v <= 100 for k, v in self.logit_bias.items()
        ):
            raise ValueError("logit_bias must map token ids >= 0 to numbers in [-100, 100]")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}], not {self.min_tokens!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, not {self.ignore_eos!r}")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids >= 0, not {self.stop_token_ids!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], not {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def processed(self) -> bool:
        """Whether anything changes the logits before the choice (bias or a penalty)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    def generator(self) -> torch.Generator | None:
        """The request's random source (None when greedy)."""
        if self.greedy:
            return None
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in logit_bias and stop_token_ids must exist in the model's vocabulary."""
        bad = [t for t in [*self.logit_bias, *self.stop_token_ids] if t >= vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["logit_bias"] = [[k, v] for k, v in self.logit_bias.items()]  # JSON keys are strings
        return d

    @classmethod
    def from_json(cls, d: dict) -> SamplingParams:
        """The inverse of to_json, validated as the constructor validates (ValueError)."""
        if not isinstance(d, dict) or set(d) - {f.name for f in fields(cls)}:
            raise ValueError("sampling settings must be an object of SamplingParams fields")
        d = dict(d)
        bias = d.get("logit_bias", [])
        if not isinstance(bias, list) or not all(isinstance(p, list) and len(p) == 2 for p in bias):
            raise ValueError("logit_bias must be a list of [token id, bias] pairs")
        d["logit_bias"] = {k: v for k, v in bias}
        return cls(**d)


@dataclass(slots=True)
class Pick:
    """One chosen token, with its log-probability and the best alternatives (token id, logprob),
    best first, when its settings ask for logprobs."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


def _wrap_seed(seed: int) -> int:
    return (seed - INT64[0]) % 2**64 + INT64[0]


class Sequence:
    """One request's generation: its settings, random source, the tokens it made, and the decision
    to stop. Used alike by `unweight generate` and by the server's workers (which hand it from a
    prefill worker to a decode worker through `state()` / `from_state()`)."""

    def __init__(
        self, params: SamplingParams, prompt: Seq[int], eos: Iterable[int], generator: torch.Generator | None = None
    ):
        self.params = params
        self.prompt = list(prompt)
        self.output: list[int] = []
        self.eos = sorted(set(eos))
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos))
        self.generator = generator if generator is not None else params.generator()
        self.finish_reason: str | None = None
        self._counts: dict[int, int] = {}
        self._prompt_ids: torch.Tensor | None = None  # distinct prompt ids, for the repetition penalty
        self._stop_index: tuple[torch.Tensor, int] | None = None  # (stop ids below vocab, vocab), for min_tokens

    @staticmethod
    def seed_for(seed: int | None, index: int) -> int | None:
        """The seed of choice `index` of a request with n > 1 (choice 0 keeps the request's)."""
        return None if seed is None else _wrap_seed(seed + index)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to change the logits but min_tokens, and no logprobs: the logits' own
        argmax is the choice wherever it is no stop token (choose_rows)."""
        p = self.params
        return p.greedy and not p.processed and p.logprobs is None

    @property
    def simple(self) -> bool:
        """Greedy with nothing to change the logits and no logprobs: an argmax on the device does."""
        return self.plain_greedy and len(self.output) >= self.params.min_tokens

    # -- the choice ---------------------------------------------------------------------------
    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits after processors and penalties (a new tensor whenever anything changes)."""
        p = self.params
        masking = len(self.output) < p.min_tokens and self.stop_ids
        if not (p.processed or masking):
            return logits
        vocab = logits.numel()
        scores = logits.clone()
        for t, b in p.logit_bias.items():
            if t < vocab:
                scores[t] += b
        if masking:
            if self._stop_index is None or self._stop_index[1] != vocab:  # made once: an index tensor a token
                self._stop_index = (
                    torch.tensor(sorted(t for t in self.stop_ids if t < vocab), dtype=torch.int64),
                    vocab,
                )
            scores.index_fill_(0, self._stop_index[0], float("-inf"))
        if p.repetition_penalty != 1:
            if self._prompt_ids is None:
                self._prompt_ids = torch.tensor(sorted(set(self.prompt)), dtype=torch.int64)
            seen = torch.unique(torch.cat([self._prompt_ids, torch.tensor(list(self._counts), dtype=torch.int64)]))
            seen = seen[seen < vocab]
            s = scores[seen]
            scores[seen] = torch.where(s > 0, s / p.repetition_penalty, s * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self._counts:
            ids = torch.tensor(list(self._counts), dtype=torch.int64)
            counts = torch.tensor(list(self._counts.values()), dtype=torch.float32)
            keep = ids < vocab
            scores[ids[keep]] -= counts[keep] * p.frequency_penalty + p.presence_penalty
        return scores

    def choose(self, logits: torch.Tensor) -> Pick:
        """The next token from fp32 logits (vocab,) on the host."""
        p = self.params
        raw = logits.float()
        scores = self._scores(raw)
        token = argmax_rows(scores)[0] if p.greedy else None
        if (token is None or not math.isfinite(scores[token])) and not bool(torch.isfinite(scores).any()):
            token = argmax_rows(torch.nan_to_num(raw, nan=float("-inf")))[0]  # nothing to choose from: the model's own
        elif token is None:
            token = self._draw(scores)
        pick = Pick(token)
        if p.logprobs is not None:
            lp = torch.log_softmax(raw, dim=-1)
            pick.logprob = float(lp[token])
            if p.logprobs:
                v, i = torch.topk(lp, min(p.logprobs, lp.numel()))
                pick.top = list(zip(i.tolist(), v.tolist()))
        return pick

    def _draw(self, scores: torch.Tensor) -> int:
        p = self.params
        scores = scores / p.temperature
        if 0 < p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p  # always keeps the best token
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
            return int(torch.argmax(scores))
        return int(torch.multinomial(probs, 1, generator=self.generator))

    # -- the stop decision --------------------------------------------------------------------
    def append(self, token: int) -> str | None:
        """Record a chosen token; returns why the sequence ends there ("stop": a stop token, which
        is not part of the text; "length": max_new_tokens reached), or None."""
        self.output.append(token)
        self._counts[token] = self._counts.get(token, 0) + 1
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.output) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason

    # -- hand-off between workers -------------------------------------------------------------
    def state(self) -> dict:
        """What a decode worker needs to carry on: settings, tokens so far, the random state."""
        rng = None if self.generator is None else self.generator.get_state().tolist()
        return {
            "sampling": self.params.to_json(),
            "prompt": self.prompt,
            "output": self.output,
            "eos": self.eos,
            "rng": rng,
        }

    @classmethod
    def from_state(cls, d: dict, vocab_size: int) -> Sequence:
        """The inverse of state(), checked (ValueError) since it comes over the network."""
        if not isinstance(d, dict):
            raise ValueError("sequence state must be an object")
        params = SamplingParams.from_json(d.get("sampling"))
        params.check_vocab(vocab_size)
        ids = [d.get("prompt"), d.get("output"), d.get("eos")]
        if not all(isinstance(v, list) and all(_is_int(t) and 0 <= t < vocab_size for t in v) for v in ids):
            raise ValueError("sequence state: prompt, output and eos must be lists of token ids")
        gen = None
        rng = d.get("rng")
        if rng is not None:
            if not isinstance(rng, list) or not all(_is_int(b) and 0 <= b < 256 for b in rng):
                raise ValueError("sequence state: rng must be a list of bytes")
            gen = torch.Generator()
            try:
                gen.set_state(torch.tensor(rng, dtype=torch.uint8))
            except RuntimeError as e:
                raise ValueError(f"sequence state: bad rng state ({e})") from None
        s = cls(params, ids[0], ids[2], gen)
        for t in ids[1]:
            s.output.append(t)
            s._counts[t] = s._counts.get(t, 0) + 1
        return s


def choose_rows(logits: torch.Tensor, seqs: list[Sequence]) -> list[Pick]:
    """The next token of each sequence from fp32 logits (batch, vocab), as `Sequence.choose`
    gives each row, with one transfer from the device for the batch: the plain greedy rows'
    argmax on the device (before min_tokens too, where it is no stop token and its score finite),
    the others' logits copied to the host together."""
    out: list[Pick | None] = [None] * len(seqs)
    plain = [i for i, s in enumerate(seqs) if s.plain_greedy]
    rest = [i for i, s in enumerate(seqs) if not s.plain_greedy]
    if plain:  # (no copy of the rows where they are all of them: a step's logits are cold in cache)
        for i, t in zip(plain, argmax_rows(logits if len(plain) == len(seqs) else logits[plain])):
            seq = seqs[i]
            # before min_tokens the stop tokens are masked out: that moves the argmax only where it
            # is one, and a finite score is the masked logits' argmax too (a NaN anywhere would be it)
            if seq.simple or (t not in seq.stop_ids and math.isfinite(_score(logits, i, t))):
                out[i] = Pick(t)
            else:
                rest.append(i)
    if rest:
        host = (logits if len(rest) == len(seqs) else logits[rest]).float().cpu()
        for i, row in zip(rest, host):
            out[i] = seqs[i].choose(row)
    return out


def _score(logits: torch.Tensor, row: int, token: int) -> float:
    """logits[row, token], read through numpy on the host (a torch index costs more)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return float(logits.numpy()[row, token])
    return float(logits[row, token])


def token_logprobs(
    logits: torch.Tensor, next_ids: torch.Tensor, top: int, chunk: int = 256
) -> list[tuple[float, list[tuple[int, float]]]]:
    """For logits (n, vocab) after each of n prefixes and the token that followed each (n,): that
    token's log-probability and the `top` best (id, logprob), in chunks of rows so that a long
    prompt never needs a second (n, vocab) buffer."""
    out = []
    for a in range(0, logits.shape[0], chunk):
        lp = torch.log_softmax(logits[a : a + chunk].float(), dim=-1)
        chosen = lp.gather(1, next_ids[a : a + chunk].reshape(-1, 1).to(lp.device))[:, 0].tolist()
        if top:
            v, i = torch.topk(lp, min(top, lp.shape[1]), dim=-1)
            alts = [list(zip(ii, vv)) for ii, vv in zip(i.tolist(), v.tolist())]
        else:
            alts = [[] for _ in chosen]
        out.extend(zip(chosen, alts))
    return out
