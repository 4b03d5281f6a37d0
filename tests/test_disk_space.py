"""Full disks (issue 23): compress needs the finished output's room and no second copy of it, and a
destination that fills up is named in a one-line error with nothing left behind. The full disks
are real: a small tmpfs mounted in a user and mount namespace (`unshare -rm`), which vanishes with
the commands run in it."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import unweight
from helpers import random_bf16, run_cli, write_checkpoint
from unweight.formats import ContainerReader, ContainerWriter, SafetensorsFile, TensorEntry

PAGE = 4096  # tmpfs gives each file whole pages
BIG = (512, 1024)  # the large tensors: 1 MiB each in BF16
SIDE_FILES = 40  # small files besides config.json: a page each on tmpfs, ~60 bytes each counted


@lru_cache(maxsize=1)
def tmpfs_unavailable() -> str | None:
    """Why a tmpfs cannot be mounted in a user and mount namespace here, or None if it can."""
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    probe = Path(tempfile.mkdtemp(prefix="unweight-unshare-probe-"))
    try:
        r = subprocess.run(
            ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=8k none {shlex.quote(str(probe))}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        probe.rmdir()
    if r.returncode != 0:
        return f"unshare -rm cannot mount a tmpfs here (user namespaces off?): {r.stderr.strip()[:200]}"
    return None


pytestmark = pytest.mark.skipif(tmpfs_unavailable() is not None, reason=str(tmpfs_unavailable()))


def cli(*args) -> str:
    """The command line run_cli runs, for a shell."""
    return shlex.join([sys.executable, "-m", "unweight.cli.main", *map(str, args)])


def on_small_disk(disk: Path, size: int, *commands: str) -> tuple[list[tuple[int, str]], list[str]]:
    """Run the shell `commands` one after another with a fresh tmpfs of `size` bytes (rounded up to
    pages) mounted at `disk`; returns each one's (exit status, stderr) and the names left on the
    disk at the end (listed inside the namespace: the tmpfs goes with it)."""
    disk.mkdir()
    logs = disk.parent / f"{disk.name}-logs"
    logs.mkdir()
    script = [f"mount -t tmpfs -o size={-(-size // 1024)}k none {shlex.quote(str(disk))} || exit 99"]
    for i, command in enumerate(commands):
        err = shlex.quote(str(logs / f"{i}.err"))
        script.append(f"{command} >/dev/null 2>{err}; echo $? > {shlex.quote(str(logs / f'{i}.rc'))}")
    script.append(f"ls -A {shlex.quote(str(disk))} > {shlex.quote(str(logs / 'left'))}")
    r = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "\n".join(script)],
        env={**os.environ, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    results = [(int((logs / f"{i}.rc").read_text()), (logs / f"{i}.err").read_text()) for i in range(len(commands))]
    return results, (logs / "left").read_text().split()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """One shard of a few MB: four 1 MiB BF16 matrices (so that a second copy of the container does
    not fit where the first does) and 40 KB of metadata in its header; a config and SIDE_FILES
    small files."""
    src = tmp_path_factory.mktemp("disk") / "src"
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": random_bf16(*BIG, seed=i) for i in range(4)}
    write_checkpoint(src / "model.safetensors", tensors, {"format": "pt", "notes": "n" * 40_000})
    (src / "config.json").write_text('{"model_type": "llama"}')
    for i in range(SIDE_FILES):
        (src / f"extra-{i:02d}.txt").write_text(f"side file {i}\n")
    return src


@pytest.fixture(scope="module")
def compressed(checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("disk") / "uw"
    r = run_cli("compress", checkpoint, out, "-q")
    assert r.returncode == 0, r.stderr
    return out


def pages(folder: Path) -> int:
    """What the folder's files take on a tmpfs."""
    return sum(-(-p.stat().st_size // PAGE) * PAGE for p in folder.rglob("*") if p.is_file())


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.slow
def test_compress_needs_room_for_the_output_alone(checkpoint, compressed, tmp_path):
    """A disk the finished output fits on, with one tensor's worth to spare, is enough (the writer
    once kept the data in side files while it copied them after the header: twice the room)."""
    disk = tmp_path / "disk"
    spare = 2 * BIG[0] * BIG[1] + 64 * 1024  # one tensor's worth and a margin
    assert (compressed / "model.safetensors").stat().st_size > spare  # a second copy would not fit
    results, left = on_small_disk(
        disk,
        pages(compressed) + spare,
        cli("compress", checkpoint, disk / "out", "-q"),
        cli("verify", disk / "out", "--against", checkpoint, "-q"),
    )
    (rc, err), (verify_rc, verify_err) = results
    assert rc == 0, err
    assert verify_rc == 0, verify_err
    assert left == ["out"]


def test_compress_onto_a_full_disk_names_the_destination(checkpoint, compressed, tmp_path):
    """Half the room the output needs: one line naming the destination (not the staging folder's
    file being written), and the partial output removed."""
    disk = tmp_path / "disk"
    results, left = on_small_disk(disk, pages(compressed) // 2, cli("compress", checkpoint, disk / "out", "-q"))
    ((rc, err),) = results
    assert rc == 1
    assert one_error_line(err).startswith(f"error: {disk / 'out'}: no space left on the device while compressing;")
    assert left == []


def test_decompress_refuses_up_front_what_the_headers_would_not_fit(compressed, tmp_path):
    """Room for the tensors' data and the copied files but not the safetensors header: refused
    before anything is written, naming the destination (once only the data was counted, and the
    disk filled up mid-write)."""
    with ContainerReader(compressed / "model.safetensors") as r:
        data = sum(e.nbytes for e in r.tensors.values())
        header = 8 + len(r.source_header.encode())
    assert header > 3 * PAGE
    others = sum(p.stat().st_size for p in compressed.iterdir() if p.suffix != ".safetensors")
    disk = tmp_path / "disk"
    size = (data + others + header // 2) // PAGE * PAGE
    assert data + others < size < data + others + header
    results, left = on_small_disk(disk, size, cli("decompress", compressed, disk / "out", "-q"))
    ((rc, err),) = results
    assert rc == 1
    assert one_error_line(err).startswith(f"error: {disk / 'out'}: the decompressed files need"), err
    assert left == []


def test_decompress_onto_a_disk_that_fills_mid_write_names_the_destination(checkpoint, compressed, tmp_path):
    """Enough bytes free for everything, but the small copied files take a page each on tmpfs: the
    disk fills while they are copied (the error once named the source file being copied)."""
    disk = tmp_path / "disk"
    need = (checkpoint / "model.safetensors").stat().st_size + sum(
        p.stat().st_size for p in compressed.iterdir() if p.suffix != ".safetensors"
    )
    size = -(-need // PAGE) * PAGE + 2 * PAGE  # the model file and a few copied files fit, not all
    assert size < pages(checkpoint)
    results, left = on_small_disk(disk, size, cli("decompress", compressed, disk / "out", "-q"))
    ((rc, err),) = results
    assert rc == 1
    assert one_error_line(err).startswith(
        f"error: {disk / 'out'}: no space left on the device while decompressing; {disk} has "
    ), err
    assert left == []


@pytest.mark.parametrize("source_header", [True, False], ids=["source-header", "built-header"])
def test_decompress_space_check_counts_each_header_to_the_byte(tmp_path, monkeypatch, source_header):
    """The up-front check asks for exactly the bytes decompress writes: one byte less free is
    refused before anything is written, exactly that many is enough."""
    tensors = {f"layer.{i}.weight": random_bf16(8, 8 + i, seed=i) for i in range(20)}
    folder = tmp_path / "uw"
    if source_header:  # compressed from a safetensors file, whose header is kept
        unweight.compress(write_checkpoint(tmp_path / "src" / "model.safetensors", tensors), folder)
    else:  # made by save_file: decompress builds the header
        folder.mkdir()
        unweight.save_file(tensors, folder / "model.safetensors")
    with ContainerReader(folder / "model.safetensors") as r:
        assert (r.source_header is not None) == source_header
    unweight.decompress(folder, tmp_path / "sized")
    need = (tmp_path / "sized" / "model.safetensors").stat().st_size
    real = shutil.disk_usage

    def free(n):
        return lambda path: SimpleNamespace(total=real(path).total, used=0, free=n)

    monkeypatch.setattr(shutil, "disk_usage", free(need - 1))
    with pytest.raises(unweight.DestinationError, match="the decompressed files need") as e:
        unweight.decompress(folder, tmp_path / "short")
    assert str(e.value).startswith(f"{tmp_path / 'short'}: ")
    assert not [p for p in tmp_path.iterdir() if "short" in p.name]
    monkeypatch.setattr(shutil, "disk_usage", free(need))
    unweight.decompress(folder, tmp_path / "exact")
    assert (tmp_path / "exact" / "model.safetensors").read_bytes() == (
        tmp_path / "sized" / "model.safetensors"
    ).read_bytes()


def test_writer_keeps_even_streams_at_even_offsets_past_its_hold_back(tmp_path):
    """Odd-length streams wait to be written in pairs; past ContainerWriter._HOLD_STREAMS of them
    they are written mid-file, and still every even-length stream starts at an even offset."""
    n = ContainerWriter._HOLD_STREAMS + 301  # odd-length streams, an odd count: one is left to go last
    rng = np.random.default_rng(0)
    sizes = [3 + i % 2 + 2 * (i % 5) for i in range(2 * n)]  # every other one odd, from 3 to 12 bytes
    blobs = {f"t{i:05d}": rng.integers(0, 256, size=size, dtype=np.uint8) for i, size in enumerate(sizes)}
    path = tmp_path / "x.safetensors"
    with ContainerWriter(str(path)) as w:
        for name, blob in blobs.items():
            w.add(TensorEntry(name, "U8", (len(blob),), "raw", {}, {"data": f"{name}#data"}, 0), {"data": blob})
        w.finish()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]
    with SafetensorsFile(path) as sf:
        assert sf.data_start % 8 == 0
        spans = {name: sf.tensors[f"{name}#data"] for name in blobs}
        for name, blob in blobs.items():
            assert np.array_equal(sf.bytes_of(f"{name}#data"), blob)
        assert all(t.begin % 2 == 0 for t in spans.values() if t.nbytes % 2 == 0)
        odd = sorted(t.begin for t in spans.values() if t.nbytes % 2)
        even_end = max(t.end for t in spans.values() if t.nbytes % 2 == 0)
        assert odd[0] < even_end  # some odd-length streams were written before the last even-length one
    with ContainerReader(path) as r:
        assert len(r.tensors) == len(blobs)
