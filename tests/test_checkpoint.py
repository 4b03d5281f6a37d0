"""Whole checkpoints through the Python API: MiniLM, sharded folders, refusals, atomic output."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import unweight
from helpers import random_bf16, write_checkpoint
from unweight import hf_config
from unweight.formats import SafetensorsFile


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_minilm_roundtrip_is_byte_identical(minilm_dir, tmp_path):
    out = tmp_path / "uw"
    report = unweight.compress(minilm_dir, out)
    assert report.totals().saving > 0.337  # issue target on the BF16 payload: >= 33.7 %
    assert {"config.json", "tokenizer.json", "vocab.txt"} <= set(report.copied_files)
    assert unweight.verify(out, against=minilm_dir).ok
    back = tmp_path / "back"
    assert unweight.decompress(out, back) == len(report.tensors)
    assert sha(back / "model.safetensors") == sha(minilm_dir / "model.safetensors")
    assert (back / "config.json").read_bytes() == (minilm_dir / "config.json").read_bytes()


def test_lazy_reader_returns_torch_tensors(minilm_dir, tmp_path):
    out = tmp_path / "uw"
    unweight.compress(minilm_dir, out)
    name = "encoder.layer.2.attention.self.key.weight"
    with unweight.open(out) as ckpt, SafetensorsFile(minilm_dir / "model.safetensors") as sf:
        t = ckpt.get_tensor(name)
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == sf.tensors[name].shape
        assert np.array_equal(t.view(torch.int16).numpy().view(np.uint8).ravel(), sf.bytes_of(name))
        assert ckpt.stored_bytes < 0.67 * os.path.getsize(minilm_dir / "model.safetensors")


@pytest.fixture()
def sharded(tmp_path):
    """A two-shard BF16 checkpoint with an index, a config and an FP32 norm."""
    src = tmp_path / "src"
    shard1 = {"model.layers.0.mlp.up_proj.weight": random_bf16(256, 128, seed=1), "model.norm.weight": torch.ones(128)}
    shard2 = {
        "model.layers.0.self_attn.q_proj.weight": random_bf16(128, 128, seed=2),
        "lm_head.weight": random_bf16(300, 128, seed=3),
    }
    write_checkpoint(src / "model-00001-of-00002.safetensors", shard1, {"format": "pt"})
    write_checkpoint(src / "model-00002-of-00002.safetensors", shard2, {"format": "pt"})
    weight_map = {
        **{k: "model-00001-of-00002.safetensors" for k in shard1},
        **{k: "model-00002-of-00002.safetensors" for k in shard2},
    }
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map})
    )
    (src / "config.json").write_text('{"model_type": "llama"}')
    return src


def test_sharded_checkpoint_keeps_index_and_round_trips(sharded, tmp_path):
    out = tmp_path / "uw"
    report = unweight.compress(sharded, out, threads=1)
    assert report.files_written == 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    with unweight.open(out) as ckpt:
        assert sorted(ckpt.keys()) == sorted(index["weight_map"])
    back = tmp_path / "back"
    unweight.decompress(out, back)
    for f in sharded.iterdir():
        assert sha(back / f.name) == sha(f), f.name


def test_verify_reports_the_first_difference(sharded, tmp_path):
    out = tmp_path / "uw"
    unweight.compress(sharded, out)
    changed = tmp_path / "changed"
    shutil.copytree(sharded, changed)
    with SafetensorsFile(changed / "model-00002-of-00002.safetensors") as sf:
        offset = sf.data_start + sf.tensors["lm_head.weight"].begin + 10
    with open(changed / "model-00002-of-00002.safetensors", "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))
    report = unweight.verify(out, against=changed)
    assert not report.ok
    assert "lm_head.weight" in report.mismatches[0] and "byte 10" in report.mismatches[0]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_big_and_small_tensors_on_threads(tmp_path, monkeypatch, threads):
    """Tensors above PARALLEL_TENSOR_BYTES go alone on every thread, runs of smaller ones several
    at once: the output is the same bytes whatever the threads, and a damaged small tensor is
    reported on its own while the others are still checked."""
    from unweight import checkpoint

    monkeypatch.setattr(checkpoint, "PARALLEL_TENSOR_BYTES", 40_000)
    sizes = {"a": 64, "b": 48, "big1": 256, "c": 64, "d": 32, "e": 64, "f": 40, "big2": 300, "g": 64}
    tensors = {f"layers.{k}.weight": random_bf16(rows, 128, seed=i) for i, (k, rows) in enumerate(sizes.items())}
    tensors["norm.weight"] = torch.ones(128)
    src = tmp_path / "src"
    write_checkpoint(src / "model.safetensors", tensors, {"format": "pt"})
    reference = tmp_path / "ref"
    unweight.compress(src, reference, threads=1)
    out = tmp_path / "uw"
    unweight.compress(src, out, threads=threads)
    assert sha(out / "model.safetensors") == sha(reference / "model.safetensors")
    back = tmp_path / "back"
    unweight.decompress(out, back, threads=threads)
    assert sha(back / "model.safetensors") == sha(src / "model.safetensors")
    got, want = unweight.inspect(out, threads=threads), unweight.inspect(reference, threads=1)
    assert [s.to_json(histogram=True) for s in got] == [s.to_json(histogram=True) for s in want]
    shard = out / "model.safetensors"
    with SafetensorsFile(shard) as sf:
        words = sf.tensors["layers.d.weight#words"]
        offset = sf.data_start + words.begin + words.nbytes // 2
    data = bytearray(shard.read_bytes())
    data[offset] ^= 0x40
    shard.write_bytes(bytes(data))
    report = unweight.verify(out, against=src, threads=threads)
    assert len(report.mismatches) == 1 and "layers.d.weight" in report.mismatches[0]
    assert report.checked_tensors == len(tensors) - 1  # every other tensor was decoded and compared


def test_refusals(tmp_path, sharded):
    pickle_dir = tmp_path / "pickled"
    pickle_dir.mkdir()
    torch.save({"w": torch.ones(2)}, pickle_dir / "pytorch_model.bin")
    with pytest.raises(unweight.SourceError, match="pickle"):
        unweight.compress(pickle_dir, tmp_path / "o1")
    with pytest.raises(unweight.SourceError, match="no such"):
        unweight.compress(tmp_path / "nope", tmp_path / "o2")
    (tmp_path / "exists").mkdir()
    with pytest.raises(unweight.DestinationError, match="already exists"):
        unweight.compress(sharded, tmp_path / "exists")
    os.remove(sharded / "model-00002-of-00002.safetensors")
    with pytest.raises(
        unweight.SourceError, match="model-00002-of-00002.safetensors: no such file; .* lists 2 tensors"
    ):
        unweight.compress(sharded, tmp_path / "o3")
    index = sharded / "model.safetensors.index.json"
    for shard in ("a\u0000b", "../x.safetensors", "/etc/hostname"):  # NUL once raised an untyped ValueError
        index.write_text(json.dumps({"weight_map": {"w": shard}}))
        with pytest.raises(unweight.SourceError, match=f"^{index}: shard path .* leaves the folder or is not a path$"):
            unweight.compress(sharded, tmp_path / "o3")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o3").exists()


def _big_source(tmp_path):
    """A checkpoint that takes a compress run a few seconds (48 MiB of BF16)."""
    return write_checkpoint(
        tmp_path / "big" / "model.safetensors", {f"w{i}": random_bf16(1024, 1024, seed=i) for i in range(24)}
    ).parent


def _start_compress(src, dst) -> subprocess.Popen:
    """`unweight compress SRC DST` as a process, returned once its staging folder exists."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "unweight.cli.main", "compress", str(src), str(dst), "-q"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not _partials(dst) and proc.poll() is None:
        time.sleep(0.02)
    assert proc.poll() is None and len(_partials(dst)) == 1, "the run never started staging"
    return proc


