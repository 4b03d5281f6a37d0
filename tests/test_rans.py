"""The rans codec: numba kernels against the plain reference decoder, on real and edge-case data."""

from __future__ import annotations

import numpy as np
import pytest

from unweight.codec import rans, rans_avx2
from unweight.codec.freq_table import TableError, parse, quantize, serialize
from unweight.codec.reference import decode_reference


@pytest.fixture(autouse=True, params=["avx2", "portable"])
def decoder(request, monkeypatch):
    """Every test here runs with both 16-bit decoders: the AVX2 one, and the numba one that
    hosts without AVX2 use."""
    if request.param == "avx2" and not rans_avx2.AVAILABLE:
        pytest.skip("the host CPU has no AVX2")
    monkeypatch.setattr(rans_avx2, "AVAILABLE", request.param == "avx2")
    return request.param


def roundtrip(values: np.ndarray, p: rans.RansParams, threads: int = 2) -> dict:
    streams = rans.encode(values, p, threads)
    fast = rans.decode(streams, p, len(values), threads)
    assert fast.dtype == values.dtype
    assert np.array_equal(fast, values)  # integer views: bit-exact
    return streams


def test_reference_matches_fast_decoder_on_minilm(minilm_tensors):
    # Several real tensors, cut to sizes that leave partial lane rounds and raw groups.
    for name, n in [
        ("encoder.layer.0.attention.self.query.weight", 9001),
        ("encoder.layer.3.intermediate.dense.weight", 4099),
        ("embeddings.word_embeddings.weight", 2053),
    ]:
        values = minilm_tensors[name][:n]
        p = rans.RansParams.for_word(16, True, precision=12, chunk=1024)
        streams = roundtrip(values, p)
        assert np.array_equal(decode_reference(p.to_json(), streams, n), values)


def test_minilm_whole_tensors_and_saving(minilm_tensors):
    original = stored = 0
    p = rans.RansParams.for_word(16, True)
    for values in minilm_tensors.values():
        if len(values) < 100_000:
            continue
        streams = roundtrip(values, p)
        original += values.nbytes
        stored += sum(len(s) for s in streams.values())
    # The order-0 bound of these tensors is 34.16 %; rans at precision 14 gets within 0.2 points.
    assert 1 - stored / original > 0.337


def test_all_65536_bf16_patterns_shuffled():
    values = np.random.default_rng(0).permutation(np.arange(65536, dtype=np.uint16))
    p = rans.RansParams.for_word(16, True, precision=14, chunk=4096)
    streams = roundtrip(values, p)
    assert np.array_equal(decode_reference(p.to_json(), streams, len(values)), values)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 1023, 1024, 1025, 3000])
def test_lengths_around_lanes_groups_and_chunks(n):
    values = np.random.default_rng(n).integers(0, 1 << 16, n, dtype=np.uint16)
    p = rans.RansParams.for_word(16, True, precision=10, chunk=1024)
    streams = roundtrip(values, p, threads=1)
    assert np.array_equal(decode_reference(p.to_json(), streams, n), values)


@pytest.mark.parametrize(
    "word_bits,rotate,dtype", [(8, True, np.uint8), (8, False, np.uint8), (16, False, np.uint16), (32, True, np.uint32)]
)
def test_other_word_sizes(word_bits, rotate, dtype):
    rng = np.random.default_rng(word_bits)
    if word_bits == 32:  # FP32 weights: a real-looking exponent spread
        values = (rng.standard_normal(5001).astype(np.float32) * 0.05).view(np.uint32)
    else:
        values = rng.integers(0, 1 << word_bits, 5001).astype(dtype)
    p = rans.RansParams.for_word(word_bits, rotate, precision=12, chunk=2048)
    streams = roundtrip(values, p)
    assert np.array_equal(decode_reference(p.to_json(), streams, len(values)), values)


def test_single_symbol_tensor_costs_no_words():
    values = np.full(10_000, 0x3F80, dtype=np.uint16)  # 1.0 everywhere
    streams = roundtrip(values, rans.RansParams.for_word(16, True))
    assert len(streams["words"]) == 0


