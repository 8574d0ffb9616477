"""The stock system of a spec: the reference target, its drafter and tokenizer, and the two
stock engines — ``stock`` (greedy autoregressive) and ``stock-spec`` (chain speculative)."""

from __future__ import annotations

from pathlib import Path

import torch

from specpilot.compiler.loader import load_models
from specpilot.compiler.spec import Spec
from specpilot.errors import SpecPilotError
from specpilot.runtime.decoding import Generation, autoregressive, speculative
from specpilot.runtime.drafters import ModelDrafter, NGramDrafter
from specpilot.runtime.lattice import LatticeRecorder, ReplayDrafter
from specpilot.runtime.reference.model import ReferenceModel
from specpilot.runtime.tokenizer import load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ENGINES = ("stock", "stock-spec")


class StockSystem:
    def __init__(self, spec: Spec):
        self.spec = spec
        dtype = DTYPES[spec.deployment.dtype]
        target, drafter = load_models(spec)
        self.target = ReferenceModel(target.cfg, target.weights, dtype)
        self.capacity = spec.deployment.max_seq_len
        self.tokenizer = load_tokenizer(target.tokenizer_path, target.cfg.vocab_size)
        d = spec.drafter
        if d.kind == "ngram":
            self.drafter = NGramDrafter(d.max_ngram, d.min_ngram, d.top_k)
        else:
            self.drafter = ModelDrafter(ReferenceModel(drafter.cfg, drafter.weights, dtype), d.top_k,
                                        self.capacity, name=d.kind)
        self.draft_len = d.draft_len
        self.eos_ids = tuple(target.cfg.eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.target.cfg.vocab_size

    def check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise SpecPilotError("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise SpecPilotError(f"prompt token {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")

    def generate(self, engine: str, prompt: list[int], max_new: int, force=None, logits_hook=None,
                 stop_at_eos: bool = False, record_lattices: Path | None = None,
                 replay_lattices: Path | None = None) -> Generation:
        self.check_prompt(prompt)
        if len(prompt) + max_new > self.capacity:
            raise SpecPilotError(f"prompt ({len(prompt)}) + max new tokens ({max_new}) exceeds "
                                 f"deployment.max_seq_len={self.capacity}")
        stop_ids = self.eos_ids if stop_at_eos else ()
        if engine == "stock":
            return autoregressive(self.target, prompt, max_new, self.capacity, force, logits_hook, stop_ids)
        if engine != "stock-spec":
            raise SpecPilotError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
        drafter = ReplayDrafter(replay_lattices) if replay_lattices else self.drafter
        if record_lattices:
            drafter = LatticeRecorder(drafter, record_lattices, prompt)
        try:
            return speculative(self.target, drafter, prompt, max_new, self.draft_len, self.capacity,
                               force, logits_hook, stop_ids)
        finally:
            if record_lattices:
                drafter.close()