def _partials(dst) -> list:
    return sorted(p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.partial-"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
@pytest.mark.slow
def test_signals_remove_the_partial_folder(tmp_path, signum):
    """SIGTERM (timeout, docker, systemd), SIGHUP (a closed terminal) and Ctrl-C in the middle of a
    run: no DST, no hidden staging folder, exit 128 + the signal, one line saying so."""
    dst = tmp_path / "out"
    proc = _start_compress(_big_source(tmp_path), dst)
    time.sleep(0.3)  # well inside the encoding, not only at its start
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr
    assert (
        "Traceback" not in stderr
        and f"interrupted ({signal.Signals(signum).name}): partial output was removed" in stderr
    ), stderr
    assert not dst.exists() and _partials(dst) == []


@pytest.mark.slow
def test_next_run_removes_stale_partials_only(tmp_path):
    """SIGKILL leaves a staging folder (nothing can clean up); the next run to that DST removes it
    but leaves a live run's folder alone, and that live run, finding DST made meanwhile, says so."""
    src, dst = _big_source(tmp_path), tmp_path / "out"
    killed = _start_compress(src, dst)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    [stale] = _partials(dst)
    assert not dst.exists() and stale.name == f".out.partial-{killed.pid}"
    live = _start_compress(src, dst.parent / "elsewhere")  # a run to another DST is not touched either
    os.kill(live.pid, signal.SIGSTOP)
    live_same = subprocess.Popen(
        [sys.executable, "-m", "unweight.cli.main", "compress", str(src), str(dst), "-q"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while (
        time.time() < deadline
        and live_same.poll() is None
        and not any(p.name.endswith(f"-{live_same.pid}") for p in _partials(dst))
    ):
        time.sleep(0.02)
    os.kill(live_same.pid, signal.SIGSTOP)  # holds it mid-run, however fast the machine
    try:
        assert stale not in _partials(dst)  # removed by live_same's start: its process is gone
        small = write_checkpoint(tmp_path / "small" / "model.safetensors", {"w": random_bf16(64, 64)}).parent
        unweight.compress(small, dst)
        assert dst.is_dir() and [p.name for p in _partials(dst)] == [f".out.partial-{live_same.pid}"]
    finally:
        os.kill(live_same.pid, signal.SIGCONT)
    _, stderr = live_same.communicate(timeout=300)
    assert (
        live_same.returncode == 1
        and stderr.strip()
        == f"error: {dst}: appeared while compressing (another run, or someone else, wrote it); this run's output was "
        f"removed"
    ), stderr
    assert _partials(dst) == [] and unweight.verify(dst, against=small).ok
    assert len(_partials(dst.parent / "elsewhere")) == 1
    live.kill()
    live.wait()


def test_save_file_handles_odd_tensors(tmp_path):
    tensors = {
        "scalar": torch.tensor(3.25, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 7, dtype=torch.bfloat16),
        "transposed": random_bf16(33, 70).t(),
        "fp8": torch.randn(999).to(torch.float8_e5m2),
        "half": torch.randn(4097).half(),
        "mask": torch.rand(1000) > 0.5,
    }
    path = tmp_path / "odd.safetensors"
    unweight.save_file(tensors, path)
    back = unweight.load_file(path)
    for k, t in tensors.items():
        t = t.contiguous()
        assert back[k].dtype == t.dtype and back[k].shape == t.shape, k
        assert torch.equal(back[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k


def test_decode_into_a_reused_buffer():
    """decode_tensor(out=...) (what decompress and verify do with one scratch buffer) writes every
    codec's bytes into the buffer, whatever an earlier tensor left there, and refuses a bad one."""
    from unweight.codec import CodecOptions, decode_tensor, encode_tensor

    g = np.random.default_rng(5)
    cases = [
        (
            "rans",
            "BF16",
            (300, 257),
            random_bf16(300, 257).view(torch.int16).numpy().view(np.uint8).reshape(-1),
            CodecOptions(),
        ),
        ("zstd", "I64", (5000,), np.arange(5000, dtype=np.int64).view(np.uint8), CodecOptions()),
        ("raw", "U8", (4099,), g.integers(0, 256, 4099, dtype=np.uint8), CodecOptions()),
        (
            "tiles",
            "BF16",
            (64, 96),
            random_bf16(64, 96).view(torch.int16).numpy().view(np.uint8).reshape(-1),
            CodecOptions(layout="serving"),
        ),
        ("raw", "BF16", (0, 3), np.zeros(0, dtype=np.uint8), CodecOptions()),
    ]
    scratch = np.empty(max(len(c[3]) for c in cases) // 8 + 1, dtype=np.uint64).view(np.uint8)
    for codec, dtype, shape, data, opts in cases:
        entry, streams = encode_tensor("t", dtype, shape, data, opts)
        assert entry.codec == codec
        scratch[:] = 0xA5  # what the last tensor left
        out = scratch[: len(data)]
        got = decode_tensor(entry, streams, threads=2, out=out)
        assert got.ctypes.data == out.ctypes.data and got.shape == out.shape
        assert np.array_equal(got, data), codec
    entry, streams = encode_tensor("t", *cases[0][1:4], CodecOptions())
    for bad in (
        scratch[: entry.nbytes - 2],
        scratch[1 : entry.nbytes + 1],
        scratch[: entry.nbytes].view(np.int8),
        np.frombuffer(bytes(entry.nbytes), dtype=np.uint8),
    ):
        with pytest.raises(TypeError, match="out must be"):
            decode_tensor(entry, streams, out=bad)


def test_small_tensors_keep_the_smaller_of_rans_and_zstd(minilm_tensors):
    """Tensors under SMALL_TENSOR_BYTES try zstd at the configured level only when a level-1 pass
    comes close to rans: on slices of 16 to 256 KB of every MiniLM weight the pick is still no
    larger than zstd at level 10 would be, and a repetitive BF16 tensor still goes to zstd."""
    from unweight.codec import CodecOptions, encode_tensor
    from unweight.codec.tensor_codec import SMALL_TENSOR_BYTES, TINY_TENSOR_BYTES, _zstd_encode

    opts = CodecOptions(threads=1)
    small = {f"{n}[:{k}]": a[:k] for n, a in minilm_tensors.items() for k in (8_192, 50_000, 128_000) if a.size >= k}
    repetitive = np.tile(np.array([0x3F80, 0x3F80, 0xBF80, 0x0000], dtype=np.uint16), 16_384)  # 128 KiB
    assert len(small) >= 100 and all(TINY_TENSOR_BYTES < a.nbytes <= SMALL_TENSOR_BYTES for a in small.values())
    for name, a in [*small.items(), ("repetitive", repetitive)]:
        data = a.view(np.uint8)
        entry, streams = encode_tensor(name, "BF16", (a.size,), data, opts)
        zstd_size = len(_zstd_encode(data, opts.zstd_level))
        assert sum(len(s) for s in streams.values()) <= zstd_size, name
        assert entry.codec == ("zstd" if name == "repetitive" else "rans"), name


def test_special_files_are_refused_not_waited_on(tmp_path):
    """A FIFO named *.safetensors (or tokenizer.json) is refused by every entry point, naming it,
    instead of blocking forever on open."""
    import faulthandler

    from unweight.formats import ContainerReader

    faulthandler.dump_traceback_later(60, exit=True)  # a regression hangs: fail instead
    try:
        fifo_dir = tmp_path / "fifo"
        fifo_dir.mkdir()
        fifo = fifo_dir / "model.safetensors"
        os.mkfifo(fifo)
        for call in (
            lambda: unweight.compress(fifo_dir, tmp_path / "o1"),
            lambda: unweight.compress(fifo, tmp_path / "o2"),
            lambda: unweight.verify(fifo),
            lambda: unweight.verify(fifo_dir),
            lambda: unweight.inspect(fifo),
            lambda: unweight.decompress(fifo, tmp_path / "o3"),
            lambda: unweight.open(fifo),
            lambda: unweight.load_file(fifo),
            lambda: unweight.open(fifo_dir),
        ):
            with pytest.raises(unweight.SourceError, match=f"^{fifo}: not a regular file \\(a FIFO\\)$"):
                call()
        for cls in (SafetensorsFile, ContainerReader):
            with pytest.raises(unweight.FormatError, match=r"not a regular file \(a FIFO\)"):
                cls(fifo)
        src = write_checkpoint(tmp_path / "m" / "model.safetensors", {"w": random_bf16(64, 64)}).parent
        unweight.compress(src, tmp_path / "uw")
        with pytest.raises(unweight.SourceError, match="tokenizer.json: not a regular file"):
            os.mkfifo(src / "tokenizer.json")
            unweight.compress(src, tmp_path / "o4")
        os.mkfifo(tmp_path / "uw" / "tokenizer.json")
        for call in (
            lambda: unweight.decompress(tmp_path / "uw", tmp_path / "o5"),
            lambda: unweight.verify(tmp_path / "uw"),
        ):
            with pytest.raises(unweight.SourceError, match="tokenizer.json: not a regular file"):
                call()
        assert not any((tmp_path / f"o{i}").exists() for i in range(1, 6))
    finally:
        faulthandler.cancel_dump_traceback_later()


def test_symbolic_links_must_stay_inside_the_folder(tmp_path):
    """A link that resolves inside the source folder is copied as the file it names (the output
    stands alone); one that leaves the folder, a broken one, or a folder link leaving it is refused,
    naming the link and its target; Hub cache snapshots may link into their repo's blobs."""
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the output")
    src = write_checkpoint(tmp_path / "m" / "model.safetensors", {"w": random_bf16(64, 64)}).parent
    (src / "real").mkdir()
    (src / "real" / "vocab.txt").write_text("a\nb\n")
    (src / "vocab.txt").symlink_to("real/vocab.txt")
    (src / "inner").symlink_to("real", target_is_directory=True)  # not followed: its file is copied from real/
    report = unweight.compress(src, tmp_path / "ok")
    assert sorted(report.copied_files) == ["real/vocab.txt", "vocab.txt"]
    copied = tmp_path / "ok" / "vocab.txt"
    assert not copied.is_symlink() and copied.read_text() == "a\nb\n" and not (tmp_path / "ok" / "inner").exists()
    assert unweight.verify(tmp_path / "ok", against=src).ok

    for name, target in (
        ("tokenizer.json", secret),
        ("model.safetensors.index.json", Path("/etc/hostname")),
        ("extra.safetensors", tmp_path / "ok" / "model.safetensors"),
        ("outside", tmp_path),
    ):
        link = src / name
        link.symlink_to(target, target_is_directory=target.is_dir())
        with pytest.raises(unweight.SourceError, match=f"^{link}: symbolic link to {target.resolve()}, outside {src}"):
            unweight.compress(src, tmp_path / "o")
        link.unlink()
    (src / "gone.json").symlink_to(tmp_path / "nothing")
    with pytest.raises(unweight.SourceError, match="gone.json: broken symbolic link"):
        unweight.compress(src, tmp_path / "o")
    (src / "gone.json").unlink()
    assert not (tmp_path / "o").exists()

    # A compressed folder is held to the same rule when it is decompressed or read.
    (tmp_path / "ok" / "tokenizer.json").symlink_to(secret)
    for call in (
        lambda: unweight.decompress(tmp_path / "ok", tmp_path / "back"),
        lambda: unweight.open(tmp_path / "ok"),
    ):
        with pytest.raises(unweight.SourceError, match="tokenizer.json: symbolic link to .*secret.txt, outside"):
            call()
    assert not (tmp_path / "back").exists()

    # huggingface_hub's cache: snapshots/REV/* link to ../../blobs/*, inside the repo's folder.
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    shutil.copy(src / "model.safetensors", repo / "blobs" / "1111")
    (repo / "blobs" / "2222").write_text("{}")
    (snap / "model.safetensors").symlink_to("../../blobs/1111")
    (snap / "config.json").symlink_to("../../blobs/2222")
    report = unweight.compress(snap, tmp_path / "from-hub")
    copied = tmp_path / "from-hub" / "config.json"  # the linked blob's bytes (with the vLLM tag), not a link
    assert report.copied_files == ["config.json"] and not copied.is_symlink()
    assert hf_config.untag(copied.read_bytes()) == b"{}"


@pytest.mark.parametrize(
    "index_bytes, why",
    [
        (b"[" * 100_000 + b"]" * 100_000, "RecursionError"),
        (b'{"weight_map": {"w": "model.safetensors"}, "metadata": {"total_size": ' + b"7" * 5000 + b"}}", "ValueError"),
        (b'{"weight_map": {"w": "model.\xff.safetensors"}}', "UnicodeDecodeError"),
        (b'{"weight_map": ', "JSONDecodeError"),
    ],
)
@pytest.mark.slow
def test_a_bad_index_is_a_typed_error_naming_it(tmp_path, index_bytes, why):
    from helpers import run_cli

    src = write_checkpoint(tmp_path / "m" / "model.safetensors", {"w": random_bf16(64, 64)}).parent
    unweight.compress(src, tmp_path / "uw")
    for folder in (src, tmp_path / "uw"):
        (folder / "model.safetensors.index.json").write_bytes(index_bytes)
    message = f"^{src / 'model.safetensors.index.json'}: not valid UTF-8 JSON \\({why}"
    with pytest.raises(unweight.SourceError, match=message):
        unweight.compress(src, tmp_path / "o")
    with pytest.raises(
        unweight.SourceError,
        match=f"^{tmp_path / 'uw' / 'model.safetensors.index.json'}: not valid UTF-8 JSON \\({why}",
    ):
        unweight.open(tmp_path / "uw")
    r = run_cli("compress", src, tmp_path / "o")
    assert (
        r.returncode == 1
        and "Traceback" not in r.stderr
        and r.stderr.startswith(f"error: {src / 'model.safetensors.index.json'}: not valid")
    ), r.stderr
    assert not (tmp_path / "o").exists()


def test_empty_tensors_whose_strides_pass_int64(tmp_path):
    """[0, 2^47, 2^47, 2^47] holds no bytes and torch (and HF safetensors) can hold it: so can
    get_tensor, and the decompressed file loads in HF safetensors."""
    from safetensors.torch import load_file as hf_load_file

    shape = (0, 1 << 47, 1 << 47, 1 << 47)
    t = torch.empty(0, dtype=torch.bfloat16).reshape(shape)
    src = write_checkpoint(tmp_path / "m" / "model.safetensors", {"e": t, "w": random_bf16(8, 8)}).parent
    unweight.compress(src, tmp_path / "uw")
    with unweight.open(tmp_path / "uw") as ckpt:
        assert tuple(ckpt.get_tensor("e").shape) == shape and ckpt.get_tensor("e").dtype == torch.bfloat16
    unweight.decompress(tmp_path / "uw", tmp_path / "back")
    assert tuple(hf_load_file(tmp_path / "back" / "model.safetensors")["e"].shape) == shape
    assert sha(tmp_path / "back" / "model.safetensors") == sha(src / "model.safetensors")


def test_a_tensor_named_metadata_is_refused(tmp_path):
    """safetensors reserves `__metadata__`: save_file and every writer refuse it (before, the
    decompressed file was one HF safetensors cannot load)."""
    from unweight.formats import write_safetensors

    with pytest.raises(ValueError, match="__metadata__"):
        unweight.save_file({"__metadata__": torch.ones(2), "w": torch.ones(2)}, tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError, match="must be strings"):
        unweight.save_file({1: torch.ones(2)}, tmp_path / "x.safetensors")
    with open(tmp_path / "plain.safetensors", "wb") as f, pytest.raises(ValueError, match="__metadata__"):
        write_safetensors(f, [("__metadata__", "F32", [2])], [np.zeros(2, np.float32)])


@pytest.mark.slow
def test_a_container_its_readers_would_refuse_is_not_written(tmp_path):
    """100k tensors with long names make a header over the cap every reader applies: the writer
    refuses to finish (naming the file and the way out), and leaves nothing behind."""
    import numpy as np

    from unweight.formats import ContainerWriter, TensorEntry

    path = tmp_path / "many.safetensors"
    one = np.zeros(2, dtype=np.uint8)
    with pytest.raises(unweight.FormatError, match="split the tensors over several files") as e:
        with ContainerWriter(str(path)) as w:
            for i in range(100_000):
                name = f"model.language_model.layers.{i // 1000}.block_sparse_moe.experts.{i % 1000}.{'w' * 120}.weight"
                w.add(TensorEntry(name, "BF16", (1,), "raw", {}, {"data": f"{name}#data"}, 0), {"data": one})
            w.finish()
    assert str(path) in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_llama4_fused_gate_up_is_coded_transposed_and_comes_back_byte_for_byte(tmp_path):
    """Llama 4's fused experts gate_up (by name) is coded transposed (format 2.1); verify and
    decompress give its bytes back, and the reader's tensor and rows are the original's."""
    from unweight.reader import CompressedCheckpoint

    name = "language_model.model.layers.0.feed_forward.experts.gate_up_proj"  # (Scout's own layout)
    tensors = {
        name: random_bf16(3, 64, 384, seed=9),
        "model.layers.0.feed_forward.experts.down_proj": random_bf16(3, 192, 64),
    }
    src = write_checkpoint(tmp_path / "src" / "model.safetensors", tensors).parent
    out, back = tmp_path / "uw", tmp_path / "back"
    unweight.compress(src, out, threads=1)
    with CompressedCheckpoint(out) as ckpt:
        assert ckpt.entry(name).params.get("transpose") is True
        assert "transpose" not in ckpt.entry("model.layers.0.feed_forward.experts.down_proj").params
        w = tensors[name]
        assert torch.equal(ckpt.get_tensor(name).view(torch.int16), w.view(torch.int16))
        assert torch.equal(ckpt.get_rows(name, 1, 3).view(torch.int16), w[1:3].view(torch.int16))
        assert torch.equal(ckpt.get_rows(name, 5, 9, slab=2).view(torch.int16), w[2, 5:9].view(torch.int16))
        t = ckpt.get_rows(name, 100, 110, slab=1, transposed=True)
        assert torch.equal(t.view(torch.int16), w[1].t()[100:110].view(torch.int16))
    assert unweight.verify(out, against=src).ok
    unweight.decompress(out, back)
    assert (back / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
