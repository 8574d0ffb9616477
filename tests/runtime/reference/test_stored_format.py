"""The ``stored`` weight format (weights kept in their dtype, converted at each use) against dense
weights converted once: the same tokens and margins, every architecture, biases included."""

from __future__ import annotations

import pytest
import torch

from specpilot.core.weights import random_weights
from specpilot.runtime.decoding import autoregressive
from specpilot.runtime.reference.model import ReferenceModel
from tests.conftest import TINY_CONFIGS, tiny_config


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_converting_at_use_equals_converting_once(arch):
    cfg = tiny_config(arch)
    weights = {k: v.to(torch.bfloat16) for k, v in random_weights(cfg, 3).items()}
    dense = ReferenceModel(cfg, weights, torch.float32)
    stored = ReferenceModel(cfg, weights, torch.float32, weight_format="stored")
    assert all(dict.__getitem__(stored.w, k).dtype == torch.bfloat16 for k in weights)
    a, b = (autoregressive(m, [1, 2, 3, 4, 5], 20, 64) for m in (dense, stored))
    assert a.tokens == b.tokens and a.margins == b.margins
