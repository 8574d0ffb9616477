"""The block / feature drafter networks lowered into a build (`compiler.lower_drafter`), behind the
interface of their PyTorch references (`runtime.reference.feature_nets`), so the drafters of
`runtime.feature_drafters` run either.

A cache is a drafter's row of a key/value buffer on the build's device (`CacheRow`): a feature
drafter's own buffer; a block drafter's row of the network's pool, shared by the drafters of one
batch so that `CompiledBlockNet.cycle_batch` drafts all their blocks in one call.  Every call
takes its positions, slots and mask from the host in one copy, its tensors where the build runs,
and returns torch tensors there (copies: a CUDA graph's outputs are reused by its next replay); a
cycle's ranked blocks come back to the host as numpy arrays when read (`RankedBlocks`).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from specpilot.core import feature_drafter as fd
from specpilot.core.errors import SpecPilotError
from specpilot.runtime import heap
from specpilot.runtime.engine import host_array
from specpilot.runtime.reference.feature_nets import identity_vocab, scatter_draft_vocab
from specpilot.runtime.uploads import Download, upload


class CacheRow:
    """A drafter's row ``row`` of the key/value buffer ``pool``; a pooled row goes back to its pool's
    free list when the last reference to its handle goes."""

    def __init__(self, pool, row: int, free: list[int] | None = None):
        self.pool, self.row = pool, row
        self.rows = np.array([row], "int32")
        if free is not None:
            weakref.finalize(self, free.append, row)


class _Compiled:
    def __init__(self, module, cfg: fd.DraftNetConfig, names: tuple[str, ...]):
        missing = [n for n in names if n not in module.functions]
        if missing:
            raise SpecPilotError(f"{module.dir}: no {', '.join(missing)} (a {cfg.kind} drafter lowered with the "
                                 "target); compile the build again")
        self.module, self.cfg = module, cfg
        self.fns = {n: module.functions[n] for n in names}
        self.gpu = module.device.dlpack_device_type() == 2
        self.device = module.torch_device
        self.dtype = getattr(torch, module.manifest.dtype)
        self.capacity = module.manifest.capacity

    def new_cache(self, slots: int) -> CacheRow:
        self._check_slots(slots)
        return CacheRow(self._zeros(1), 0)

    def _check_slots(self, slots: int) -> None:
        if slots != fd.cache_slots(self.cfg, self.capacity):
            raise SpecPilotError(f"a compiled {self.cfg.kind} drafter's cache holds "
                                 f"{fd.cache_slots(self.cfg, self.capacity)} slots, not {slots}")

    def _zeros(self, rows: int):
        return self.module.zeros(fd.cache_shape(self.cfg, self.capacity, rows), self.module.manifest.dtype)

    def _tensor(self, t: torch.Tensor):
        """A torch tensor as the build's argument: a fresh aligned copy where the build runs."""
        return self.module.tvm.runtime.from_dlpack(t.to(device=self.device, dtype=self.dtype).clone())

    def _out(self, array) -> torch.Tensor:
        if not self.gpu:
            return torch.from_numpy(array.numpy())
        return torch.from_dlpack(array).clone()


