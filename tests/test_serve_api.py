"""The OpenAI fields real clients send, through the official `openai` client and real HTTP, on the
compressed SmolLM2 served for real (prefill and decode workers): logprobs, echo, token-id and
batched prompts, content parts, nulls, n and best_of, penalties and logit_bias, and every field
the server does not implement refused by name.

Logprobs are checked against ones computed here, from `unweight.load` on the same folder.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

import unweight
from test_serve import KEY, Server

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
TOL = 2e-3  # the server's fused CPU GEMV and this process's pipeline sum in different orders


@pytest.fixture(scope="module")
def server(uw):
    s = Server(str(uw), "--api-key", KEY, "--max-model-len", "512")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def local(uw):
    return unweight.load(uw, dtype="float32"), unweight.load_tokenizer(uw)


def logprobs_of(local, ids: list[int]) -> torch.Tensor:
    """log-softmax after each prefix of ids (len(ids), vocab), computed in this process."""
    model, _ = local
    seq = model.new_sequence()
    try:
        return torch.log_softmax(model.prefill(seq, torch.tensor(ids), all_logits=True), dim=-1)
    finally:
        model.free(seq)


def chat_ids(local, messages) -> list[int]:
    from unweight.runtime.generate import encode_prompt

    return encode_prompt(local[1], messages)


@pytest.mark.slow
def test_chat_logprobs_match_the_model(client, local):
    r = client.chat.completions.create(
        model="uw", messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = r.choices[0]
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens > 0
    assert b"".join(bytes(e.bytes) for e in content).decode() == choice.message.content
    tok = local[1]
    gen = tok.convert_tokens_to_ids(
        [tok.convert_ids_to_tokens(i) for i in tok(choice.message.content, add_special_tokens=False)["input_ids"]]
    )
    prompt = chat_ids(local, CHAT)
    lp = logprobs_of(local, prompt + gen)
    for k, e in enumerate(content):
        want = lp[len(prompt) - 1 + k]
        assert e.logprob == pytest.approx(float(want.max()), abs=TOL)  # greedy: the chosen token is the best
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(torch.topk(want, 3).values.tolist(), abs=TOL)


def test_streamed_chat_logprobs_equal_the_whole_answer(client):
    kw = dict(model="uw", messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw).choices[0]
    entries, text = [], ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None:
                entries += c.logprobs.content
    assert text == whole.message.content
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in whole.logprobs.content]


def test_echo_scores_a_token_id_prompt_as_lm_eval_asks(client, local):
    """lm-eval's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1."""
    tok = local[1]
    ids = tok("The capital of France is Paris", add_special_tokens=False)["input_ids"]
    r = client.completions.create(model="uw", prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = logprobs_of(local, ids)
    for k in range(1, len(ids)):
        assert lp.token_logprobs[k] == pytest.approx(float(want[k - 1, ids[k]]), abs=TOL)
        best = max(lp.top_logprobs[k].values())
        assert best == pytest.approx(float(want[k - 1].max()), abs=TOL)
        assert (
            lp.top_logprobs[k][lp.tokens[k]] == lp.token_logprobs[k]
        )  # the chosen token is in its dict, as lm-eval's is_greedy needs
    assert r.choices[0].text.startswith(tok.decode(ids)) and "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1


def test_streamed_echo_sends_the_prompt_first(client):
    kw = dict(model="uw", prompt="Once upon a time", echo=True, logprobs=1, max_tokens=4, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].text.startswith("Once upon a time")
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.text_offset]
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset


def test_batched_and_token_id_prompts_are_choices_of_their_own(client, local):
    prompts = ["The sky is", "Two plus two is"]
    one = [
        client.completions.create(model="uw", prompt=p, max_tokens=6, temperature=0).choices[0].text for p in prompts
    ]
    r = client.completions.create(model="uw", prompt=prompts, max_tokens=6, temperature=0)
    assert sorted((c.index, c.text) for c in r.choices) == [(0, one[0]), (1, one[1])]
    ids = [local[1](p)["input_ids"] for p in prompts]
    r = client.completions.create(model="uw", prompt=ids, max_tokens=6, temperature=0)
    assert sorted((c.index, c.text) for c in r.choices) == [(0, one[0]), (1, one[1])]
    assert r.usage.prompt_tokens == sum(len(i) for i in ids)


