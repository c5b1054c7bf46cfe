"""What mha_ext's torch backward needs travels as autograd's saved tensors.

The projections, the inputs' and parameters' copies, the masks (the torch
classes) and q, k, v (the SDPA twin) were NumPy arrays on the autograd
context: torch.utils.checkpoint (non-reentrant, transformers'
gradient_checkpointing_enable default) could not free them, nor could
saved-tensor hooks (torch.autograd.graph.save_on_cpu) see them.  Now the
context holds no array of any size, the hooks see them all, and the
gradients are unchanged.

Legend: B batch, S length, E = embed_dim, H = num_heads.
"""
import numpy as np
import pytest

from _support import require_torch

torch = require_torch()
import mha_ext  # noqa: E402
import mha_ext.torch as mt  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

B, S, E, H, LAYERS = 2, 64, 32, 4, 3


def _layers(kind):
    torch.manual_seed(0)
    if kind == "SDPA twin":
        lin = [torch.nn.Linear(E, 3 * E, dtype=torch.float64) for _ in range(LAYERS)]

        def f(i, h, bias):
            q, k, v = lin[i](h).view(B, S, 3, H, E // H).permute(2, 0, 3, 1, 4)
            out = mha_ext.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            return out.transpose(1, 2).reshape(B, S, E) + h
        return f, lin
    cls = mt.MultiheadAttention if kind == "drop-in" else None
    mods = [cls(E, H, batch_first=True, dropout=0.1, dtype=torch.float64)
            if cls else mt.MultiHeadAttention(E, H, 0.1, dtype=torch.float64, seed=i)
            for i in range(LAYERS)]

    def f(i, h, bias):
        m = mods[i]
        if kind == "drop-in":
            return m(h, h, h, attn_mask=bias[0, 0], need_weights=False)[0] + h
        return m(h, attn_mask=bias[0, 0])[0] + h
    return f, mods


def _held_bytes(root):
    """Bytes of NumPy arrays (with memory of their own: no zero stride) that
    mha_ext's autograd contexts in the graph below `root` hold."""
    seen, total, stack = set(), 0, [root]

    def arrays(x, depth=0):
        if isinstance(x, np.ndarray):
            return x.nbytes if x.size and 0 not in x.strides else 0
        if depth > 3:
            return 0
        if isinstance(x, (tuple, list)):
            return sum(arrays(y, depth + 1) for y in x)
        slots = getattr(type(x), "__slots__", ())
        if slots and type(x).__module__.startswith("mha_ext"):
            return sum(arrays(getattr(x, s, None), depth + 1) for s in slots)
        return 0
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__.endswith("FunctionBackward"):  # ours: ctx is the node
            total += sum(arrays(v) for v in vars(node).values())
        stack.extend(fn for fn, _ in node.next_functions)
    return total


@pytest.mark.parametrize("kind", ["drop-in", "MultiHeadAttention", "SDPA twin"])
def test_checkpoint_frees_and_hooks_see_what_the_backward_needs(kind):
    f, mods = _layers(kind)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, E, generator=g, dtype=torch.float64)
    bias = torch.randn(1, H, S, S, generator=g, dtype=torch.float64, requires_grad=True)

    def run(mode):
        torch.manual_seed(5)  # the same dropout draws in every mode
        xx = x.clone().requires_grad_()
        seen = []

        def pack(t):
            seen.append(t.nbytes)
            return t
        h = xx
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for i in range(LAYERS):
                h = checkpoint(f, i, h, bias, use_reentrant=False) if mode == "checkpoint" \
                    else f(i, h, bias)
        held = _held_bytes(h.grad_fn)
        params = [p for m in mods for p in m.parameters()]
        grads = torch.autograd.grad(h.square().sum(), [xx, bias, *params])
        return held, sum(seen), grads
    held, packed, grads = run("plain")
    held_ck, _, grads_ck = run("checkpoint")
    # the contexts hold no array: everything went through the saved tensors
    # (the hooks saw at least the layers' q, k and v) ...
    assert held == 0 and held_ck == 0, (held, held_ck)
    assert packed >= LAYERS * 3 * B * S * E * 8
    # ... and checkpointing recomputes them to the same gradients
    for a, b in zip(grads, grads_ck):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_save_on_cpu_and_offloading_hooks_give_the_same_gradients():
    # a pack hook that keeps copies elsewhere and hands back ids: the
    # backward reads only what unpack returns
    f, mods = _layers("drop-in")
    x = torch.randn(B, S, E, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(1, H, S, S, dtype=torch.float64)
    torch.manual_seed(5)
    want = torch.autograd.grad(f(0, x, bias).square().sum(), x)[0]
    store = {}

    def pack(t):
        store[len(store)] = t.clone()
        return len(store) - 1
    torch.manual_seed(5)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda i: store[i]):
        out = f(0, x, bias)
    # the store holds what the backward reads (at least the projections)
    assert sum(t.nbytes for t in store.values()) >= 3 * B * S * E * 8
    got = torch.autograd.grad(out.square().sum(), x)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_an_input_changed_in_place_before_the_backward_is_an_error_as_in_torch():
    # the SDPA twin's backward read q, k, v as views of the inputs: a key
    # doubled in place gave other gradients without a word (torch raises)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 2, 4, 3, generator=g, dtype=torch.float64)
    k0 = torch.randn(1, 2, 5, 3, generator=g, dtype=torch.float64)
    for f in (mha_ext.scaled_dot_product_attention,
              torch.nn.functional.scaled_dot_product_attention):
        qq, k = q.clone().requires_grad_(), k0.clone()
        out = f(qq, k, k)
        k.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


