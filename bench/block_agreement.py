"""A block drafter's agreement with its target on the acceptance prompts, every position teacher-forced.

    python bench/block_agreement.py DRAFTER_DIR [SPEC] [--prompts 32] [--max-new-tokens 64] [--out DIR]

For each prompt the target (PyTorch reference, fp32, SPEC default examples/smollm2.yaml) decodes greedily;
then at every generated position the inference network (`BlockNet.context` + `block`) drafts the block
after it from the target's features of the context, as the engine does.  Reported: per block position k,
how often its top-1 is the target's token k ahead, and the drafts a block would accept (its top-1 prefix
that matches).  This is the held-out agreement of `specpilot drafter train` measured on the benchmark's
own prompts instead of the training distribution.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import write  # noqa: E402
from bench.acceptance import conditioned  # noqa: E402


def forced_blocks(net, model, seq: list[int], start: int, capacity: int) -> list[list[int]]:
    """The top-1 drafts of the block after each position n >= ``start`` of ``seq`` (the target consumed
    seq[:n], seq[n] is the last emitted token), from the target's features of seq[:n], as the engine drafts."""
    import torch
    state = model.new_state(capacity)
    model.forward(seq, state)
    features = state.features.read(0, len(seq))
    cfg, blocks = net.cfg, []
    for n in range(start, len(seq) - 1):
        cache = net.new_cache(capacity + cfg.block_size)
        net.context(cache, features[:n], 0)
        tokens = torch.tensor([seq[n]] + [cfg.mask_token_id] * cfg.drafts_per_pass)
        blocks.append(net.block(cache, tokens, n)[1:].argmax(-1).tolist())
    return blocks


def block_hits(blocks: list[list[int]], seq: list[int], start: int) -> tuple[dict, list[int]]:
    """(block position k -> 0/1 list: draft k is the token k ahead, the drafts each block would accept)."""
    hits, accepted = {}, []
    for n, drafts in enumerate(blocks, start=start):
        want = seq[n + 1:n + 1 + len(drafts)]
        for k, (got, ref) in enumerate(zip(drafts, want), start=1):
            hits.setdefault(k, []).append(int(got == ref))
        run = 0
        while run < len(want) and drafts[run] == want[run]:
            run += 1
        accepted.append(run)
    return hits, accepted


def main() -> None:
    import torch

    from specpilot.core.loader import load_models
    from specpilot.core.spec import load_spec
    from specpilot.core.weights import file_digest
    from specpilot.runtime.decoding import autoregressive
    from specpilot.runtime.prompt_sets import texts
    from specpilot.runtime.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("drafter", type=Path)
    ap.add_argument("spec", nargs="?", default=str(Path(__file__).resolve().parents[1] / "examples" / "smollm2.yaml"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_grad_enabled(False)

    target, _ = load_models(load_spec(args.spec))
    tok = load_tokenizer(target.tokenizer_path, target.cfg.vocab_size)
    prompts = [tok.encode(t) for t in texts("mixed")[:args.prompts]]
    capacity = max(len(p) for p in prompts) + args.max_new_tokens + 16
    make, model = conditioned(target, args.drafter, 1, capacity)
    net = make().net
    if net.cfg.kind != "block":
        sys.exit(f"{args.drafter}: a {net.cfg.kind} drafter; this measures block drafters")
    hits: dict[int, list[int]] = {}
    accepted: list[int] = []
    for p in prompts:
        seq = p + autoregressive(model, p, args.max_new_tokens, capacity).tokens
        h, a = block_hits(forced_blocks(net, model, seq, len(p), capacity), seq, len(p))
        for k, v in h.items():
            hits.setdefault(k, []).extend(v)
        accepted += a
    top1 = {f"top1@{k}": round(sum(v) / len(v), 4) for k, v in sorted(hits.items())}
    mean = sum(accepted) / max(len(accepted), 1)
    path = write("block-agreement", {"spec": args.spec, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                                     "drafter": {"directory": str(args.drafter),
                                                 "sha256": file_digest(args.drafter / "model.safetensors")},
                                     "positions": len(accepted), "agreement": top1,
                                     "mean_accepted_drafts": mean}, args.out)
    print(" ".join(f"{k} {v:.3f}" for k, v in top1.items()))
    print(f"drafts a block would accept, mean over {len(accepted)} positions: {mean:.3f}\nwrote {path}")


if __name__ == "__main__":
    main()
