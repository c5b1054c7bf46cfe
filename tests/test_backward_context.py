"""A ForwardContext is differentiated only by a module of the configuration
that made it (docs/API.md §8: backward gives "the gradients of exactly the
call that made ctx"): two modules of one parameter count, seed and width
may differ in their heads (4 or 2, grouped or not) or their extra key, and
such a module's backward would compute another attention's gradients.

Legend: B batch, S length, E = d_model, H = n_heads, Hkv = n_kv_heads.
"""
import numpy as np
import pytest

import mha_ext

B, S, E = 2, 5, 16
RNG = np.random.default_rng(0)
X = RNG.standard_normal((B, S, E)).astype(np.float32)
G = RNG.standard_normal((B, S, E)).astype(np.float32)


@pytest.mark.parametrize("save", [False, True])
@pytest.mark.parametrize("made, other, says", [
    (dict(n_heads=4), dict(n_heads=2), "n_heads 4, not 2"),
    (dict(n_heads=4, n_kv_heads=2), dict(n_heads=2, n_kv_heads=1), "n_kv_heads 2, not 1"),
    (dict(n_heads=4), dict(n_heads=4, add_zero_attn=True), "add_zero_attn False, not True"),
])
def test_a_context_of_another_configuration_is_refused_by_name(save, made, other, says):
    a = mha_ext.MultiHeadAttention(E, seed=1, **made)
    b = mha_ext.MultiHeadAttention(E, seed=1, **other)
    assert a.num_parameters == b.num_parameters     # the old check let it through
    b.load_state_dict(a.state_dict())
    ctx = a.forward_train(X, dropout=0.0, save_projections=save)
    with pytest.raises(ValueError, match="different module .*" + says):
        b.backward(ctx, G)
    # its own module, and a copy of it, differentiate it
    right = a.backward(ctx, G)
    c = mha_ext.MultiHeadAttention(E, seed=1, **made)
    c.load_state_dict(a.state_dict())
    again = c.backward(ctx, G)
    for k in right:
        np.testing.assert_array_equal(right[k], again[k], err_msg=k)
