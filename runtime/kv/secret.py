"""The control secret that authenticates the two ends of a KV hand-off: read from a file only its
owner can read, and the keys derived from it. `unweight serve`'s router and workers share one
(runtime/serve), and so do a prefill and a decode vLLM engine with UnweightConnector
(runtime/vllm/kv_connector.py, `secret_file` in kv_connector_extra_config).

Each use has its own key (HMAC-SHA256 of the secret under a label), so a proof made for one never
serves another. A proof answers the peer's fresh nonce with an HMAC bound to who answers and to its
own nonce (`proof`): it cannot be replayed, reflected back, or made without the key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

MIN_SECRET_CHARS = 32
NONCE_BYTES = 32


def new_secret() -> str:
    return secrets.token_hex(32)


def read_secret_file(path: str | os.PathLike) -> str:
    """The control secret from a file only its owner can read (one line, >= 32 characters)."""
    try:
        st = os.stat(path)
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(
                f"control secret file {path} is readable by group or others (mode {stat.S_IMODE(st.st_mode):o}); run "
                f"chmod 600 {path}"
            )
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read control secret file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"control secret file {path} is not text") from None
    lines = [line.strip() for line in lines if line.strip()]
    if len(lines) != 1 or len(lines[0]) < MIN_SECRET_CHARS:
        raise ValueError(
            f"control secret file {path} must hold one line of at least {MIN_SECRET_CHARS} characters (make one: "
            f"python -c 'import secrets; print(secrets.token_hex(32))' > {path}; chmod 600 {path})"
        )
    return lines[0]


def kv_link_key(secret: str) -> bytes:
    """The key with which a prefill and a decode worker of `unweight serve` prove to each other, over
    a new KV group, that both hold the control secret (runtime/serve/kv_link.py)."""
    return hmac.new(secret.encode(), b"unweight serve kv link", hashlib.sha256).digest()


def connector_key(secret: str) -> bytes:
    """The key with which a prefill and a decode vLLM engine's UnweightConnector prove to each other,
    on each side-channel connection, that both hold the secret (runtime/kv/side_channel.py)."""
    return hmac.new(secret.encode(), b"unweight vllm kv connector", hashlib.sha256).digest()


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(key: bytes, who: str, challenge: bytes, own_nonce: bytes) -> bytes:
    """What `who` answers to the peer's `challenge` (its nonce), bound to `who`'s own nonce."""
    return hmac.new(key, f"proof/{who}/".encode() + challenge + own_nonce, hashlib.sha256).digest()