@pytest.mark.slow
def test_content_parts_tool_histories_and_nulls(server, client):
    plain = (
        client.chat.completions.create(model="uw", messages=CHAT, max_tokens=8, temperature=0)
        .choices[0]
        .message.content
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    assert (
        client.chat.completions.create(model="uw", messages=parts, max_tokens=8, temperature=0)
        .choices[0]
        .message.content
        == plain
    )
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        *CHAT,
    ]
    assert (
        client.chat.completions.create(model="uw", messages=history, max_tokens=4, temperature=0)
        .choices[0]
        .message.content
    )
    nulls = {
        k: None
        for k in (
            "max_tokens",
            "max_completion_tokens",
            "top_p",
            "top_k",
            "n",
            "stream",
            "stop",
            "seed",
            "logprobs",
            "top_logprobs",
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "stream_options",
            "tools",
            "tool_choice",
            "response_format",
            "min_p",
            "repetition_penalty",
            "min_tokens",
            "ignore_eos",
            "stop_token_ids",
            "user",
        )
    }
    r = server.http.post("/v1/chat/completions", json={"model": "uw", "messages": CHAT, "temperature": 0, **nulls})
    assert r.status_code == 200, r.text
    r = server.http.post(
        "/v1/completions",
        json={
            "model": "uw",
            "prompt": "Hi",
            "temperature": None,
            "echo": None,
            "best_of": None,
            "suffix": None,
            "max_tokens": 4,
        },
    )
    assert r.status_code == 200, r.text
    unused = {
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "response_format": {"type": "text"},
        "modalities": ["text"],
        "tools": [],
    }
    r = server.http.post("/v1/chat/completions", json={"model": "uw", "messages": CHAT, "max_tokens": 2, **unused})
    assert r.status_code == 200, r.text
    r = server.http.post(
        "/v1/chat/completions",
        json={
            "model": "uw",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        },
    )
    assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]


@pytest.mark.slow
def test_n_and_best_of(client):
    r = client.chat.completions.create(model="uw", messages=CHAT, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].message.content == r.choices[1].message.content
    kw = dict(model="uw", prompt="My favourite animal is", max_tokens=6, temperature=1.0, seed=7)
    three = client.completions.create(n=3, logprobs=0, **kw).choices
    assert len({c.text for c in three}) > 1  # each choice has a seed of its own
    best = client.completions.create(n=1, extra_body={"best_of": 3}, **kw)
    ranked = max(three, key=lambda c: sum(c.logprobs.token_logprobs))
    assert [c.text for c in best.choices] == [ranked.text] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in three)


