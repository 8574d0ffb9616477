"""A quick ``inspect.stack`` for TVMScript parsing.

TVM 0.27's TVMScript decorators call ``inspect.stack()`` for every function they parse, to find
the caller's frames.  The standard version resolves every frame's module through
``inspect.getmodule``, which scans ``sys.modules`` each time: with torch loaded, ~0.18 s per
parsed function.  Importing ``tvm.s_tir.tensor_intrin`` parses 508 of them (50-150 s; measured
with cProfile: 88 of 97 s in ``getmodule``), and every kernel factory pays it too.  Inside
`quick_stack()` ``inspect.stack`` builds the same frame records from the frames themselves
(file name from the code object, source lines from ``linecache``), which is all the parser reads
(frames, their locals, function names, the source line of a decorator).  ``inspect.getouterframes``
too: each ``T.macro`` expansion calls it to find its parser.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import sys
import threading

_lock = threading.RLock()


def _stack(context: int = 1) -> list[inspect.FrameInfo]:
    return _outer(sys._getframe(1), context)


def _outer(frame, context: int = 1) -> list[inspect.FrameInfo]:
    """``inspect.getouterframes(frame, context)``: ``frame``'s record and its callers', innermost first."""
    out = []
    while frame is not None:
        filename, lineno = frame.f_code.co_filename, frame.f_lineno or 1
        source = linecache.getlines(filename) if context > 0 else []
        if source:                  # the window inspect.getframeinfo takes
            start = max(0, min(lineno - 1 - context // 2, len(source) - context))
            lines, index = source[start:start + context], lineno - 1 - start
        else:                       # no context asked, or no source (stdin, exec)
            lines, index = None, None
        out.append(inspect.FrameInfo(frame, filename, lineno, frame.f_code.co_name, lines, index))
        frame = frame.f_back
    return out


@contextlib.contextmanager
def quick_stack():
    """``inspect.stack`` is `_stack` and ``inspect.getouterframes`` `_outer` inside (re-entrant;
    restored on exit)."""
    with _lock:
        saved = inspect.stack, inspect.getouterframes
        inspect.stack, inspect.getouterframes = _stack, _outer
        try:
            yield
        finally:
            inspect.stack, inspect.getouterframes = saved
