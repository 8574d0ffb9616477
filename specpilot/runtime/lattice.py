"""Drafter lattices: per drafted position, the top candidates with log-probabilities.

A chain drafter conditions position i on the top-1 tokens of positions < i; the lattice
keeps the runner-up candidates too, so tree builders and the cost model can replay what a
wider tree would have accepted without running the models again.

Recorded as JSON lines (never pickles): a header, then one line per verification step.
Floats round-trip exactly through JSON (Python floats are doubles; the values are float32).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specpilot.core.errors import SpecPilotError

FORMAT = "specpilot-lattices"
VERSION = 1


@dataclass
class Lattice:
    tokens: torch.Tensor     # (positions, top_k) int64, best first
    logprobs: torch.Tensor   # (positions, top_k) float32

    @property
    def positions(self) -> int:
        return self.tokens.shape[0]

    def chain(self) -> list[int]:
        return self.tokens[:, 0].tolist() if self.positions else []

    def scored_chain(self) -> list[tuple[int, float]]:
        """The first-ranked (token, log-probability) at each position."""
        if not self.positions:
            return []
        return list(zip(self.tokens[:, 0].tolist(), self.logprobs[:, 0].tolist()))

    def to_record(self, step: int, context_len: int) -> dict:
        return {"step": step, "context_len": context_len, "tokens": self.tokens.tolist(),
                "logprobs": self.logprobs.tolist()}

    @staticmethod
    def empty(top_k: int = 1) -> "Lattice":
        return Lattice(torch.zeros(0, top_k, dtype=torch.long), torch.zeros(0, top_k))


class LatticeRecorder:
    """Wraps a drafter and writes every lattice it proposes to a JSONL file."""

    def __init__(self, drafter, path: Path, prompt: list[int]):
        self.drafter, self.name = drafter, drafter.name
        self.file = open(path, "w")
        self.file.write(json.dumps({"format": FORMAT, "version": VERSION, "drafter": drafter.name,
                                    "prompt": prompt}) + "\n")
        self.step = 0

    def reset(self) -> None:
        if hasattr(self.drafter, "reset"):
            self.drafter.reset()

    def bind(self, state) -> None:
        if hasattr(self.drafter, "bind"):
            self.drafter.bind(state)

    def propose(self, context: list[int], n: int) -> Lattice:
        lattice = self.drafter.propose(context, n)
        self.file.write(json.dumps(lattice.to_record(self.step, len(context))) + "\n")
        self.step += 1
        return lattice

    def close(self) -> None:
        self.file.close()


class LatticeKeeper:
    """Wraps a drafter and keeps every lattice it proposes, with its context's length, in ``kept``
    (in memory: a bench's timed run records its drafter's confidence without writing in the loop)."""

    def __init__(self, drafter, kept: list):
        self.drafter, self.name, self.kept = drafter, drafter.name, kept

    def propose(self, context: list[int], n: int) -> Lattice:
        lattice = self.drafter.propose(context, n)
        self.kept.append((len(context), lattice))
        return lattice

    def __getattr__(self, name):
        return getattr(self.drafter, name)


class LatticeReplayer:
    """Hands back recorded lattices in order; refuses to go on if the run has diverged."""

    name = "lattice-replay"

    def __init__(self, path: Path, vocab_size: int | None = None):
        path = Path(path)
        try:
            lines = path.read_text().splitlines()
            header = json.loads(lines[0])
            records = [json.loads(line) for line in lines[1:] if line.strip()]
        except (OSError, UnicodeDecodeError, IndexError, json.JSONDecodeError) as e:
            raise SpecPilotError(f"{path}: not a lattice recording ({e})") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION:
            raise SpecPilotError(f"{path}: not a {FORMAT} v{VERSION} file")
        bad = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
        if bad is not None:
            raise SpecPilotError(f"{path}: step {bad} is not a record")
        self.path, self.prompt, self.records, self.next = path, header.get("prompt"), records, 0
        self.vocab_size = vocab_size

    def propose(self, context: list[int], n: int) -> Lattice:
        if self.next >= len(self.records):
            raise SpecPilotError(f"{self.path}: recording has {len(self.records)} steps; replay asked for more")
        rec = self.records[self.next]
        if rec.get("context_len") != len(context):
            raise SpecPilotError(f"{self.path}: replay diverged at step {self.next}: recorded context length "
                                 f"{rec.get('context_len')}, now {len(context)}")
        try:
            tokens = torch.tensor(rec["tokens"], dtype=torch.long)
            logprobs = torch.tensor(rec["logprobs"], dtype=torch.float32)
        except (KeyError, TypeError, ValueError) as e:
            raise SpecPilotError(f"{self.path}: step {self.next} is malformed ({e})") from None
        if tokens.ndim != 2 and tokens.numel() == 0:
            tokens, logprobs = Lattice.empty().tokens, Lattice.empty().logprobs
        if tokens.shape != logprobs.shape or tokens.ndim != 2:
            raise SpecPilotError(f"{self.path}: step {self.next}: tokens and logprobs shapes differ")
        limit = self.vocab_size if self.vocab_size is not None else 2 ** 31
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= limit):
            raise SpecPilotError(f"{self.path}: step {self.next}: a token id outside the vocabulary (0..{limit - 1})")
        self.next += 1
        return Lattice(tokens[:n], logprobs[:n])
