"""The runtime on a real trained chat model: SmolLM2-135M-Instruct, compressed by the CLI, loaded
with `unweight.load`, against Hugging Face transformers on the uncompressed BF16 folder.

Both sides compute in fp32 from the same BF16 weights (every BF16 value is an fp32 value), so the
only differences are the order of fp32 accumulations: logits agree to ~1e-4 absolute (measured
5e-5), and greedy tokens are identical. With dtype="bfloat16" both round every activation to BF16
at the same places: through decode-then-GEMM the logits are bit-equal to transformers' BF16 run.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch

import unweight
from helpers import run_cli

LOGIT_ATOL = 1e-3  # fp32 accumulation order on logits of magnitude ~30: measured 5e-5
PROMPTS = [
    ("plain", "The history of the Roman Empire began"),
    ("chat", "Write a short story about a robot who learns to paint."),
    ("chat", "List the planets of the solar system and one fact about each."),
]


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(smollm2_uw):
    return unweight.load(smollm2_uw[0], dtype="float32")  # against transformers' FP32 (auto is BF16 on some CPUs)


@pytest.fixture(scope="module")
def tok(smollm2_uw):
    return unweight.load_tokenizer(smollm2_uw[0])


def prompt_ids(tok, kind: str, text: str) -> list[int]:
    from unweight.runtime.generate import encode_prompt

    return encode_prompt(tok, text, chat=kind == "chat")


def hf_greedy(hf, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens from transformers' own KV-cached loop (no EOS stop), and the prompt logits."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
        first_logits = out.logits[0]
        tokens = []
        for _ in range(n):
            nxt = int(out.logits[0, -1].argmax())
            tokens.append(nxt)
            out = hf(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, first_logits


def our_greedy(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    seq = model.new_sequence()
    try:
        logits = model.prefill(seq, ids, all_logits=True)
        first_logits, tokens = logits, []
        last = logits[-1]
        for _ in range(n):
            nxt = int(last.argmax())
            tokens.append(nxt)
            last = model.decode_step([seq], [nxt])[0]
    finally:
        model.free(seq)
    return tokens, first_logits


@pytest.mark.parametrize("kind,text", PROMPTS)
@pytest.mark.slow
def test_greedy_tokens_identical_to_transformers(model, hf, tok, kind, text):
    ids = prompt_ids(tok, kind, text)
    ours, our_logits = our_greedy(model, ids, 64)
    theirs, their_logits = hf_greedy(hf, ids, 64)
    assert ours == theirs, (
        f"first difference at token {next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)}"
    )
    assert (our_logits - their_logits).abs().max() < LOGIT_ATOL


@pytest.mark.slow
def test_a_bfloat16_kv_cache_is_the_float32_one_rounded_as_stored(smollm2_uw, model, tok, monkeypatch):
    """--kv-cache-dtype bfloat16 with FP32 compute: the oracle is the FP32 cache whose K and V are
    rounded to BF16 where they are written, and nothing else: attention widens them back exactly,
    so the logits are bit-equal, token after token."""
    from unweight.runtime.kernels import cpu_pointwise
    from unweight.runtime.model.kv_cache import KVCache

    bf16 = unweight.load(smollm2_uw[0], kv_cache_dtype="bfloat16", dtype="float32")
    assert bf16.cache.k.dtype == torch.bfloat16 and model.cache.k.dtype == torch.float32
    assert 2 * bf16.cache.bytes_per_token == model.cache.bytes_per_token
    ids = prompt_ids(tok, *PROMPTS[1])
    ours, our_logits = our_greedy(bf16, ids, 24)
    # K and V reach the cache through write_slots (a prompt's; the BF16 cache's decode steps) or the native
    # rope's store (the FP32 cache's decode steps): both round them here
    write = KVCache.write_slots
    monkeypatch.setattr(
        KVCache,
        "write_slots",
        lambda self, layer, slots, k, v: write(
            self, layer, slots, k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
        ),
    )
    rope_store = cpu_pointwise.rope_store_cpu

    def rounded_store(qkv, cos, sin, nq, nkv, k_cache, v_cache, slots):
        rope_store(qkv, cos, sin, nq, nkv, k_cache, v_cache, slots)
        for c in (k_cache, v_cache):
            c[slots] = c[slots].to(torch.bfloat16).float()

    monkeypatch.setattr(cpu_pointwise, "rope_store_cpu", rounded_store)
    ref, ref_logits = our_greedy(model, ids, 24)
    assert ours == ref
    assert torch.equal(our_logits.view(torch.int32), ref_logits.view(torch.int32))
    with pytest.raises(ValueError, match="kv_cache_dtype 'float16' is not one of auto, bfloat16, float32"):
        unweight.load(smollm2_uw[0], kv_cache_dtype="float16")


@pytest.mark.slow
def test_bfloat16_compute_rounds_as_transformers_bfloat16(smollm2_uw, smollm2_dir, hf, tok, monkeypatch):
    """dtype="bfloat16" rounds activations where transformers' BF16 run rounds them: through
    decode-then-GEMM (the pipeline prefills take, forced here) every matmul is the BF16 GEMM
    transformers runs on the same weights, and the prompt's logits are bit-equal. Decode steps
    attend in FP32 (a single BF16 query is 7x slower in torch's CPU kernel) and the fused GEMV sums
    in FP32 in its own order, so they are held to the FP32 run instead, fed the same tokens: as
    close to it as transformers' BF16 decode is (docs/runtime.md)."""
    from transformers import AutoModelForCausalLM

    hf_bf16 = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval()
    monkeypatch.setenv("UNWEIGHT_PIPELINE", "decode_matmul")
    bf16 = unweight.load(smollm2_uw[0], dtype="bfloat16")
    assert bf16.compute_dtype == torch.bfloat16 and bf16.cache.k.dtype == torch.bfloat16
    for kind, text in PROMPTS[:2]:
        ids = prompt_ids(tok, kind, text)
        seq = bf16.new_sequence()
        ours = bf16.prefill(seq, ids, all_logits=True)
        bf16.free(seq)
        with torch.no_grad():
            theirs = hf_bf16(torch.tensor([ids])).logits[0]
        assert torch.equal(ours.view(torch.int32), theirs.float().view(torch.int32))
    monkeypatch.delenv("UNWEIGHT_PIPELINE")
    fused = unweight.load(smollm2_uw[0], dtype="bfloat16")  # the autotuned pipelines, FP32 attention at decode
    for kind, text in PROMPTS[:2]:
        ids = prompt_ids(tok, kind, text)
        tokens, _ = hf_greedy(hf, ids, 32)  # the FP32 run's greedy tokens, fed to both BF16 runs
        seq = fused.new_sequence()
        ours = [fused.prefill(seq, ids)] + [fused.decode_step([seq], [t])[0] for t in tokens[:-1]]
        fused.free(seq)
        ours = torch.stack(ours).float()
        with torch.no_grad():
            ref = hf(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
            theirs = hf_bf16(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1].float()
        assert torch.equal(ours, ours.bfloat16().float())  # logits rounded as BF16
        # as far from the FP32 run as transformers' BF16 run: on average (a BF16 rounding that flips one
        # way or the other in a step carries into the steps after it, so the two runs trade places
        # within a tenth or two), and at the worst (one such flip is the largest difference)
        assert (ours - ref).abs().mean() <= 1.25 * (theirs - ref).abs().mean()
        assert (ours - ref).abs().max() <= 2 * (theirs - ref).abs().max()
        agree = lambda logits: int((logits.argmax(-1) == ref.argmax(-1)).sum())  # noqa: E731
        assert agree(ours) >= agree(theirs) - 1
    with pytest.raises(ValueError, match="dtype 'float16' is not one of auto, bfloat16, float32"):
        unweight.load(smollm2_uw[0], dtype="float16")


class _Dense(torch.nn.Module):
    """A linear (or embedding) over a plain BF16 weight, as the engine runs it on an uncompressed
    model: F.linear in x's dtype, rows looked up."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight.to(x.dtype))

    def rows(self, ids, dtype=torch.bfloat16, check=True):
        return (self.weight if ids is None else self.weight[ids.reshape(-1).long()]).to(dtype)


@pytest.mark.slow
def test_bfloat16_text_is_the_engines_on_the_uncompressed_weights(smollm2_uw, smollm2_dir, tok, monkeypatch):
    """BF16 compute's guarantee: the compressed model gives the text, and the logits bit for bit, that
    the same engine gives with the uncompressed BF16 weights read from the source folder in place of
    every compressed matrix, when both multiply the same way (decode-then-GEMM, forced here; the fused
    GEMV sums in its own order). The source's tensors are also compared with the decoded ones on their
    integer views, so the twin really holds the checkpoint's bits."""
    from safetensors.torch import load_file

    from unweight.runtime.layers.linear import UnweightLinear
    from unweight.runtime.model.loader import PACKED

    monkeypatch.setenv("UNWEIGHT_PIPELINE", "decode_matmul")
    ours, twin = unweight.load(smollm2_uw[0], dtype="bfloat16"), unweight.load(smollm2_uw[0], dtype="bfloat16")
    source = load_file(smollm2_dir / "model.safetensors")
    dense: dict[int, _Dense] = {}  # a tied lm_head is the embedding's module: one twin for both
    swapped = 0
    for name, module in list(twin.named_modules()):
        for attr, child in list(module.named_children()):
            if not isinstance(child, UnweightLinear):
                continue
            full = f"{name}.{attr}" if name else attr
            parent, leaf = full.rpartition(".")[::2]
            parts = [f"{parent}.{p}.weight" for p in PACKED[leaf]] if leaf in PACKED else [f"{full}.weight"]
            if parts == ["lm_head.weight"] and parts[0] not in source:  # tied: the embedding's tensor
                parts = ["model.embed_tokens.weight"]
            weight = torch.cat([source[p] for p in parts])
            assert weight.dtype == torch.bfloat16
            assert torch.equal(child.decoded_weight().view(torch.int16), weight.view(torch.int16)), full
            setattr(module, attr, dense.setdefault(id(child), _Dense(weight)))
            swapped += 1
    assert swapped == 2 + 4 * ours.config.num_layers  # embedding, lm_head, and qkv, o, gate_up, down a layer
    assert twin.lm_head is twin.model.embed_tokens  # SmolLM2 ties them, and so does the twin

    def greedy(m, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        seq = m.new_sequence()
        logits, tokens = [m.prefill(seq, ids)], []
        for _ in range(n - 1):
            tokens.append(int(logits[-1].argmax()))
            logits.append(m.decode_step([seq], [tokens[-1]])[0])
        m.free(seq)
        return tokens, torch.stack(logits)

    for kind, text in PROMPTS:
        ids = prompt_ids(tok, kind, text)
        (a, la), (b, lb) = greedy(ours, ids, 32), greedy(twin, ids, 32)
        assert a == b and tok.decode(a) == tok.decode(b)
        assert torch.equal(la.view(torch.int32), lb.view(torch.int32))


def test_weights_stay_compressed(model, smollm2_dir):
    bf16_bytes = (smollm2_dir / "model.safetensors").stat().st_size
    resident = model.resident_weight_bytes()
    assert resident < 0.75 * bf16_bytes  # tiles: ~11.3 bits a weight instead of 16
    dense = [
        n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_floating_point() and t.dim() >= 2
    ]
    assert dense == []  # no decoded copy of any matrix is kept
    assert model.lm_head is model.model.embed_tokens  # tied: one copy of the streams


def test_archive_layout_gives_the_same_logits(smollm2_uw, model, tok):
    archive = unweight.load(smollm2_uw[0], layout="archive", dtype="float32")
    assert archive.resident_weight_bytes() < model.resident_weight_bytes()
    ids = prompt_ids(tok, *PROMPTS[0])
    a, b = archive.new_sequence(), model.new_sequence()
    assert (archive.prefill(a, ids) - model.prefill(b, ids)).abs().max() < LOGIT_ATOL
    model.free(b)


def test_batched_decode_equals_one_at_a_time(model, tok):
    """Two sequences of different lengths decoded in one batch give each its own logits."""
    seqs, last = [], []
    for kind, text in PROMPTS[:2]:
        s = model.new_sequence()
        last.append(int(model.prefill(s, prompt_ids(tok, kind, text)).argmax()))
        seqs.append(s)
    batched = model.decode_step(seqs, last)
    for s, t, row in zip(seqs, last, batched):
        s.length -= 1  # replay the same step alone
        single = model.decode_step([s], [t])[0]
        assert (single - row).abs().max() < LOGIT_ATOL
        model.free(s)


def test_a_prompt_and_a_decode_step_in_one_forward_equal_both_apart(model, tok):
    """prefill_with_step (what --no-disagg runs when a prompt arrives beside a running batch) gives
    the prompt's last logits and each running sequence's next ones as prefill and decode_step
    apart do, and leaves every sequence's cache as they do; a bad call is refused whole."""
    (kind0, text0), (kind1, text1), (kind2, text2) = PROMPTS[:3]
    running = [model.new_sequence(), model.new_sequence()]
    last = [
        int(model.prefill(s, prompt_ids(tok, k, t)).argmax()) for s, (k, t) in zip(running, [PROMPTS[0], PROMPTS[1]])
    ]
    new = model.new_sequence()
    ids = prompt_ids(tok, kind2, text2)
    first, rows = model.prefill_with_step(new, ids, running, last)
    assert [s.length for s in running] == [
        len(prompt_ids(tok, kind0, text0)) + 1,
        len(prompt_ids(tok, kind1, text1)) + 1,
    ]
    assert new.length == len(ids) and rows.shape == (2, model.config.vocab_size)
    after = model.decode_step([new, *running], [int(first.argmax()), *[int(r.argmax()) for r in rows]])
    alone = model.new_sequence()
    assert (model.prefill(alone, ids) - first).abs().max() < LOGIT_ATOL
    assert (model.decode_step([alone], [int(first.argmax())])[0] - after[0]).abs().max() < LOGIT_ATOL
    for s, t, row in zip(running, last, rows):
        s.length -= 2  # replay the riding step alone
        assert (model.decode_step([s], [t])[0] - row).abs().max() < LOGIT_ATOL
    with pytest.raises(ValueError, match="one token per sequence"):
        model.prefill_with_step(model.new_sequence(), ids, running, last[:1])
    for s in [*running, new, alone]:
        model.free(s)


def test_kv_cache_moves_between_caches(model, tok):
    """export/import (the hand-off between prefill and decode workers) keeps decoding exact."""
    ids = prompt_ids(tok, *PROMPTS[1])
    s = model.new_sequence()
    nxt = int(model.prefill(s, ids).argmax())
    data = model.cache.export(s)
    assert data.shape == (30, 2, len(ids), 3, 64)
    moved = model.cache.import_(data)
    assert torch.equal(model.decode_step([moved], [nxt]), model.decode_step([s], [nxt]))
    used = model.cache.used_blocks
    model.free(s)
    model.free(moved)
    assert model.cache.used_blocks < used and s.blocks == [] and s.length == 0


def test_generate_and_stream_agree(model, tok):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    result = unweight.generate(model, tok, messages, max_new_tokens=20)
    assert "Paris" in result.text and result.finish_reason == "stop"
    g = unweight.stream(model, tok, messages, max_new_tokens=20)
    assert "".join(g) == result.text and g.result.token_ids == result.token_ids
    assert result.prompt_tokens == len(prompt_ids(tok, "chat", messages[0]["content"]))


def test_stop_strings_and_sampling(model, tok):
    full = unweight.generate(model, tok, "The capital of France is", max_new_tokens=12)
    cut = full.text.split()[1]  # stop at the second word of the greedy continuation
    stopped = unweight.generate(model, tok, "The capital of France is", max_new_tokens=12, stop=[cut])
    assert stopped.text == full.text[: full.text.find(cut)] and stopped.finish_reason == "stop"
    a = unweight.generate(model, tok, "Once upon a time", max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    b = unweight.generate(model, tok, "Once upon a time", max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8
    k1 = unweight.generate(model, tok, "Once upon a time", max_new_tokens=8, temperature=1.0, top_k=1, seed=3)
    assert k1.token_ids == unweight.generate(model, tok, "Once upon a time", max_new_tokens=8).token_ids


@pytest.mark.slow
def test_cli_generate_streams_then_prints_stats(smollm2_uw):
    # (the demo's question: without "Answer in one sentence." its first token is a near tie in FP32,
    # "The" 25.36 against "L" 25.26, which BF16 sums in another order can flip; see docs/runtime.md)
    question = "What is the capital of France? Answer in one sentence."
    r = run_cli("generate", smollm2_uw[0], "--chat", "--prompt", question, "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    stats = r.stderr.strip().splitlines()[-1]
    assert "prompt" in stats and "tokens/s" in stats and "MB resident" in stats
    uncompressed = float(
        re.search(r"uncompressed ([0-9.]+) MB", stats).group(1)
    )  # the checkpoint's tensor bytes, beside the resident ones
    assert round(smollm2_uw[1]["total"]["original_bytes"] / 1e6, 1) == uncompressed
    assert "loaded in " in stats and f"({smollm2_uw[1]['total']['tensors']} tensors checksummed" in stats
    both = run_cli("generate", smollm2_uw[0], "--prompt", "Hi", "--max-new-tokens", "3", merged=True)
    assert both.returncode == 0, both.stdout
    assert both.stdout.splitlines()[-1].startswith("prompt ")  # the text's newline comes before the stats


@pytest.mark.parametrize(
    "args,message",
    [
        (["--temperature", "-1"], "temperature must be"),
        (["--top-p", "0"], "top_p must be"),
        (["--max-new-tokens", "100000"], "exceeds the context length"),
        (["--device", "tpu"], "is not a torch device"),
        (["--device", "meta"], "only cpu and cuda"),
        (["--dtype", "float16"], "dtype 'float16' is not one of auto, bfloat16, float32"),
    ],
)
@pytest.mark.slow
def test_cli_generate_bad_values(smollm2_uw, args, message):
    r = run_cli("generate", smollm2_uw[0], "--prompt", "Hi", *args)
    assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_cli_generate_bad_paths(smollm2_dir, smollm2_uw, tmp_path):
    plain = run_cli("generate", smollm2_dir, "--prompt", "Hi")  # not compressed
    assert plain.returncode == 1 and "not an Unweight container" in plain.stderr
    missing = run_cli("generate", tmp_path / "nope", "--prompt", "Hi")
    assert missing.returncode == 1 and "no such model folder" in missing.stderr
    no_tok = tmp_path / "no-tokenizer"
    shutil.copytree(smollm2_uw[0], no_tok)
    for f in no_tok.glob("tokenizer*"):
        f.unlink()
    r = run_cli("generate", no_tok, "--prompt", "Hi")
    assert r.returncode == 1 and "no usable tokenizer" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.gpu
def test_decode_step_never_waits_for_the_gpu(smollm2_uw):
    """With CUDA's sync debug mode set to error, any operation that waits for the device raises:
    a decode step (embedding, every layer, lm_head) runs through without one; only reading the
    tokens back, after it, waits (once for the batch)."""
    from unweight.runtime.model.sampling import SamplingParams, Sequence, choose_rows

    gpu_model = unweight.load(smollm2_uw[0], device="cuda")
    seqs = [gpu_model.new_sequence(), gpu_model.new_sequence()]
    for s in seqs:
        gpu_model.prefill(s, torch.tensor([1, 2, 3]))
    gpu_model.decode_step(seqs, [4, 5])  # the autotuner's first timing waits, on purpose
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = gpu_model.decode_step(seqs, [6, 7])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(choose_rows(logits, [Sequence(SamplingParams(), [1], [0])] * 2)) == 2


def test_choose_rows_is_choose_per_row():
    """The batch form gives each row what `Sequence.choose` gives it: simple greedy rows (argmax
    on the device), seeded rows and rows with penalties or logprobs mixed."""
    from unweight.runtime.model.sampling import SamplingParams, Sequence, choose_rows

    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(temperature=1.2, top_k=5, top_p=0.9, seed=9),
        SamplingParams(logprobs=3),
    ]

    def seqs():
        return [Sequence(p, [4, 5, 6], [0]) for p in params]

    want = [s.choose(row) for s, row in zip(seqs(), logits)]
    assert choose_rows(logits, seqs()) == want


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
@pytest.mark.slow
def test_a_fifo_among_the_model_files_is_refused_not_waited_on(smollm2_uw, tmp_path, name):
    folder = tmp_path / "uw"
    folder.mkdir()
    for f in smollm2_uw[0].iterdir():
        os.link(f, folder / f.name)  # the same files, without copying the weights
    (folder / name).unlink()
    os.mkfifo(folder / name)
    r = run_cli("generate", folder, "--prompt", "Hi", "--max-new-tokens", "2", timeout=120)
    assert r.returncode == 1 and "not a regular file" in r.stderr and name in r.stderr, r.stderr
