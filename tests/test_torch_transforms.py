"""What autograd's other modes, torch.func and torch.onnx cannot get from
mha_ext is refused with a message naming mha_ext, never computed silently
wrong: each case below gave zeros, a dropped term or a constant graph
before (found by an audit against torch; see docs/API.md §4).

Legend: B batch, L query length, E = embed_dim, H = num_heads.
"""
import io
import warnings

import pytest

from _support import require_torch

torch = require_torch()
import mha_ext  # noqa: E402
import mha_ext.torch as mt  # noqa: E402

E, H, B, L = 8, 2, 2, 5
F64 = torch.float64


def _entry_points():
    torch.manual_seed(0)
    drop_in = mt.MultiheadAttention(E, H, batch_first=True, dtype=F64)
    own = mt.MultiHeadAttention(E, H, dtype=F64, seed=0)
    return {
        "drop-in": lambda x, **kw: drop_in(x, x, x, **kw)[0],
        "MultiHeadAttention": lambda x, **kw: own(x, **kw)[0],
        "SDPA twin": lambda x, **kw: mha_ext.scaled_dot_product_attention(x, x, x, **kw),
    }


ENTRY_POINTS = ["drop-in", "MultiHeadAttention", "SDPA twin"]


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_differentiating_through_the_incoming_gradient_is_refused(name):
    # torch.autograd.functional.jvp differentiates a vjp with respect to its
    # grad_outputs; a gradient penalty on later layers differentiates the
    # gradient through them: both gave wrong numbers (zeros, a dropped term)
    f = _entry_points()[name]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, L, E, generator=g, dtype=F64)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.functional.jvp(f, x, torch.randn_like(x))
    head = torch.nn.Linear(E, 1, dtype=F64)
    xx = x.clone().requires_grad_()
    out = torch.tanh(head(f(xx))).sum()
    gx, = torch.autograd.grad(out, xx, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(gx.pow(2).sum() + out, head.weight)
    # first derivatives still run (the loss, its gradient, no second one)
    gx2, = torch.autograd.grad(torch.tanh(head(f(xx))).sum(), xx)
    torch.testing.assert_close(gx2, gx.detach())


@pytest.mark.parametrize("name,mask", [(n, "attn_mask") for n in ENTRY_POINTS]
                         + [(n, "key_padding_mask") for n in ENTRY_POINTS[:2]])
def test_a_forward_mode_tangent_on_a_mask_is_refused(name, mask):
    import torch.autograd.forward_ad as fwAD
    f = _entry_points()[name]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, L, E, generator=g, dtype=F64)
    m = torch.randn((L, L) if mask == "attn_mask" else (B, L), generator=g, dtype=F64)
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match=f"{mask} carries a forward-mode tangent"):
            f(x, **{mask: fwAD.make_dual(m, torch.ones_like(m))})


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_torch_func_transforms_name_mha_ext(name):
    f = _entry_points()[name]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, L, E, generator=g, dtype=F64)
    m = torch.randn(L, L, generator=g, dtype=F64)
    with pytest.raises(RuntimeError, match="query is a tensor of a torch.func transform"):
        torch.func.grad(lambda t: f(t).sum())(x)
    with pytest.raises(RuntimeError, match="attn_mask is a tensor of a torch.func transform"):
        torch.func.jvp(lambda a: f(x, attn_mask=a), (m,), (m,))
    with pytest.raises(RuntimeError, match="functionalize"):
        torch.func.functionalize(f)(x)


def _functional_twin():
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, dtype=F64)

    def f(x, **kw):  # seq-first (L, B, E), as torch's functional takes it
        return mt.multi_head_attention_forward(
            x, x, x, E, H, ref.in_proj_weight, ref.in_proj_bias, None, None, False, 0.0,
            ref.out_proj.weight, ref.out_proj.bias, training=False, need_weights=False,
            **kw)[0]
    return f


