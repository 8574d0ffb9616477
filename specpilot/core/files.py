"""Files written whole or not at all: a crash mid-write leaves the previous version, never half a file."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def _replacing(path: Path | str):
    """(fd, name) of a temporary file beside ``path`` with the permissions open() would give it (not
    mkstemp's 0600), renamed over ``path`` when the block ends and removed when it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        yield fd, tmp
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename it over ``path``."""
    with _replacing(path) as (fd, _), os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path | str, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_save_tensors(path: Path | str, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """safetensors' ``save_file`` into a temporary file beside ``path``, then renamed over it."""
    from safetensors.torch import save_file
    with _replacing(path) as (fd, tmp):
        os.close(fd)
        save_file(tensors, tmp, metadata=metadata)


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
