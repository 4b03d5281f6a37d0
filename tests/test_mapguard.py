"""A checkpoint file that shrinks while it is mapped ends the process with one line naming it and
exit status 1, instead of a silent SIGBUS (unweight/mapguard.py); other SIGBUSes are left as they
were. Each door runs in a child process, which the file's truncation kills."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import unweight
from helpers import random_bf16, write_checkpoint
from unweight import mapguard
from unweight.formats import ContainerReader, SafetensorsFile

pytestmark = pytest.mark.skipif(not mapguard._SUPPORTED, reason="the guard is Linux x86_64 / aarch64 only")

MESSAGE = "the file shrank while it was being read (truncated or replaced in place); the process cannot go on"


@pytest.fixture(scope="module")
def compressed(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    write_checkpoint(src / "model.safetensors", {"a.weight": random_bf16(256, 512), "b.bias": random_bf16(64, seed=1)})
    out = tmp_path_factory.mktemp("uw") / "uw"
    unweight.compress(src, out)
    return out


@pytest.fixture
def folder(compressed, tmp_path) -> Path:
    """A fresh copy of the compressed folder (a test truncates its container)."""
    return Path(shutil.copytree(compressed, tmp_path / "uw"))


def start(code: str, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *flags, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def handshake(child: subprocess.Popen, expect: str) -> None:
    """Wait for the child's line `expect` (it has mapped what it will read)."""
    line = child.stdout.readline().strip()
    if line != expect:
        child.kill()
        pytest.fail(f"child said {line!r}, not {expect!r}: {child.communicate()[1][-3000:]}")


def finish(child: subprocess.Popen) -> tuple[int, str]:
    """Tell the child to go on; its exit status and stderr."""
    _, err = child.communicate("go\n", timeout=120)
    return child.returncode, err


# A child that maps the folder through the public reader, then reads a tensor when told to (in the
# main thread, or in another one: the handler runs in whichever thread faults)
READER = """
    import sys, threading, unweight
    from unweight import mapguard
    ckpt = unweight.open(sys.argv[1])
    print("ready", mapguard.installed(), flush=True)
    sys.stdin.readline()
    if sys.argv[2] == "thread":
        t = threading.Thread(target=ckpt.get_tensor, args=("a.weight",))
        t.start()
        t.join()
    else:
        ckpt.get_tensor("a.weight")
    print("read it all", flush=True)
"""


@pytest.mark.parametrize("where", ["main", "thread"])
@pytest.mark.parametrize("faulthandler", [False, True])
@pytest.mark.slow
def test_a_container_truncated_under_a_reader_ends_it_with_a_line_naming_the_file(folder, where, faulthandler):
    container = folder / "model.safetensors"
    flags = ("-X", "faulthandler") if faulthandler else ()
    child = start(READER.replace("sys.argv[1]", repr(str(folder))).replace("sys.argv[2]", repr(where)), *flags)
    handshake(child, "ready True")
    os.truncate(container, 0)  # every page of the mapping is now past the file's end
    code, err = finish(child)
    assert code == mapguard.EXIT_SHRANK == 1, (code, err[-3000:])
    assert err.splitlines()[-1] == f"unweight: {container}: {MESSAGE}", err[-3000:]
    assert "Fatal Python error" not in err  # the guard ran before faulthandler (installed earlier)


def test_the_cli_names_the_file_that_shrank_during_verify(folder):
    """`unweight verify` whose container is truncated once it is open (the reader's constructor is
    wrapped to truncate it, so that the race with a real writer is not left to chance)."""
    container = folder / "model.safetensors"
    code = f"""
        import os, sys
        from unweight.formats import container
        opened = container.ContainerReader.__init__
        def open_then_truncate(self, path):
            opened(self, path)
            os.truncate(path, 0)
        container.ContainerReader.__init__ = open_then_truncate
        from unweight.cli.main import app
        print("ready", flush=True)
        sys.stdin.readline()
        sys.argv = ["unweight", "verify", {str(folder)!r}]
        app()
    """
    child = start(code)
    handshake(child, "ready")
    status, err = finish(child)
    assert status == 1, (status, err[-3000:])
    assert err.splitlines()[-1] == f"unweight: {container}: {MESSAGE}", err[-3000:]