@pytest.mark.parametrize("name", ENTRY_POINTS + ["functional twin"])
def test_vmap_jacfwd_and_hessian_name_mha_ext(name):
    # the functional twin made its call's module first, whose initialisation
    # draws: torch's "randomness error mode" message, which named no one
    # (and whose advice, randomness="same", led to torch's setup_context
    # error); the drop-in and the SDPA twin gave torch's setup_context error
    # under vmap (the autograd Function ran before the batched-tensor check)
    f = _functional_twin() if name == "functional twin" else _entry_points()[name]
    x = torch.randn(B, L, E, generator=torch.Generator().manual_seed(4), dtype=F64)
    with pytest.raises(RuntimeError, match="query is a batched tensor .*mha_ext"):
        torch.func.vmap(f)(x[None].repeat(2, 1, 1, 1))
    for transform in (torch.func.jacfwd, lambda g: torch.func.hessian(lambda t: g(t).sum())):
        with pytest.raises(RuntimeError, match="query is a tensor of a torch.func transform"):
            transform(f)(x)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_torchscript_onnx_export_is_refused(name, grad):
    # the TorchScript exporter inlined the autograd function: the C call's
    # result became one Constant node, the graph without inputs
    f = _entry_points()[name]

    class Model(torch.nn.Module):
        def forward(self, x):
            return f(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.set_grad_enabled(grad), pytest.raises(RuntimeError,
                                                         match="torch.onnx.export cannot record"):
            torch.onnx.export(Model(), (torch.randn(B, L, E, dtype=F64),), io.BytesIO(),
                              dynamo=False)
    f(torch.randn(B, L, E, dtype=F64))  # and outside the export, the call runs


def test_the_refusal_names_the_argument_transformed():
    # inside jacfwd/jacrev what the call derives from its arguments is
    # wrapped too: the drop-in named "query" for a transform over key
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(L, B, E, generator=g, dtype=F64) for _ in range(2))
    torch.manual_seed(0)
    m = mt.MultiheadAttention(E, H, dtype=F64)
    ref = torch.nn.MultiheadAttention(E, H, dtype=F64)
    q4, k4 = q[None], k[None]  # made outside the transform (inside, they are its tensors)
    cases = {
        "key": lambda x: m(q, x, x, need_weights=False)[0],
        "value": lambda x: mha_ext.scaled_dot_product_attention(q4, k4, x),
        "query": lambda x: mt.multi_head_attention_forward(
            x, k, k, E, H, ref.in_proj_weight, ref.in_proj_bias, None, None, False, 0.0,
            ref.out_proj.weight, ref.out_proj.bias, training=False)[0],
    }
    for name, f in cases.items():
        for transform in (torch.func.jacfwd, torch.func.jacrev):
            with pytest.raises(RuntimeError, match=f"^{name} is a tensor of a torch.func"):
                transform(f)(k)


@pytest.mark.parametrize("cls", ["drop-in", "MultiHeadAttention"])
def test_a_transform_of_the_parameters_alone_names_them_not_the_query(cls):
    # functional_call under grad: the query the caller passed is a plain
    # tensor; its conversion inside the call is the transform's, and the
    # refusal named "query"
    torch.manual_seed(0)
    m = (mt.MultiheadAttention(E, H, batch_first=True, dtype=F64) if cls == "drop-in"
         else mt.MultiHeadAttention(E, H, dtype=F64, seed=0))
    x = torch.randn(B, L, E, dtype=F64)
    p = {k: v.detach() for k, v in m.named_parameters()}
    with pytest.raises(RuntimeError, match="^a weight or bias of the attention is a tensor "
                                           "of a torch.func transform"):
        torch.func.grad(lambda p: torch.func.functional_call(m, p, (x, x, x))[0].sum())(p)
    # a transform of one input alone names that input (mha_ext.torch's
    # MultiHeadAttention named query for each: its inputs' conversions are
    # the transform's tensors too)
    calls = {"query": lambda t: m(t, x, x), "key": lambda t: m(x, t, x),
             "value": lambda t: m(x, x, t)}
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=f"^{name} is a tensor of a torch.func transform"):
            torch.func.grad(lambda t: call(t)[0].sum())(x)
