"""transformers' door (docs/transformers.md): `from_pretrained` on compressed folders, against
transformers on the uncompressed BF16 folder, both loaded here.

- In float32, the logits equal bit for bit with the decode-then-matmul pipeline, and lie within the
  fused kernels' fp32 bound with the fused one; greedy `generate` gives the same tokens. Every family
  of tests/tiny_models.FAMILIES, SmolLM2 (real weights) in float32 and bfloat16.
- Without `import unweight`, a compressed folder never loads as a model of random weights.
- LoRA (PEFT) trains on the compressed base with the losses of the BF16 base.
- Damaged, foreign or mismatched folders fail with one error naming the file and tensor.

The whole module runs again under the oldest transformers supported (test_oldest_transformers).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import FAMILIES, tiny_family

import unweight
from helpers import fake_hub_cache, flip_stream_byte
from unweight.errors import CorruptDataError, FormatError, SourceError

transformers = pytest.importorskip("transformers")
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, pipeline  # noqa: E402

FORCE = "UNWEIGHT_PIPELINE"
IDS = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(1))
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


REPO = Path(__file__).resolve().parents[1]


def fused_bound(ref: torch.Tensor) -> float:
    """The fused kernels' fp32 products sum in another order than torch's: through a few layers the
    logits then differ by a few fp32 roundings of their magnitude (measured: below 2e-6 of the
    largest logit), held here to 1e-5 of it."""
    return 1e-5 * float(ref.abs().max())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """model_type -> (BF16 folder, its compressed folder), made on first use."""
    root, made = tmp_path_factory.mktemp("hf"), {}

    def get(model_type: str, **compress) -> tuple[Path, Path]:
        key = (model_type, tuple(sorted(compress.items())))
        if key not in made:
            src = tiny_family(model_type, root / model_type)
            dst = root / f"{model_type}-uw-{len(made)}"
            unweight.compress(src, dst, **compress)
            made[key] = (src, dst)
        return made[key]

    return get


def load(path, pipeline_name: str | None = None, monkeypatch=None, **kw):
    if pipeline_name is not None:
        monkeypatch.setenv(FORCE, pipeline_name)
    return AutoModelForCausalLM.from_pretrained(path, **{"dtype": torch.float32, **kw})


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_families_match_transformers_on_the_bf16_folder(tiny, model_type, monkeypatch):
    src, dst = tiny(model_type)
    ref = load(src)
    with torch.no_grad():
        want = ref(IDS).logits
        exact = load(dst, "decode_matmul", monkeypatch)
        assert same_bits(exact(IDS).logits, want)
        fused = load(dst, "fused", monkeypatch)
        got = fused(IDS).logits
    assert (got - want).abs().max() <= fused_bound(want)
    assert torch.equal(
        fused.generate(IDS[:1], max_new_tokens=8, do_sample=False),
        ref.generate(IDS[:1], max_new_tokens=8, do_sample=False),
    )
    report = fused.unweight_report
    assert report["linears"] > 0 and report["resident_bytes"] < 0.82 * report["original_bytes"]
    # MoE families keep their experts compressed
    moe = {"qwen3_moe": 2, "mixtral": 2, "llama4_text": 2, "deepseek_v3": 2}
    assert report["experts"] == moe.get(model_type, 0)


@pytest.mark.parametrize("arg", ["dtype", "torch_dtype"])
def test_dtype_none_loads_as_the_uncompressed_folder_does(tiny, tmp_path, arg, monkeypatch):
    """`from_pretrained(folder, dtype=None)` (or torch_dtype=None): AutoConfig then sets the config's
    dtype to None, and transformers takes the dtype of the checkpoint's first floating-point tensor,
    which a container has none of (it found the streams' uint8 and refused to build the model). The
    compressed folder loads as the uncompressed one does: in BF16 from a BF16 source, in FP16 from an
    FP16 one, with the same logits bit for bit."""
    monkeypatch.setenv(FORCE, "decode_matmul")
    fp16 = tiny_family("llama", tmp_path / "fp16", dtype=torch.float16)
    unweight.compress(fp16, tmp_path / "fp16-uw")
    for (src, dst), want in ((tiny("llama"), torch.bfloat16), ((fp16, tmp_path / "fp16-uw"), torch.float16)):
        ref = AutoModelForCausalLM.from_pretrained(src, **{arg: None})
        model = AutoModelForCausalLM.from_pretrained(dst, **{arg: None})
        assert ref.dtype == model.dtype == model.config.dtype == want
        with torch.no_grad():
            assert same_bits(model(IDS).logits, ref(IDS).logits)


def test_serving_layout_and_shards(tiny, tmp_path, monkeypatch):
    """A sharded BF16 folder compressed in the serving layout: shards and index kept, tiles loaded
    as stored (no transcode), logits bit for bit."""
    src, _ = tiny("qwen3")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(sharded, max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    dst = tmp_path / "uw"
    unweight.compress(sharded, dst, layout="serving")
    assert (dst / "model.safetensors.index.json").exists()
    ref = load(sharded)
    with torch.no_grad():
        assert same_bits(load(dst, "decode_matmul", monkeypatch)(IDS).logits, ref(IDS).logits)


@pytest.mark.slow
def test_smollm2_answers_as_transformers_does(smollm2_dir, smollm2_uw, monkeypatch):
    """Real trained weights: the same greedy answer, bit-identical logits in float32 and bfloat16
    with decode-then-matmul, resident weights at most 0.72x the BF16 bytes."""
    uw = smollm2_uw[0]
    tok = AutoTokenizer.from_pretrained(uw)
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    for dtype in (torch.float32, torch.bfloat16):
        ref = load(smollm2_dir, dtype=dtype)
        model = load(uw, "decode_matmul", monkeypatch, dtype=dtype)
        with torch.no_grad():
            assert same_bits(model(ids).logits, ref(ids).logits), dtype
        out = model.generate(ids, max_new_tokens=10, do_sample=False)
        assert torch.equal(out, ref.generate(ids, max_new_tokens=10, do_sample=False))
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])
    assert model.get_memory_footprint() <= 0.72 * model.unweight_report["original_bytes"]


def test_pipeline_and_auto_model(smollm2_uw, tiny):
    pipe = pipeline("text-generation", model=str(smollm2_uw[0]), dtype=torch.float32)
    answer = pipe(QUESTION, max_new_tokens=10, do_sample=False)[0]["generated_text"][-1]["content"]
    assert "Paris" in answer
    _, dst = tiny("llama")
    base = AutoModel.from_pretrained(dst, dtype=torch.float32)  # no lm_head: the checkpoint's is left unused
    assert type(base.layers[0].self_attn.q_proj).__name__ == "CompressedLinear"


@pytest.mark.slow
def test_hub_repo_id_offline(tiny, tmp_path, monkeypatch):
    """A compressed model on the Hub (here huggingface_hub's cache, offline) loads by its repo id."""
    src, dst = tiny("qwen3")
    fake_hub_cache(tmp_path / "hub", "acme/tiny-uw", dst)
    monkeypatch.setenv(FORCE, "decode_matmul")
    # huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE at import: the arguments say the same here
    model = load("acme/tiny-uw", cache_dir=tmp_path / "hub", local_files_only=True)
    with torch.no_grad():
        assert same_bits(model(IDS).logits, load(src)(IDS).logits)


@pytest.mark.parametrize("device_map", ["auto", {"": "cpu"}])
def test_device_map(tiny, device_map):
    _, dst = tiny("qwen3_moe")
    model = load(dst, device_map=device_map)
    assert all(b.device.type == "cpu" for b in model.buffers())
    with torch.no_grad():
        assert torch.isfinite(model(IDS).logits).all()


def test_weight_reads_decode_exactly_and_are_read_only(tiny):
    src, dst = tiny("llama")
    model, ref = load(dst), load(src)
    for name in ("model.layers.0.self_attn.q_proj", "model.embed_tokens", "lm_head"):
        w = model.get_submodule(name).weight
        want = ref.get_submodule(name).weight
        assert (w.shape, w.dtype, w.device) == (want.shape, want.dtype, want.device)
        assert same_bits(w + 0, want)
        with pytest.raises(RuntimeError, match="read-only"):
            w.add_(1)
    assert model.lm_head.compressed is model.model.embed_tokens.compressed  # tied: one copy


def test_save_pretrained_is_refused(tiny, tmp_path):
    _, dst = tiny("llama")
    with pytest.raises(ValueError, match="unweight"):
        load(dst).save_pretrained(tmp_path / "out")
    assert not any((tmp_path / "out").glob("*.safetensors"))


@pytest.mark.slow
def test_without_import_unweight_a_compressed_folder_never_loads(tiny):
    """transformers alone (no `import unweight` in the process) must fail, not load random weights:
    every tensor's placeholder has the wrong shape (formats/SPEC.md §1). The same through pipeline."""
    _, dst = tiny("llama")
    for call in (
        "transformers.AutoModelForCausalLM.from_pretrained(path)",
        "transformers.pipeline('text-generation', model=path)",
        "transformers.AutoModel.from_pretrained(path)",
    ):
        code = f"import sys, transformers; path = sys.argv[1]; {call}; print('LOADED')"
        r = subprocess.run([sys.executable, "-c", code, str(dst)], capture_output=True, text=True)
        assert r.returncode != 0 and "LOADED" not in r.stdout, (call, r.stdout[-500:])
        assert "size mismatch" in r.stderr or "ignore_mismatched_sizes" in r.stderr, r.stderr[-1000:]


def test_lora_trains_on_the_compressed_base(tiny, monkeypatch):
    """20 steps of LoRA in float32: the losses of the BF16 base, bit for bit with decode-then-matmul
    and within the fused bound with the autotuner's choice; the base stays frozen. (On MoE models the
    targets name the linears: PEFT's LoRA on the routed experts' 3-D parameters needs them dense.)"""
    peft = pytest.importorskip("peft")

    def train(path, targets) -> tuple[list[float], torch.nn.Module]:
        model = load(path)
        torch.manual_seed(0)
        pm = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets))
        opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-3)
        losses = []
        for _ in range(20):
            loss = pm(input_ids=IDS, labels=IDS).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, pm

    dense = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for model_type, targets, force in (
        ("llama", dense, "decode_matmul"),
        ("llama", dense, None),
        ("qwen3_moe", ["q_proj", "k_proj", "v_proj", "o_proj"], "decode_matmul"),
    ):
        src, dst = tiny(model_type)
        if force:
            monkeypatch.setenv(FORCE, force)
        else:
            monkeypatch.delenv(FORCE, raising=False)
        want, ref = train(src, targets)
        got, pm = train(dst, targets)
        trainable = lambda m: sum(p.numel() for p in m.parameters() if p.requires_grad)  # noqa: E731
        assert trainable(pm) == trainable(ref) > 0
        assert want[-1] < want[0]  # it trains
        if force:
            assert got == want, (model_type, got, want)
        else:
            assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5 * want[0]
        base = pm.base_model.model.model.layers[0].self_attn.q_proj.base_layer
        assert isinstance(base.compressed, unweight.runtime.layers.linear.UnweightLinear)


