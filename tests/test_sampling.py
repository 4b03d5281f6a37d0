"""Sampling settings, processors, penalties, the stop decision and logprobs (runtime/model/sampling.py),
each against a plain per-element reference written here."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unweight.runtime.model.sampling import SamplingParams, Sequence, argmax_rows, choose_rows, token_logprobs

V = 50


def reference_scores(
    logits: list[float], p: SamplingParams, prompt: list[int], output: list[int], stop_ids: set[int]
) -> list[float]:
    """The processed logits, one element at a time, in the order the module's docstring gives."""
    s = list(logits)
    for t, b in p.logit_bias.items():
        s[t] += b
    if len(output) < p.min_tokens:
        for t in stop_ids:
            s[t] = -math.inf
    seen = set(prompt) | set(output)
    for t in seen:
        s[t] = s[t] / p.repetition_penalty if s[t] > 0 else s[t] * p.repetition_penalty
    for t in set(output):
        c = output.count(t)
        s[t] -= c * p.frequency_penalty + p.presence_penalty
    return s


params_st = st.builds(
    SamplingParams,
    max_new_tokens=st.just(50),
    repetition_penalty=st.sampled_from([1.0, 0.7, 1.3]),
    presence_penalty=st.sampled_from([0.0, -1.5, 0.5, 2.0]),
    frequency_penalty=st.sampled_from([0.0, 1.0, -0.25]),
    logit_bias=st.dictionaries(st.integers(0, V - 1), st.sampled_from([-100.0, -3.0, 5.0, 100.0]), max_size=4),
    min_tokens=st.integers(0, 4),
    ignore_eos=st.booleans(),
    stop_token_ids=st.lists(st.integers(0, V - 1), max_size=2),
)


@settings(max_examples=150, deadline=None)
@given(
    params_st,
    st.lists(st.integers(0, V - 1), min_size=1, max_size=6),
    st.lists(st.integers(0, V - 1), max_size=6),
    st.integers(0, 2**32),
)
def test_processed_greedy_choice_matches_the_reference(p, prompt, output, seed):
    logits = torch.randn(V, generator=torch.Generator().manual_seed(seed))
    seq = Sequence(p, prompt, eos=[0])
    for t in output:
        seq.output.append(t)
        seq._counts[t] = seq._counts.get(t, 0) + 1
    want = reference_scores(logits.tolist(), p, prompt, output, seq.stop_ids)
    got = seq._scores(logits)
    assert torch.allclose(got, torch.tensor(want), rtol=1e-6, atol=1e-5)
    assert seq.choose(logits).token == max(range(V), key=lambda i: (want[i], -i))


def test_stop_tokens_are_masked_before_min_tokens_and_end_the_sequence_after():
    logits = torch.full((V,), -5.0)
    logits[0] = 10.0  # EOS is by far the best
    p = SamplingParams(max_new_tokens=5, min_tokens=2, stop_token_ids=[7])
    seq = Sequence(p, [1, 2], eos=[0])
    reasons = []
    for _ in range(3):
        t = seq.choose(logits).token
        reasons.append((t, seq.append(t)))
    assert reasons[0][0] != 0 and reasons[1][0] != 0 and reasons[:2] == [(reasons[0][0], None), (reasons[1][0], None)]
    assert reasons[2] == (0, "stop")
    seq = Sequence(SamplingParams(max_new_tokens=2, ignore_eos=True), [1], eos=[0])
    assert [seq.append(seq.choose(logits).token) for _ in range(2)] == [None, "length"]
    seq = Sequence(SamplingParams(max_new_tokens=9, stop_token_ids=[7]), [1], eos=[0])
    assert seq.append(7) == "stop"


@pytest.mark.parametrize("temperature", [1e-40, 1e-6, 1e-5, 1e-3, 2.0])
def test_every_accepted_temperature_gives_a_valid_choice(temperature):
    """A temperature that 1/T would overflow is greedy; the rest sample from a real distribution,
    also with huge logits and every other cut at its edge."""
    logits = torch.tensor([3e4, -3e4, 2.9e4, 0.0] + [1.0] * (V - 4))
    p = SamplingParams(temperature=temperature, top_p=1e-9, top_k=1, min_p=1.0, seed=1, logit_bias={1: 100.0})
    seq = Sequence(p, [2], eos=[])
    pick = seq.choose(logits)
    assert pick.token == 0
    p = SamplingParams(temperature=temperature, seed=1)
    assert 0 <= Sequence(p, [2], eos=[]).choose(logits).token < V