def test_a_hook_that_changes_the_dtype_is_undone():
    # a pack hook that widens (or compresses) and an unpack that leaves it:
    # the backward reads the arrays as the forward made them
    m = mt.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8, requires_grad=True)
    want = torch.autograd.grad(m(x, x, x)[0].sum(), x)[0]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.double(), lambda t: t):
        out = m(x, x, x)[0]
    got = torch.autograd.grad(out.sum(), x)[0]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("lead", [(1, 2), (2,)])    # 4-D (torch: fused) and 3-D (math)
def test_a_float_mask_changed_in_place_before_the_twins_backward_is_an_error(lead):
    # its C backward reads the mask again: a key blocked in place after the
    # forward gave other gradients without a word (0.78 off); torch's fused
    # kernel saves the mask and raises (its 3-D math path keeps none)
    g = torch.Generator().manual_seed(7)
    q0 = torch.randn(*lead, 5, 8, generator=g)
    q = q0.clone().requires_grad_()
    mask = torch.zeros(5, 5)
    out = mha_ext.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    mask[:, 0] = float("-inf")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.square().sum().backward()
    # a bool mask is copied (as torch converts it): the forward's mask, no error
    want = torch.autograd.grad(mha_ext.scaled_dot_product_attention(
        q, q, q, attn_mask=torch.ones(5, 5, dtype=torch.bool)).square().sum(), q)[0]
    keep = torch.ones(5, 5, dtype=torch.bool)
    out = mha_ext.scaled_dot_product_attention(q, q, q, attn_mask=keep)
    keep[:, 0] = False
    torch.testing.assert_close(torch.autograd.grad(out.square().sum(), q)[0], want,
                               rtol=0, atol=0)


@pytest.mark.parametrize("need_weights", [True, False])
def test_the_torch_classes_differentiate_the_mask_the_forward_used(need_weights):
    # API.md §8: they copy the masks at the call (torch's weights path keeps
    # none; its need_weights=False path raises): the backward's numbers are
    # those of the forward's mask
    torch.manual_seed(0)
    m = mt.MultiheadAttention(16, 4, batch_first=True)
    x0 = torch.randn(2, 5, 16)

    def grad(change):
        x = x0.clone().requires_grad_()
        mask = torch.zeros(5, 5)
        out = m(x, x, x, attn_mask=mask, need_weights=need_weights)[0]
        if change:
            mask[:, 0] = -1e9
        return torch.autograd.grad(out.square().sum(), x)[0]
    torch.testing.assert_close(grad(True), grad(False), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["numpy", "inference"])
