"""The `unweight` command as a user runs it: a separate process, exit codes, one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import random_bf16, run_cli, write_checkpoint


@pytest.mark.slow
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
    assert per_tensor.returncode == 0 and all(
        f"encoder.layer.{i}.attention.self.query.weight" in per_tensor.stdout for i in range(6)
    )
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


@pytest.mark.slow
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


@pytest.mark.slow
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


HOSTILE = [
    "a[/]b",
    "[link=https://evil.example]click[/link]",
    "[bold]x",
    "esc\x1b]8;;https://evil.example\x07y",
    "two\nlines",
]


def _run_on_a_terminal(*args) -> tuple[int, str, str]:
    """The CLI with stderr on a pseudo-terminal (so the progress bar draws); (rc, stdout, stderr)."""
    import os
    import pty
    import subprocess
    import sys
    import threading

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "unweight.cli.main", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=slave,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
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


@pytest.mark.slow
def test_names_and_paths_are_text_not_markup(tmp_path):
    """Tensor names and paths holding rich markup or terminal escapes are printed literally: no
    crash after the output was written, no hyperlink, no terminal sequence, no extra line."""
    src = write_checkpoint(
        tmp_path / "m[/]x" / "model.safetensors", {n: random_bf16(64, 64, seed=i) for i, n in enumerate(HOSTILE)}
    ).parent
    out = tmp_path / "uw[link=mailto:x]"
    rc, stdout, stderr = _run_on_a_terminal(
        "compress", src, out, "--threads", "1"
    )  # the progress bar shows tensor names
    assert rc == 0 and "Traceback" not in stdout + stderr, stdout + stderr
    title = "".join(stdout.split())  # the table's title wraps
    assert f"{src}→{out}" in title, stdout
    assert "\x1b]8" not in stdout + stderr, "a hyperlink reached the terminal"
    r = run_cli("inspect", out)  # by layer type: the names are the types
    assert r.returncode == 0 and "\x1b" not in r.stdout, r.stderr
    assert "a[/]b" in r.stdout and "[link=https://evil.example]click[/link]" in r.stdout, r.stdout
    r = run_cli("inspect", out, "--tensors")
    assert r.returncode == 0, r.stderr
    for name in (
        "a[/]b",
        "[link=https://evil.example]click[/link]",
        "[bold]x",
        "esc\\x1b]8;;https://evil.example\\x07y",
        "two\\nlines",
    ):
        assert name in r.stdout, (name, r.stdout)
    assert "\x1b" not in r.stdout
    (tmp_path / "back[").mkdir()
    r = run_cli("decompress", out, tmp_path / "back[/]x")
    assert r.returncode == 0 and r.stdout.strip() == f"wrote {len(HOSTILE)} tensors to {tmp_path / 'back[/]x'}", (
        r.stdout + r.stderr
    )
    blob = bytearray((out / "model.safetensors").read_bytes())
    blob[-100] ^= 0xFF
    (out / "model.safetensors").write_bytes(bytes(blob))
    r = run_cli("verify", out)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "\x1b" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"MISMATCH: {out / 'model.safetensors'}: tensor "), r.stderr
    one_line_error(run_cli("compress", tmp_path / "no[/]such\nfolder", tmp_path / "o"), "no[/]such\\nfolder")


@pytest.mark.slow
def test_a_fifo_is_refused_not_waited_on(tmp_path):
    import os

    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    for args in (
        ("compress", fifo, tmp_path / "o"),
        ("compress", tmp_path, tmp_path / "o"),
        ("verify", fifo),
        ("inspect", fifo),
        ("decompress", fifo, tmp_path / "o"),
    ):
        one_line_error(run_cli(*args, timeout=60), f"{fifo}: not a regular file (a FIFO)")
    assert not (tmp_path / "o").exists()


def _hand_made_safetensors(path, tensors: dict) -> None:
    """A safetensors file written byte by byte: {name: (dtype, shape, raw bytes)} in name order."""
    import struct

    header, cursor = {}, 0
    for name, (dtype, shape, raw) in sorted(tensors.items()):
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [cursor, cursor + len(raw)]}
        cursor += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        struct.pack("<Q", len(head)) + head + b"".join(raw for _, _, raw in (tensors[n] for n in sorted(tensors)))
    )


@pytest.mark.slow
def test_newer_safetensors_dtypes_are_stored_bit_exact(tmp_path):
    """F4, F6_*, F8_E8M0, the FNUZ float8s and C64 (dtypes safetensors 0.8 accepts and the codec has
    no model of) are stored with zstd or raw, said so in the summary, and come back bit for bit."""
    import numpy as np
    from safetensors import safe_open

    import unweight

    g = np.random.default_rng(3)
    raw = lambda n: g.integers(0, 256, n, dtype=np.uint8).tobytes()  # noqa: E731
    tensors = {
        "scales": ("F8_E8M0", [300], raw(300)),
        "rot": ("C64", [64, 5], raw(64 * 5 * 8)),
        "w4": ("F4", [64, 7], raw(64 * 7 // 2)),
        "w6": ("F6_E2M3", [4, 100], raw(4 * 100 * 6 // 8)),
        "w6b": ("F6_E3M2", [8], raw(6)),
        "fnuz": ("F8_E4M3FNUZ", [1000], raw(1000)),
        "fnuz5": ("F8_E5M2FNUZ", [1000], raw(1000)),
        "zeros": ("F8_E8M0", [4096], bytes(4096)),  # compressible: zstd
        "w": ("BF16", [64, 64], random_bf16(64, 64).view(torch.int16).numpy().tobytes()),
    }
    src = tmp_path / "m" / "model.safetensors"
    _hand_made_safetensors(src, tensors)
    with safe_open(src, "np") as f:  # what HF safetensors itself accepts
        assert sorted(f.keys()) == sorted(tensors)
    out = tmp_path / "uw"
    r = run_cli("compress", src.parent, out, "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    codecs = {t["name"]: t["codec"] for t in summary["tensors"]}
    assert (
        codecs["w"] == "rans"
        and codecs["zeros"] == "zstd"
        and all(codecs[n] in ("zstd", "raw") for n in tensors if n != "w")
    ), codecs
    assert any(n.startswith("2 F8_E8M0 tensors (4,396 bytes) stored with") for n in summary["notes"]), summary["notes"]
    assert {n.split()[1] for n in summary["notes"]} == {
        "C64",
        "F4",
        "F6_E2M3",
        "F6_E3M2",
        "F8_E4M3FNUZ",
        "F8_E5M2FNUZ",
        "F8_E8M0",
    }
    r = run_cli("compress", src.parent, tmp_path / "uw2")
    assert r.returncode == 0 and "note: 1 C64 tensor (2,560 bytes) stored with" in r.stderr, r.stderr
    r = run_cli("verify", out, "--against", src.parent)
    assert r.returncode == 0 and r.stdout.startswith("OK:"), r.stdout + r.stderr
    r = run_cli("inspect", out, "--json")
    assert r.returncode == 0, r.stderr
    stats = {s["name"]: s for s in json.loads(r.stdout)}
    assert stats["w4"]["order0_bound"] is None and stats["w4"]["bits_per_weight"] == 4.0  # raw: 4 bits each
    assert stats["zeros"]["order0_bound"] == 0.0 and stats["scales"]["order0_bound"] > 7.0
    r = run_cli("decompress", out, tmp_path / "back")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == src.read_bytes()
    with unweight.open(out) as ckpt:
        for name, (_dtype, _shape, data) in tensors.items():
            assert ckpt.get_bytes(name).tobytes() == data, name
        for name, torch_dtype in (
            ("scales", torch.float8_e8m0fnu),
            ("rot", torch.complex64),
            ("fnuz", torch.float8_e4m3fnuz),
        ):
            t = ckpt.get_tensor(name)
            assert t.dtype == torch_dtype and list(t.shape) == tensors[name][1]
            assert t.reshape(-1).view(torch.uint8).numpy().tobytes() == tensors[name][2], name
        with __import__("pytest").raises(TypeError, match=f"{out / 'model.safetensors'}: tensor 'w4' is F4, which"):
            ckpt.get_tensor("w4")
    # save_file / load_file take the torch dtypes among them.
    c = torch.randn(33, 3, dtype=torch.complex64)
    unweight.save_file({"c": c, "s": torch.ones(5).to(torch.float8_e8m0fnu)}, tmp_path / "c.safetensors")
    back = unweight.load_file(tmp_path / "c.safetensors")
    assert back["c"].dtype == torch.complex64 and torch.equal(back["c"].view(torch.uint8), c.view(torch.uint8))
    # Sub-byte elements must fill whole bytes (safetensors' rule): named, typed, one line.
    _hand_made_safetensors(tmp_path / "odd" / "model.safetensors", {"w4": ("F4", [3], raw(2))})
    one_line_error(
        run_cli("compress", tmp_path / "odd", tmp_path / "o"),
        "model.safetensors",
        "'w4'",
        "12 bits, not a whole number of bytes",
    )