@pytest.mark.slow
def test_penalties_bias_and_stop_controls(client, local):
    model, tok = local
    plain = (
        client.completions.create(model="uw", prompt="one, one, one, one,", max_tokens=12, temperature=0)
        .choices[0]
        .text
    )
    kw = dict(frequency_penalty=2.0, presence_penalty=1.0)
    penalised = (
        client.completions.create(model="uw", prompt="one, one, one, one,", max_tokens=12, temperature=0, **kw)
        .choices[0]
        .text
    )
    assert penalised != plain
    assert penalised == unweight.generate(model, tok, "one, one, one, one,", max_new_tokens=12, **kw).text
    rep = client.completions.create(
        model="uw", prompt="one, one, one, one,", max_tokens=12, temperature=0, extra_body={"repetition_penalty": 1.5}
    )
    assert (
        rep.choices[0].text
        == unweight.generate(model, tok, "one, one, one, one,", max_new_tokens=12, repetition_penalty=1.5).text
    )
    x = tok(" banana", add_special_tokens=False)["input_ids"][0]
    r = client.completions.create(model="uw", prompt="Hello", max_tokens=5, temperature=0, logit_bias={str(x): 100})
    assert r.choices[0].text == " banana" * 5
    r = client.completions.create(
        model="uw",
        prompt="Hello",
        max_tokens=7,
        temperature=0,
        logit_bias={str(x): 100},
        extra_body={"stop_token_ids": [x], "min_tokens": 0},
    )
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 0
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    r = client.chat.completions.create(
        model="uw",
        messages=CHAT,
        max_tokens=20,
        temperature=0,
        logit_bias={str(eos): 100},
        extra_body={"min_tokens": 3},
    )
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(
        model="uw",
        messages=CHAT,
        max_tokens=20,
        temperature=0,
        logit_bias={str(eos): 100},
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 20 and r.choices[0].finish_reason == "length"


def test_tiny_temperatures_and_extreme_values_are_served(client):
    for t in (1e-40, 1e-6):
        r = client.chat.completions.create(
            model="uw", messages=CHAT, max_tokens=4, temperature=t, top_p=1e-9, extra_body={"min_p": 1.0, "top_k": 1}
        )
        assert r.choices[0].message.content
    r = client.chat.completions.create(
        model="uw",
        messages=CHAT,
        max_tokens=4,
        temperature=2.0,
        seed=-(2**63),
        presence_penalty=-2,
        frequency_penalty=2,
    )
    assert r.usage.completion_tokens == 4 or r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "endpoint,extra,param",
    [
        ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
        ("chat", {"guided_json": {"type": "object"}}, "guided_json"),
        ("chat", {"echo": True}, "echo"),
        ("chat", {"best_of": 2}, "best_of"),
        ("completions", {"suffix": "end"}, "suffix"),
        ("completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
        ("chat", {"seed": 2**63}, "seed"),
        ("chat", {"seed": -(2**63) - 1}, "seed"),
        ("chat", {"top_logprobs": 2}, None),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("chat", {"logit_bias": {"99999999": 5}}, None),
        ("chat", {"logit_bias": {"the": 5}}, "logit_bias"),
        ("chat", {"presence_penalty": 3}, "presence_penalty"),
        ("chat", {"n": 0}, "n"),
        ("chat", {"min_tokens": 300, "max_tokens": 10}, None),
        ("completions", {"n": 3, "best_of": 2}, None),
        ("completions", {"prompt": [[]]}, "prompt"),
        ("completions", {"prompt": [1, 10**9]}, "prompt"),
    ],
)
def test_unsupported_and_bad_fields_are_400_by_name(server, endpoint, extra, param):
    base = {"model": "uw", "max_tokens": 4}
    base.update({"messages": CHAT} if endpoint == "chat" else {"prompt": "Hi"})
    r = server.http.post(f"/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}", json={**base, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param and param in err["message"]


def test_the_openai_client_raises_bad_request_by_name(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="uw", messages=CHAT, response_format={"type": "json_object"})
    assert "response_format" in str(e.value)
    assert json.loads(e.value.response.text)["error"]["param"] == "response_format"


def test_generation_config_gives_the_sampling_a_request_leaves_out(uw, tmp_path):
    """As vLLM's `--generation-config auto`: the model's generation_config.json fills what a request
    leaves out of temperature, top_p, top_k, min_p and repetition_penalty (values equal to
    transformers' defaults say nothing); what the request gives wins; `--generation-config vllm`
    keeps OpenAI's defaults. A mistyped or out-of-bounds field stops the server, named."""
    from unweight.errors import SourceError
    from unweight.runtime.serve.api import ChatRequest, CompletionRequest
    from unweight.runtime.serve.protocol import ServeConfig
    from unweight.runtime.serve.routes.state import ServerState

    folder = tmp_path / "model"
    folder.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / f).write_bytes((uw / f).read_bytes())
    gen = {"eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 50, "min_p": 0.05}
    (folder / "generation_config.json").write_text(json.dumps(gen | {"repetition_penalty": 1.1}))

    state = ServerState.from_config(ServeConfig(model=str(folder)))
    assert state.sampling == {"temperature": 0.6, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1}
    p = ChatRequest(model="uw", messages=CHAT).params(8, None, defaults=state.sampling)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.6, 0.9, 0, 0.05, 1.1)
    p = CompletionRequest(model="uw", prompt="x", temperature=0, top_p=1, top_k=5).params(
        8, None, defaults=state.sampling
    )
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0, 1, 5, 0.05)
    assert ServerState.from_config(ServeConfig(model=str(folder), generation_config="vllm")).sampling == {}
    assert CompletionRequest(model="uw", prompt="x").params(8, None, defaults={}).temperature == 1.0

    for bad, named in (({"temperature": "0.6"}, "temperature is '0.6', not a number"),
                       ({"top_k": 2.5}, "top_k is 2.5, not an integer"),
                       ({"top_p": 0}, "top_p is 0, out of bounds"),
                       ({"temperature": float("nan")}, "temperature is nan, out of bounds")):  # fmt: skip
        (folder / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(SourceError, match=named):
            ServerState.from_config(ServeConfig(model=str(folder)))
    (folder / "generation_config.json").unlink()
    assert ServerState.from_config(ServeConfig(model=str(folder))).sampling == {}
    with pytest.raises(ValueError, match="generation-config 'hf' is not one of auto, vllm"):
        ServeConfig(model=str(folder), generation_config="hf")
