"""Snapshot / rollback and truncation of the reference model's state."""

from __future__ import annotations

import pytest
import torch

from specpilot.core.errors import SpecPilotError
from tests.conftest import DENSE, HYBRID, tiny_model


@pytest.mark.parametrize("arch", [DENSE, HYBRID])
def test_snapshot_restore_reproduces_logits(arch):
    model = tiny_model(arch, seed=4)
    state = model.new_state(64)
    model.forward([1, 2, 3, 4, 5], state)
    snap = state.snapshot()
    first = model.forward([9, 8, 7], state)
    model.forward([100, 101], state)           # wander off
    state.restore(snap)
    assert state.length == 5
    assert torch.equal(model.forward([9, 8, 7], state), first)


@pytest.mark.parametrize("arch", [DENSE, HYBRID])
def test_truncate_to_any_recorded_length(arch):
    model = tiny_model(arch, seed=4)
    tokens = [3, 14, 15, 92, 65, 35, 89, 79]
    state = model.new_state(64)
    model.forward(tokens[:3], state)
    model.forward(tokens[3:], state, record=True)
    for keep in (8, 6, 4, 3):
        state.truncate(keep)
        fresh = model.new_state(64)
        want = model.forward(tokens[:keep] + [7], fresh)[-1]
        got = model.forward([7], state)[-1]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        state.truncate(keep)  # undo the probe: the recorded state at `keep` is still held
        assert state.length == keep


def test_truncate_without_record_is_refused_for_recurrent_layers():
    model = tiny_model(HYBRID)
    state = model.new_state(64)
    model.forward([1, 2, 3, 4], state)
    with pytest.raises(SpecPilotError, match="not recorded"):
        state.truncate(2)


def test_dense_truncate_needs_no_record():
    model = tiny_model(DENSE)
    state = model.new_state(64)
    model.forward([1, 2, 3, 4], state)
    state.truncate(2)
    assert state.length == 2


def test_capacity_is_enforced_with_a_clear_error():
    model = tiny_model(DENSE)
    state = model.new_state(16)
    with pytest.raises(SpecPilotError, match="max_seq_len=16"):
        model.forward(list(range(17)), state)
