"""TextStream against its oracle, `tokenizer.decode(all tokens)`, with the real SmolLM2 tokenizer:
random token sequences (whole vocabulary, pieces of multi-byte characters, special tokens) with
and without stop strings, and the work each push hands to `decode`."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unweight.runtime.generate import TextStream, load_tokenizer

MULTIBYTE = "😀🎉 中文字符 naïve café Ω≈ç√∫ 👩‍👩‍👧 𝔘𝔫𝔴𝔢𝔦𝔤𝔥𝔱 ﷽ ∮ E⋅da = Q"


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return load_tokenizer(smollm2_dir)


class Reference:
    """The plain version (the oracle): decode every token at each push and cut the text before the
    earliest occurrence of any stop string."""

    def __init__(self, tokenizer, stop):
        self.tokenizer, self.stop, self.tokens, self.text, self.finished = tokenizer, list(stop), [], "", False

    def push(self, token):
        self.tokens.append(token)
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        hits = [at for at in (full.find(s) for s in self.stop) if at >= 0]
        if hits:
            full, self.finished = full[: min(hits)], True
        self.text = full


class Counting:
    """The real tokenizer, counting the tokens each decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def decode(self, ids, **kw):
        self.calls.append(len(ids))
        return self.tokenizer.decode(ids, **kw)


def run(stream, tokens):
    pieces, pushed = [], 0
    for t in tokens:
        pieces.append(stream.push(t))
        pushed += 1
        if stream.finished:
            break
    pieces.append(stream.flush())
    return "".join(pieces), pushed


@st.composite
def sequences(draw, tok):
    vocab = len(tok)
    pieces = tok(MULTIBYTE, add_special_tokens=False)["input_ids"]  # byte-level pieces of multi-byte characters
    special = sorted(set(tok.all_special_ids))
    token = st.one_of(st.integers(0, vocab - 1), st.sampled_from(pieces), st.sampled_from(special))
    return draw(st.lists(token, min_size=0, max_size=48))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_pushed_text_is_the_decode_of_all_tokens(tok, data):
    tokens = data.draw(sequences(tok))
    stream = TextStream(tok)
    text, _ = run(stream, tokens)
    assert text == stream.text == tok.decode(tokens, skip_special_tokens=True)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stop_strings_end_the_text_as_the_plain_version_does(tok, data):
    tokens = data.draw(sequences(tok))
    full = tok.decode(tokens, skip_special_tokens=True)
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        if full and data.draw(st.booleans()):  # a piece of the text itself, so that it hits
            i = data.draw(st.integers(0, len(full) - 1))
            s = full[i : i + data.draw(st.integers(1, 6))]
        else:
            s = data.draw(st.text(st.sampled_from("ab 中😀\n."), min_size=1, max_size=4))
        if "\ufffd" not in s:
            stops.append(s)
    stream, ref = TextStream(tok, stops), Reference(tok, stops)
    text, pushed = run(stream, tokens)
    _, ref_pushed = run_reference(ref, tokens)
    assert (pushed, stream.finished) == (ref_pushed, ref.finished)
    assert text == stream.text == ref.text
    if not stream.finished:
        assert text == full
    else:
        assert not any(s in text for s in stops)


def run_reference(ref, tokens):
    pushed = 0
    for t in tokens:
        ref.push(t)
        pushed += 1
        if ref.finished:
            break
    return ref.text, pushed


def test_each_push_decodes_a_few_tokens_however_long_the_text(tok):
    """An 8,000-token completion used to re-decode all its tokens at every push (32 million
    token decodes); now each push decodes the last few."""
    paragraph = (
        "The history of Rome spans 28 centuries. "
        + MULTIBYTE
        + " Ünïcödé, 日本語のテキスト, and code: `x = [i**2 for i in range(10)]`.\n"
    )
    tokens = tok(paragraph * 120, add_special_tokens=False)["input_ids"]
    assert len(tokens) > 4000
    counting = Counting(tok)
    stream = TextStream(counting, ["never appears"])
    text, pushed = run(stream, tokens)
    assert pushed == len(tokens) and text == tok.decode(tokens, skip_special_tokens=True)
    assert max(counting.calls) <= 12  # the window: the last pieces and an unfinished character
    assert sum(counting.calls) <= 6 * len(tokens)


def test_held_back_text_comes_out_whole(tok):
    """A character split across tokens and the start of a stop string are held back, then sent."""
    ids = tok("x😀", add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, ["😀!"])
    pieces = [stream.push(t) for t in ids]
    assert "".join(pieces) == "x" and stream.text == "x😀" and not stream.finished  # "😀" may begin "😀!"
    assert stream.flush() == "😀"
    stream = TextStream(tok, ["😀"])
    assert "".join(stream.push(t) for t in ids) == "x" and stream.finished and stream.text == "x"


def test_a_stop_string_ending_in_an_unfinished_character_is_held_back(tok):
    """ " t" is settled text, then a half character arrives: " t" may begin the stop " t¡", so it
    is not shown; the next byte completes "¡" and the stop (found by hypothesis)."""
    ids = [252, 141, 111]  # " t", then the two bytes of "¡"
    assert tok.decode(ids) == " t¡" and tok.decode(ids[:2]) == " t\ufffd"
    stream = TextStream(tok, [" t¡"])
    text, pushed = run(stream, ids)
    assert (text, stream.text, stream.finished, pushed) == ("", "", True, 3)


def test_overlapping_stop_strings_cut_at_the_earliest(tok):
    """One token completes " t" (at 0) and "t" (at 1): the text ends before " t", whatever the
    order of the list (the version before cut at "t" first, and then " t" was no longer found)."""
    (token,) = tok(" t", add_special_tokens=False)["input_ids"]
    for stops in (["t", " t"], [" t", "t"]):
        stream = TextStream(tok, stops)
        assert stream.push(token) == "" and stream.finished and stream.text == ""


def test_stop_strings_do_not_count_before_min_tokens(tok):
    """As in vLLM: a stop string in the first min_tokens tokens does not end the text; the first
    one after them does."""
    text = "the cat sat on the mat and the dog ran off"
    tokens = tok(text, add_special_tokens=False)["input_ids"]
    at = [len(tok.decode(tokens[:i])) for i in range(len(tokens) + 1)]
    assert len(tokens) > 8
    plain = TextStream(tok, [" the"])
    run(plain, tokens)
    assert plain.finished and plain.text == "the cat sat on"
    late = TextStream(tok, [" the"], min_tokens=6)
    got, _ = run(late, tokens)
    first = text.index(" the")
    assert at[6] >= first + 4  # the first " the" lies wholly within the first six tokens
    assert late.finished and got == late.text == text[: text.index(" the", first + 1)] == "the cat sat on the mat and"
    never = TextStream(tok, [" the"], min_tokens=len(tokens))
    assert run(never, tokens)[0] == text and not never.finished
