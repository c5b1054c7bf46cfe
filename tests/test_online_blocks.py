"""The online softmax across several blocks of keys, against torch.

Without weights the forward runs an online softmax over blocks of KB keys
(attend_impl.h, 512 keys): each block updates the row's running maximum and
sum and rescales the context accumulated so far.  The other tests mostly use
fewer keys than one block; here the keys span two to four blocks, the last
one partial, with the scores' scale growing along the keys (so that a later
block raises the running maximum and the rescaling matters), with causality
and key padding (blocks where a row sees nothing, or only part), on every
ISA the machine has, float32 and float64, against torch.
"""
import numpy as np
import pytest

import mha_ext

TOL = {"float32": 2e-5, "float64": 1e-10}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("Sk", [513, 1100, 1537])
@pytest.mark.parametrize("masking", ["none", "causal", "padding"])
def test_module_forward_across_key_blocks(torch, isa, dtype, Sk, masking):
    B, E, H = 2, 16, 2
    Sq = Sk if masking == "causal" else 7
    tdt = getattr(torch, dtype)
    torch.manual_seed(Sk)
    tm = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=tdt).eval()
    q = torch.randn(B, Sq, E, dtype=tdt)
    # keys growing in scale along the sequence: later blocks hold larger scores
    k = torch.randn(B, Sk, E, dtype=tdt) * torch.linspace(0.5, 3.0, Sk, dtype=tdt)[:, None]
    v = torch.randn(B, Sk, E, dtype=tdt)
    kw, ours_kw = {}, {}
    if masking == "causal":
        kw["attn_mask"] = torch.triu(torch.ones(Sq, Sk, dtype=torch.bool), 1)
        ours_kw["is_causal"] = True
    elif masking == "padding":
        pad = torch.zeros(B, Sk, dtype=torch.bool)
        pad[0, Sk // 3:] = True  # batch 0: only its first third visible
        pad[1, :512] = True      # batch 1: the whole first block blocked
        kw["key_padding_mask"] = pad
        ours_kw["key_padding_mask"] = pad.numpy()
    with torch.inference_mode():
        want = tm(q, k, v, need_weights=False, **kw)[0].numpy()
    ours = mha_ext.MultiHeadAttention.from_torch(tm).eval()
    got, w = ours(q.numpy(), k.numpy(), v.numpy(), need_weights=False, **ours_kw)
    assert w is None
    tol = TOL[dtype]
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_query_block_groups(torch, isa, dtype, need_weights):
    """Each attention task runs a group of consecutive blocks of 48 queries
    of one head (attend_pass_impl.h's attend_blocks_task), about 32 tasks a
    thread: with 8 heads and 22 blocks a head, 1 thread runs groups of 6
    blocks (the last of 4), 2 threads groups of 3 (the last of 1), 3
    threads groups of 2.  Every row against torch, and the same bits
    whatever the thread count."""
    B, E, H, Sq, Sk = 1, 64, 8, 21 * 48 + 10, 600
    tdt = getattr(torch, dtype)
    torch.manual_seed(7)
    tm = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=tdt).eval()
    q = torch.randn(B, Sq, E, dtype=tdt)
    k = torch.randn(B, Sk, E, dtype=tdt)
    v = torch.randn(B, Sk, E, dtype=tdt)
    with torch.inference_mode():
        want, want_w = tm(q, k, v, need_weights=need_weights, average_attn_weights=False)
    ours = mha_ext.MultiHeadAttention.from_torch(tm).eval()
    before = mha_ext.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 3):
            mha_ext.set_num_threads(n)
            runs.append(ours(q.numpy(), k.numpy(), v.numpy(), need_weights=need_weights,
                             average_weights=False))
    finally:
        mha_ext.set_num_threads(before)
    tol = TOL[dtype]
    for got, w in runs:
        np.testing.assert_allclose(got, want.numpy(), atol=tol, rtol=tol)
        if need_weights:
            np.testing.assert_allclose(w, want_w.numpy(), atol=tol, rtol=tol)
        else:
            assert w is None
    for got, w in runs[1:]:
        assert np.array_equal(got, runs[0][0])
        if need_weights:
            assert np.array_equal(w, runs[0][1])
