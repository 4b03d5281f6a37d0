"""formats/SPEC.md's worked example and its 15-line reader, run verbatim."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

import unweight
from unweight.codec import rans

SPEC = Path(__file__).resolve().parents[1] / "formats" / "SPEC.md"


def test_worked_example_bytes():
    values = np.array([0x3F80, 0xC000], dtype=np.uint16)  # 1.0, -2.0
    p = rans.RansParams.for_word(16, True, precision=10, chunk=1024)
    s = rans.encode(values, p, 1)
    assert bytes(s["table"]) == bytes.fromhex("fc 03 05 80 04 00 00 00 80 04".replace(" ", ""))
    assert bytes(s["raw"]) == bytes.fromhex("400000")
    assert len(s["words"]) == 0
    offsets = np.frombuffer(bytes(s["index"][:16]), "<u8")
    states = np.frombuffer(bytes(s["index"][16:]), "<u4")
    assert offsets.tolist() == [0, 0]
    assert states.tolist() == [131072, 131584] + [65536] * 6
    assert np.array_equal(rans.decode(s, p, 2, 1), values)


def test_spec_reader_runs_verbatim(tmp_path):
    code = re.search(r"## 7\..*?```python\n(.*?)```", SPEC.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(SPEC), "exec"), namespace)
    # A container whose tensors are all stored raw: tiny tensors where nothing else pays.
    tensors = {"a": torch.tensor([1.5, -2.0]), "b": torch.tensor(7, dtype=torch.int32)}
    path = tmp_path / "tiny.safetensors"
    unweight.save_file(tensors, path)
    got = {name: (dtype, shape, raw) for name, dtype, shape, raw in namespace["read_manifest"](path)}
    assert got["a"][:2] == ("F32", [2]) and got["a"][2] == tensors["a"].numpy().tobytes()
    assert got["b"][:2] == ("I32", []) and got["b"][2] == tensors["b"].numpy().tobytes()


def test_container_is_a_safetensors_file(tmp_path):
    from safetensors import safe_open

    path = tmp_path / "x.safetensors"
    unweight.save_file({"w": torch.randn(64, 64).to(torch.bfloat16)}, path)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        assert meta["format"] == "unweight" and meta["format_version"] == "2.1"
        assert set(f.keys()) == {"w", "w#table", "w#raw", "w#words", "w#index"}
        assert f.get_slice("w").get_shape() == [0]  # the placeholder (SPEC.md §1): no bytes