def test_a_float_mask_autograd_cannot_watch_is_copied_for_the_twins_backward(kind):
    # a NumPy float mask with tensors, or one made under inference_mode (no
    # version counter to check): changed in place before the backward, it
    # gave other gradients (5.2 off); now the backward reads the forward's
    g = torch.Generator().manual_seed(8)
    q0 = torch.randn(1, 2, 5, 8, generator=g)

    def grad(mask, change):
        q = q0.clone().requires_grad_()
        out = mha_ext.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        change(mask)
        return torch.autograd.grad(out.square().sum(), q)[0]
    want = grad(torch.zeros(5, 5), lambda m: None)
    if kind == "numpy":
        mask = np.zeros((5, 5), np.float32)
        got = grad(mask, lambda m: m.__setitem__((slice(None), 0), -np.inf))
    else:
        with torch.inference_mode():
            mask = torch.zeros(5, 5)

        def change(m):
            with torch.inference_mode():
                m[:, 0] = float("-inf")
        got = grad(mask, change)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_meta_mask_with_tensors_holding_data_is_refused():
    # torch's function read it as undefined memory (values like -1.7e10)
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(RuntimeError, match="attn_mask on the meta device .* with query, key, "
                                           "value holding data") as info:
        mha_ext.scaled_dot_product_attention(
            q, q, q, attn_mask=torch.full((5, 5), float("-inf"), device="meta"))
    assert isinstance(info.value, ValueError)         # ours (§7) and torch's device type
    qm = torch.empty(1, 2, 5, 8, device="meta")       # all on meta: torch's shapes
    assert mha_ext.scaled_dot_product_attention(qm, qm, qm).shape == (1, 2, 5, 8)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("which", ["attn_mask", "key_padding_mask"])
def test_a_learned_mask_changed_in_place_before_the_backward_is_torchs_too(need_weights,
                                                                            which):
    # a float mask that requires grad (a learned bias) was saved as an anchor
    # of create_graph's guard, so changing it in place after the forward was
    # autograd's in-place error, where torch's module (adding a copy of it)
    # runs the backward: the gradients of the input and of the mask's leaf
    # must be torch's, from the forward's mask
    got = {}
    for cls in (torch.nn.MultiheadAttention, mt.MultiheadAttention):
        torch.manual_seed(1)
        m = cls(16, 4, batch_first=True, dtype=torch.float64)
        x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
        base = torch.randn((5, 5) if which == "attn_mask" else (2, 5), dtype=torch.float64,
                           requires_grad=True)
        mask = base * 1.0
        out = m(x, x, x, need_weights=need_weights, **{which: mask})[0]
        with torch.no_grad():
            mask.add_(1.0)
        got[cls] = torch.autograd.grad(out.square().sum(), [x, base])
    for ours, theirs in zip(got[mt.MultiheadAttention], got[torch.nn.MultiheadAttention]):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)


