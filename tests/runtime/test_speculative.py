"""Stock speculative decoding produces exactly the autoregressive tokens, dense and hybrid,
with every drafter, including after rejections in the middle of a drafted block."""

from __future__ import annotations

import pytest

from specpilot.runtime.decoding import autoregressive, speculative
from specpilot.runtime.drafters import ModelDrafter, NGramDrafter, common_prefix
from specpilot.runtime.lattice import LatticeRecorder, LatticeReplayer
from tests.conftest import DENSE, HYBRID, noisy_copy, tiny_model

PROMPT = [5, 17, 29, 41, 53, 65, 77, 89, 101, 113, 17, 29, 41]


@pytest.mark.parametrize("arch", [DENSE, HYBRID, "LlamaForCausalLM", "Qwen3NextForCausalLM"])
@pytest.mark.parametrize("draft_len", [1, 4, 7])
def test_model_drafter_matches_autoregressive(arch, draft_len):
    target = tiny_model(arch, seed=3)
    drafter = ModelDrafter(noisy_copy(target, 0.3), top_k=3, capacity=512)
    want = autoregressive(target, PROMPT, 96, 512).tokens
    got = speculative(target, drafter, PROMPT, 96, draft_len, 512)
    assert got.tokens == want
    committed = got.accepted[1:]
    if draft_len > 1:  # some blocks were cut mid-way, and some drafts were accepted
        assert any(1 < c < draft_len + 1 for c in committed)
        assert any(c == 1 for c in committed)
    assert got.mean_accepted > 1.0


@pytest.mark.parametrize("arch", [DENSE, HYBRID])
def test_hybrid_rollback_with_early_exit_drafter(arch):
    from dataclasses import replace

    from specpilot.runtime.reference.model import ReferenceModel
    target = tiny_model(arch, seed=6)
    cut = replace(target.cfg, num_hidden_layers=2, layer_types=target.cfg.layer_types[:2])
    keep = {k: v for k, v in target.w.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2}
    drafter = ModelDrafter(ReferenceModel(cut, keep), top_k=2, capacity=512)
    want = autoregressive(target, PROMPT, 80, 512).tokens
    assert speculative(target, drafter, PROMPT, 80, 5, 512).tokens == want


@pytest.mark.parametrize("arch", [DENSE, HYBRID])
def test_ngram_drafter_matches_autoregressive(arch):
    target = tiny_model(arch, seed=8)
    want = autoregressive(target, PROMPT, 120, 512).tokens
    got = speculative(target, NGramDrafter(max_n=3, min_n=1, top_k=4), PROMPT, 120, 6, 512)
    assert got.tokens == want
    assert got.mean_accepted > 1.0


def test_exact_length_and_eos_stop():
    target = tiny_model(DENSE, seed=3)
    want = autoregressive(target, PROMPT, 40, 512).tokens
    eos = want[10]
    stopped = speculative(target, ModelDrafter(noisy_copy(target, 0.1), 2, 512), PROMPT, 40, 5, 512,
                          stop_ids=(eos,)).tokens
    assert stopped == want[:want.index(eos) + 1]
    assert len(speculative(target, NGramDrafter(), PROMPT, 37, 8, 512).tokens) == 37


def test_ngram_lattice_ranks_by_count_then_recency():
    d = NGramDrafter(max_n=2, min_n=1, top_k=3)
    lat = d.propose([1, 2, 9, 1, 2, 7, 1, 2, 7, 1, 2], 2)
    assert lat.tokens[0].tolist() == [7, 9, 7]          # 7 twice, 9 once, padded
    assert lat.logprobs[0, 2] == float("-inf")
    assert lat.chain() == [7, 1]


def test_lattices_record_and_replay_exactly(tmp_path):
    target = tiny_model(HYBRID, seed=3)
    path = tmp_path / "lattices.jsonl"
    rec = LatticeRecorder(ModelDrafter(noisy_copy(target, 0.3), 3, 512), path, PROMPT)
    live = speculative(target, rec, PROMPT, 64, 4, 512)
    rec.close()
    replayed = speculative(target, LatticeReplayer(path), PROMPT, 64, 4, 512)
    assert replayed.tokens == live.tokens
    assert replayed.accepted == live.accepted
    # replaying against a different run is refused, not silently wrong
    from specpilot.core.errors import SpecPilotError
    with pytest.raises(SpecPilotError, match="diverged|asks for more|asked for more"):
        speculative(target, LatticeReplayer(path), PROMPT[:-1], 64, 4, 512)


def test_corrupt_lattice_file_is_a_clear_error(tmp_path):
    from specpilot.core.errors import SpecPilotError
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "something-else"}\n')
    with pytest.raises(SpecPilotError, match="not a specpilot-lattices"):
        LatticeReplayer(bad)
    bad.write_text("not json\n")
    with pytest.raises(SpecPilotError, match="not a lattice recording"):
        LatticeReplayer(bad)


