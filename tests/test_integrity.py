"""`unweight.load` refuses a damaged checkpoint, whatever its layout and whichever layout it is
loaded in: every tensor is checked once at load (a weight kept as stored by the CRC-32s of its
streams, one decoded at load by the CRC-32 of its original bytes), and the error is one line naming
the file and the tensor. Undamaged folders load and generate as before, format 1.0 containers
(no stream CRCs) included, and `model.load_report` says what was checked.

The folders are real: a tiny random Llama saved by transformers, compressed by the `unweight` CLI
(`--layout serving`) and by the library (the default archive layout); damage is a byte flipped in
the container file, found through its safetensors header.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

import unweight
from helpers import container_header as _header
from helpers import container_manifest as _manifest
from helpers import flip_stream_byte as _flip
from helpers import record_in_members, run_cli
from unweight.errors import CorruptDataError
from unweight.reader import CompressedCheckpoint

O_PROJ = "model.layers.0.self_attn.o_proj.weight"  # a weight alone in its module: kept as stored
Q_PROJ = "model.layers.1.self_attn.q_proj.weight"  # stacked into qkv_proj: decoded at load
NORM = "model.norm.weight"
PROMPT = [5, 17, 42, 99, 3, 250, 7]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("integrity")
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(root / "bf16")
    r = run_cli("compress", root / "bf16", root / "serving", "--layout", "serving")
    assert r.returncode == 0, r.stderr
    unweight.compress(root / "bf16", root / "archive")
    return {"bf16": root / "bf16", "serving": root / "serving", "archive": root / "archive"}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_members(folder: Path, edit, version: str | None = None) -> None:
    """Re-serialise the container header after `edit(tensors)`; the data section is unchanged."""
    path = folder / "model.safetensors"
    n, header = _header(path)
    data = path.read_bytes()[8 + n :]
    meta = header["__metadata__"]
    manifest = json.loads(meta["unweight"])
    edit(manifest["tensors"])
    meta["unweight"] = json.dumps(manifest, separators=(",", ":"))
    if version is not None:
        meta["format_version"] = version
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    record_in_members(path)  # a crafted folder, consistent with its member list


def _as_version_1_0(folder: Path) -> Path:
    """The folder as a format 1.0 writer made it: no stream CRCs."""
    _rewrite_members(folder, lambda ts: [t.pop("stream_crc32") for t in ts.values()], "1.0")
    assert all("stream_crc32" not in t for t in _manifest(folder / "model.safetensors").values())
    return folder


def _refused(folder: Path, layout: str, tensor: str) -> str:
    with pytest.raises(CorruptDataError) as info:
        unweight.load(folder, layout=layout, threads=1)
    message = str(info.value)
    assert "\n" not in message
    assert str(folder / "model.safetensors") in message, message
    assert repr(tensor) in message, message
    return message


def _greedy(model, n: int = 8) -> list[int]:
    seq = model.new_sequence()
    logits = model.prefill(seq, torch.tensor(PROMPT))
    out = [int(logits.argmax())]
    for _ in range(n - 1):
        out.append(int(model.decode_step([seq], [out[-1]])[0].argmax()))
    return out


# -------------------------------------------------------------------- damage is refused at load


@pytest.mark.parametrize("role, at", [("sm", 100), ("esc", 3), ("codes", 7), ("esc_index", 4)])
@pytest.mark.parametrize("layout", ["serving", "archive"])
def test_serving_folder_with_a_damaged_tiles_stream_is_refused(folders, tmp_path, role, at, layout):
    folder = _copy(folders["serving"], tmp_path / "damaged")
    _flip(folder, O_PROJ, role, at)
    message = _refused(folder, layout, O_PROJ)
    assert "CRC-32" in message


@pytest.mark.parametrize("layout", ["serving", "archive"])
def test_serving_folder_with_a_damaged_stacked_weight_is_refused(folders, tmp_path, layout):
    folder = _copy(folders["serving"], tmp_path / "damaged")
    _flip(folder, Q_PROJ, "sm", 10)
    _refused(folder, layout, Q_PROJ)


@pytest.mark.parametrize("tensor", [O_PROJ, Q_PROJ, "model.embed_tokens.weight", "lm_head.weight"])
@pytest.mark.parametrize("role", ["raw", "words", "table"])
@pytest.mark.parametrize("layout", ["serving", "archive"])
def test_archive_folder_with_a_damaged_rans_stream_is_refused(folders, tmp_path, tensor, role, layout):
    folder = _copy(folders["archive"], tmp_path / "damaged")
    _flip(folder, tensor, role, 5, 0x10)
    _refused(folder, layout, tensor)


@pytest.mark.parametrize("kind", ["serving", "archive"])
@pytest.mark.parametrize("layout", ["serving", "archive"])
def test_a_damaged_norm_is_refused(folders, tmp_path, kind, layout):
    folder = _copy(folders[kind], tmp_path / "damaged")
    role = next(iter(_manifest(folder / "model.safetensors")[NORM]["streams"]))
    _flip(folder, NORM, role, 4)
    _refused(folder, layout, NORM)


def test_a_wrong_stream_crc_is_refused_by_load_and_reported_by_verify(folders, tmp_path):
    """The stream bytes are intact, their recorded CRC-32 is not: load (which trusts the streams it
    keeps only after checking them) refuses; verify reports it; a decode, which checks the
    original bytes, still gets them right."""
    folder = _copy(folders["serving"], tmp_path / "damaged")

    def edit(ts):
        ts[O_PROJ]["stream_crc32"]["esc"] ^= 1

    _rewrite_members(folder, edit)
    _refused(folder, "serving", O_PROJ)
    report = unweight.verify(folder, threads=1)
    assert not report.ok and len(report.mismatches) == 1
    assert O_PROJ in report.mismatches[0] and str(folder / "model.safetensors") in report.mismatches[0]
    r = run_cli("verify", folder)
    assert r.returncode != 0 and O_PROJ in r.stdout + r.stderr
    with CompressedCheckpoint(folder) as ckpt:
        assert ckpt.get_tensor(O_PROJ).shape == (64, 64)


def test_verify_reports_every_damage_load_refuses(folders, tmp_path):
    folder = _copy(folders["serving"], tmp_path / "damaged")
    _flip(folder, O_PROJ, "sm", 100)
    report = unweight.verify(folder, threads=1)
    assert not report.ok and O_PROJ in report.mismatches[0]


# ------------------------------------------------------------------ format 1.0: no stream CRCs


@pytest.mark.parametrize(
    "kind, tensor, role, layout",
    [
        ("serving", O_PROJ, "sm", "serving"),
        ("serving", O_PROJ, "esc", "archive"),
        ("archive", O_PROJ, "raw", "archive"),
        ("archive", "model.embed_tokens.weight", "raw", "archive"),
    ],
)
def test_version_1_0_damage_is_refused_by_a_decode(folders, tmp_path, kind, tensor, role, layout):
    folder = _as_version_1_0(_copy(folders[kind], tmp_path / "old"))
    _flip(folder, tensor, role, 9, 0x04)
    message = _refused(folder, layout, tensor)
    assert "CRC-32" in message


def test_version_1_0_folders_still_load_and_say_how_they_were_checked(folders, tmp_path):
    want = _greedy(unweight.load(folders["serving"], threads=1, dtype="float32"))
    for kind in ("serving", "archive"):
        folder = _as_version_1_0(_copy(folders[kind], tmp_path / kind))
        for layout in ("serving", "archive"):
            model = unweight.load(folder, layout=layout, threads=1, dtype="float32")
            rep = model.load_report
            assert rep.stream_checked == 0 and rep.stream_bytes == 0
            assert rep.decode_checked == 21  # 16 matrices and 5 norms, each once
            assert rep.decode_only_to_check == len(_kept_as_stored(kind, layout))
            assert _greedy(model) == want, (kind, layout)


# ------------------------------------------------------------ undamaged: loads, same tokens


def test_undamaged_folders_load_and_generate_the_same_tokens(folders):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(folders["bf16"], dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT) :].tolist()
    for kind in ("serving", "archive"):
        for layout in ("serving", "archive"):
            model = unweight.load(folders[kind], layout=layout, threads=1, dtype="float32")
            assert _greedy(model) == want, (kind, layout)


def _kept_as_stored(kind: str, layout: str) -> list[str]:
    """The matrices `load` keeps in their stored streams (the others are decoded and re-encoded)."""
    matrices = [
        f"model.layers.{i}.{m}.weight"
        for i in range(2)
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    matrices += ["model.embed_tokens.weight", "lm_head.weight"]
    if layout == "archive":
        return matrices
    if kind == "serving":  # a tiles weight alone in its module
        return [m for m in matrices if not any(p in m for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))]
    return []


@pytest.mark.parametrize(
    "kind, layout", [("serving", "serving"), ("serving", "archive"), ("archive", "archive"), ("archive", "serving")]
)
def test_load_report_says_what_was_checked(folders, kind, layout, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="unweight.runtime.model.loader"):
        model = unweight.load(folders[kind], layout=layout, threads=1)
    rep = model.load_report
    kept = _kept_as_stored(kind, layout)
    assert (
        rep.stream_checked
        == len(kept)
        == {("serving", "serving"): 6, ("archive", "serving"): 0}.get((kind, layout), 16)
    )
    assert rep.stream_bytes == sum(sum(_stream_sizes(folders[kind], n).values()) for n in kept)
    assert rep.decode_checked == 21 - len(kept) and rep.decode_only_to_check == 0
    assert 0 <= rep.check_seconds <= rep.seconds
    assert any("checked 21 tensors" in r.getMessage() and str(folders[kind]) in r.getMessage() for r in caplog.records)


def _stream_sizes(folder: Path, tensor: str) -> dict[str, int]:
    _, header = _header(folder / "model.safetensors")
    streams = _manifest(folder / "model.safetensors")[tensor]["streams"]
    return {role: header[s]["shape"][0] for role, s in streams.items()}


def test_reader_streams_check_and_name_the_file(folders, tmp_path):
    folder = _copy(folders["serving"], tmp_path / "damaged")
    _flip(folder, O_PROJ, "sm", 1)
    with CompressedCheckpoint(folder) as ckpt:
        with pytest.raises(
            CorruptDataError,
            match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.o_proj\.weight': stream .*#sm' fails its "
            r"CRC-32",
        ):
            ckpt.streams(O_PROJ)
        assert set(ckpt.streams(O_PROJ, check=False)) == {
            "sm",
            "codes",
            "esc",
            "esc_index",
        }  # a caller that decodes checks
        assert ckpt.integrity.by_stream_crc == 0
        ckpt.streams("model.layers.1.self_attn.o_proj.weight")
        assert ckpt.integrity.by_stream_crc == 1 and ckpt.integrity.stream_bytes > 64 * 64
        checked = ckpt.integrity.stream_bytes
        ckpt.get_rows("model.layers.1.self_attn.o_proj.weight", 0, 8)  # checked once: not again for a slice
        assert ckpt.integrity.by_stream_crc == 1 and ckpt.integrity.stream_bytes == checked
        with pytest.raises(CorruptDataError):  # a tensor that failed is not remembered as checked
            ckpt.streams(O_PROJ)


@pytest.mark.slow
def test_cli_generate_refuses_a_damaged_smollm2(smollm2_uw, tmp_path):
    """The real model through the real CLI: one line naming the file and tensor, exit status 1,
    where it used to generate from the damaged weight."""
    folder = _copy(smollm2_uw[0], tmp_path / "damaged")
    tensor = "model.layers.3.self_attn.o_proj.weight"
    _flip(folder, tensor, "raw", 1000, 0x20)
    r = run_cli("generate", folder, "--layout", "archive", "--prompt", "Hello", "--max-new-tokens", "2")
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(folder / "model.safetensors") in lines[0] and tensor in lines[0], r.stderr
