"""Files written whole or not at all: a crash mid-write leaves the previous version, never half a file."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())       # what open() would have made, not mkstemp's 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path | str, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_save_tensors(path: Path | str, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """safetensors' ``save_file`` into a temporary file beside ``path``, then renamed over it."""
    from safetensors.torch import save_file
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        os.close(fd)
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def swap_in_dir(staging: Path, out_dir: Path) -> None:
    """Put a finished directory in place: a process killed before this leaves the previous one whole."""
    os.chmod(staging, 0o755)
    if not out_dir.exists():
        os.rename(staging, out_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    os.rename(out_dir, old / "previous")
    os.rename(staging, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def copy_tree_atomic(source: Path, out_dir: Path) -> None:
    """Copy the directory ``source`` to ``out_dir`` through a staging directory beside it (`swap_in_dir`)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent))
    try:
        shutil.copytree(source, staging, dirs_exist_ok=True)
        swap_in_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
