"""Memory: decompression bombs decoded or refused within a cap, pieces against whole decodes,
and every command's peak RSS within 1.5 × the largest tensor + 256 MiB (benchmarks/memory_bench.py
at a small size)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zstandard

import peak_rss
from unweight.codec import CodecOptions, decode_tensor, encode_tensor, rans, tiles
from unweight.codec.checksum import crc32
from unweight.codec.pieces import decode_pieces
from unweight.errors import CorruptDataError
from unweight.formats import ContainerWriter, TensorEntry

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
BOMB_CAP = 450 * MiB  # peak RSS a command may reach on a bomb: the interpreter (~100 MiB) and pieces


def run_measured(args: list[str], limit_as: int | None = None) -> tuple[int, int, str, str]:
    """(exit status, peak RSS in bytes, stdout, stderr): the command's own peak (tests/peak_rss.py)."""
    return peak_rss.run_measured(args, limit_as, env={**os.environ, "COLUMNS": "200"})


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "unweight.cli.main", *map(str, args)]


def write_container(path: Path, entry: TensorEntry, streams: dict) -> Path:
    with ContainerWriter(str(path)) as w:
        w.add(entry, streams)
        w.finish()
    return path


def constant_crc(byte: int, n: int) -> int:
    block = np.full(4 * MiB, byte, dtype=np.uint8)
    crc = 0
    for at in range(0, n, len(block)):
        crc = crc32(block[: min(len(block), n - at)], crc)
    return crc


def rans_bomb(path: Path, nchunks: int, good_crc: bool = True) -> tuple[Path, int]:
    """A valid container of one U8 tensor of nchunks × 4M copies of one byte: one rANS symbol
    costs 0 bits, so each chunk is its 40 bytes of index alone (512 chunks: 21 KB for 2 GiB)."""
    chunk = rans.CHUNK_RANGE[1]
    p = rans.RansParams.for_word(8, False, rans.PRECISION_RANGE[0], chunk)
    one = rans.encode(np.full(chunk, 7, dtype=np.uint8), p, 1)
    assert len(one["words"]) == 0 and len(one["raw"]) == 0
    states = one["index"][8 * 2 :]
    index = np.concatenate([np.zeros(8 * (nchunks + 1), dtype=np.uint8), np.tile(states, nchunks)])
    n = nchunks * chunk
    crc = constant_crc(7, n) if good_crc else 12345
    entry = TensorEntry("bomb", "U8", (n,), "rans", p.to_json(), {r: f"bomb#{r}" for r in one}, crc)
    return write_container(
        path, entry, {"table": one["table"], "raw": one["raw"], "words": one["words"], "index": index}
    ), n


