"""The Python heap around a decoding loop.  A loaded system holds some 250k long-lived objects (torch's,
TVM's, the build's tables) and a batched loop allocates many small ones a pass (tree nodes, paths,
choices); each time the cyclic collector runs its oldest generation it walks all of them, most of a
batched tree pass's level expansions on the CPU machine.  `frozen` takes the objects alive at a
loop's start out of the collector's passes while the loop runs (`gc.freeze`) and gives them back after it;
`collect` reclaims cycles among them too (a cache row that a dropped state in a cycle still holds)."""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def frozen():
    """The heap as it is frozen for the block; nothing where it is frozen already (an outer loop's)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def collect() -> None:
    """A full collection, frozen objects included; inside `frozen`, everything alive after it is frozen
    until the block ends (the cycles formed later wait for the next call or the block's end)."""
    was_frozen = gc.get_freeze_count() > 0
    if was_frozen:
        gc.unfreeze()
    gc.collect()
    if was_frozen:
        gc.freeze()