def test_a_row_without_finite_logits_still_gives_a_token():
    logits = torch.full((V,), float("nan"))
    assert 0 <= Sequence(SamplingParams(temperature=0.7, seed=0), [1], eos=[]).choose(logits).token < V
    logits = torch.full((V,), float("-inf"))
    assert 0 <= Sequence(SamplingParams(), [1], eos=[]).choose(logits).token < V


EDGES = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0, 1.0]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from(EDGES) | st.floats(-3, 3, width=32), min_size=1, max_size=V), min_size=1, max_size=3
    ).filter(lambda rows: len({len(r) for r in rows}) == 1)
)
def test_argmax_rows_is_torchs_argmax(rows):
    """numpy's argmax for host fp32 logits gives torch's choice: the first maximum, a NaN before any number."""
    logits = torch.tensor(rows, dtype=torch.float32)
    for t in (logits, logits.to(torch.bfloat16), logits.clone().requires_grad_()):
        assert argmax_rows(t) == torch.argmax(t, dim=-1).tolist()
        assert argmax_rows(t[0]) == [int(torch.argmax(t[0]))]


def test_a_greedy_choice_over_non_finite_logits_is_the_reference_one():
    """Greedy with a NaN or +inf among finite scores takes the argmax of the scores (it has something
    to choose from); with nothing finite, the model's own argmax with NaN as -inf."""
    masked = SamplingParams(min_tokens=5)  # EOS masked: not the simple path
    for row, want in (
        ([1.0, float("nan"), 3.0], 1),
        ([1.0, float("inf"), 3.0], 1),
        ([float("nan"), float("-inf"), float("nan")], 1),
    ):
        for p in (SamplingParams(), masked):
            seq = Sequence(p, [0], eos=[0] if p is masked else [])
            assert seq.choose(torch.tensor(row)).token == want, (row, p)
    seqs = [Sequence(SamplingParams(), [0], eos=[]), Sequence(masked, [0], eos=[0])]
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [9.0, 2.0, 2.0, -1.0]])  # row 2: token 0 is EOS, masked
    assert [pick.token for pick in choose_rows(logits, seqs)] == [1, 1]
    seqs = [Sequence(SamplingParams(), [0], eos=[]) for _ in range(2)]  # all simple: the rows as they are
    assert [pick.token for pick in choose_rows(logits, seqs)] == [1, 0]
    seqs = [Sequence(masked, [0], eos=[0])]  # EOS masked, nothing finite: the model's own argmax, NaN as -inf
    logits = torch.tensor([[float("-inf"), float("nan"), float("nan")]])
    assert [pick.token for pick in choose_rows(logits, seqs)] == [seqs[0].choose(logits[0]).token] == [0]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 3),  # min_tokens
            st.lists(st.integers(0, 7), max_size=3),  # stop ids
            st.integers(0, 3),  # tokens already out
            st.lists(st.tuples(st.integers(0, 7), st.sampled_from([math.nan, math.inf, -math.inf, 9.0])), max_size=3),
        ),
        min_size=1,
        max_size=4,
    ),
    st.integers(0, 2**32),
)
def test_a_batch_of_greedy_rows_is_chosen_as_each_row_alone(rows, seed):
    """choose_rows takes a plain greedy row's argmax as it is wherever it is no masked stop token
    and its score is finite: the same tokens as Sequence.choose row by row, before min_tokens too,
    whatever the stop ids and non-finite scores."""
    logits = torch.randn(len(rows), 8, generator=torch.Generator().manual_seed(seed))
    seqs = []
    for r, (min_tokens, stops, out, odd) in enumerate(rows):
        seq = Sequence(SamplingParams(min_tokens=min_tokens, stop_token_ids=stops), [1], eos=[0])
        seq.output.extend([5] * out)
        for t, v in odd:
            logits[r, t] = v
        seqs.append(seq)
    want = [seq.choose(row.clone()).token for seq, row in zip(seqs, logits)]
    assert [pick.token for pick in choose_rows(logits, seqs)] == want


def test_min_p_and_top_k_cut_the_draws():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04] + [1e-9] * (V - 5)))
    drawn = set()
    seq = Sequence(SamplingParams(temperature=1.0, min_p=0.25, seed=5, max_new_tokens=300), [1], eos=[])
    for _ in range(300):
        drawn.add(seq.choose(logits).token)
    assert drawn == {0, 1}  # 0.1 < 0.25 * 0.5
    seq = Sequence(SamplingParams(temperature=1.0, top_k=3, seed=5), [1], eos=[])
    assert {seq.choose(logits).token for _ in range(300)} == {0, 1, 2}


