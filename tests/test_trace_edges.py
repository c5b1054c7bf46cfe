"""A trace at its edges (docs/API.md §6, §7): the legend sizes of a call
through a cross-attention cache (which passes no key), a step number out of
range, an infinite input, which the call takes without a word, and grouped
heads (n_kv_heads < n_heads): the formulas and the repeated K and V groups.

Legend: B batch, Sq query length, M the cached memory's length, E = d_model,
H = n_heads, Ek = kdim, Ev = vdim.
"""
import threading
import warnings

import numpy as np
import pytest

import mha_ext

E, H, EK, EV, B, SQ, M = 16, 4, 8, 12, 2, 3, 6
RNG = np.random.default_rng(0)


def test_a_cross_cache_trace_gives_the_modules_key_and_value_widths():
    m = mha_ext.MultiHeadAttention(E, H, kdim=EK, vdim=EV, seed=0).eval()
    mem = m.cache_memory(RNG.standard_normal((B, M, EK)), RNG.standard_normal((B, M, EV)))
    t = m.trace(RNG.standard_normal((B, SQ, E)), cache=mem)
    assert (t.sizes["Ek"], t.sizes["Ev"]) == (EK, EV)
    assert "Ek=%d, Ev=%d" % (EK, EV) in str(t).splitlines()[1]
    # the same widths as a trace given the memory as key and value
    plain = m.trace(RNG.standard_normal((B, SQ, E)), RNG.standard_normal((B, M, EK)),
                    RNG.standard_normal((B, M, EV)))
    assert (plain.sizes["Ek"], plain.sizes["Ev"]) == (EK, EV)


def test_a_step_number_out_of_range_is_a_value_error_naming_the_steps():
    t = mha_ext.MultiHeadAttention(E, H, seed=0).trace(np.ones((1, SQ, E), np.float32))
    with pytest.raises(ValueError, match="step 99 is out of range for a trace of") as info:
        t[99]
    assert isinstance(info.value, IndexError)       # as indexing the list of steps
    assert "softmax" in str(info.value)
    assert t[-1].name == "output projection"        # in range: as before
    assert [s.name for s in t] == t.names           # iteration stops at the end


def test_an_infinite_input_traces_without_numpys_warnings_as_the_call():
    m = mha_ext.MultiHeadAttention(E, H, seed=0).eval()
    x = RNG.standard_normal((B, 4, E)).astype(np.float32)
    x[1, 1, 0] = np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = m(x)
        t = m.trace(x)
    np.testing.assert_array_equal(np.isnan(t["output projection"].array), np.isnan(out))


def test_an_infinite_score_under_a_float_masks_minus_inf_traces_silently():
    # +inf (a projection overflowing) plus the mask's -inf: NaN, as in the call
    m = mha_ext.MultiHeadAttention(E, H, seed=0).eval()
    x = RNG.standard_normal((1, 4, E)).astype(np.float32)
    x[0, 0, :] = 3e38
    blk = np.where(np.triu(np.ones((4, 4)), 1) > 0, -np.inf, 0).astype(np.float32)
    hm = np.array([0.0, 1.0, 1.0, 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = m(x, attn_mask=blk, head_mask=hm)
        t = m.trace(x, attn_mask=blk, head_mask=hm)
    np.testing.assert_array_equal(np.isnan(t["output projection"].array), np.isnan(out))



class _EditedDuringTrace(mha_ext.MultiHeadAttention):
    """A module whose call is followed, before trace() reads the parameters,
    by another thread's edit: `how` "editing" (an editing() block), "load"
    (load_state_dict) or "none"."""
    how = "editing"

    def __call__(self, *args, **kwargs):
        result = super().__call__(*args, **kwargs)

        def edit():
            if self.how == "none":
                return
            if self.how == "editing":
                with self.editing():
                    self.W_q.weight[...] += 1
            else:
                state = self.state_dict()
                state["W_q.weight"] = state["W_q.weight"] + 1
                self.load_state_dict(state)
        worker = threading.Thread(target=edit)
        worker.start()
        worker.join(30)
        assert not worker.is_alive(), "the edit hung"
        return result


@pytest.mark.parametrize("how", ["editing", "load"])
def test_another_threads_edit_between_the_call_and_its_steps_is_refused(how):
    m = _EditedDuringTrace(E, H, seed=0).eval()
    m.how = how
    x = RNG.standard_normal((B, SQ, E)).astype(np.float32)
    # the steps would compute with W_q + 1 and show another output than the call's
    with pytest.raises(RuntimeError, match="another thread changed the module's parameters"):
        m.trace(x)
    # no edit meanwhile (the same module, its W_q edited before): traced
    m.how = "none"
    t = m.trace(x)
    np.testing.assert_allclose(t["output projection"].array, t.output, rtol=1e-5, atol=1e-6)
    assert np.array_equal(t.output, m(x)[0])


def test_a_cross_cache_trace_shows_no_causal_mask_and_its_softmax_is_the_calls():
    # a cross-attention cache's call has no causality: the trace showed the
    # lower-right mask of a self-attention cache (another softmax)
    m = mha_ext.MultiHeadAttention(8, 2, seed=0).eval()
    rng = np.random.default_rng(0)
    cache = m.cache_memory(rng.standard_normal((1, 5, 8)).astype(np.float32))
    t = m.trace(rng.standard_normal((1, 3, 8)).astype(np.float32), cache=cache)
    assert t.info["query_position"] == 0 and not t.info["blocked_by"]
    np.testing.assert_allclose(t["softmax"].array, t.weights, rtol=1e-6, atol=1e-7)


def test_query_position_is_where_the_queries_sit_among_the_keys():
    m = mha_ext.MultiHeadAttention(8, 2, seed=0).eval()
    x = np.random.default_rng(0).standard_normal((1, 6, 8)).astype(np.float32)
    cache = m.new_cache(1, 8)
    m(x[:, :4], cache=cache)                            # 4 keys cached
    assert m.trace(x[:, 4:5], cache=cache).info["query_position"] == 4
    kv = np.concatenate([x, x], 1)
    assert m.trace(x, kv, is_causal="lower_right").info["query_position"] == 6
    assert m.trace(x).info["query_position"] == 0


def test_the_output_projection_step_is_the_calls_output_bit_for_bit():
    m = mha_ext.MultiHeadAttention(64, 4, seed=0).eval()
    x = np.random.default_rng(0).standard_normal((2, 33, 64)).astype(np.float32)
    t = m.trace(x)
    assert np.array_equal(t["output projection"].array, m(x)[0])
    assert np.array_equal(t["output projection"].array, t.output)


def test_formulas_fold_the_offsets_and_gqa_keeps_the_query_path():
    import mha_ext
    m = mha_ext.MultiHeadAttention(16, 4, n_kv_heads=2, seed=0).eval()
    t = m.trace(np.ones((1, 3, 16)), np.ones((1, 5, 16)), is_causal="lower_right",
                window=(1, 0))
    formula = t["masked scores"].formula
    assert "j < i + 1" in formula and "j > i + 2 (window)" in formula, formula
    assert "[B, H, Sk, Dk]" not in t.shape_flow()


def test_grouped_heads_show_both_k_and_v_repeated():
    # each query head's keys and values, as the scores and the weighted sum read them
    import mha_ext
    m = mha_ext.MultiHeadAttention(16, 4, n_kv_heads=2, seed=0).eval()
    rng = np.random.default_rng(0)
    t = m.trace(rng.standard_normal((2, 3, 16)), rng.standard_normal((2, 5, 16)))
    names = [st.name for st in t]
    assert names.index("K groups") + 1 == names.index("V groups") < names.index("raw scores")
    for kv in "KV":
        heads, groups = t[f"{kv} heads"].array, t[f"{kv} groups"].array
        assert heads.shape == (2, 2, 5, 4) and groups.shape == (2, 4, 5, 4)
        for h in range(4):
            np.testing.assert_array_equal(groups[:, h], heads[:, h // 2])
        assert f"reads {kv} head h // 2" in t[f"{kv} groups"].formula
    # the weighted sum reads the V groups: each head's context is A·V of its group
    np.testing.assert_allclose(t["softmax"].array @ t["V groups"].array,
                               t["context"].array, rtol=1e-12, atol=1e-14)
