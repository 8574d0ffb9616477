"""The target's hidden states of a sequence's tokens, kept for drafters that read them.

A target built or loaded with feature layers (``model.feature_layers``: decoder-layer indices)
returns, for every token of every pass, the residual stream after each of those layers,
concatenated (the inputs of DFlash- and EAGLE-3-style drafters).  A sequence's
`FeatureStore` holds them by position like a KV cache: a pass writes its tokens' rows, a tree
verification keeps its accepted path's rows (`accept`), and the state's length says which rows
are the committed context's.  A compiled model keeps its sequences' stores in one `FeaturePool`,
so that a batch's writes and moves are one copy each.
"""

from __future__ import annotations

import numpy as np
import torch

from specpilot.core.errors import SpecPilotError
from specpilot.runtime.uploads import upload


class FeaturePool:
    """The feature rows of a model's sequences in one tensor (sequences, capacity, width), a
    sequence a pool row like its KV cache's: a batched pass writes every sequence's rows, and a
    batch's accepted tree paths move, in one indexed copy each instead of a few launches and a
    host-to-device copy per sequence.  Rows past what a store wrote are never read (not zeroed)."""

    def __init__(self, sequences: int, capacity: int, width: int, dtype: torch.dtype, device):
        self.data = torch.empty(sequences, capacity, width, dtype=dtype, device=device)

    def store(self, row: int) -> "FeatureStore":
        """The store of pool row ``row`` (empty: a new sequence's)."""
        return FeatureStore.in_pool(self, row)

    def write(self, entries: list[tuple["FeatureStore", int, int]], features: torch.Tensor) -> None:
        """``entries[b]`` = (store, start, n): ``features[b, :n]`` of a (B, T, width) pass become that
        store's rows start .. start + n - 1, all in one copy."""
        self.settle([store for store, _, _ in entries])
        if len(entries) == 1:
            store, start, n = entries[0]
            store.write(start, features[0, :n])
            return
        n = np.array([k for _, _, k in entries])
        b = np.repeat(np.arange(len(entries)), n)
        t = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)        # each entry's 0 .. n - 1
        row = np.array([store.row for store, _, _ in entries])[b]
        pos = np.array([start for _, start, _ in entries])[b] + t
        b, t, row, pos = upload(np.stack([b, t, row, pos]), self.data.device)
        self.data[row, pos] = features[b, t].to(self.data.dtype)
        for store, start, n in entries:
            store.written = start + n

    def settle(self, stores: list["FeatureStore"]) -> None:
        """Move the accepted paths ``stores`` still owe (`FeatureStore.accept`), all in one copy."""
        moves = [store.take_moves() for store in stores if store.moves is not None]
        if moves:
            row, src, dst = upload(np.concatenate(moves, axis=1), self.data.device)
            self.data[row, dst] = self.data[row, src]


class FeatureStore:
    """One sequence's feature rows (a `FeaturePool` row; a pool of its own where made alone)."""

    def __init__(self, capacity: int, width: int, dtype: torch.dtype, device):
        self._bind(FeaturePool(1, capacity, width, dtype, device), 0)

    @classmethod
    def in_pool(cls, pool: FeaturePool, row: int) -> "FeatureStore":
        store = cls.__new__(cls)
        store._bind(pool, row)
        return store

    def _bind(self, pool: FeaturePool, row: int) -> None:
        self.pool, self.row = pool, row
        self.rows = pool.data[row]
        self.written = 0     # rows 0 .. written-1 hold a pass's outputs (the committed ones up to the state's length)
        self.moves: np.ndarray | None = None     # (row, from, to) of an accepted path still to move

    @property
    def width(self) -> int:
        return self.rows.shape[1]

    def write(self, start: int, features: torch.Tensor) -> None:
        """Rows ``start`` .. of a pass's tokens, (T, width)."""
        self.settle()
        n = features.shape[0]
        self.rows[start:start + n] = features.to(self.rows.dtype)
        self.written = start + n

    def accept(self, base: int, rows: list[int]) -> None:
        """After a tree verification from ``base``: its tokens ``rows`` (an ascending root path)
        become positions base, base+1, ...  The rows move when first read or written, or with their
        batch's (`FeaturePool.settle`)."""
        if any(b <= a for a, b in zip(rows, rows[1:])) or (rows and (rows[0] < 0 or base + rows[-1] >= self.written)):
            raise SpecPilotError(f"features: rows {rows} are not an ascending path inside the last pass")
        self.settle()
        moved = [(self.row, base + r, base + i) for i, r in enumerate(rows) if r != i]
        self.moves = np.array(moved, dtype=np.int64).T if moved else None
        self.written = base + len(rows)

    def take_moves(self) -> np.ndarray:
        """The (3, n) moves this store owes, handed to whoever makes them."""
        moves, self.moves = self.moves, None
        return moves

    def settle(self) -> None:
        if self.moves is not None:
            self.pool.settle([self])

    def read(self, start: int, end: int) -> torch.Tensor:
        if not 0 <= start <= end <= self.written:
            raise SpecPilotError(f"features: rows {start}..{end} asked, {self.written} written")
        self.settle()
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
