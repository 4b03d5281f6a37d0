"""No silently wrong model through any door: a compressed folder with a shard missing, an index that
does not match its shards, a tensor of the wrong shape, a zstd bomb or streams swapped with their
CRCs is refused, naming the file and the tensor, by `unweight verify`, `decompress`, `inspect`,
`unweight.load`, `unweight.open` and transformers' `from_pretrained` (tests/test_vllm.py takes the
same folders through `vllm.LLM`).

The folder: a tiny Llama with untied embeddings, in four shards of our own cut, so that one shard
holds only the RMSNorm weights (a partial download that loses it leaves every linear in place) and
one holds a whole decoder layer's linears.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import INDEX, LAYER_1, NORMS, four_shards, tiny_llama

import unweight
from helpers import run_cli, swap_streams, zstd_bomb
from unweight.errors import CorruptDataError, SourceError


@pytest.fixture(scope="module")
def folders(smollm2_dir, tmp_path_factory):
    """(the BF16 source in four shards, its compressed folder)."""
    root = tmp_path_factory.mktemp("broken")
    src = four_shards(tiny_llama(root / "tiny", smollm2_dir), root / "sharded")
    uw = root / "uw"
    unweight.compress(src, uw)
    return src, uw


@pytest.fixture
def uw(folders, tmp_path) -> Path:
    """A fresh copy of the compressed folder, to break."""
    return Path(shutil.copytree(folders[1], tmp_path / "uw"))


def from_pretrained(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


MEMBERS = "unweight-folder.json"  # compress's list of the folder's containers, with their header digests


def every_door_refuses(uw: Path, message: str, tmp_path: Path) -> None:
    """verify, decompress and inspect (the CLI), unweight.open and load, from_pretrained: each refuses `uw` with
    `message`."""
    r = run_cli("verify", uw)
    assert r.returncode == 1 and message in r.stderr and "OK" not in r.stdout, r.stdout + r.stderr
    r = run_cli("decompress", uw, tmp_path / "back")
    assert r.returncode == 1 and message in r.stderr and not (tmp_path / "back").exists(), r.stderr
    r = run_cli("inspect", uw)
    assert r.returncode == 1 and message in r.stderr, r.stderr
    for door in (unweight.open, unweight.load, from_pretrained):
        with pytest.raises(SourceError, match=message):
            door(uw)


@pytest.mark.slow
def test_a_missing_shard_is_named_by_every_reader(uw, tmp_path):
    (uw / NORMS).unlink()
    listed = sorted(k for k, v in json.loads((uw / INDEX).read_text())["weight_map"].items() if v == NORMS)
    every_door_refuses(uw, f"{uw / NORMS}: no such file; {INDEX} lists {len(listed)} tensors in it", tmp_path)
    report = json.loads(run_cli("verify", uw, "--json").stdout)
    assert not report["ok"] and report["missing"] == listed and report["checked_tensors"] > 0


def test_a_missing_shard_of_whole_layers_is_named_as_a_file_not_as_a_layer(uw):
    (uw / LAYER_1).unlink()
    for door in (unweight.load, from_pretrained):
        with pytest.raises(SourceError, match=f"{uw / LAYER_1}: no such file; {INDEX} lists 7 tensors"):
            door(uw)


def test_shards_that_differ_from_their_index(uw):
    """A tensor the index lists in a shard that lacks it, and one a shard holds but the index puts
    elsewhere: verify reports both; the loaders refuse the folder."""
    index = json.loads((uw / INDEX).read_text())
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = NORMS
    index["weight_map"]["model.norm.weight"] = LAYER_1
    (uw / INDEX).write_text(json.dumps(index))
    report = json.loads(run_cli("verify", uw, "--json").stdout)
    assert report["mismatches"] == [
        f"{uw / LAYER_1}: tensor 'model.norm.weight' is missing; {INDEX} lists it in this file",
        f"{uw / NORMS}: tensor 'model.layers.0.mlp.extra.weight' is missing; {INDEX} lists it in this file",
        f"{uw / NORMS}: tensor 'model.norm.weight' is here, but {INDEX} lists it in {LAYER_1}",
    ]
    assert report["missing"] == ["model.norm.weight", "model.layers.0.mlp.extra.weight"]
    for door in (unweight.open, unweight.load, from_pretrained):
        with pytest.raises(SourceError, match="is missing; model.safetensors.index.json lists it in this file"):
            door(uw)


def test_a_tensor_wider_than_its_layer_is_refused(folders, tmp_path):
    """q_proj of layer 0 stored twice as wide as the config's layer: refused, never cropped."""
    name = "model.layers.0.self_attn.q_proj.weight"

    def widen(tensors):
        tensors[name] = torch.cat([tensors[name], tensors[name]], dim=1)
        return tensors

    src = four_shards(folders[0].parent / "tiny", tmp_path / "wide", widen)
    uw = tmp_path / "wide-uw"
    unweight.compress(src, uw)
    with pytest.raises(
        SourceError, match=rf"{name}, .* have shapes \[\[256, 512\], \[128, 256\], \[128, 256\]\], the config implies"
    ):
        unweight.load(uw)
    with pytest.raises(SourceError, match=rf"{name}.*\[256, 512\].*\[256, 256\]"):
        from_pretrained(uw)


