"""`fast_frames.quick_stack`: inside it ``inspect.stack`` gives the records the standard one
gives (file, line, function, source lines, index) for every frame, and it is put back after."""

from __future__ import annotations

import inspect

from specpilot.kernels.fast_frames import quick_stack


def _records(context):
    return [(f.frame, f.filename, f.lineno, f.function, f.code_context, f.index) for f in inspect.stack(context)]


def _both(context):
    want = _records(context)
    with quick_stack():
        got = _records(context)
    return want, got


def test_quick_stack_gives_the_standard_records_and_is_restored():
    original = inspect.stack
    for context in (0, 1, 3):
        want, got = _both(context)
        assert len(want) == len(got) > 3
        # record 1 is _both, at the two lines that called _records; every other record is the same
        assert want[0][1:] == got[0][1:] and [w[1:] for w in want[2:]] == [g[1:] for g in got[2:]]
        assert want[1][1] == got[1][1] and want[1][3] == got[1][3] == "_both" and got[1][2] == want[1][2] + 2
    assert inspect.stack is original


def test_tvmscript_parses_under_it():
    from specpilot.schedules.tensor_core import nt_matmul
    assert "NT_matmul" in nt_matmul(32, 16).script()
