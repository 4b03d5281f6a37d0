"""A mapped file that shrinks ends the process with one line naming it, not a silent SIGBUS.

Every checkpoint file unweight reads is memory-mapped (formats/safetensors_file.py). If the file
shrinks while it is mapped (truncated, or rewritten in place by another process), reading a page
past its new end raises SIGBUS, and by default the process dies with status 135 and no word. A
Python signal handler cannot help: CPython's C handler only sets a flag and returns, and the
faulting load runs again, forever. So this module installs a native handler, about forty LLVM IR
instructions JIT-compiled with llvmlite, that takes neither the GIL nor memory (write and _exit
only, both async-signal-safe):

- a fault (si_code BUS_ADRERR) whose address (si_addr) lies in a registered mapping writes
  `unweight: PATH: the file shrank while it was being read (truncated or replaced in place); the
  process cannot go on` to stderr (fd 2) and ends the process with _exit(EXIT_SHRANK), status 1,
  in whatever thread faulted (numba's threads included). Nothing is cleaned up: a partial output
  folder of compress/decompress stays, as after a kill -9;
- any other SIGBUS restores the action that was there before (Python's faulthandler, or the
  default) and returns, so the fault runs again under it; one sent by kill() or raise() (which
  returning would lose) is raised again.

The mappings are registered through SafetensorsFile's MAP_OBSERVERS hook: unweight/__init__.py
adds an observer that imports this module at the first mapping and calls `observe`, which then
compiles and installs the handler; each mapping is struck off when it goes (its addresses are
reused). Every door that maps a checkpoint decodes with the codec, which has loaded numba and
llvmlite already, so the first mapping adds only the compile: about 6-9 ms (llvmlite alone would
take 80 ms more to load). Importing unweight loads neither this module nor llvmlite (vLLM's CPU
worker scans the loaded modules when it starts, before any file is mapped: runtime/vllm/plugin.py).

Linux on x86_64 and aarch64 only (the siginfo_t and struct sigaction layouts below are glibc's
and musl's there); elsewhere, or if the compile fails (`failure()` says why), files are read
unguarded, as before.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import signal
import sys
import threading

EXIT_SHRANK = 1  # the process's exit status after a mapped file shrank (the CLI's status for a bad file)
SLOTS = 4096  # mappings guarded at once (the table is 128 KiB); a mapping beyond them is read unguarded
_ROW = 4  # a table row, 4 uint64: start, end (end 0: a free slot), message address, message length
_MESSAGE = b": the file shrank while it was being read (truncated or replaced in place); the process cannot go on\n"

# Linux on x86_64 and aarch64 (asm-generic numbers, glibc's and musl's layouts)
_SUPPORTED = sys.platform == "linux" and os.uname().machine in ("x86_64", "aarch64")
_SI_CODE, _SI_ADDR = 8, 16  # byte offsets in siginfo_t: int si_signo, si_errno, si_code; then void *si_addr
_BUS_ADRERR = 2  # si_code of an access to a page of a mapping past the end of its file
_SA_SIGINFO, _SA_ONSTACK = 0x4, 0x08000000
_CONTROL = re.compile(rb"[\x00-\x1f\x7f]")  # bytes that would break the line


class _Sigaction(ctypes.Structure):
    """glibc's (and musl's) struct sigaction on 64-bit Linux: 152 bytes."""

    _fields_ = [
        ("handler", ctypes.c_void_p),  # sa_sigaction, as SA_SIGINFO is set
        ("mask", ctypes.c_ulong * 16),  # sigset_t: 1024 bits
        ("flags", ctypes.c_int),
        ("restorer", ctypes.c_void_p),
    ]


class _Guard:
    """The installed handler's state, kept alive for the life of the process: the JIT engine that
    holds its code, the table and messages it reads, and the action it restores."""

    def __init__(self):
        self.table = (ctypes.c_uint64 * (SLOTS * _ROW))()
        self.previous = _Sigaction()  # filled by the sigaction() that installs the handler
        self.messages: list[ctypes.Array | None] = [None] * SLOTS  # slot -> its message, until reused
        self.free = list(range(SLOTS - 1, -1, -1))
        self.engine = None


# Registrations (the handler only reads the table, without it). Re-entrant: an allocation inside
# may run the garbage collector, whose finalizers strike other mappings off in this same thread.
_lock = threading.RLock()
_guard: _Guard | None = None
_failure: str | None = None  # why the handler is not installed, once an install was tried and failed


def _after_fork() -> None:
    global _lock
    _lock = threading.RLock()  # a fork in the middle of a registration leaves the child's copy taken


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_after_fork)


def installed() -> bool:
    """Whether the handler is installed in this process (it is at the first mapping)."""
    return _guard is not None


def failure() -> str | None:
    """Why installing the handler failed (the files are then read unguarded), or None."""
    return _failure


def guarded() -> list[tuple[int, int, bytes]]:
    """The registered mappings: (start, end, the line the handler would write), by slot."""
    with _lock:
        if _guard is None:
            return []
        t = _guard.table
        return [
            (t[s * _ROW], t[s * _ROW + 1], _guard.messages[s].raw[: t[s * _ROW + 3]])
            for s in range(SLOTS)
            if t[s * _ROW + 1]
        ]


def observe(path: str, address: int, length: int):
    """SafetensorsFile's MAP_OBSERVERS hook: register [address, address + length) under `path`
    (installing the handler at the first call); the callable returned strikes it off. Never
    raises: a mapping it cannot guard (another OS, a full table, a failed install) is read
    unguarded, and None is returned."""
    global _guard, _failure
    if not _SUPPORTED:
        return None
    message = ctypes.create_string_buffer(b"unweight: " + _printable(path) + _MESSAGE)  # (before the lock)
    with _lock:
        if _guard is None:
            if _failure is not None:
                return None
            try:
                _guard = _install()
            except Exception as e:  # noqa: BLE001 (no guard is no worse than before: the file is still read)
                _failure = f"{e.__class__.__name__}: {e}"
                return None
        g = _guard
        if not g.free:
            return None
        slot = g.free.pop()
        g.messages[slot] = message  # (the one it replaces was struck off with its range)
        page = os.sysconf("SC_PAGE_SIZE")
        row = slot * _ROW
        # start before end and end before start when struck off: a half-written row (end 0)
        # matches no address, whatever the handler reads in between
        g.table[row + 2] = ctypes.addressof(message)
        g.table[row + 3] = len(message) - 1  # (without the NUL)
        g.table[row] = address
        g.table[row + 1] = address + -(-length // page) * page  # the mapping covers whole pages
    return functools.partial(_strike_off, g, slot)


def _strike_off(g: _Guard, slot: int) -> None:
    with _lock:
        g.table[slot * _ROW + 1] = 0
        g.table[slot * _ROW] = 0
        g.free.append(slot)


def _printable(path: str) -> bytes:
    """The absolute path as bytes, control bytes as \\xNN, so that the message stays one line."""
    return _CONTROL.sub(lambda m: b"\\x%02x" % m[0][0], os.fsencode(os.path.abspath(path)))


def _install() -> _Guard:
    """Compile the handler and make it SIGBUS's action; the previous one is kept for it to restore."""
    from llvmlite import binding as llvm  # loaded already wherever a checkpoint is decoded (numba)

    g = _Guard()
    libc = ctypes.CDLL(None, use_errno=True)
    funcs = {
        name: ctypes.cast(getattr(libc, name), ctypes.c_void_p).value
        for name in ("write", "_exit", "sigaction", "raise")
    }
    ir_text = _handler_ir(ctypes.addressof(g.table), ctypes.addressof(g.previous), funcs)
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    machine = llvm.Target.from_default_triple().create_target_machine(opt=0)
    module = llvm.parse_assembly(ir_text)
    module.verify()
    g.engine = llvm.create_mcjit_compiler(module, machine)
    g.engine.finalize_object()
    action = _Sigaction(handler=g.engine.get_function_address("unweight_sigbus"), flags=_SA_SIGINFO | _SA_ONSTACK)
    libc.sigaction.argtypes = (ctypes.c_int, ctypes.POINTER(_Sigaction), ctypes.POINTER(_Sigaction))
    if libc.sigaction(signal.SIGBUS, ctypes.byref(action), ctypes.byref(g.previous)) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return g