def test_quantize_keeps_every_symbol_and_sums_exactly():
    counts = np.array([0, 1, 0, 10**9, 3, 0, 7] + [1] * 1000, dtype=np.int64)
    for precision in (10, 12, 15):
        f = quantize(counts, precision)
        assert f.sum() == 1 << precision
        assert np.all((f > 0) == (counts > 0))


def test_table_parser_rejects_bad_tables():
    f = quantize(np.array([5, 0, 3, 9]), 10)
    blob = serialize(f)
    assert np.array_equal(parse(blob, 10, 10)[:4], f)
    with pytest.raises(TableError, match="sum"):
        parse(blob, 10, 11)
    with pytest.raises(TableError, match="varint"):
        parse(blob[:-1] + b"\x80", 10, 10)
    with pytest.raises(TableError, match="alphabet"):
        parse(bytes([0xFF, 0x07, 0x02, 1, 1]), 10, 10)
    with pytest.raises(TableError, match="longer"):
        parse(bytes([0, 1, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01]), 10, 10)


def test_corrupt_words_are_detected_not_misread():
    values = np.random.default_rng(1).integers(0, 1 << 16, 20_000, dtype=np.uint16)
    p = rans.RansParams.for_word(16, True, precision=12, chunk=4096)
    streams = rans.encode(values, p, 1)
    bad = dict(streams, words=streams["words"][:-2].copy())
    with pytest.raises(ValueError):
        rans.decode(bad, p, len(values), 1)
    index = streams["index"].copy()
    index[-4:] = 0  # last state of the last chunk below 2^16
    with pytest.raises(ValueError, match="state"):
        rans.decode(dict(streams, index=index), p, len(values), 1)


def test_a_tiny_file_cannot_claim_a_huge_tensor(tmp_path):
    """A constant tensor codes to no words at all, so a small file could declare terabytes: the
    reader refuses sizes beyond physical memory before allocating."""
    import torch

    import unweight
    from unweight.codec import decode_tensor
    from unweight.formats import ContainerReader

    path = tmp_path / "c.safetensors"
    unweight.save_file({"c": torch.ones(20000, dtype=torch.bfloat16)}, path)
    with ContainerReader(path) as reader:
        entry = reader.tensors["c"]
        huge = type(entry)(entry.name, entry.dtype, (1 << 46,), entry.codec, entry.params, entry.streams, entry.crc32)
        with pytest.raises(unweight.CorruptDataError, match="exceed this machine's memory"):
            decode_tensor(huge, reader.streams_of(entry))