class CompiledBlockNet(_Compiled):
    def __init__(self, module, cfg: fd.DraftNetConfig, d2t: torch.Tensor | None):
        super().__init__(module, cfg, ("drafter_context", "drafter_block", "drafter_cycle"))
        self.one_call = True      # `ranked_cycle` as the build's drafter_cycle where it serves
        # a draft vocabulary: the build's head rows and ranks are draft ids, mapped here to the target's
        self.d2t = None if identity_vocab(cfg, d2t) else d2t.to(self.device)
        self.ids = None if self.d2t is None else fd.vocab_ids(d2t.cpu()).numpy()
        self.d2t_ids = None if self.ids is None else torch.from_numpy(self.ids).to(self.device)
        rows = cfg.draft_vocab_size if self.ids is not None else cfg.vocab_size
        self.ranks = min(module.manifest.drafter.top_k, rows)   # what drafter_cycle ranks a position
        # the build's pool: max_batch rows where it drafts batches, else a buffer a drafter
        self.batched = "drafter_cycle_batch" in module.functions
        self.pool_rows = module.manifest.max_batch if self.batched else 1
        if self.batched:
            self.fns["drafter_cycle_batch"] = module.functions["drafter_cycle_batch"]
        self._pool, self._free = None, []

    def new_cache(self, slots: int) -> CacheRow:
        """A row of the network's pool (builds for batches), else a buffer of its own."""
        if self.pool_rows == 1:
            return super().new_cache(slots)
        self._check_slots(slots)
        if self._pool is None:
            self._pool, self._free = self._zeros(self.pool_rows), list(range(self.pool_rows - 1, -1, -1))
        if not self._free:
            heap.collect()        # rows of drafters that went in reference cycles
        if not self._free:
            raise SpecPilotError(f"all {self.pool_rows} rows of the block drafter's cache pool are in use "
                                 "(deployment.max_batch drafters at once)")
        return CacheRow(self._pool, self._free.pop(), self._free)

    def context(self, cache: CacheRow, features: torch.Tensor, start: int) -> None:
        positions = np.arange(start, start + features.shape[0], dtype="int32")[None]
        m = self.module
        self.fns["drafter_context"](self._tensor(features[None]), *m.tensors(positions, positions, cache.rows),
                                    cache.pool, m.params)

    def block(self, cache: CacheRow, tokens: torch.Tensor, start: int) -> torch.Tensor:
        m = self.module
        out = self.fns["drafter_block"](*m.tensors(*self._block_inputs(tokens, start, cache.rows)), cache.pool,
                                        m.params)
        return scatter_draft_vocab(self._out(out)[0], self.d2t, self.cfg.vocab_size, self.d2t is None)

    def ranked_cycle(self, cache: CacheRow, features: torch.Tensor, start: int, tokens: torch.Tensor, k: int):
        """`context` of ``features`` (the tokens just before ``start``), then `block` at ``start``, each
        position's k best (indices, log-probabilities) on the host -- the build's ``drafter_cycle``, one
        call and one small read-back.  None where it does not serve: more new tokens than a block's
        rows, more ranks than the build keeps, or ``one_call`` off."""
        if not self.serves(features.shape[0], k):
            return None
        return self._cycle("drafter_cycle", [(cache, features, start, tokens)], k)[0]

    def serves(self, new: int, k: int) -> bool:
        """Whether a cycle call takes ``new`` committed tokens and ranks ``k`` proposals a position."""
        return self.one_call and new <= self.cfg.block_size and k <= self.ranks

    def cycle_batch(self, entries: list[tuple[CacheRow, torch.Tensor, int, torch.Tensor]], k: int) -> "RankedBlocks":
        """`ranked_cycle` of many sequences, each (cache row, features, start, tokens), in one call over
        the pool (the build's ``drafter_cycle_batch``: one pass over the weights for all their blocks),
        read to the host when first indexed.  Every entry must be one `serves` takes, its row of this
        network's pool."""
        if not self.batched:
            raise SpecPilotError("this build drafts one block a call (no drafter_cycle_batch: deployment.max_batch 1)")
        rows = {c.row for c, *_ in entries}
        if any(c.pool is not self._pool for c, *_ in entries) or len(rows) < len(entries) \
                or not all(self.serves(f.shape[0], k) for _, f, _, _ in entries):
            raise SpecPilotError("cycle_batch: every sequence needs a row of this network's pool of its own and at "
                                 f"most a block of new tokens, ranked at most {self.ranks} a position")
        return self._cycle("drafter_cycle_batch", entries, k)

    def _cycle(self, name: str, entries: list, k: int) -> "RankedBlocks":
        inputs = self._cycle_inputs(entries)
        out = self.fns[name](*inputs, entries[0][0].pool, self.module.params)
        tokens = torch.from_dlpack(inputs[3]) if self.gpu else torch.from_numpy(inputs[3].numpy())
        return RankedBlocks(out, k, self.ids, self.d2t_ids, tokens, self.gpu)

    def _cycle_inputs(self, entries: list) -> list:
        """A cycle call's inputs for ``entries``, built for the whole batch at once (a copy or array
        op each, not one per sequence): the new features padded to a block a sequence, the committed
        tokens' positions and slots (padding slots -1 write nothing), the block's tokens, positions,
        mask (everything cached and the block) and the pool rows."""
        K, B, F = self.cfg.block_size, len(entries), entries[0][1].shape[1]
        counts = np.array([f.shape[0] for _, f, _, _ in entries])
        starts = np.array([start for _, _, start, _ in entries])
        col = np.arange(K)
        new = col < counts[:, None]                              # (B, K): the rows holding new features
        padded = torch.zeros((B * K, F), dtype=self.dtype, device=self.device)
        index = upload(np.flatnonzero(new), self.device)
        padded[index] = torch.cat([f for _, f, _, _ in entries]).to(device=self.device, dtype=self.dtype)
        committed = starts[:, None] - counts[:, None] + col
        positions = (starts[:, None] + col).astype("int32")
        width = int(starts.max()) + K
        mask = np.broadcast_to(np.arange(width) < (starts + K)[:, None, None], (B, K, width))
        tokens = np.stack([np.asarray(host_array(t), "int32") for _, _, _, t in entries])
        rows = np.array([c.row for c, *_ in entries], "int32")
        return [self.module.tvm.runtime.from_dlpack(padded.view(B, K, F)),
                *self.module.tensors(np.where(new, committed, 0).astype("int32"),
                                     np.where(new, committed, -1).astype("int32"), tokens, positions, positions,
                                     np.ascontiguousarray(mask), rows)]

    @staticmethod
    def _block_inputs(tokens: torch.Tensor, start: int, rows: np.ndarray) -> tuple[np.ndarray, ...]:
        """The block's host inputs: tokens, positions, slots, mask (everything cached and the block), row."""
        K = tokens.shape[0]
        positions = np.arange(start, start + K, dtype="int32")[None]
        return (np.asarray(host_array(tokens), "int32")[None], positions, positions,
                np.ones((1, K, start + K), bool), rows)