@pytest.mark.parametrize("tensor", ["model.embed_tokens.weight", "model.norm.weight"])
def test_a_zstd_bomb_is_refused_before_it_is_decoded(uw, tensor):
    """A valid zstd stream of zeros (a few hundred KB) declared far larger than its parameter: the
    loaders compare shapes before a byte is decoded (benchmarks/refusal_bench.py measures the time
    and memory through vLLM, with the 6.4 GB one)."""
    shape = (49152, 8192) if "embed" in tensor else (256, 1 << 20)
    stored = zstd_bomb(uw, tensor, shape)
    assert stored < 1 << 20
    declared = rf"\[{shape[0]}, {shape[1]}\]"
    with pytest.raises(SourceError, match=declared):
        unweight.load(uw)
    with pytest.raises(SourceError, match=declared):
        from_pretrained(uw)


def test_streams_swapped_with_their_crcs_are_refused_where_the_tensor_is_decoded(uw):
    """Layer 0's k_proj and v_proj (one shape, one file) given each other's streams along with
    their stream CRCs: only the whole-tensor CRC-32s tell. verify and every loader that decodes
    the tensors check them."""
    a, b = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"
    swap_streams(uw, a, b)
    r = run_cli("verify", uw)
    assert r.returncode == 1 and f"tensor {a!r}" in r.stderr and "CRC-32" in r.stderr, r.stderr
    crc = rf"tensor '{a}'.*CRC-32"
    with unweight.open(uw) as ckpt, pytest.raises(CorruptDataError, match=crc):
        ckpt.get_tensor(a)
    for door in (unweight.load, from_pretrained):  # both decode the archive layout to lay out tiles
        with pytest.raises(CorruptDataError, match=crc):
            door(uw)


# A folder is one model: every door refuses a container of another model, or of another compress, naming the file.


@pytest.mark.slow
def test_a_stale_container_beside_the_shards_is_refused_by_every_door(uw, folders, tmp_path):
    """Another model's model.safetensors left beside the shards (transformers reads a
    model.safetensors before an index): no door reads it, or the shards, as the model."""
    other = tmp_path / "other"
    unweight.compress(folders[0].parent / "tiny", other)
    shutil.copy(other / "model.safetensors", uw / "model.safetensors")
    every_door_refuses(uw, f"{uw / 'model.safetensors'}: a container that {MEMBERS} does not list", tmp_path)


@pytest.mark.slow
def test_a_shard_from_another_compress_is_refused_by_every_door(uw, folders, tmp_path):
    """A mixed-revision download: one shard of a compress of other weights under the same names and
    shapes (every CRC of its own honest) in place of the folder's own."""
    src = four_shards(folders[0].parent / "tiny", tmp_path / "src2", lambda ts: {n: -t for n, t in ts.items()})
    unweight.compress(src, tmp_path / "uw2")
    shutil.copy(tmp_path / "uw2" / LAYER_1, uw / LAYER_1)
    every_door_refuses(uw, f"{uw / LAYER_1}: not the container {MEMBERS} lists", tmp_path)


def test_decompress_gives_the_source_back_without_the_manifest(folders, tmp_path):
    src, uw = folders
    members = json.loads((uw / MEMBERS).read_text())["containers"]
    assert members.keys() == {p.name for p in src.glob("*.safetensors")}
    assert all(d.startswith("sha256:") and len(d) == 7 + 64 for d in members.values())
    unweight.decompress(uw, tmp_path / "back")
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == sorted(p.name for p in src.iterdir())
    for f in src.iterdir():
        assert (tmp_path / "back" / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.slow
def test_a_folder_compressed_before_member_lists_loads_but_verify_cannot_vouch(uw, folders, tmp_path):
    """Without the member list (an older unweight's folder) the shards still load and verify passes,
    saying it cannot vouch for their unity; a container the index does not list is still refused."""
    (uw / MEMBERS).unlink()
    with unweight.open(uw) as ckpt:
        assert not ckpt.vouched and len(ckpt) == len(json.loads((uw / INDEX).read_text())["weight_map"])
    r = run_cli("verify", uw)
    assert r.returncode == 0 and "OK" in r.stdout and "cannot vouch" in r.stderr, r.stdout + r.stderr
    assert json.loads(run_cli("verify", uw, "--json").stdout)["vouched"] is False
    shutil.copy(uw / NORMS, uw / "model.safetensors")
    with pytest.raises(SourceError, match=f"{uw / 'model.safetensors'}: a container that {INDEX} does not list"):
        unweight.load(uw)


@pytest.mark.parametrize(
    "text",
    [
        "{",
        "[1]",
        '{"format": "other", "containers": {}}',
        '{"format": "unweight-folder/1", "containers": {"../x": "a"}}',
    ],
)
def test_a_member_list_that_is_not_one_is_named(uw, text):
    (uw / MEMBERS).write_text(text)
    with pytest.raises(SourceError, match=str(uw / MEMBERS)):
        unweight.open(uw)
