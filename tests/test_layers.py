"""The dependency rule: cli -> runtime -> unweight (codec core) -> formats, rooms inside runtime/ that point
down (docs/architecture.md), and no import circle.

Every import is seen: at module level or inside functions, absolute or relative (resolved against
the file's package, as Python resolves it), and a string that is a module's name (an argv item of
`python -m unweight.cli.main`, an `importlib.import_module` argument) counts as an import of it.
The package's facade (unweight/__init__.py: `unweight.load`, `unweight.generate`) is the one file
of the library that reaches the runtime, inside its functions only.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)
# source folder -> the package it installs as (pyproject.toml's package-dir)
PACKAGES = {"formats": "unweight.formats", "runtime": "unweight.runtime", "cli": "unweight.cli", "unweight": "unweight"}
MODULE_NAME = re.compile(r"unweight(?:\.\w+)+")


def package_of(path: Path) -> str:
    rel = path.relative_to(REPO)
    parts = [PACKAGES[rel.parts[0]], *rel.parts[1:-1]]
    return ".".join(parts)


def imports_of(folder: str) -> dict[str, set[str]]:
    """file -> absolute names of the modules it imports, in any way listed in the module docstring."""
    out = {}
    for path in (REPO / folder).rglob("*.py"):
        package, mods = package_of(path), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                    mods |= {f"{mod}.{a.name}" for a in node.names} if node.module is None else {mod}
                else:
                    mods.add(node.module)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.fullmatch(node.value):
                mods.add(node.value)
        out[str(path.relative_to(REPO))] = mods
    return out


def top(mod: str) -> str:
    return mod.split(".")[0]


def ours(mods: set[str], *layers: str) -> set[str]:
    """The modules among `mods` that belong to any of our `layers` (unweight.runtime, ...)."""
    return {m for m in mods if any(m == layer or m.startswith(layer + ".") for layer in layers)}


def test_the_resolver_sees_relative_and_string_imports():
    mods = imports_of("runtime/serve")["runtime/serve/worker.py"]
    assert (
        "unweight.runtime.serve.kv_link" in mods and "unweight.runtime.model.loader" in mods
    )  # from .kv_link, from ..loader
    assert (
        "unweight.runtime.serve.worker" in imports_of("runtime/serve")["runtime/serve/router.py"]
    )  # "-m unweight.runtime.serve.worker"


def test_formats_uses_only_stdlib_and_numpy():
    for f, mods in imports_of("formats").items():
        bad = {m for m in mods if top(m) not in STDLIB | {"numpy", "unweight"}} | (
            ours(mods, "unweight") - ours(mods, "unweight.formats")
        )
        assert not bad, f"{f} imports {bad}"


def test_codec_core_is_cpu_only():
    # llvmlite is numba's code generator (the AVX2 kernels are its IR); isal and zlib_ng only give CRC-32
    allowed = STDLIB | {"numpy", "numba", "llvmlite", "zstandard", "isal", "zlib_ng", "unweight"}
    for f, mods in imports_of("unweight/codec").items():
        bad = {m for m in mods if top(m) not in allowed} | ours(mods, "unweight.runtime", "unweight.cli")
        assert not bad, f"{f} imports {bad}"


def test_library_never_imports_runtime_or_cli():
    for f, mods in imports_of("unweight").items():
        bad = ours(mods, "unweight.cli") | {m for m in mods if top(m) in {"typer", "rich", "triton"}}
        if f != "unweight/__init__.py":  # the facade (next test)
            bad |= ours(mods, "unweight.runtime")
        if f != "unweight/hub.py":  # the only code that reaches the Hub, imported by the facade for a Hub id only
            bad |= {m for m in mods if top(m) == "huggingface_hub"}
        assert not bad, f"{f} imports {bad}"


def test_the_facade_reaches_the_runtime_only_lazily():
    """unweight/__init__.py is the one library file that may name the runtime (load, generate...),
    inside functions, so that importing the package stays light."""
    tree = ast.parse((REPO / "unweight/__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            assert not any("runtime" in n or "cli" in n for n in names), ast.dump(node)


ON_TOP = ("generate", "threads", "warmup", "serve", "vllm", "transformers")  # runtime/ beside its three rooms


def test_runtime_rooms_point_down():
    """Inside runtime/: kernels <- layers <- model, and what is built on them (ON_TOP) above all three;
    kv/ (the KV cache on the wire) below serve/ and vllm/, over none of the rest."""
    rt = "unweight.runtime"
    above = {
        "kernels": [f"{rt}.layers", f"{rt}.model", *(f"{rt}.{t}" for t in ON_TOP)],
        "layers": [f"{rt}.model", *(f"{rt}.{t}" for t in ON_TOP)],
        "model": [f"{rt}.{t}" for t in ON_TOP],
        # the KV cache on the wire: under serve/ and vllm/, over nothing of the runtime
        "kv": [f"{rt}.kernels", f"{rt}.layers", f"{rt}.model", *(f"{rt}.{t}" for t in ON_TOP)],
    }
    for room, forbidden in above.items():
        files = imports_of(f"runtime/{room}")
        assert files, room
        for f, mods in files.items():
            assert not ours(mods, *forbidden), f"{f} imports {ours(mods, *forbidden)}"
    loose = {p.name for p in (REPO / "runtime").glob("*.py")} - {"__init__.py"}
    assert loose == {f"{t}.py" for t in ON_TOP if (REPO / "runtime" / f"{t}.py").exists()}, loose


def module_graph() -> dict[str, set[str]]:
    """Each of our modules -> the modules of ours it imports, at module level or inside functions
    (`from pkg import mod` names the module mod, `from pkg import name` the package pkg)."""
    files = {}
    for folder in PACKAGES:
        for path in (REPO / folder).rglob("*.py"):
            name = package_of(path) if path.name == "__init__.py" else f"{package_of(path)}.{path.stem}"
            files[name] = path
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                for a in node.names:
                    deps |= {f"{base}.{a.name}"} if f"{base}.{a.name}" in files else {base} & files.keys()
        graph[name] = deps - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(comp)
    return found


def test_no_import_circle():
    """No module of ours reaches itself through imports, counting those inside functions (a lazy
    import hides a circle from Python, not from the reader)."""
    graph = module_graph()
    assert "unweight.codec.tensor_codec" in graph["unweight.codec"]  # `from .tensor_codec import ...`
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]  # the finder finds
    assert not circles(graph), circles(graph)


def test_every_package_folder_is_installed():
    """pyproject.toml lists every folder of ours that holds Python files (a wheel has only those)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {package_of(p) for folder in PACKAGES for p in (REPO / folder).rglob("*.py")}
    assert found == listed, (found - listed, listed - found)