def zstd_bomb(path: Path, n: int) -> Path:
    """A valid container of one I64 tensor of n zero bytes in one zstd frame (33 KB for 1 GiB)."""
    frame = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(bytes(n))
    entry = TensorEntry("bomb", "I64", (n // 8,), "zstd", {}, {"data": "bomb#data"}, constant_crc(0, n))
    return write_container(path, entry, {"data": np.frombuffer(frame, dtype=np.uint8)})


@pytest.mark.slow
def test_a_rans_bomb_is_verified_and_inspected_in_pieces_and_refused_whole(tmp_path):
    path, n = rans_bomb(tmp_path / "bomb.safetensors", 512)
    assert path.stat().st_size < 25_000 and n == 2 << 30
    for args in (cli("verify", path, "-q"), cli("inspect", path, "--json")):
        code, peak, out, err = run_measured(args)
        assert code == 0, err
        assert peak < BOMB_CAP, (args, peak)
    # Whole, it is refused before allocation: by --max-memory, and by an address-space rlimit.
    get = [
        sys.executable,
        "-c",
        "import sys, unweight\n"
        "m = int(sys.argv[2]) or None\n"
        "try:\n    unweight.open(sys.argv[1], max_memory=m).get_bytes('bomb')\n"
        "except unweight.MemoryLimitError as e:\n    print(e); sys.exit(3)\n",
        str(path),
    ]
    code, peak, out, err = run_measured(get + [str(1 << 30)])
    assert code == 3, err
    assert "tensor 'bomb'" in out and "--max-memory budget" in out and str(path) in out
    code, peak, out, err = run_measured(get + ["0"], limit_as=(9 << 30) // 4)  # 2.25 GiB of address space
    assert code == 3, err
    assert "available" in out


@pytest.mark.slow
def test_a_damaged_rans_bomb_fails_its_crc_within_the_cap(tmp_path):
    path, _ = rans_bomb(tmp_path / "bomb.safetensors", 256, good_crc=False)
    code, peak, out, err = run_measured(cli("verify", path, "-q", "--max-memory", "64M"))
    assert code == 1 and "CRC-32" in err and "'bomb'" in err and "Traceback" not in err
    assert peak < BOMB_CAP


@pytest.mark.slow
def test_a_zstd_bomb_is_decoded_in_pieces(tmp_path):
    path = zstd_bomb(tmp_path / "bomb.safetensors", 1 << 30)
    assert path.stat().st_size < 64_000
    for args in (cli("verify", path, "-q"), cli("decompress", path, tmp_path / "out", "-q")):
        code, peak, out, err = run_measured(args)
        assert code == 0, err
        assert peak < BOMB_CAP, (args, peak)
    restored = tmp_path / "out" / "bomb.safetensors"
    assert restored.stat().st_size > 1 << 30


def test_max_memory_refuses_compress_and_bad_values(tmp_path):
    from helpers import random_bf16, write_checkpoint

    src = write_checkpoint(tmp_path / "src" / "model.safetensors", {"w": random_bf16(1024, 1024)}).parent
    code, _, out, err = run_measured(cli("compress", src, tmp_path / "out", "--max-memory", "2M"))
    assert code == 1 and "'w'" in err and "--max-memory budget" in err and not (tmp_path / "out").exists()
    code, _, out, err = run_measured(cli("verify", src, "--max-memory", "lots"))
    assert code == 2 and "not a size" in err


def test_decode_pieces_match_decode_tensor_for_every_codec():
    rng = np.random.default_rng(3)
    bf16 = (rng.normal(0, 0.02, 300 * 257).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    cases = [
        ("BF16", (300, 257), bf16.view(np.uint8), CodecOptions(chunk=1024)),  # rans, 76 chunks
        ("BF16", (300, 257), bf16.view(np.uint8), CodecOptions(layout="serving")),  # tiles
        ("I64", (5000,), rng.integers(0, 9, 5000).astype(np.int64).view(np.uint8), CodecOptions()),  # zstd
        ("I32", (7,), rng.integers(0, 1 << 30, 7).astype(np.int32).view(np.uint8), CodecOptions()),  # raw
        ("U8", (40_000,), rng.integers(0, 5, 40_000).astype(np.uint8), CodecOptions(chunk=1024)),  # rans, 8-bit
    ]
    for dtype, shape, data, opts in cases:
        entry, streams = encode_tensor("t", dtype, shape, data, opts)
        whole = decode_tensor(entry, streams)
        for piece_bytes in (1024, 4096 + 8, 1 << 20):
            pieces = [p.copy() for p in decode_pieces(entry, streams, piece_bytes, threads=2)]
            assert all(len(p) <= max(piece_bytes, 8 * 1024) for p in pieces[:-1])
            assert np.array_equal(np.concatenate(pieces), whole), (entry.codec, piece_bytes)
        bad = TensorEntry(entry.name, dtype, tuple(shape), entry.codec, entry.params, entry.streams, entry.crc32 ^ 1)
        with pytest.raises(CorruptDataError, match="CRC-32"):
            for _ in decode_pieces(bad, streams, 4096):
                pass


def test_rans_slabs_and_ranges_give_the_one_slab_streams(monkeypatch):
    values = (np.random.default_rng(5).normal(0, 0.02, 100_003).astype(np.float32).view(np.uint32) >> 16).astype(
        np.uint16
    )
    p = rans.RansParams.for_word(16, True, 14, 1024)
    whole = rans.encode(values, p, 2)
    monkeypatch.setattr(rans, "ENCODE_SLAB_BYTES", 3 * 2 * 1024 * 4)  # 12 chunks a slab: 9 slabs
    slabbed = rans.encode(values, p, 2)
    assert all(np.array_equal(whole[k], slabbed[k]) for k in whole)
    d = rans.Decoder(whole, p, len(values))
    out = np.empty(len(values), dtype=np.uint16)
    for c0 in range(0, d.nchunks, 8):
        c1 = min(d.nchunks, c0 + 8)
        d.run(c0, c1, out[c0 * 1024 : min(c1 * 1024, len(values))], 2)
    assert np.array_equal(out, values)


def test_tiles_row_ranges_check_what_a_whole_decode_checks():
    values = (np.random.default_rng(6).normal(0, 0.5, 64 * 40).astype(np.float32).view(np.uint32) >> 16).astype(
        np.uint16
    )
    p, streams = tiles.encode(values, 64, 40, block=16)
    assert len(streams["esc"]) > 0
    assert np.array_equal(tiles.decode(streams, p, 64, 40), tiles.decode_reference(streams, p, 64, 40))
    d = tiles.Decoder(streams, p, 64, 40)
    out = np.empty(64 * 40, dtype=np.uint16)
    for r0 in range(0, 64, 5):
        d.run(r0, min(64, r0 + 5), out[r0 * 40 : min(64, r0 + 5) * 40])
    assert np.array_equal(out, values)
    # Every entry shifted by one, esc one byte longer at the front: consistent but for entry 0.
    idx = tiles.esc_index_entries(streams["esc_index"]) + 1
    shifted = dict(
        streams, esc_index=idx.astype("<u4").view(np.uint8), esc=np.concatenate([[0], streams["esc"]]).astype(np.uint8)
    )
    with pytest.raises(ValueError, match="esc_index"):
        tiles.decode(shifted, p, 64, 40)


@pytest.mark.slow
def test_every_command_within_the_memory_target(tmp_path):
    """benchmarks/memory_bench.py at 160 MiB: peak RSS of each command <= 1.5 × tensor + 256 MiB.
    Not smaller: the interpreter's own peak (numba and llvmlite imported) is 100-165 MiB depending
    on how much of its shared libraries the page cache has (a freshly installed venv maps more),
    and at 96 MiB that left compress 6 MiB over its target on CI, 60 MiB under it here."""
    out = tmp_path / "memory_bench.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "memory_bench.py"),
            "--mib",
            "160",
            "--threads",
            "2",
            "--workdir",
            str(tmp_path),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    result = json.loads(out.read_text())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["command"]: r for r in result["rows"]}
    assert {"compress", "compress --layout serving", "verify", "verify --against", "decompress", "inspect"} <= set(rows)
    assert all(r["ok"] for r in rows.values())
    assert result["largest_tensor"] == 160 * MiB


def test_decompress_refuses_what_the_disk_cannot_hold_before_writing(tmp_path):
    """A valid 1 MB container can declare twice the free disk space: refused up front, nothing written."""
    import shutil

    chunks = -(-2 * shutil.disk_usage(tmp_path).free // rans.CHUNK_RANGE[1])
    path, n = rans_bomb(tmp_path / "bomb.safetensors", chunks, good_crc=False)
    code, peak, out, err = run_measured(cli("decompress", path, tmp_path / "out"))
    assert code == 1 and "GB free" in err and str(tmp_path / "out") in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
