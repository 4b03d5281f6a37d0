"""The `unweight` command as a user runs it: a separate process, exit codes, one-line errors."""

from __future__ import annotations

import json

import torch

from helpers import random_bf16, run_cli, write_checkpoint


def test_compress_verify_inspect_decompress(minilm_dir, tmp_path):
    out = tmp_path / "uw"
    r = run_cli("compress", minilm_dir, out, "--json", "--threads", "2")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["total"]["saving_percent"] > 33.7
    assert set(summary["by_class"]) >= {"attention", "mlp", "embeddings"}
    r = run_cli("verify", out, "--against", minilm_dir)
    assert r.returncode == 0 and r.stdout.startswith("OK:"), r.stdout + r.stderr
    r = run_cli("inspect", out, "--json", "--plot", tmp_path / "exp.png")
    assert r.returncode == 0, r.stderr
    stats = {s["name"]: s for s in json.loads(r.stdout)}
    q = stats["encoder.layer.0.attention.self.query.weight"]
    assert q["codec"] == "rans" and 2.0 < q["exponent_entropy"] < 3.5 and 0 <= q["gap_to_bound"] < 0.1
    assert (tmp_path / "exp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = run_cli("inspect", out)  # one row per layer type: MiniLM's six layers' query weights are one row
    assert table.returncode == 0, table.stderr
    query = [line for line in table.stdout.splitlines() if "encoder.layer.*.attention.self.query.weight" in line]
    assert len(query) == 1 and " 6 " in query[0] and "encoder.layer.0." not in table.stdout and "total" in table.stdout
    per_tensor = run_cli("inspect", out, "--tensors")
    assert per_tensor.returncode == 0 and all(f"encoder.layer.{i}.attention.self.query.weight" in per_tensor.stdout for i in range(6))
    r = run_cli("decompress", out, tmp_path / "back")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (minilm_dir / "model.safetensors").read_bytes()


def one_line_error(r, *words: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert "Traceback" not in r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_errors_are_one_line(tmp_path):
    one_line_error(run_cli("compress", tmp_path / "missing", tmp_path / "o"), "no such")
    (tmp_path / "pickled").mkdir()
    torch.save({"w": torch.ones(2)}, tmp_path / "pickled" / "pytorch_model.bin")
    one_line_error(run_cli("compress", tmp_path / "pickled", tmp_path / "o"), "pytorch_model.bin", "pickle")
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    one_line_error(run_cli("compress", tmp_path / "junk.safetensors", tmp_path / "o"), "junk.safetensors", "JSON")
    src = write_checkpoint(tmp_path / "m" / "model.safetensors", {"w": random_bf16(64, 64)})
    one_line_error(run_cli("verify", src), "model.safetensors", "not an Unweight container")
    (tmp_path / "taken").mkdir()
    one_line_error(run_cli("compress", src.parent, tmp_path / "taken"), "already exists")
    one_line_error(run_cli("compress", src.parent, tmp_path / "o2", "--chunk", "1001"), "chunk")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o2").exists()


def test_verify_fails_on_damaged_file(tmp_path):
    src = write_checkpoint(tmp_path / "m" / "model.safetensors", {"w": random_bf16(256, 256)})
    out = tmp_path / "uw"
    assert run_cli("compress", src.parent, out, "-q").returncode == 0
    blob = bytearray((out / "model.safetensors").read_bytes())
    blob[-100] ^= 0xFF  # inside the last stream
    (out / "model.safetensors").write_bytes(bytes(blob))
    r = run_cli("verify", out)
    assert r.returncode == 1 and "MISMATCH" in r.stderr and "'w'" in r.stderr, r.stderr


def test_help_lists_commands():
    r = run_cli("--help")
    assert r.returncode == 0
    for cmd in ("compress", "decompress", "verify", "inspect"):
        assert cmd in r.stdout


HOSTILE = ["a[/]b", "[link=https://evil.example]click[/link]", "[bold]x", "esc\x1b]8;;https://evil.example\x07y", "two\nlines"]


def _run_on_a_terminal(*args) -> tuple[int, str, str]:
    """The CLI with stderr on a pseudo-terminal (so the progress bar draws); (rc, stdout, stderr)."""
    import os
    import pty
    import subprocess
    import sys
    import threading

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "unweight.cli.main", *map(str, args)], stdout=subprocess.PIPE, stderr=slave,
                            text=True, env={**os.environ, "COLUMNS": "200"})
    os.close(slave)
    chunks = []

    def drain():
        while True:
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: the child closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    stdout, _ = proc.communicate(timeout=600)
    t.join(60)
    os.close(master)
    return proc.returncode, stdout, b"".join(chunks).decode("utf-8", "replace")


def test_names_and_paths_are_text_not_markup(tmp_path):
    """Tensor names and paths holding rich markup or terminal escapes are printed literally: no
    crash after the output was written, no hyperlink, no terminal sequence, no extra line."""
    src = write_checkpoint(tmp_path / "m[/]x" / "model.safetensors", {n: random_bf16(64, 64, seed=i) for i, n in enumerate(HOSTILE)}).parent
    out = tmp_path / "uw[link=mailto:x]"
    rc, stdout, stderr = _run_on_a_terminal("compress", src, out, "--threads", "1")  # the progress bar shows tensor names
    assert rc == 0 and "Traceback" not in stdout + stderr, stdout + stderr
    title = "".join(stdout.split())  # the table's title wraps
    assert f"{src}→{out}" in title, stdout
    assert "\x1b]8" not in stdout + stderr, "a hyperlink reached the terminal"
    r = run_cli("inspect", out)
    assert r.returncode == 0, r.stderr
    for name in ("a[/]b", "[link=https://evil.example]click[/link]", "[bold]x", "esc\\x1b]8;;https://evil.example\\x07y", "two\\nlines"):
        assert name in r.stdout, (name, r.stdout)
    assert "\x1b" not in r.stdout
    (tmp_path / "back[").mkdir()
    r = run_cli("decompress", out, tmp_path / "back[/]x")
    assert r.returncode == 0 and r.stdout.strip() == f"wrote {len(HOSTILE)} tensors to {tmp_path / 'back[/]x'}", r.stdout + r.stderr
    blob = bytearray((out / "model.safetensors").read_bytes())
    blob[-100] ^= 0xFF
    (out / "model.safetensors").write_bytes(bytes(blob))
    r = run_cli("verify", out)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "\x1b" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"MISMATCH: {out / 'model.safetensors'}: tensor "), r.stderr
    one_line_error(run_cli("compress", tmp_path / "no[/]such\nfolder", tmp_path / "o"), "no[/]such\\nfolder")


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    import os

    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    for args in (("compress", fifo, tmp_path / "o"), ("compress", tmp_path, tmp_path / "o"), ("verify", fifo), ("inspect", fifo),
                 ("decompress", fifo, tmp_path / "o")):
        one_line_error(run_cli(*args, timeout=60), f"{fifo}: not a regular file (a FIFO)")
    assert not (tmp_path / "o").exists()