def test_runtime_does_not_import_cli():
    for f, mods in imports_of("runtime").items():
        assert not ours(mods, "unweight.cli"), f"{f} imports {ours(mods, 'unweight.cli')}"


def test_import_is_light():
    """Importing the package loads neither torch, numba nor the CLI stack."""
    heavy = ("torch", "numba", "typer", "triton", "huggingface_hub")
    code = f"import sys, unweight; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"


def test_the_transformers_registration_loads_no_numba():
    """`import unweight` where transformers' quantizer registry is loaded (as in vLLM's processes)
    registers the quantizer without loading numba or llvmlite: vLLM's CPU worker scans every
    module's globals at start and fails on llvmlite's (runtime/vllm/plugin.py)."""
    code = (
        "import sys, transformers.quantizers.auto as auto, unweight; "
        "print('unweight' in auto.AUTO_QUANTIZER_MAPPING, sorted(m for m in ('numba', 'llvmlite') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "True []", r.stdout + r.stderr


def test_reading_does_not_import_writing():
    """The reader (unweight.open, get_tensor) and inspect load neither the compress / decompress /
    verify module nor the container writer's encoder."""
    code = (
        "import sys, unweight.reader, unweight.inspection; "
        "print(sorted(m for m in ('unweight.checkpoint', 'unweight.tensors') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]", r.stdout