def test_damaged_foreign_and_mismatched_folders(tiny, tmp_path):
    import shutil

    src, dst = tiny("llama")
    # a flipped byte in a stream: CRC-32, file and tensor named
    bad = tmp_path / "damaged"
    shutil.copytree(dst, bad)
    flip_stream_byte(bad, "model.layers.1.mlp.up_proj.weight", "raw", at=5)
    with pytest.raises(CorruptDataError, match="model.layers.1.mlp.up_proj.weight") as e:
        load(bad)
    assert "model.safetensors" in str(e.value)
    # a config that names unweight over plain safetensors files
    foreign = tmp_path / "foreign"
    shutil.copytree(src, foreign)
    shutil.copy2(dst / "config.json", foreign / "config.json")
    with pytest.raises(FormatError, match="not an Unweight container"):
        load(foreign)
    # a config narrower than the checkpoint: shapes compared before anything is decoded
    narrow = tmp_path / "narrow"
    shutil.copytree(dst, narrow)
    cfg = (narrow / "config.json").read_text().replace('"intermediate_size": 128', '"intermediate_size": 96')
    (narrow / "config.json").write_text(cfg)
    with pytest.raises(SourceError, match=r"mlp\..*shape"):
        load(narrow)
    # a tensor the model needs is not in the checkpoint
    partial = tmp_path / "partial"
    model = AutoModelForCausalLM.from_pretrained(src)
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k not in ("model.norm.weight", "lm_head.weight")}
    (tmp_path / "partial-src").mkdir()
    from safetensors.torch import save_file

    save_file(sd, tmp_path / "partial-src" / "model.safetensors", metadata={"format": "pt"})
    shutil.copy2(src / "config.json", tmp_path / "partial-src" / "config.json")
    unweight.compress(tmp_path / "partial-src", partial)
    with pytest.raises(SourceError, match="no tensor for model.norm.weight"):
        load(partial)


