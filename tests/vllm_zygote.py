"""Runs tests/vllm_driver.py jobs in children forked from one process that has imported vLLM: each
driver process otherwise spends most of its fixed cost importing vLLM (10 to 14 s of about 22 s on
a 2-core CI host), and tests/test_vllm.py starts about 25 of them. It runs in the vLLM virtual
environment, as the driver does. No engine runs here, so vLLM still reads its environment variables
lazily and each child sees its job's; a child's tensor-parallel workers are spawned afresh, as
vLLM-CPU always spawns them.

One job per line on stdin, {"argv": [...], "env": {...}, "log": PATH}: the child's stdout and stderr
go to PATH; this process answers {"pid": N} when the child starts and {"rc": N} when it ends.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_driver  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402, F401  what the children share


def child(job: dict) -> None:
    os.setpgid(0, 0)  # the caller ends a job that outlives its timeout, and any workers it started, as a group
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(job["env"])  # over this process's own: a .pth file here sets NUMBA_CACHE_DIR as it starts
    sys.argv = [vllm_driver.__file__, *job["argv"]]
    vllm_driver.main()  # an exception ends the child as it would end the driver: a traceback and status 1


def serve() -> None:
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(job)
            sys.exit(0)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
