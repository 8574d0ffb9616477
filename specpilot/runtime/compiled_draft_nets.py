"""The block / feature drafter networks lowered into a build (`compiler.lower_drafter`), behind the
interface of their PyTorch references (`runtime.reference.feature_nets`), so the drafters of
`runtime.feature_drafters` run either.

A cache is the drafter's own key/value buffer on the build's device; every call takes its
positions, slots and mask from the host in one copy, its tensors where the build runs, and
returns torch tensors there (copies: a CUDA graph's outputs are reused by its next replay).
"""

from __future__ import annotations

import numpy as np
import torch

from specpilot.core import feature_drafter as fd
from specpilot.core.errors import SpecPilotError
from specpilot.runtime.engine import host_array
from specpilot.runtime.reference.feature_nets import scatter_draft_vocab

_ROW = np.zeros(1, "int32")    # a drafter's cache holds one sequence


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

    def new_cache(self, slots: int):
        if slots != fd.cache_slots(self.cfg, self.capacity):
            raise SpecPilotError(f"a compiled {self.cfg.kind} drafter's cache holds "
                                 f"{fd.cache_slots(self.cfg, self.capacity)} slots, not {slots}")
        return self.module.zeros(fd.cache_shape(self.cfg, self.capacity), self.module.manifest.dtype)

    def _tensor(self, t: torch.Tensor):
        """A torch tensor as the build's argument: a fresh aligned copy where the build runs."""
        return self.module.tvm.runtime.from_dlpack(t.to(device=self.device, dtype=self.dtype).clone())

    def _out(self, array) -> torch.Tensor:
        if not self.gpu:
            return torch.from_numpy(array.numpy())
        return torch.from_dlpack(array).clone()


class CompiledBlockNet(_Compiled):
    def __init__(self, module, cfg: fd.DraftNetConfig):
        super().__init__(module, cfg, ("drafter_context", "drafter_block", "drafter_cycle"))
        self.one_call = True      # `ranked_cycle` as the build's drafter_cycle where it serves
        self.ranks = min(module.manifest.drafter.top_k, cfg.vocab_size)   # what drafter_cycle ranks a position

    def context(self, cache, features: torch.Tensor, start: int) -> None:
        positions = np.arange(start, start + features.shape[0], dtype="int32")[None]
        m = self.module
        self.fns["drafter_context"](self._tensor(features[None]), *m.tensors(positions, positions, _ROW), cache,
                                    m.params)

    def block(self, cache, tokens: torch.Tensor, start: int) -> torch.Tensor:
        m = self.module
        out = self.fns["drafter_block"](*m.tensors(*self._block_inputs(tokens, start)), cache, m.params)
        return self._out(out)[0]

    def ranked_cycle(self, cache, features: torch.Tensor, start: int, tokens: torch.Tensor, k: int):
        """`context` of ``features`` (the tokens just before ``start``), then `block` at ``start``, each
        position's k best (indices, log-probabilities) on the host -- the build's ``drafter_cycle``, one
        call and one small read-back.  None where it does not serve: more new tokens than a block's
        rows, more ranks than the build keeps, or ``one_call`` off."""
        K, n = self.cfg.block_size, features.shape[0]
        if not self.one_call or n > K or k > self.ranks:
            return None
        padded = torch.zeros((1, K, features.shape[1]), dtype=self.dtype, device=self.device)
        padded[0, :n] = features.to(device=self.device, dtype=self.dtype)
        positions = np.zeros((1, K), "int32")
        positions[0, :n] = np.arange(start - n, start)
        slots = np.full((1, K), -1, "int32")      # padding rows write nothing
        slots[0, :n] = positions[0, :n]
        m = self.module
        out = self.fns["drafter_cycle"](m.tvm.runtime.from_dlpack(padded),
                                        *m.tensors(positions, slots, *self._block_inputs(tokens, start)), cache, m.params)
        ranked = torch.from_numpy(out.numpy())[0, :, :k]       # (K, k, 2): log-probability, index
        return ranked[..., 1].long(), ranked[..., 0]

    @staticmethod
    def _block_inputs(tokens: torch.Tensor, start: int) -> tuple[np.ndarray, ...]:
        """The block's host inputs: tokens, positions, slots, mask (everything cached and the block), row."""
        K = tokens.shape[0]
        positions = np.arange(start, start + K, dtype="int32")[None]
        return (np.asarray(host_array(tokens), "int32")[None], positions, positions,
                np.ones((1, K, start + K), bool), _ROW)


class CompiledFeatureNet(_Compiled):
    def __init__(self, module, cfg: fd.DraftNetConfig, d2t: torch.Tensor):
        super().__init__(module, cfg, ("drafter_fuse", "drafter_step"))
        self.identity_vocab = cfg.draft_vocab_size == cfg.vocab_size and not bool(d2t.any())
        self.d2t = d2t.to(self.device)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self._out(self.fns["drafter_fuse"](self._tensor(features[None]), self.module.params))[0]

    def step(self, cache, hidden: torch.Tensor, tokens, positions, slots, mask):
        m = self.module
        args = (np.asarray(host_array(tokens), "int32")[None], np.asarray(host_array(positions), "int32")[None],
                np.asarray(host_array(slots), "int32")[None], np.asarray(host_array(mask), bool)[None], _ROW)
        h, draft = self.fns["drafter_step"](self._tensor(hidden[None]), *m.tensors(*args), cache, m.params)
        logits = scatter_draft_vocab(self._out(draft)[0], self.d2t, self.cfg.vocab_size, self.identity_vocab)
        return self._out(h)[0], logits


def compiled_draft_net(module, cfg: fd.DraftNetConfig, tensors: dict[str, torch.Tensor]):
    if cfg.kind == "block":
        return CompiledBlockNet(module, cfg)
    return CompiledFeatureNet(module, cfg, tensors["d2t"])
