"""The code passes ruff's checks and is as ruff formats it (pyproject.toml [tool.ruff]): 120
columns, pyflakes, bugbear, import order, and every blind `except` saying why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_ruff_check():
    r = ruff("check", "--output-format", "concise", ".")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_ruff_format():
    r = ruff("format", "--check", ".")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