@pytest.mark.parametrize("ids", [[[-1]], [[301]], [[7, 2 ** 40]]])
def test_recorded_ids_outside_the_vocabulary_are_refused(tmp_path, ids):
    import json

    from specpilot.core.errors import SpecPilotError
    from specpilot.runtime.lattice import FORMAT, VERSION
    path = tmp_path / "l.jsonl"
    path.write_text(json.dumps({"format": FORMAT, "version": VERSION, "drafter": "x", "prompt": PROMPT}) + "\n"
                    + json.dumps({"step": 0, "context_len": len(PROMPT), "tokens": ids,
                                  "logprobs": [[0.0] * len(ids[0])]}) + "\n")
    with pytest.raises(SpecPilotError, match="outside the vocabulary"):
        LatticeReplayer(path, vocab_size=301).propose(PROMPT, 4)
    path.write_text(path.read_text().splitlines()[0] + "\n[1, 2]\n")
    with pytest.raises(SpecPilotError, match="step 0 is not a record"):
        LatticeReplayer(path)


def test_commits_from_choices_read_at_once_equal_row_by_row():
    """On a GPU a verification's choices are read back at once (`decoding.row_choices`, `top2_rows`):
    committing from them records what committing row by row does -- tokens, choices, margins,
    runner-ups and accepted counts -- over rows with exact ties."""
    import torch

    from specpilot.runtime.decoding import Emitter, commit_chain, commit_tree, top2_rows
    from specpilot.runtime.tree import Tree

    class Cache:
        def truncate(self, length):
            self.length = length

        def drop_history(self):
            pass

        def accept_path(self, state, base, rows):
            self.path = (base, list(rows))

    gen = torch.Generator().manual_seed(3)
    rows = torch.randint(-3, 3, (6, 37), generator=gen).float()          # many exact ties
    best = [int(r.argmax()) for r in rows]
    draft = [best[0], best[1], (best[2] + 1) % 37, 5, 6]                  # two accepted, then a miss
    tree = Tree([best[0], (best[0] + 1) % 37, best[1], (best[3] + 1) % 37, 10],      # two accepted, then a miss
                [-1, -1, 0, 2, 3], [1, 1, 2, 3, 4], [0.0] * 5)
    for commit, args in ((commit_chain, (draft,)), (commit_tree, (tree,))):
        records = []
        for given in (rows, top2_rows([rows])[0]):
            out, cache = Emitter(20, None, None, ()), Cache()
            last = commit(cache, out, *args, given, 10) if commit is commit_chain else \
                commit(cache, cache, out, *args, given, 10)
            records.append((last, out.gen.tokens, out.gen.choices, out.gen.margins, out.gen.runner_up,
                            out.gen.accepted, vars(cache)))
        assert records[0] == records[1]
        assert records[0][5] == [3]                  # two drafts and the bonus token


@pytest.mark.parametrize("seed", range(6))
def test_common_prefix_equals_a_scan_of_the_two_contexts(seed):
    """The halving comparison against a position-by-position scan, on fresh random pairs: equal,
    one a prefix of the other, diverging anywhere (first, last, middle), empty and odd lengths."""
    import random
    rng = random.Random(seed)

    def scan(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n
    for _ in range(300):
        a = [rng.randrange(5) for _ in range(rng.randrange(0, 70))]
        cut = rng.randrange(0, len(a) + 1)
        b = a[:cut] + [rng.randrange(5) for _ in range(rng.randrange(0, 9))]
        for x, y in ((a, b), (b, a), (a, list(a)), (a, a[:cut])):
            assert common_prefix(x, y) == scan(x, y), (x, y)


@pytest.mark.parametrize("arch", [DENSE, HYBRID, "Qwen3NextForCausalLM"])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_teacher_forced_rows_are_the_forced_autoregressive_rows(arch, chunk):
    """One logits row a position, the forced tokens fed before it, from passes of ``chunk`` tokens
    (across the prompt's end too): the rows of a forced token-by-token run, to float32 rounding."""
    import torch

    from specpilot.runtime.decoding import teacher_forced
    target = tiny_model(arch, seed=4)
    gen = torch.Generator().manual_seed(chunk)
    forced = torch.randint(0, target.vocab_size, (23,), generator=gen).tolist()
    seen = []
    autoregressive(target, PROMPT, len(forced), 256, force=forced,
                   logits_hook=lambda pos, logits: seen.append(logits.clone()) or logits)
    rows = list(teacher_forced(target, PROMPT, forced, 256, chunk=chunk))
    assert len(rows) == len(seen) == len(forced)
    for want, got in zip(seen, rows):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)    # a prompt in one pass or several
    with pytest.raises(ValueError, match="prompt"):
        list(teacher_forced(target, [], forced, 256))
