"""W12 size of a model's weights (bytes ratio with metadata and escapes, escape rate, bit-exact
round trip), recorded with machine and versions.

    python bench/w12_stats.py examples/smollm2.yaml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write  # noqa: E402
from specpilot.core.loader import model_weights  # noqa: E402
from specpilot.core import w12  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec_or_checkpoint")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = w12.stats(model_weights(args.spec_or_checkpoint))
    path = write("w12-stats", {"model": args.spec_or_checkpoint, **result}, args.out)
    print(f"{args.spec_or_checkpoint}: {result['bytes_ratio']:.4f} of bf16 bytes, escape rate "
          f"{100 * result['escape_rate']:.4f}%, bit-exact {result['bit_exact']} -> {path}")


if __name__ == "__main__":
    main()
