"""Hub access for `unweight compress REPO_ID` and `unweight plan REPO_ID`: the only code that reaches the Hub."""

from __future__ import annotations

import os

from unweight.errors import SourceError

# What a compressed mirror needs from a model repo: weights, configs, tokenizer, docs.
ALLOW_PATTERNS = ["*.safetensors", "*.json", "*.txt", "*.model", "*.tiktoken", "*.md", "*.py", "*.jinja"]


def resolve_source(repo_id: str, revision: str | None = None, patterns: list[str] | None = None) -> str:
    """A local folder holding `repo_id` at `revision` (the files matching `patterns`, by default
    what a compressed mirror needs), downloaded or taken from the HF cache.

    Honours HF_HUB_OFFLINE (then only the local cache is used) and HF_HOME / HF_HUB_CACHE.
    """
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError as e:  # pragma: no cover - huggingface_hub is a dependency
        raise SourceError(f"{repo_id}: huggingface_hub is needed to fetch from the Hub ({e})") from None
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=patterns or ALLOW_PATTERNS)
    except RepositoryNotFoundError:
        raise SourceError(
            f"{repo_id}: no such model on the Hub (or it is private: log in with `hf auth login`)"
        ) from None
    except LocalEntryNotFoundError:
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        why = (
            "HF_HUB_OFFLINE is set and it is not in the local cache"
            if offline
            else "not in the local cache and the Hub cannot be reached"
        )
        raise SourceError(f"{repo_id}: {why}; pass a local folder instead") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise SourceError(f"{repo_id}: cannot fetch from the Hub ({e.__class__.__name__}: {e})") from None