def test_division_magic_is_exact_for_every_frequency():
    """The encoder divides x < 2^32 by each frequency with a multiply and shifts; check it against
    integer division for every frequency up to 2^15 at random and edge numerators."""
    from unweight.codec.rans_kernels import division_magic

    d = np.arange(1, (1 << 15) + 1, dtype=np.int64)
    magic = division_magic(d).astype(np.uint64)
    rng = np.random.default_rng(0)
    numerators = [np.full(len(d), v, dtype=np.int64) for v in (0, 1, (1 << 31), (1 << 32) - 1)]
    numerators += [np.minimum(d * k - off, (1 << 32) - 1) for k in (1, 7, 1 << 17) for off in (0, 1)]
    numerators += [rng.integers(0, 1 << 32, len(d), dtype=np.int64) for _ in range(8)]
    for x in numerators:
        xu = np.maximum(x, 0).astype(np.uint64)
        t1 = (xu * (magic & np.uint64(0xFFFFFFFF))) >> np.uint64(32)
        q = (t1 + ((xu - t1) >> ((magic >> np.uint64(32)) & np.uint64(0xFF)))) >> (magic >> np.uint64(40))
        assert np.array_equal(q.astype(np.int64), np.maximum(x, 0) // d)


@pytest.mark.parametrize("rotate", [True, False])
def test_symbol_counts_match_bincount_at_any_offset(rotate):
    from unweight.codec.rans_kernels import histogram

    values = np.random.default_rng(9).integers(0, 1 << 16, 10_007, dtype=np.uint16)
    for start, stop in [(0, 10_007), (3, 10_002), (1, 2), (5, 5), (4, 9)]:
        counts = np.zeros(1024, dtype=np.int64)
        histogram(values, 16, 6, rotate, start, stop, counts)
        w = values[start:stop].astype(np.int64)
        if rotate:
            w = ((w << 1) | (w >> 15)) & 0xFFFF
        assert np.array_equal(counts, np.bincount(w >> 6, minlength=1024))


def _damage_chunk(streams: dict, p: rans.RansParams, n: int, c: int) -> dict:
    """The streams with the first word of chunk c flipped (its decode then fails its end check)."""
    nchunks = p.nchunks(n)
    offsets = streams["index"].view("<u8")[: nchunks + 1]
    words = streams["words"].copy()
    assert offsets[c + 1] > offsets[c]
    words[2 * int(offsets[c])] ^= 0xFF
    return dict(streams, words=words)


def test_decoding_chosen_chunks_touches_only_those():
    values = (np.random.default_rng(5).standard_normal(70_000) * 0.02).astype(np.float32).view(np.uint32) >> 16
    values = values.astype(np.uint16)
    p = rans.RansParams.for_word(16, True, chunk=8192)
    streams = rans.encode(values, p, 1)
    nchunks = p.nchunks(len(values))  # 9, the last one short
    chosen = np.array([0, 1, 4, 6, 7, 8])
    sentinel = np.full(len(values), 0xABCD, dtype=np.uint16)
    out = rans.decode(_damage_chunk(streams, p, len(values), 5), p, len(values), 2, sentinel.copy(), chunks=chosen)
    mask = np.zeros(len(values), dtype=bool)
    for c in chosen:
        mask[c * p.chunk : (c + 1) * p.chunk] = True
    assert np.array_equal(out[mask], values[mask]) and np.all(out[~mask] == 0xABCD)
    with pytest.raises(ValueError, match="chunk 5"):
        rans.decode(_damage_chunk(streams, p, len(values), 5), p, len(values), 1, chunks=np.array([5]))
    for bad in ([3, 3], [4, 2], [-1], [nchunks]):
        with pytest.raises(ValueError, match="sorted, distinct"):
            rans.decode(streams, p, len(values), 1, chunks=np.array(bad))
    assert np.array_equal(rans.decode(streams, p, len(values), 1, chunks=np.arange(nchunks)), values)


def test_decode_rows_reads_only_the_chunks_of_those_rows():
    import unweight
    from unweight.codec import CodecOptions, decode_rows, decode_tensor, encode_tensor

    w = (np.random.default_rng(6).standard_normal((1000, 96)) * 0.02).astype(np.float32).view(np.uint32) >> 16
    data = w.astype(np.uint16).view(np.uint8).ravel()
    entry, streams = encode_tensor("emb", "BF16", (1000, 96), data, CodecOptions(threads=1))
    p = rans.RansParams.from_json(entry.params)
    assert entry.codec == "rans" and p.nchunks(entry.numel) >= 4
    table = data.reshape(1000, -1)
    ids = np.array([999, 3, 3, 500, 0, 170])  # any order, repeats
    assert np.array_equal(decode_rows(entry, streams, ids), table[ids])
    assert decode_rows(entry, streams, np.array([], dtype=np.int64)).shape == (0, 192)
    # damage a chunk that holds none of the rows asked for: they still decode; a whole decode fails
    per_chunk_rows = p.chunk // 96
    far = p.nchunks(entry.numel) - 1
    broken = _damage_chunk(streams, p, entry.numel, far)
    near = np.array([0, 1, per_chunk_rows - 1])
    assert np.array_equal(decode_rows(entry, broken, near), table[near])
    with pytest.raises(unweight.CorruptDataError, match=rf"emb.*chunk {far}"):
        decode_rows(entry, broken, np.array([999]))
    with pytest.raises(unweight.CorruptDataError, match="emb"):
        decode_tensor(entry, broken)
    for bad in ([1000], [-1]):
        with pytest.raises(ValueError, match=r"\[0, 1000\)"):
            decode_rows(entry, streams, np.array(bad))
    # other codecs decode the whole tensor (CRC included) and index it
    zeros = np.zeros(4000, dtype=np.uint8)
    ez, sz = encode_tensor("z", "BF16", (20, 100), zeros, CodecOptions(threads=1))
    assert ez.codec != "rans" and np.array_equal(decode_rows(ez, sz, np.array([19, 0])), zeros.reshape(20, -1)[[19, 0]])
    scalar, ss = encode_tensor("s", "BF16", (), np.zeros(2, np.uint8), CodecOptions(threads=1))
    with pytest.raises(ValueError, match="no rows"):
        decode_rows(scalar, ss, np.array([0]))


@pytest.mark.parametrize("dtype", ["I32", "U32", "I16", "U16", "I64", "U64"])
@pytest.mark.slow
def test_integers_wider_than_a_byte_are_coded_byte_by_byte(dtype):
    """compressed-tensors' INT4 codes, eight to an I32 (Kimi K2.5's experts): `rans` codes them as
    bytes, two codes a symbol (SPEC.md §3.3, format 2.1), and beats zstd on codes of a peaked
    distribution; any integer dtype of the same bytes decodes bit for bit, by rows and in pieces."""
    import zstandard

    from unweight.codec import CodecOptions, decode_rows, encode_tensor
    from unweight.codec.pieces import decode_pieces
    from unweight.formats.dtypes import DTYPE_SIZES

    rng = np.random.default_rng(7)
    codes = np.clip(np.round(rng.standard_normal((512, 2048)) * 2.2), -8, 7).astype(np.int64) + 8
    words = sum(codes[:, i::8].astype(np.uint32) << (4 * i) for i in range(8))  # (512, 256) packed words
    data = words.view(np.uint8).reshape(-1)
    shape = (512, data.size // 512 // DTYPE_SIZES[dtype])
    entry, streams = encode_tensor("w", dtype, shape, data, CodecOptions(threads=1))
    p = rans.RansParams.from_json(entry.params)
    assert entry.codec == "rans" and (p.word_bits, p.rotate) == (8, False)
    stored = sum(len(s) for s in streams.values())
    assert stored < len(zstandard.ZstdCompressor(level=10).compress(data.tobytes())) < len(data)
    assert np.array_equal(decode_reference(entry.params, streams, len(data)), data)
    assert np.array_equal(np.concatenate([piece.copy() for piece in decode_pieces(entry, streams, 1 << 14)]), data)
    ids = np.array([511, 0, 200, 200])
    assert np.array_equal(decode_rows(entry, streams, ids), data.reshape(512, -1)[ids])


@pytest.mark.parametrize("shape", [(3, 50, 700), (4, 64, 64)])  # (square matrices: the shape cannot tell)
def test_a_3d_tensor_coded_transposed_decodes_whole_by_rows_and_in_pieces(shape):
    """`transpose` (format 2.1): the words are the tensor with its last two dimensions swapped, as
    the reference decoder reads them; decode_tensor, decode_rows (experts, dim 0) and decode_pieces
    (a matrix at a time) give the original bytes. 2-D tensors and other dtypes are not transposed."""
    from unweight.codec import CodecOptions, decode_rows, decode_tensor, encode_tensor, transposed
    from unweight.codec.pieces import decode_pieces

    rng = np.random.default_rng(8)  # (3, 50, 700): matrices of 35,000 elements across 4,096-element chunks
    w = ((rng.standard_normal(shape).astype(np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16)
    data = w.view(np.uint8).reshape(-1)
    entry, streams = encode_tensor("w", "BF16", shape, data, CodecOptions(threads=1, chunk=4096), transpose=True)
    assert transposed(entry)
    words = {k: v for k, v in entry.params.items() if k != "transpose"}
    assert np.array_equal(decode_reference(words, streams, w.size), w.swapaxes(-1, -2).reshape(-1))
    assert np.array_equal(decode_tensor(entry, streams), data)
    ids = np.array([2, 0, 2])
    assert np.array_equal(decode_rows(entry, streams, ids), data.reshape(shape[0], -1)[ids])
    matrix = 2 * shape[1] * shape[2]
    for piece_bytes in (1000, 200_000):  # a matrix a piece; as many as fit
        pieces = [p.copy() for p in decode_pieces(entry, streams, piece_bytes)]
        per = max(1, piece_bytes // matrix)
        assert np.array_equal(np.concatenate(pieces), data) and len(pieces) == -(-shape[0] // per)
    flat, _ = encode_tensor("w", "BF16", (shape[0] * shape[1], shape[2]), data, CodecOptions(threads=1), transpose=True)
    ints, _ = encode_tensor("w", "I16", shape, data, CodecOptions(threads=1), transpose=True)
    assert "transpose" not in flat.params and "transpose" not in ints.params