def test_a_folder_compressed_from_compressed_tensors_int4_is_refused_by_name(tiny, tmp_path):
    """Its INT4 layers are vLLM's to run (runtime/vllm): transformers gets a clear refusal, never a
    model with those layers left random."""
    from tiny_models import w4a16

    src, _ = tiny("llama")
    unweight.compress(w4a16(src, tmp_path / "w4a16"), tmp_path / "uw")
    with pytest.raises(ValueError, match="compressed from a compressed-tensors checkpoint"):
        load(tmp_path / "uw")


def test_moe_folder_missing_an_expert(tiny, tmp_path):
    """Per-expert tensors that transformers merges into 3-D ones must be experts 0 .. E-1, each once."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, _ = tiny("qwen3_moe")
    tensors = load_file(src / "model.safetensors")
    gone = [k for k in tensors if ".layers.0.mlp.experts.1." in k]
    assert len(gone) == 3
    part = tmp_path / "src"
    part.mkdir()
    save_file(
        {k: v for k, v in tensors.items() if k not in gone}, part / "model.safetensors", metadata={"format": "pt"}
    )
    shutil.copy2(src / "config.json", part / "config.json")
    unweight.compress(part, tmp_path / "uw")
    with pytest.raises(SourceError, match=r"model.layers.0.mlp.experts.*numbered \[0, 2, 3\]"):
        load(tmp_path / "uw")


@pytest.mark.slow
def test_oldest_transformers(tmp_path):
    """This module again under transformers 5.17 (the GPU machine's), from a folder put first on
    PYTHONPATH (tests/envs.py transformers_site)."""
    from envs import transformers_site

    site = transformers_site()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    code = "import transformers; print(transformers.__version__)"
    version = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert version.stdout.strip() == "5.17.0"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not oldest", str(Path(__file__))],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
