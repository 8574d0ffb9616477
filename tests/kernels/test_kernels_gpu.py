"""GPU forms of the lowering's TIR kernels, on a machine without a GPU: they are well formed,
bound to blocks and threads, and compile to sm_90 code.  Their numbers are checked on the H200
(bench/tree_verify.py: the GDN recurrence against the PyTorch recurrence; bench/gpu_forcing.py:
whole hybrid builds, chain and tree, against stock)."""

from __future__ import annotations

import pytest

from specpilot.kernels import gated_delta_rule, gdn_commit
from tests.kernel_helpers import sm90_source


@pytest.mark.parametrize("dk,dv", [(16, 12), (128, 128), (6, 5)])
def test_gdn_gpu_form_splits_dk_over_threads(dk, dv):
    text = gated_delta_rule(3, dk, dv, keep_states=True, gpu=True, tree=True).script()
    assert '"threadIdx.y"' in text and '"threadIdx.x"' in text and '"blockIdx.x"' in text
    # two barriers a token, the loop over pairs of tokens written out (a buffer of its own for each
    # token's operands, fetched a token ahead), one after the first token's k and q are in shared
    # memory, and the tree form's one before it, after the bits of the states to store
    assert "T.alloc_shared(" in text and text.count('tvm_storage_sync("shared"') == 2 * 2 + 2
    assert gated_delta_rule(3, dk, dv, keep_states=True, gpu=True).script().count('tvm_storage_sync("shared"') == 5
    # k and q wait in shared memory, the whole d_k of a token a buffer; in the registers form every
    # thread holds its own rows and no barrier waits for them
    assert text.count(f"T.alloc_shared(({dk},))") >= 4
    old = gated_delta_rule(3, dk, dv, keep_states=True, gpu=True, tree=True, operands="registers").script()
    assert old.count('tvm_storage_sync("shared"') == 5 and f"T.alloc_shared(({dk},))" not in old
    parts = 4 if dk % 4 == 0 else 2 if dk % 2 == 0 else 1
    assert f"T.thread_binding({parts}, thread=\"threadIdx.y\")" in text
    # value columns evolve independently: 27B-class heads (dv = 128) split over 4 blocks of 32
    cols = 32 if dv == 128 else dv
    assert f"T.thread_binding({cols}, thread=\"threadIdx.x\")" in text
    blocks = f"batch * {3 * dv // cols}"      # int32 indexing
    assert f"T.thread_binding({blocks}, thread=\"blockIdx.x\")" in text
    # the CPU form is untouched: a thread per value column, no shared memory
    cpu = gated_delta_rule(3, dk, dv, keep_states=True, gpu=False, tree=True).script()
    assert "shared" not in cpu and "thread_binding" not in cpu


def _token_loop(source: str, kernel: str) -> str:
    """The body of ``kernel``'s token loop (``for (int t2 ...) { ... }``) in CUDA source."""
    start = source.index("for (int t2", source.rindex(f" {kernel}_kernel("))   # the definition, after the declarations
    depth, i = 0, source.index("{", start)
    for j in range(i, len(source)):
        depth += {"{": 1, "}": -1}.get(source[j], 0)
        if depth == 0:
            return source[i:j]
    raise AssertionError("unbalanced braces")


def test_gdn_gpu_token_steps_have_only_their_own_barriers(tmp_path):
    """TVM's barrier pass adds none to a token step: two a step (the S^T k sums, the S^T q sums), two
    steps a loop iteration, for every split; a split or the parent state prefetched changes where, not
    how many."""
    forms = {"two": "{}", "split": "{'split': (8, 16)}", "prefetch": "{'split': (8, 16), 'parent': 'prefetch'}"}
    funcs = ", ".join(f"'{name}': gated_delta_rule(48, 128, 128, True, True, True, stack=(2, 1), **{kw})"
                      for name, kw in forms.items())
    text = sm90_source(tmp_path, "from specpilot.kernels import gated_delta_rule", "{" + funcs + "}")
    for name in forms:
        assert _token_loop(text, name).count("__syncthreads()") == 2 * 2, name
    # registers for 6 blocks of 128 threads an SM by default (80 a thread on sm_90), and int32 indices
    assert "__launch_bounds__(128, 6) two_kernel(" in text
    start = text.rindex(" two_kernel(")
    body = text[start:text.find('extern "C"', start) % (len(text) + 1)]
    assert "int64_t" not in body and "int " in body