def test_a_learned_mask_changed_in_place_keeps_the_double_backward_refused():
    # the mask, the only tensor requiring grad, still anchors the guard: a
    # second differentiation of its gradient is the double-backward error
    m = mt.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    base = torch.zeros(3, 3, dtype=torch.float64, requires_grad=True)
    mask = base * 1.0
    out = m(x, x, x, attn_mask=mask)[0]
    with torch.no_grad():
        mask.add_(1.0)
    (g,) = torch.autograd.grad(out.square().sum(), base, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(g.sum(), base)


def test_a_learned_mask_is_not_held_after_the_backward():
    # the copy the call saves is freed with the graph's buffers: the caller's
    # non-leaf mask dies after the backward though the output is kept, as
    # with torch's module (a reference kept on the autograd node held it)
    import gc
    import weakref
    for cls in (torch.nn.MultiheadAttention, mt.MultiheadAttention):
        torch.manual_seed(0)
        m = cls(16, 2, batch_first=True)
        bias = torch.nn.Parameter(torch.zeros(6, 7))
        q, k = torch.randn(2, 6, 16), torch.randn(2, 7, 16)
        mask = bias * 2.0
        ref = weakref.ref(mask)
        out, w = m(q, k, k, attn_mask=mask)
        del mask
        (out.sum() + w.sum()).backward()
        gc.collect()
        assert ref() is None, cls
        assert out.shape == (2, 6, 16) and bias.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lead", [(1, 2), (2,)])    # 4-D and 3-D: torch's math path for both
def test_a_learned_mask_changed_in_place_before_the_twins_backward_is_torchs_too(dtype, lead):
    # torch's SDPA takes a mask that requires grad on its math path, which
    # keeps no mask: changed in place after the forward, the backward runs on
    # the forward's.  The twin saved the caller's mask and raised autograd's
    # in-place error; it now saves a copy, as the torch classes do
    got = {}
    for f in (torch.nn.functional.scaled_dot_product_attention,
              mha_ext.scaled_dot_product_attention):
        g = torch.Generator().manual_seed(7)
        q = torch.randn(*lead, 5, 8, generator=g, dtype=dtype, requires_grad=True)
        base = torch.randn(5, 5, generator=g, dtype=dtype, requires_grad=True)
        mask = base * 1.0
        out = f(q, q, q, attn_mask=mask)
        with torch.no_grad():
            mask[:, 0] = float("-inf")
        got[f] = torch.autograd.grad(out.square().sum(), [q, base])
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    for ours, theirs in zip(*got.values()):
        torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)


def test_a_learned_mask_of_the_twin_keeps_the_double_backward_refused_and_is_not_held():
    import gc
    import weakref
    q = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    base = torch.zeros(3, 3, dtype=torch.float64, requires_grad=True)
    mask = base * 1.0
    out = mha_ext.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    with torch.no_grad():
        mask.add_(1.0)
    (g,) = torch.autograd.grad(out.square().sum(), base, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(g.sum(), base)
    # the copy is freed with the graph's buffers: the caller's mask dies
    # after the backward though the output is kept
    mask = base * 2.0
    ref = weakref.ref(mask)
    out = mha_ext.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    del mask
    out.sum().backward()
    gc.collect()
    assert ref() is None and base.grad is not None and out.shape == q.shape


@pytest.mark.parametrize("kind", ["drop-in", "SDPA twin"])
def test_an_expanded_learned_mask_is_copied_once_not_written_out(kind):
    # a learned bias shared by the batch (expanded: stride 0) was cloned,
    # which wrote it out B times over; the copy now keeps the broadcast,
    # and the gradients are still torch's (summed over the expanded dims)
    Bm, Hm, L, Sk, D = 4, 2, 5, 6, 8
    shape = (Bm * Hm, L, Sk) if kind == "drop-in" else (Bm, Hm, L, Sk)
    base_shape = (1, L, Sk) if kind == "drop-in" else (1, Hm, L, Sk)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(Bm, L, Hm * D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(Bm, Sk, Hm * D, generator=g, dtype=torch.float64)
    base = torch.randn(base_shape, generator=g, dtype=torch.float64, requires_grad=True)
    mods = [torch.nn.MultiheadAttention(Hm * D, Hm, batch_first=True, dtype=torch.float64)]
    mods.append(mt.MultiheadAttention.from_torch(mods[0]))
    got, saved = [], []

    def pack(t):
        if t.shape == shape and torch.equal(t, base.expand(shape)):
            saved.append(t.untyped_storage().nbytes())
        return t
    for ours in (False, True):
        mask = base.expand(shape)
        with torch.autograd.graph.saved_tensors_hooks(pack if ours else (lambda t: t),
                                                      lambda t: t):
            if kind == "drop-in":
                out = mods[ours](q, k, k, attn_mask=mask, need_weights=False)[0]
            else:
                f = (mha_ext.scaled_dot_product_attention if ours
                     else torch.nn.functional.scaled_dot_product_attention)
                heads = [t.view(Bm, -1, Hm, D).transpose(1, 2) for t in (q, k)]
                out = f(heads[0], heads[1], heads[1], attn_mask=mask)
        got.append(torch.autograd.grad(out.square().sum(), [q, base]))
    for ours, theirs in zip(got[1], got[0]):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    assert saved and max(saved) == base.numel() * base.element_size(), saved
