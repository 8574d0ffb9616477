"""The target's hidden states of a sequence's tokens, kept for drafters that read them.

A target built or loaded with feature layers (``model.feature_layers``: decoder-layer indices)
returns, for every token of every pass, the residual stream after each of those layers,
concatenated (the inputs of DFlash- and EAGLE-3-style drafters).  A sequence's
`FeatureStore` holds them by position like a KV cache: a pass writes its tokens' rows, a tree
verification keeps its accepted path's rows (`accept`), and the state's length says which rows
are the committed context's.
"""

from __future__ import annotations

import torch

from specpilot.core.errors import SpecPilotError


class FeatureStore:
    def __init__(self, capacity: int, width: int, dtype: torch.dtype, device):
        self.rows = torch.zeros(capacity, width, dtype=dtype, device=device)
        self.written = 0     # rows 0 .. written-1 hold a pass's outputs (the committed ones up to the state's length)

    @property
    def width(self) -> int:
        return self.rows.shape[1]

    def write(self, start: int, features: torch.Tensor) -> None:
        """Rows ``start`` .. of a pass's tokens, (T, width)."""
        n = features.shape[0]
        self.rows[start:start + n] = features.to(self.rows.dtype)
        self.written = start + n

    def accept(self, base: int, rows: list[int]) -> None:
        """After a tree verification from ``base``: its tokens ``rows`` (an ascending root path)
        become positions base, base+1, ..."""
        if any(b <= a for a, b in zip(rows, rows[1:])) or (rows and (rows[0] < 0 or base + rows[-1] >= self.written)):
            raise SpecPilotError(f"features: rows {rows} are not an ascending path inside the last pass")
        index = torch.tensor([base + r for r in rows], device=self.rows.device, dtype=torch.long)
        self.rows[base:base + len(rows)] = self.rows[index]
        self.written = base + len(rows)

    def read(self, start: int, end: int) -> torch.Tensor:
        if not 0 <= start <= end <= self.written:
            raise SpecPilotError(f"features: rows {start}..{end} asked, {self.written} written")
        return self.rows[start:end]


def check_layers(layers, num_layers: int, where: str) -> tuple[int, ...]:
    """Feature layer indices, validated against a target of ``num_layers`` decoder layers."""
    layers = tuple(int(i) for i in layers)
    if not layers:
        raise SpecPilotError(f"{where}: no feature layers")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise SpecPilotError(f"{where}: feature layer {bad[0]} is not among the target's {num_layers} layers")
    if len(set(layers)) != len(layers):
        raise SpecPilotError(f"{where}: feature layers {list(layers)} repeat")
    return layers