class RankedBlocks:
    """A cycle call's ranked blocks, (indices, values) an entry: copied to the host right behind the
    call and read when first indexed, as numpy views of that copy (int64 target ids, float32
    log-probabilities, (K, k) each, best first).  `first_ranked` hands a verification each entry's
    block token and first-ranked drafts where they were computed, so that it launches behind the
    cycle without waiting for it; the host reads the blocks when it commits."""

    def __init__(self, out, k: int, ids: np.ndarray | None, ids_device: torch.Tensor | None,
                 tokens: torch.Tensor, gpu: bool):
        self.k, self.ids, self.ids_device, self.tokens = k, ids, ids_device, tokens
        # the copy queued right behind the call: reading it later waits for the call alone, not for a
        # verification launched since (the host ranks the blocks while the device verifies)
        self.built = torch.from_dlpack(out) if gpu else torch.from_numpy(out.numpy())   # (B, K, ranks, 2)
        self.copy = Download(self.built)
        self.host: list | None = None
        self.first: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.read()[i]

    def read(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Every entry's ranked block on the host (one read-back, waiting for the call and its copy only)."""
        if self.host is None:
            ranked = self.copy.wait().numpy()[:, :, :self.k]        # (B, K, k, 2): log-probability, index
            index = ranked[..., 1].astype(np.int64)
            self.host = list(zip(self.ids[index] if self.ids is not None else index, ranked[..., 0]))
        return self.host

    def first_ranked(self) -> torch.Tensor:
        """(B, K) int32 where the build ran: each entry's block token 0 (its context's last token), then
        its first-ranked draft at every later position -- the tokens a chain verification reads."""
        if self.first is None:
            index = self.built[:, 1:, 0, 1].long()                # the index channel holds exact integers
            if self.ids_device is not None:
                index = self.ids_device[index]
            self.first = torch.cat([self.tokens[:, :1].to(index.device, torch.int32), index.to(torch.int32)], 1)
        return self.first


class CompiledFeatureNet(_Compiled):
    def __init__(self, module, cfg: fd.DraftNetConfig, d2t: torch.Tensor):
        super().__init__(module, cfg, ("drafter_fuse", "drafter_step"))
        self.identity_vocab = identity_vocab(cfg, d2t)
        self.d2t = d2t.to(self.device)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self._out(self.fns["drafter_fuse"](self._tensor(features[None]), self.module.params))[0]

    def step(self, cache, hidden: torch.Tensor, tokens, positions, slots, mask):
        m = self.module
        args = (np.asarray(host_array(tokens), "int32")[None], np.asarray(host_array(positions), "int32")[None],
                np.asarray(host_array(slots), "int32")[None], np.asarray(host_array(mask), bool)[None], cache.rows)
        h, draft = self.fns["drafter_step"](self._tensor(hidden[None]), *m.tensors(*args), cache.pool, m.params)
        logits = scatter_draft_vocab(self._out(draft)[0], self.d2t, self.cfg.vocab_size, self.identity_vocab)
        return self._out(h)[0], logits


def compiled_draft_net(module, cfg: fd.DraftNetConfig, tensors: dict[str, torch.Tensor]):
    if cfg.kind == "block":
        return CompiledBlockNet(module, cfg, tensors.get("d2t"))
    return CompiledFeatureNet(module, cfg, tensors["d2t"])
