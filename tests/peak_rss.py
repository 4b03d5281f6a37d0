"""A command's own peak RSS, for the memory tests and benchmark. Test support only: the package
does not ship it."""

from __future__ import annotations

import os
import subprocess
import sys

# Linux carries a process's peak RSS across exec, and a child started with vfork (what subprocess
# uses) inherits at its exec the peak of the process it came from: a command started from a large
# process (pytest, a benchmark that built its inputs) would report that process's peak. So a small
# trampoline forks the command (the child then starts from the trampoline's few MiB) and reports
# the command's own peak.
_TRAMPOLINE = """
import os, resource, sys
limit, report, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
pid = os.fork()
if pid == 0:
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.execv(args[0], args)
_, status, usage = os.wait4(pid, 0)
with open(report, "w") as f:
    f.write(str(usage.ru_maxrss * 1024))
sys.exit(os.waitstatus_to_exitcode(status) % 256)
"""


def run_measured(args: list, limit_as: int | None = None, env: dict | None = None) -> tuple[int, int, str, str]:
    """(exit status, peak RSS in bytes, stdout, stderr) of the command `args` (args[0] a path),
    optionally under an RLIMIT_AS of `limit_as` bytes; the peak is the command's own."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, tempfile.TemporaryDirectory() as td:
        report = os.path.join(td, "peak")
        argv = [sys.executable, "-c", _TRAMPOLINE, str(limit_as or 0), report, *map(str, args)]
        r = subprocess.run(argv, stdout=out, stderr=err, text=True, env=env)
        out.seek(0)
        err.seek(0)
        with open(report) as f:
            peak = int(f.read())
        return r.returncode, peak, out.read(), err.read()
