"""`runtime.heap`: a decoding loop runs with the heap alive at its start frozen and gives it back after;
a full collection inside reclaims cycles among the frozen objects (a dropped state's cache row)."""

from __future__ import annotations

import gc
import weakref

from specpilot.runtime import heap


class _Node:
    pass


def _cycle(freed: list):
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    weakref.finalize(a, freed.append, "a")
    return a


def test_the_heap_is_frozen_inside_and_given_back_after():
    assert gc.get_freeze_count() == 0
    before = _cycle(freed := [])
    with heap.frozen():
        assert gc.get_freeze_count() > 0
        with heap.frozen():                      # an inner loop leaves the outer one's freeze alone
            pass
        assert gc.get_freeze_count() > 0
        del before
        gc.collect()
        assert freed == []                       # frozen: not reclaimed by the collector's passes
        heap.collect()
        assert freed == ["a"]                    # a full collection reaches it
        assert gc.get_freeze_count() > 0         # and leaves the heap frozen
    assert gc.get_freeze_count() == 0


def test_a_loop_that_raises_still_gives_the_heap_back():
    try:
        with heap.frozen():
            raise ValueError("a failed pass")
    except ValueError:
        pass
    assert gc.get_freeze_count() == 0
    young = _cycle(freed := [])
    del young
    heap.collect()
    assert freed == ["a"]
