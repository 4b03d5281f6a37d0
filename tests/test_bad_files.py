"""Every crafted bad file in tests/bad_files is refused with a FormatError that names the file
(and the tensor, where one is concerned): never another exception, never wrong data, never a hang.

The files are made by tests/bad_files/make_bad_files.py, whose CASES table says, per file, which
tensor the error must name and which operations must refuse it.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import sys
from pathlib import Path

import pytest

import unweight

BAD = Path(__file__).resolve().parent / "bad_files"
HANG_SECONDS = 60  # one file's checks take well under a second; past this, dump stacks and exit


def _load_maker():
    name = "unweight_tests_make_bad_files"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BAD / "make_bad_files.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


maker = _load_maker()
FILES = sorted(p.name for p in BAD.glob("*.safetensors"))


@pytest.fixture(autouse=True)
def no_hang():
    """A watchdog thread (works even while a numba kernel holds the main thread)."""
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def _case(file_name: str):
    stem = file_name.removesuffix(".safetensors")
    assert stem in maker.CASES, f"{file_name} is not in make_bad_files.CASES (stale file? rerun the script)"
    _, tensor, ops = maker.CASES[stem]
    return tensor, ops


def _check_message(message: str, path: Path, tensor: str | None) -> None:
    assert str(path) in message, f"the error does not name the file: {message!r}"
    if tensor is not None:
        assert tensor in message, f"the error does not name {tensor!r}: {message!r}"


def _load(path: Path) -> dict:
    return unweight.load_file(path, threads=1)


def _verify_problem(path: Path) -> str | None:
    """The first problem unweight.verify finds (raised or reported), or None if it finds none."""
    try:
        report = unweight.verify(path, threads=1)
    except unweight.FormatError as e:
        return str(e)
    assert report.ok == (not report.mismatches)
    if report.ok:
        assert report.checked_files == 1
        return None
    return report.mismatches[0]


def _decompress_error(path: Path, tmp_path: Path) -> str | None:
    out = tmp_path / "restored"
    try:
        unweight.decompress(path, out, threads=1)
    except (unweight.FormatError, unweight.DestinationError) as e:  # the latter: it declares more than the disk holds
        # Nothing half-written is left behind: no output folder, no hidden staging folder.
        assert not out.exists()
        assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
        return str(e)
    return None


def test_folder_is_complete():
    assert len(FILES) >= 40, "tests/bad_files is (nearly) empty: run tests/bad_files/make_bad_files.py"
    assert sorted(f"{name}.safetensors" for name in maker.CASES) == FILES
    for name in FILES:
        assert (BAD / name).stat().st_size <= 8 * 1024, f"{name} is not a small file"


def test_regenerates_byte_identical(tmp_path):
    written = maker.main(tmp_path)
    assert sorted(p.name for p in written) == FILES
    for p in written:
        assert p.read_bytes() == (BAD / p.name).read_bytes(), f"{p.name} differs when regenerated"


def _originals() -> dict:
    """The tensors of the valid containers the bad files were made from."""
    return {**maker.base_tensors(), "weight#B": maker.base_b_tensor(), "proj": maker.base_c_tensor()}


def _assert_original(tensors: dict) -> None:
    """A file that an operation may accept gave back original tensors, bit for bit."""
    originals = _originals()
    if set(tensors) == {"weight"} and tuple(tensors["weight"].shape) == tuple(originals["weight#B"].shape):
        originals = {"weight": originals["weight#B"]}
    for name, got in tensors.items():
        want = originals[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.contiguous().view(maker.torch.uint8).equal(want.contiguous().view(maker.torch.uint8)), name


@pytest.mark.parametrize("file_name", FILES)
def test_load_file_refuses(file_name):
    path = BAD / file_name
    tensor, ops = _case(file_name)
    if "load" in ops:
        with pytest.raises(unweight.FormatError) as info:
            _load(path)
        _check_message(str(info.value), path, tensor)
        return
    # What is wrong with this file does not matter to loading (e.g. only the stored source
    # header is bad): a FormatError, or the original tensors.
    try:
        tensors = _load(path)
    except unweight.FormatError as e:
        _check_message(str(e), path, tensor)
    else:
        _assert_original(tensors)


@pytest.mark.parametrize("file_name", FILES)
def test_verify_refuses(file_name):
    path = BAD / file_name
    tensor, ops = _case(file_name)
    problem = _verify_problem(path)
    if "verify" in ops:
        assert problem is not None, f"verify found nothing wrong with {file_name}"
    if problem is not None:
        _check_message(problem, path, tensor)


@pytest.mark.parametrize("file_name", FILES)
def test_decompress_refuses(file_name, tmp_path):
    path = BAD / file_name
    tensor, ops = _case(file_name)
    work = tmp_path / "work"
    work.mkdir()
    error = _decompress_error(path, work)
    if "decompress" in ops:
        assert error is not None, f"decompress accepted {file_name}"
    if (
        error is not None and "GB free" in error
    ):  # refused before decoding: its declared output exceeds the free disk space
        assert file_name == "zstd_declares_huge_size.safetensors", error
    elif error is not None:
        _check_message(error, path, tensor)


@pytest.mark.parametrize("file_name", [f for f in FILES if "compress" in _case(f)[1]])
def test_compress_refuses_bad_source(file_name, tmp_path):
    """Bad *sources* (plain safetensors files): compressing them is refused, nothing is written."""
    path = BAD / file_name
    tensor, _ = _case(file_name)
    out = tmp_path / "out"
    with pytest.raises(unweight.FormatError) as info:
        unweight.compress(path, out, threads=1)
    _check_message(str(info.value), path, tensor)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []
