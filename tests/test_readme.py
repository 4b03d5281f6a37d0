"""The README's Python example, run verbatim on the real MiniLM folder."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example(minilm_dir, tmp_path, monkeypatch):
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    (tmp_path / "path" / "to").mkdir(parents=True)
    (tmp_path / "path" / "to" / "model").symlink_to(minilm_dir)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(README), "exec"), {})
    assert (tmp_path / "model-restored" / "model.safetensors").read_bytes() == (
        minilm_dir / "model.safetensors"
    ).read_bytes()


def test_readme_runtime_example(smollm2_uw, tmp_path, monkeypatch, capsys):
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[1]
    (tmp_path / "model-uw").symlink_to(smollm2_uw[0])
    monkeypatch.chdir(tmp_path)
    exec(compile("import unweight\n" + code, str(README), "exec"), {})
    assert capsys.readouterr().out.strip()  # it printed a completion


def test_readme_transformers_example(smollm2_uw, tmp_path, monkeypatch, capsys):
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[2]
    assert code.startswith("import unweight")
    (tmp_path / "model-uw").symlink_to(smollm2_uw[0])
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(README), "exec"), {})
    assert "Paris" in capsys.readouterr().out