def test_gdn_split_is_checked():
    with pytest.raises(ValueError, match="split=\\(3, 32\\)"):
        gated_delta_rule(3, 128, 128, keep_states=True, gpu=True, split=(3, 32))
    with pytest.raises(ValueError, match="parent='guess'"):
        gated_delta_rule(3, 128, 128, keep_states=True, gpu=True, tree=True, parent="guess")


def test_gdn_gpu_forms_compile_to_sm90_code_without_a_gpu(tmp_path):
    text = sm90_source(tmp_path, "from specpilot.kernels import gated_delta_rule, gdn_commit",
                       "{'tree': gated_delta_rule(4, 16, 12, True, True, True), "
                       "'chain': gated_delta_rule(4, 16, 12, True, True), "
                       "'step': gated_delta_rule(4, 16, 12, False, True), "
                       "'stacked': gated_delta_rule(4, 16, 12, True, True, True, stack=(3, 1)), "
                       "'registers': gated_delta_rule(4, 16, 12, True, True, True, operands='registers'), "
                       "'walk': gated_delta_rule(4, 16, 12, True, True, True, padding='walk'), "
                       "'commit': gdn_commit(3, 4, 16, 12, True), "
                       # fewer threads (4 x 5) than words of store bits (32): a round per 20 words
                       "'narrow': gated_delta_rule(3, 8, 5, True, True, True)}")
    for name in ("tree", "chain", "step", "stacked", "registers", "walk", "commit", "narrow"):
        assert f"{name}_kernel" in text


def test_gdn_operands_place_is_checked():
    with pytest.raises(ValueError, match="operands='global'"):
        gated_delta_rule(3, 16, 12, keep_states=True, gpu=True, operands="global")
    with pytest.raises(ValueError, match="padding='pad'"):
        gated_delta_rule(3, 16, 12, keep_states=True, gpu=True, padding="pad")
    with pytest.raises(ValueError, match="needs keep_states"):
        gated_delta_rule(3, 16, 12, keep_states=False, gpu=True, tree=True)


@pytest.mark.parametrize("tree", [False, True])
def test_gdn_gpu_form_walks_a_sequence_only_to_its_last_real_token(tree):
    """A batch pads every sequence to the longest: with ``skip`` a block finds its sequence's last token
    with a slot (a scan of its slots) and its token loop ends there, the padding past it written as 0;
    ``walk`` steps every block through all n tokens."""
    skip = gated_delta_rule(3, 16, 12, keep_states=True, gpu=True, tree=tree).script()
    walk = gated_delta_rule(3, 16, 12, keep_states=True, gpu=True, tree=tree, padding="walk").script()
    assert "for t2 in range((live[0] + 1) // 2):" in skip          # (int32 indices)
    assert "live[0] = c + 1" in skip and "if slots[bhc // 3, c] >= 0:" in skip   # 3 heads, 1 block each
    assert "for t in range(live[0], " in skip                       # the padding's outputs
    assert "for t2 in range((n + 1) // 2):" in walk and "live[0] =" not in walk
    assert skip.count('tvm_storage_sync("shared"') == walk.count('tvm_storage_sync("shared"')


@pytest.mark.parametrize("make", ["gdn_conv_verify", "gdn_conv_prefill"])
def test_gdn_conv_gpu_forms_spread_channels_over_blocks(make):
    """27B-class layers have 10240 conv channels: a block per (token, 256 channels), not one block
    looping over all of them."""
    from specpilot import kernels
    text = getattr(kernels, make)(10240, 4, "bfloat16", True).script()
    assert 'T.thread_binding(40, thread="blockIdx.y")' in text and 'T.thread_binding(256, thread="threadIdx.x")' in text


def test_gdn_conv_gpu_forms_compile_to_sm90_code_without_a_gpu(tmp_path):
    text = sm90_source(tmp_path, "from specpilot import kernels",
                       "{'tree': kernels.gdn_conv_verify(300, 4, 'bfloat16', True, True), "
                       "'prefill': kernels.gdn_conv_prefill(300, 4, 'bfloat16', True), "
                       "'stacked': kernels.gdn_conv_verify(300, 4, 'bfloat16', True, True, stack=(3, 1))}")
    assert "tree_kernel" in text and "prefill_kernel" in text and "stacked_kernel" in text and "blockIdx.y" in text
