"""Sampling as a deterministic function of (seed, position, logits), so token forcing can prove it.

The Gumbel-max form: the token at sequence position p is

    argmax_v  [ logits[v] / T + g(seed, p, v) ]   over the tokens top-k / top-p keep,

where g = -log(-log(u)) and u is a counter-based hash of (seed, p, v) mapped into (0, 1).  This
draws exactly from softmax(logits / T) restricted to the kept tokens, and the noise at a
position does not depend on how the position was reached: an autoregressive step, row i of a
chain verification and every tree node at depth d below base all see the same g at the same
position.  So a speculative engine accepts a draft exactly when autoregressive sampling would
have produced the same token, and sampled speculative decoding is token-identical to sampled
autoregressive decoding with the same seed.

The hash (Chris Wellons' "lowbias32" finaliser, chained over the key's words) is written
twice: in TIR inside the compiled module (`kernels.sampling`) and in PyTorch for the stock
reference (`runtime.sampling`); `MIX` and `GOLDEN` below are their shared constants.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

WORD = 0xFFFFFFFF                   # the hash works on 32-bit words
MIX = (0x7FEB352D, 0x846CA68B)      # lowbias32's multipliers (shifts 16, 15, 16)
GOLDEN = 0x9E3779B9                 # added to each word before it is mixed in
MASKED = -3.0e38                    # the score of a token top-k / top-p leave out (finite: margins stay numbers)
KEY_WORDS = 3                       # a row's key: seed low 32 bits, seed high 32 bits, position (int32 each)
MAX_SEED = 2 ** 64 - 1


class SamplingParams(BaseModel):
    """One request's sampling.  temperature 0 is greedy decoding (the other fields are then unused)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(0.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=2 ** 31 - 1)    # 0: no top-k cut
    seed: int = Field(0, ge=0, le=MAX_SEED)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def key_words(self, position: int) -> tuple[int, int, int]:
        """The three int32 words keying the noise of ``position`` (two's-complement views of uint32)."""
        lo, hi = self.seed & WORD, self.seed >> 32
        return tuple(w - (1 << 32) if w >= 1 << 31 else w for w in (lo, hi, position & WORD))


def mix32(x: int) -> int:
    """lowbias32 on a Python int (the definition both implementations are tested against)."""
    x &= WORD
    x ^= x >> 16
    x = (x * MIX[0]) & WORD
    x ^= x >> 15
    x = (x * MIX[1]) & WORD
    x ^= x >> 16
    return x


def noise_hash(seed: int, position: int, token: int) -> int:
    """The 32-bit hash behind g(seed, position, token)."""
    h = mix32((seed & WORD) + GOLDEN)
    h = mix32(h ^ ((seed >> 32) + GOLDEN))
    h = mix32(h ^ ((position & WORD) + GOLDEN))
    return mix32(h ^ ((token + GOLDEN) & WORD))


def uniform(h: int) -> float:
    """(0, 1) from a 32-bit hash: its top 24 bits, centred (exact in float32)."""
    return ((h >> 8) + 0.5) * 2.0 ** -24