def _handler_ir(table: int, previous: int, funcs: dict[str, int]) -> str:
    """void unweight_sigbus(int sig, siginfo_t *info, void *context) as LLVM IR: the addresses of
    the table, the saved action and the libc functions are constants in the code."""
    from llvmlite import ir

    i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
    p8, p64 = i8.as_pointer(), i64.as_pointer()
    module = ir.Module(name="unweight_mapguard")
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [i32, p8, p8]), name="unweight_sigbus")
    fn.attributes.add("nounwind")
    _, info, _ = fn.args
    entry, loop, step, found, write, written, die, other, resend, back = (
        fn.append_basic_block(n)
        for n in ("entry", "loop", "step", "found", "write", "written", "die", "other", "resend", "back")
    )
    b = ir.IRBuilder(entry)

    def const(v, t=i64):
        return ir.Constant(t, v)

    def libc(name, ret, *args):
        return b.inttoptr(const(funcs[name]), ir.FunctionType(ret, list(args)).as_pointer())

    def field(ptr, offset, t):
        return b.load(b.bitcast(b.gep(ptr, [const(offset)]), t.as_pointer()))

    # entry: a fault at an address (BUS_ADRERR) is looked up; anything else goes to `other`
    code = field(info, _SI_CODE, i32)
    addr = field(info, _SI_ADDR, i64)
    rows = b.inttoptr(const(table), p64)
    b.cbranch(b.icmp_signed("==", code, const(_BUS_ADRERR, i32)), loop, other)

    # loop: slot i holds addr when start <= addr < end (a free slot has end 0)
    b.position_at_end(loop)
    i = b.phi(i64)
    i.add_incoming(const(0), entry)
    row = b.gep(rows, [b.mul(i, const(_ROW))])
    start, end = b.load(row), b.load(b.gep(row, [const(1)]))
    hit = b.and_(b.icmp_unsigned("<=", start, addr), b.icmp_unsigned("<", addr, end))
    b.cbranch(hit, found, step)
    b.position_at_end(step)
    nxt = b.add(i, const(1))
    i.add_incoming(nxt, step)
    b.cbranch(b.icmp_unsigned("<", nxt, const(SLOTS)), loop, other)

    # found: write the row's message to fd 2 (again after a partial write), then _exit
    b.position_at_end(found)
    msg = b.inttoptr(b.load(b.gep(row, [const(2)])), p8)
    size = b.load(b.gep(row, [const(3)]))
    b.branch(write)
    b.position_at_end(write)
    at, left = b.phi(p8), b.phi(i64)
    at.add_incoming(msg, found)
    left.add_incoming(size, found)
    n = b.call(libc("write", i64, i32, p8, i64), [const(2, i32), at, left])
    b.cbranch(b.icmp_signed(">", n, const(0)), written, die)  # an error (EINTR included): give up the line
    b.position_at_end(written)
    rest = b.sub(left, n)
    at.add_incoming(b.gep(at, [n]), written)
    left.add_incoming(rest, written)
    b.cbranch(b.icmp_signed(">", rest, const(0)), write, die)
    b.position_at_end(die)
    b.call(libc("_exit", ir.VoidType(), i32), [const(EXIT_SHRANK, i32)])
    b.unreachable()

    # other: not ours; the previous action again, and the signal raised again if it was sent
    # (si_code <= 0: SI_USER, SI_TKILL, SI_QUEUE...), since returning re-runs only a fault
    b.position_at_end(other)
    sigaction = libc("sigaction", i32, i32, p8, p8)
    b.call(sigaction, [const(signal.SIGBUS, i32), b.inttoptr(const(previous), p8), ir.Constant(p8, None)])
    b.cbranch(b.icmp_signed("<=", code, const(0, i32)), resend, back)
    b.position_at_end(resend)
    b.call(libc("raise", i32, i32), [const(signal.SIGBUS, i32)])  # pending until this handler returns
    b.branch(back)
    b.position_at_end(back)
    b.ret_void()
    return str(module)
