"""The CUDA runtime's last error, which TVM and torch share in one process (one libcudart).

TVM's pooled allocator recovers from a failed ``cudaMalloc`` by giving its free blocks back and
allocating again, but the failed call leaves ``cudaErrorMemoryAllocation`` as the runtime's last
error; torch's next kernel-launch check reads it back and raises "CUDA error: out of memory"
(``torch.AcceleratorError``) where nothing is out of memory any more.  `LastError.check` runs after
each call of a build's function on the GPU: a recovered allocation's error is cleared (and counted),
any other error is raised there, with the function's name."""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache
from pathlib import Path

from specpilot.core.errors import SpecPilotError

ALLOCATION = 2          # cudaErrorMemoryAllocation
log = logging.getLogger(__name__)


class LastError:
    """``cudaGetLastError`` (which reads and clears the calling thread's last error) of a libcudart."""

    def __init__(self, library):
        self._get = library.cudaGetLastError
        self._get.restype = ctypes.c_int
        self._name = library.cudaGetErrorName
        self._name.restype = ctypes.c_char_p
        self._name.argtypes = [ctypes.c_int]
        self.recovered = 0

    def check(self, where: str) -> None:
        """Clear a recovered allocation's error left by ``where``; raise any other."""
        code = self._get()
        if code == 0:
            return
        if code == ALLOCATION:
            self.recovered += 1
            if self.recovered == 1:
                log.warning("%s: a device allocation failed and was retried after TVM's pool gave its free "
                            "blocks back; the error it left is cleared", where)
            return
        raise SpecPilotError(f"{where}: CUDA error {self._name(code).decode()} ({code})")

    def wrap(self, name: str, fn):
        """``fn`` (a build's function), checked after each call."""
        def call(*args):
            out = fn(*args)
            self.check(name)
            return out
        return call


def loaded_cudart(maps: str | None = None) -> str | None:
    """The path of the libcudart this process has loaded (from /proc/self/maps: the sixth field
    on, spaces kept, a deleted file's suffix dropped), or None."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
    for line in maps.splitlines():
        fields = line.split(None, 5)
        path = fields[5].removesuffix(" (deleted)") if len(fields) == 6 else ""
        if Path(path).name.startswith("libcudart.so"):
            return path
    return None


@lru_cache(maxsize=1)
def _found(path: str) -> LastError | None:
    try:
        return LastError(ctypes.CDLL(path))
    except (OSError, AttributeError) as e:
        log.warning("%s: cannot read CUDA's last error there (%s); allocation errors TVM recovers from may "
                    "reach torch", path, e)
        return None


def last_error() -> LastError | None:
    """The loaded libcudart's last error (one reader a library; None where none is loaded: a CPU
    process, or a GPU one before its runtime loads)."""
    path = loaded_cudart()
    return _found(path) if path else None
