"""The dependency rule of DESIGN.md §2: cli -> runtime -> unweight (codec core) -> formats."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)


def imports_of(folder: str) -> dict[str, set[str]]:
    """file -> absolute module names it imports at any level (module body or functions)."""
    out = {}
    for path in (REPO / folder).rglob("*.py"):
        mods = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods.add(node.module)
        out[str(path.relative_to(REPO))] = mods
    return out


def top(mod: str) -> str:
    return mod.split(".")[0]


def test_formats_uses_only_stdlib_and_numpy():
    for f, mods in imports_of("formats").items():
        bad = {m for m in mods if top(m) not in STDLIB | {"numpy"}}
        assert not bad, f"{f} imports {bad}"


def test_codec_core_is_cpu_only():
    # llvmlite is numba's code generator (the AVX2 kernels are its IR); isal and zlib_ng only give CRC-32
    allowed = STDLIB | {"numpy", "numba", "llvmlite", "zstandard", "isal", "zlib_ng", "unweight"}
    for f, mods in imports_of("unweight/codec").items():
        bad = {m for m in mods if top(m) not in allowed or m.startswith(("unweight.runtime", "unweight.cli"))}
        assert not bad, f"{f} imports {bad}"


def test_library_never_imports_cli_except_the_facade():
    for f, mods in imports_of("unweight").items():
        if f == "unweight/__init__.py":
            continue  # the facade resolves Hub ids through cli/hub.py, lazily
        bad = {m for m in mods if m.startswith("unweight.cli") or top(m) in {"typer", "rich", "huggingface_hub", "triton"}}
        assert not bad, f"{f} imports {bad}"


def test_runtime_does_not_import_cli():
    for f, mods in imports_of("runtime").items():
        assert not {m for m in mods if m.startswith("unweight.cli")}, f


def test_import_is_light():
    """Importing the package loads neither torch, numba nor the CLI stack."""
    code = "import sys, unweight; print(sorted(m for m in ('torch', 'numba', 'typer', 'triton') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"
