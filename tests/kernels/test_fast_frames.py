"""`fast_frames.quick_stack`: inside it ``inspect.stack`` and ``inspect.getouterframes`` give the
records the standard ones give (file, line, function, source lines, index) for every frame, and
they are put back after."""

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


def _outer_records(frame, context):
    return [(f.frame, f.filename, f.lineno, f.function, f.code_context, f.index)
            for f in inspect.getouterframes(frame, context)]


def _inner(context):
    frame = inspect.currentframe()
    want = _outer_records(frame, context)
    with quick_stack():
        got = _outer_records(frame, context)
    return want, got


def test_quick_outer_frames_are_the_standard_records_and_are_restored():
    original = inspect.getouterframes
    for context in (0, 1, 2, 5):
        want, got = _inner(context)
        assert len(want) == len(got) > 3 and want[1:] == got[1:]
        # record 0 is _inner itself, live: read at the two lines that called _outer_records
        assert want[0][:2] == got[0][:2] and want[0][3] == got[0][3] == "_inner" and got[0][2] == want[0][2] + 2
    assert inspect.getouterframes is original


def test_tvmscript_parses_under_it():
    from specpilot.schedules.tensor_core import nt_matmul
    assert "NT_matmul" in nt_matmul(32, 16).script()


def test_a_kernel_of_macros_parses_under_it():
    """The Gated DeltaNet kernels expand ``T.macro``s, each finding its parser in the outer frames."""
    from specpilot.kernels.gdn import gdn_commit
    assert "for d in range(depth)" in gdn_commit(2, 3, 8, 4, True).script()
