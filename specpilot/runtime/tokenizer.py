"""Text <-> token ids: a checkpoint's own tokenizer.json, or raw bytes for random models."""

from __future__ import annotations

from pathlib import Path

from specpilot.core.errors import SpecPilotError


class ByteTokenizer:
    """Token id = byte value; what a seeded random model without a tokenizer reads and writes."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        if self.vocab_size < 256:
            raise SpecPilotError(f"a model with vocab_size {self.vocab_size} < 256 has no byte tokenizer; "
                                 "pass --prompt-ids or give target.tokenizer")
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise SpecPilotError(f"{file}: cannot read tokenizer ({e})") from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def load_tokenizer(path: Path | None, vocab_size: int):
    return HFTokenizer(path) if path is not None else ByteTokenizer(vocab_size)
