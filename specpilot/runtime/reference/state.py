"""Decoding state of the reference model: a KV cache per attention layer, and per Gated
DeltaNet layer its short-conv window and recurrent state, with an explicit snapshot/rollback API.

Attention state rolls back by length alone (entries past the length are dead).  Recurrent
state does not: the state after position p must be kept or recomputed.  Two ways here:

- ``snapshot()`` / ``restore(snap)``: copy the recurrent and conv states, put them back.
- a forward pass with ``record=True`` keeps the state after each of its tokens, and
  ``truncate(n)`` then rolls back to any length the pass went through.  Speculative
  verification uses this: one pass over the drafted block, then keep the accepted prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpilot.core.config import ModelConfig
from specpilot.core.errors import SpecPilotError


class KVCache:
    def __init__(self, n_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device):
        self.k = torch.zeros(n_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(n_kv_heads, capacity, head_dim, dtype=dtype, device=device)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (n_kv, T, d) at cache positions start .. start+T-1."""
        self.k[:, start:start + k.shape[1]] = k
        self.v[:, start:start + v.shape[1]] = v


class RecurrentState:
    """One Gated DeltaNet layer: conv window (conv_dim, K-1) and recurrent state (H, dk, dv)."""

    def __init__(self, conv_dim: int, kernel: int, n_heads: int, dk: int, dv: int, dtype: torch.dtype, device):
        self.conv = torch.zeros(conv_dim, kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(n_heads, dk, dv, dtype=torch.float32, device=device)
        # states recorded since the last drop_history(): length -> (conv, recurrent)
        self.history: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.tree_rows: list[tuple[torch.Tensor, torch.Tensor]] = []   # after each token of a tree pass


@dataclass
class StateSnapshot:
    length: int
    recurrent: list[tuple[torch.Tensor, torch.Tensor] | None]


class ModelState:
    """Everything a decoding step of one sequence reads and writes besides the weights."""

    def __init__(self, cfg: ModelConfig, capacity: int, dtype: torch.dtype, device="cpu"):
        self.capacity = capacity
        self.length = 0
        self.features = None    # a `runtime.features.FeatureStore` when the model keeps feature layers
        self.layers: list[KVCache | RecurrentState] = []
        for kind in cfg.layer_types:
            if kind == "full_attention":
                self.layers.append(KVCache(cfg.num_key_value_heads, cfg.head_dim, capacity, dtype, device))
            else:
                conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim \
                    + cfg.linear_num_value_heads * cfg.linear_value_head_dim
                self.layers.append(RecurrentState(conv_dim, cfg.linear_conv_kernel_dim,
                                                  cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                                  cfg.linear_value_head_dim, dtype, device))

    def check_room(self, n_new: int) -> None:
        if self.length + n_new > self.capacity:
            raise SpecPilotError(
                f"sequence of {self.length + n_new} tokens exceeds deployment.max_seq_len={self.capacity}; "
                "raise it in the spec or ask for fewer tokens")

    def recurrent_layers(self) -> list[RecurrentState]:
        return [layer for layer in self.layers if isinstance(layer, RecurrentState)]

    def snapshot(self) -> StateSnapshot:
        return StateSnapshot(self.length, [
            (layer.conv.clone(), layer.recurrent.clone()) if isinstance(layer, RecurrentState) else None
            for layer in self.layers])

    def restore(self, snap: StateSnapshot, keep_history: bool = False) -> None:
        """Back to ``snap``.  ``keep_history``: keep the recorded states up to the snapshot's
        length (valid when nothing below it changed since, e.g. a look-ahead pass was undone)."""
        self.length = snap.length
        for layer, saved in zip(self.layers, snap.recurrent):
            if saved is not None:
                layer.conv, layer.recurrent = saved[0].clone(), saved[1].clone()
                layer.tree_rows = []
                for n in [n for n in layer.history if not keep_history or n > snap.length]:
                    del layer.history[n]

    def truncate(self, length: int) -> None:
        """Roll back to ``length`` tokens: free for attention; recurrent layers need a recorded state."""
        if length == self.length:
            return
        if not 0 <= length < self.length:
            raise SpecPilotError(f"cannot truncate a state of length {self.length} to {length}")
        for layer in self.recurrent_layers():
            if length not in layer.history:
                raise SpecPilotError(
                    f"recurrent state at length {length} was not recorded; run the pass with record=True "
                    "or restore a snapshot")
            layer.conv, layer.recurrent = layer.history[length]
            for stale in [n for n in layer.history if n > length]:
                del layer.history[stale]
        self.length = length

    def accept_path(self, base: int, rows: list[int]) -> None:
        """Keep tree-verification tokens ``rows`` (ascending offsets from ``base``, a root path)
        as positions base, base+1, ...: their keys/values move down; recurrent layers take the
        state after the path's last token."""
        if any(b <= a for a, b in zip(rows, rows[1:])) or (rows and rows[0] < 0) or \
                (rows and base + rows[-1] >= self.length):
            raise SpecPilotError(f"accept_path: rows {rows} are not an ascending path inside the last pass")
        for layer in self.layers:
            if isinstance(layer, KVCache):
                for i, r in enumerate(rows):
                    if r != i:
                        layer.k[:, base + i] = layer.k[:, base + r]
                        layer.v[:, base + i] = layer.v[:, base + r]
            elif rows:
                layer.conv, layer.recurrent = layer.tree_rows[rows[-1]]
                layer.tree_rows = []
                layer.history.clear()
        self.length = base + len(rows)

    def drop_history(self) -> None:
        for layer in self.recurrent_layers():
            layer.history.clear()