def test_logprobs_are_the_models_raw_distribution():
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3))
    want = torch.log_softmax(logits, -1)
    for p in (
        SamplingParams(logprobs=4),
        SamplingParams(logprobs=4, temperature=0.5, seed=2, repetition_penalty=2.0, logit_bias={3: 50.0}),
    ):
        pick = Sequence(p, [3, 4], eos=[]).choose(logits)
        assert pick.logprob == pytest.approx(float(want[pick.token]), abs=1e-6)
        assert [t for t, _ in pick.top] == torch.topk(want, 4).indices.tolist()
        assert [v for _, v in pick.top] == pytest.approx(torch.topk(want, 4).values.tolist(), abs=1e-6)
    assert Sequence(SamplingParams(logprobs=0), [1], eos=[]).choose(logits).top == []
    assert Sequence(SamplingParams(), [1], eos=[]).choose(logits).logprob is None


def test_token_logprobs_in_chunks_equal_one_log_softmax():
    logits = torch.randn(70, V, generator=torch.Generator().manual_seed(4))
    nxt = torch.randint(0, V, (70,), generator=torch.Generator().manual_seed(5))
    got = token_logprobs(logits, nxt, top=3, chunk=16)
    lp = torch.log_softmax(logits, -1)
    assert [c for c, _ in got] == pytest.approx(lp.gather(1, nxt[:, None])[:, 0].tolist(), abs=1e-6)
    assert [[i for i, _ in a] for _, a in got] == torch.topk(lp, 3, dim=-1).indices.tolist()


def test_the_state_hands_over_mid_sequence():
    """A sequence resumed from its state() on another worker draws what it would have drawn."""
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(6))
    p = SamplingParams(temperature=0.9, seed=11, frequency_penalty=0.5, repetition_penalty=1.2, max_new_tokens=8)
    whole = Sequence(p, [1, 2, 3], eos=[0])
    want = []
    for row in logits:
        want.append(whole.choose(row).token)
        whole.append(want[-1])
    first = Sequence(p, [1, 2, 3], eos=[0])
    got = []
    for row in logits[:3]:
        got.append(first.choose(row).token)
        first.append(got[-1])
    resumed = Sequence.from_state(__import__("json").loads(__import__("json").dumps(first.state())), V)
    for row in logits[3:]:
        got.append(resumed.choose(row).token)
        resumed.append(got[-1])
    assert got == want


@pytest.mark.parametrize(
    "bad",
    [
        {"sampling": {"temperature": "x"}, "prompt": [1], "output": [], "eos": [], "rng": None},
        {"sampling": {"bogus": 1}, "prompt": [1], "output": [], "eos": [], "rng": None},
        {"sampling": {}, "prompt": [V], "output": [], "eos": [], "rng": None},
        {"sampling": {}, "prompt": ["1"], "output": [], "eos": [], "rng": None},
        {"sampling": {}, "prompt": [1], "output": [], "eos": [], "rng": [300]},
        {"sampling": {}, "prompt": [1], "output": [], "eos": [], "rng": [1, 2, 3]},
        {"sampling": {"logit_bias": [[V + 5, 1.0]]}, "prompt": [1], "output": [], "eos": [], "rng": None},
        {"sampling": {"logit_bias": {"1": 2}}, "prompt": [1], "output": [], "eos": [], "rng": None},
        "not an object",
    ],
)
def test_a_bad_state_is_a_value_error(bad):
    with pytest.raises(ValueError):
        Sequence.from_state(bad, V)


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": float("nan")},
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": -2},
        {"min_p": 1.5},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3},
        {"repetition_penalty": 0},
        {"logit_bias": {1: 101}},
        {"min_tokens": 300},
        {"seed": 2**63},
        {"seed": -(2**63) - 1},
        {"logprobs": 21},
        {"ignore_eos": 1},
        {"stop_token_ids": [-1]},
    ],
)
def test_out_of_range_settings_are_refused(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_choices_of_one_request_get_distinct_seeds_in_range():
    assert Sequence.seed_for(None, 3) is None
    assert Sequence.seed_for(5, 0) == 5 and Sequence.seed_for(5, 1) == 6
    assert Sequence.seed_for(2**63 - 1, 1) == -(2**63)
    SamplingParams(seed=Sequence.seed_for(2**63 - 1, 1))