# A child whose guard is installed (a container is mapped) and which then faults elsewhere
ELSEWHERE = """
    import mmap, os, signal, sys, unweight
    from unweight import mapguard
    ckpt = unweight.open(sys.argv[1])
    with open(sys.argv[2], "r+b") as f:
        own = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # mapped by Python, not registered
    print("ready", mapguard.installed(), flush=True)
    sys.stdin.readline()
    if sys.argv[3] == "kill":
        os.kill(os.getpid(), signal.SIGBUS)
    else:
        os.truncate(sys.argv[2], 0)
        own[mmap.PAGESIZE]
    print("survived", flush=True)
"""


@pytest.mark.parametrize("how", ["own mapping", "kill"])
@pytest.mark.parametrize("faulthandler", [False, True])
def test_a_sigbus_that_is_not_ours_goes_to_the_previous_action(folder, tmp_path, how, faulthandler):
    """A fault outside every registered mapping, or a SIGBUS sent by kill(), reaches the action that
    was there before the guard: the default (death by SIGBUS) or faulthandler's traceback."""
    other = tmp_path / "other.bin"
    other.write_bytes(b"x" * (4 * 4096))
    code = ELSEWHERE
    for i, arg in enumerate((str(folder), str(other), "kill" if how == "kill" else "fault"), start=1):
        code = code.replace(f"sys.argv[{i}]", repr(arg))
    child = start(code, *(("-X", "faulthandler") if faulthandler else ()))
    handshake(child, "ready True")
    status, err = finish(child)
    assert status == -signal.SIGBUS, (status, err[-3000:])
    assert MESSAGE not in err
    assert ("Fatal Python error: Bus error" in err) == faulthandler, err[-3000:]


def test_a_mapping_is_struck_off_when_it_goes(folder):
    """Registered while mapped, struck off when closed; if a view outlives close(), the mapping
    (and its registration) lasts until the view is freed (its addresses may then be reused)."""
    container = folder / "model.safetensors"
    line = f"unweight: {container}: {MESSAGE}\n".encode()

    def registered(sf: SafetensorsFile) -> bool:
        start = sf._buf.ctypes.data
        return any(lo <= start < hi and text == line for lo, hi, text in mapguard.guarded())

    sf = SafetensorsFile(container)
    assert mapguard.installed() and registered(sf), mapguard.failure()
    start, size = sf._buf.ctypes.data, len(sf._mmap)
    [(lo, hi)] = [(lo, hi) for lo, hi, _ in mapguard.guarded() if lo == start]
    assert hi - lo == -(-size // os.sysconf("SC_PAGE_SIZE")) * os.sysconf("SC_PAGE_SIZE")  # whole pages
    sf.close()
    assert all(lo != start for lo, _, _ in mapguard.guarded())

    reader = ContainerReader(container)
    view = reader.stream(next(iter(reader.tensors["a.weight"].streams.values())))
    assert isinstance(view, np.ndarray)
    start = reader._file._buf.ctypes.data
    reader.close()  # the view keeps the mapping
    assert any(lo == start for lo, _, _ in mapguard.guarded())
    del view, reader
    gc.collect()
    assert all(lo != start for lo, _, _ in mapguard.guarded())


def test_the_line_stays_one_line_whatever_the_path():
    """Control bytes in a path are written as \\xNN; a relative path is made absolute."""
    assert mapguard._printable("we\nird\x7f.safetensors") == os.fsencode(os.getcwd()) + b"/we\\x0aird\\x7f.safetensors"


def test_importing_unweight_loads_no_guard():
    """The guard's module and llvmlite load with the first mapping, not with `import unweight`."""
    code = "import sys, unweight; print(sorted(m for m in ('unweight.mapguard', 'llvmlite') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr
