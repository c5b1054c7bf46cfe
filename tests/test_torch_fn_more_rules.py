"""mha_ext._torch_fn, the drop-in's autograd Function and its routing: the
rules a second round of mutation testing found no test holding (a mutant of
each passed the torch test files before).  A recorded call without dropout
draws nothing from torch's generator, as torch's module; a value that is the
query (not the key) read as the value on the plain path; torch.jit.trace's
refusal naming every mask it cannot record, not the first alone;
MultiHeadAttention's blocking `mask` as a tensor not requiring grad taken
under grad mode (only one requiring grad is refused); a NaN or infinity on
the value path (the value, W_v, the output projection, bias_v) kept out of
the gradients of a loss on the weights alone (docs/API.md §8).

Each expectation is torch's nn.MultiheadAttention on the same parameters
(float64: 1e-10) doing the same, or the seed module of tests/torch_seed.py
(the mask's masked_fill, 1 = blocked).

Legend: B batch, L length, E = embed_dim, H = num_heads.
"""
import pytest

from _support import require_torch

torch = require_torch()

import mha_ext.torch as mt  # noqa: E402

from test_torch_fn_rules import B, E, F64, H, L, _pair, _x  # noqa: E402

TOL = dict(rtol=1e-10, atol=1e-10)


# ----------------------------------------------- dropout: torch's generator

@pytest.mark.parametrize("training", [True, False])
def test_a_recorded_call_without_dropout_draws_nothing(training):
    # dropout 0: no stream drawn, as torch's module draws none (a call after
    # it masks as it would have without it)
    ref, ours = _pair()
    x = _x().requires_grad_()
    for m in (ref, ours):
        m.train(training)
        before = torch.get_rng_state()
        out, w = m(x, x, x)
        assert out.requires_grad
        assert torch.equal(torch.get_rng_state(), before), type(m)


# ------------------------------------------- the plain path's aliased inputs

@pytest.mark.parametrize("batch_first", [True, False])
def test_a_value_that_is_the_query_is_read_as_the_value(batch_first):
    # m(q, k, q) with no grad: the value is the query's tensor, not the key's
    ref, ours = _pair(batch_first=batch_first)
    shape = (B, L, E) if batch_first else (L, B, E)
    q, k = _x(shape=shape, seed=1), _x(shape=shape, seed=2)
    with torch.no_grad():
        want, want_w = ref(q, k, q)
        got, got_w = ours(q, k, q)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_w, want_w, **TOL)


# ----------------------------------------------------- torch.jit.trace's refusal

@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_jit_trace_of_two_masks_names_both(grad):
    # API.md §8: the masks ride outside the traced op's inputs; the refusal
    # names each of them, not only the first
    import warnings
    _, ours = _pair(dtype=torch.float32)
    ours.eval()
    x = _x(torch.float32)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    am = torch.zeros(L, L)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.set_grad_enabled(grad), pytest.raises(RuntimeError) as info:
            torch.jit.trace(lambda a, k, m: ours(a, a, a, key_padding_mask=k, attn_mask=m)[0],
                            (x, kpm, am), check_trace=False)
    assert "attn_mask" in str(info.value) and "key_padding_mask" in str(info.value)


# ------------------------------------- MultiHeadAttention's blocking mask

@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_blocking_mask_tensor_not_requiring_grad_is_taken_under_grad_mode(kind):
    # API.md: `mask` 1 = blocked; only a mask that requires grad is refused
    # (it has no gradient): a fixed one is the seed module's masked_fill
    from torch_seed import make_seed_module
    seed = make_seed_module(E, H, dtype="float64")
    ours = mt.MultiHeadAttention(E, H, dtype=F64)
    ours.load_state_dict(seed.state_dict())
    mask = torch.triu(torch.ones(L, L, dtype=F64), 1)
    mask = mask.bool() if kind == "bool" else mask
    grads = []
    outs = []
    for m in (seed, ours):
        x = _x().requires_grad_()
        out = m(x, x, x, mask=mask)[0]
        out.sum().backward()
        outs.append(out.detach())
        grads.append(x.grad)
    torch.testing.assert_close(outs[1], outs[0], **TOL)
    torch.testing.assert_close(grads[1], grads[0], **TOL)


# ------------------------------------------ an attention-map loss, packed

def _weights_loss_grads(nan_at):
    # both modules' parameters after a loss on the attention weights alone,
    # the value (which the weights do not read) holding a nan at nan_at
    ref, ours = _pair()
    q, k, v = _x(seed=1), _x(seed=2), _x(seed=3)
    v[nan_at] = float("nan")
    xs = []
    for m in (ref, ours):
        x = q.clone().requires_grad_()
        w = m(x, k, v)[1]
        (w * w).sum().backward()
        xs.append(x.grad)
    return ref, ours, xs


def test_a_loss_on_the_weights_alone_gives_in_proj_zero_value_rows():
    # torch: the value's third of the packed in_proj gradient is zeros, the
    # weights not reading the value (whatever it holds: 0 * nan is nan where
    # that third was taken from the C backward's value gradient)
    ref, ours, _ = _weights_loss_grads((0, 1, 2))
    got, want = ours.in_proj_weight.grad[2 * E:], ref.in_proj_weight.grad[2 * E:]
    assert torch.equal(want, torch.zeros_like(want))
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(ours.in_proj_bias.grad[2 * E:], ref.in_proj_bias.grad[2 * E:],
                               **TOL)


@pytest.mark.parametrize("where", ["value", "W_v", "out_proj.weight", "out_proj.bias",
                                   "bias_v", "value inf"])
@pytest.mark.parametrize("kw", [dict(), dict(average_attn_weights=False, batch_first=False),
                                dict(kdim=6, vdim=10, dtype=torch.float32)])
def test_a_nan_on_the_value_path_stays_out_of_a_weights_only_loss_gradient(where, kw):
    # torch: the weights read only query and key, so their gradients are
    # finite whatever the value path holds; ours had NaN in the query's and
    # the q/k projections' (the C backward formed 0 * nan with the zero
    # output gradient)
    kw = dict(kw)
    dtype = kw.pop("dtype", F64)
    average = kw.pop("average_attn_weights", True)
    batch_first = kw.pop("batch_first", True)
    if where == "bias_v":
        kw["add_bias_kv"] = True
    ref, ours = _pair(dtype=dtype, batch_first=batch_first, **kw)
    shape = (lambda d: (B, L, d)) if batch_first else (lambda d: (L, B, d))
    q = _x(dtype, shape(E), seed=1)
    k, v = _x(dtype, shape(kw.get("kdim", E)), seed=2), _x(dtype, shape(kw.get("vdim", E)), 3)
    bad = float("inf") if where == "value inf" else float("nan")
    if where.startswith("value"):
        v[1, 1, 2] = bad
    with torch.no_grad():
        for m in (ref, ours):
            if where == "W_v":
                w = m.v_proj_weight if "kdim" in kw else m.in_proj_weight[2 * E:]
                w[3, 1] = bad
            elif where != "value" and where != "value inf":
                t = m.bias_v if where == "bias_v" else \
                    getattr(m.out_proj, where.split(".")[1])
                t.view(-1)[2] = bad
    got = []
    for m in (ref, ours):
        x = q.clone().requires_grad_()
        w = m(x, k, v, average_attn_weights=average)[1]
        (w * w).sum().backward()
        got.append([x.grad] + [p.grad for p in m.parameters()])
    tol = TOL if dtype == F64 else dict(rtol=1e-5, atol=1e-6)
    for want, ours_g in zip(*got):
        if want is None or ours_g is None:
            assert want is None and ours_g is None
            continue
        assert torch.isfinite(want).all()
        torch.testing.assert_close(ours_g, want, **tol)


# --------------------------------- bias_k never seen under the causal hint

def test_bias_kv_masked_for_every_query_by_the_causal_hint_get_zero_gradients():
    # torch's SDPA path with is_causal: bias_k / bias_v sit after the S keys,
    # which a query of L <= S rows never sees: their gradient is zeros (not
    # None: they were in the graph)
    ref, ours = _pair(add_bias_kv=True)
    x = _x()
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    for m in (ref, ours):
        out = m(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0]
        out.sum().backward()
    for name in ("bias_k", "bias_v"):
        want, got = getattr(ref, name).grad, getattr(ours, name).grad
        assert want is not None and got is not None, name
        torch.testing.assert_close(got, want, msg=name, **TOL)
