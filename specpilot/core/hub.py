"""Models named as users name them: a Hugging Face id (``Qwen/Qwen3-8B``) resolved from the local
Hugging Face cache (``HF_HUB_CACHE`` / ``HF_HOME``), never from the network."""

from __future__ import annotations

import os
import re
from pathlib import Path

from specpilot.core.errors import CheckpointError

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def is_hub_id(text: str) -> bool:
    """``org/name`` that is not a path on this machine."""
    return bool(HUB_ID.match(text)) and not Path(text).expanduser().exists()


def _cache_dir() -> str | None:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None


def cached_snapshot(repo_id: str) -> Path:
    """The cached snapshot directory of ``repo_id`` (its main revision)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:   # the cache folder read now (huggingface_hub reads its environment once, at import)
        path = Path(snapshot_download(repo_id, local_files_only=True, cache_dir=_cache_dir()))
    except LocalEntryNotFoundError:
        raise CheckpointError(f"Hugging Face model {repo_id!r} is not in the local cache (HF_HUB_CACHE); download "
                              f"it first where there is network: `hf download {repo_id}`") from None
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: the cached snapshot of {repo_id!r} has no config.json (incomplete download?)")
    return path
