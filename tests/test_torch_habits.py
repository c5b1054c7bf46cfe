"""Issue 12, points 6 and 7: no silent wrong numbers from torch habits
(torch's keyword names, seq-first modules), and every seed-style module
layout converts by from_torch (q_linear/..., q_proj/o_proj, per-head lists,
an explicit name mapping), with the keep-polarity mask given explicitly.
Each layout is checked against the torch module's own forward, and
mha_ext.compare runs on it.

Legend: B batch, S sequence length, E = d_model, H = n_heads, Dk = E / H.
"""
import math
import pickle

import numpy as np
import pytest

import mha_ext
from mha_ext import MultiHeadAttention
from _support import require_torch

torch = require_torch()
from torch import nn  # noqa: E402

E, H, B, S = 8, 2, 2, 5
DK = E // H
TOL = {"float32": 2e-5, "float64": 1e-10}


def rng_x(*shape, seed=0, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def assert_close(ours, theirs, dtype="float64"):
    theirs = theirs.detach().numpy() if hasattr(theirs, "detach") else theirs
    assert ours.shape == theirs.shape
    assert np.array_equal(np.isnan(ours), np.isnan(theirs))
    ok = ~np.isnan(ours)
    assert np.abs(ours[ok] - theirs[ok]).max() <= TOL[dtype]


# ---------------------------------------------------------------- point 6: keywords

@pytest.mark.parametrize("kw,ours", [(dict(embed_dim=E, num_heads=H), "d_model"),
                                     (dict(d_model=E, num_heads=H), "n_heads")])
def test_torch_constructor_keywords_name_ours(kw, ours):
    with pytest.raises(TypeError, match=f"mha_ext spells it '{ours}'"):
        MultiHeadAttention(**kw)


def test_batch_first_keyword_says_what_to_do():
    with pytest.raises(TypeError, match=r"batch_first = False"):
        MultiHeadAttention(E, H, batch_first=False)
    m = MultiHeadAttention(E, H, seed=0)
    with pytest.raises(TypeError, match=r"in a call.*batch_first = False"):
        m(rng_x(B, S, E), batch_first=False)


@pytest.mark.parametrize("method", ["forward", "__call__", "forward_train"])
def test_average_attn_weights_names_ours(method):
    m = MultiHeadAttention(E, H, seed=0)
    with pytest.raises(TypeError, match="mha_ext spells it 'average_weights'"):
        getattr(m, method)(rng_x(B, S, E), average_attn_weights=True)


class _Head(nn.Module):
    # the nanoGPT lecture's Head: causal through its own tril buffer
    def __init__(self, E, hs, T=8, kind="tril"):
        super().__init__()
        self.key, self.query, self.value = (nn.Linear(E, hs, bias=False) for _ in range(3))
        if kind == "tril":
            self.register_buffer("tril", torch.tril(torch.ones(T, T)))
        elif kind == "triu":  # True = blocked, as a bool mask
            self.register_buffer("mask", torch.ones(1, 1, T, T, dtype=torch.bool).triu(1))
        elif kind == "per-head":  # one tril per head of a batch of heads
            self.register_buffer("tril", torch.ones(3, T, T).tril())
            self.register_buffer("eye", torch.eye(T))  # square, not causal: no matter
        else:                 # additive: -inf above the diagonal
            self.register_buffer("bias", torch.full((T, T), -math.inf).triu(1))
        self.kind = kind

    def forward(self, x):
        T = x.shape[1]
        k, q = self.key(x), self.query(x)
        w = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5
        if self.kind == "tril":
            w = w.masked_fill(self.tril[:T, :T] == 0, -math.inf)
        elif self.kind == "per-head":
            w = w.masked_fill(self.tril[0, :T, :T] == 0, -math.inf)
        elif self.kind == "triu":
            w = w.masked_fill(self.mask[0, 0, :T, :T], -math.inf)
        else:
            w = w + self.bias[:T, :T]
        return w.softmax(-1) @ self.value(x)


class _Heads(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.heads = nn.ModuleList([_Head(12, 4, kind=kind) for _ in range(3)])
        self.proj = nn.Linear(12, 12)

    def forward(self, x):
        return self.proj(torch.cat([h(x) for h in self.heads], -1))


@pytest.mark.parametrize("kind", ["tril", "triu", "additive", "per-head"])
def test_a_module_with_its_own_causal_buffer_is_converted_only_when_told(kind):
    """from_torch copies the projections, not the forward: a seed module
    holding a causal mask buffer is a ValueError naming it until causal= is
    given; causal=True makes every call of the copy causal (torch's
    numbers, through the call, trace, forward_train and compare, kept by
    pickle), causal=False leaves calls as given."""
    torch.manual_seed(0)
    mod = _Heads(kind).double()
    xt = torch.randn(2, 6, 12, dtype=torch.float64)
    want = mod(xt).detach().numpy()
    buffer = {"tril": "heads.0.tril", "triu": "heads.0.mask", "additive": "heads.0.bias",
              "per-head": "heads.0.tril"}[kind]
    with pytest.raises(ValueError, match=f"'{buffer}' shaped as a causal mask.*causal=True"):
        MultiHeadAttention.from_torch(mod)
    with pytest.raises(ValueError, match="causal mask"):
        mha_ext.compare(mod, xt)
    m = MultiHeadAttention.from_torch(mod, causal=True)
    x = xt.numpy()
    assert m.causal is True
    np.testing.assert_allclose(m(x)[0], want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(m(x, is_causal=False)[0], want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(m.trace(x).output, want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(m.forward_train(x).output, want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(pickle.loads(pickle.dumps(m))(x)[0], want, rtol=0, atol=1e-12)
    row = mha_ext.compare(mod, xt, from_torch_options={"causal": True})[0]
    assert row.mha_ext_error < 1e-12, row
    plain = MultiHeadAttention.from_torch(mod, causal=False)
    assert plain.causal is False
    np.testing.assert_allclose(plain(x, is_causal=True)[0], want, rtol=0, atol=1e-12)
    assert np.abs(plain(x)[0] - want).max() > 1e-3
    m.causal = False
    np.testing.assert_array_equal(m(x)[0], plain(x)[0])


def test_a_causal_modules_calls_traces_and_caches():
    """On a module with causal = True every false truth value of is_causal
    is causal (None, 0, a false 0-d array, as for a plain module's False),
    the trace's steps are the causal ones (weights above the diagonal 0,
    the masked scores -inf there), a cross-attention cache's call is not
    made causal (its memory has no order), and repr says causal=True."""
    m = MultiHeadAttention(8, 2, seed=0).eval()
    x = np.random.default_rng(0).standard_normal((1, 5, 8))
    want = m(x, is_causal=True)[0]
    m.causal = True
    assert "causal=True" in repr(m)
    for flag_ in (False, None, 0, np.False_, np.array(False)):
        np.testing.assert_array_equal(m(x, is_causal=flag_)[0], want)
    tr = m.trace(x)
    above = np.triu(np.ones((5, 5), bool), 1)
    assert (tr["softmax"].array[..., above] == 0).all()
    assert np.isneginf(tr["masked scores"].array[..., above]).all()
    np.testing.assert_allclose(tr.output, want, rtol=0, atol=1e-6)
    memory = np.random.default_rng(1).standard_normal((1, 7, 8))
    plain = MultiHeadAttention(8, 2, seed=0).eval()
    np.testing.assert_array_equal(m(x, cache=m.cache_memory(memory))[0], plain(x, memory)[0])


def test_trace_and_from_torch_name_ours():
    # trace's message named forward(); from_torch gave Python's "unexpected
    # keyword argument 'num_heads'" although it takes n_heads=
    m = MultiHeadAttention(E, H, seed=0)
    with pytest.raises(TypeError, match=r"^trace\(\) got torch's keyword "
                                        r"'average_attn_weights'; mha_ext spells it"):
        m.trace(rng_x(B, S, E), average_attn_weights=True)
    ref = torch.nn.MultiheadAttention(E, H)
    with pytest.raises(TypeError, match="from_torch.*'num_heads'; mha_ext spells it 'n_heads'"):
        MultiHeadAttention.from_torch(ref, num_heads=H)
    with pytest.raises(TypeError, match="'embed_dim': the copy takes its width"):
        MultiHeadAttention.from_torch(ref, embed_dim=E)
    with pytest.raises(TypeError, match="unexpected keyword argument 'heads'"):
        MultiHeadAttention.from_torch(ref, heads=H)


def test_torch_adapter_names_ours_too():
    import mha_ext.torch as mt

    a = mt.MultiHeadAttention(E, H, seed=0)
    with pytest.raises(TypeError, match="mha_ext spells it 'average_weights'"):
        a(torch.zeros(B, S, E), average_attn_weights=False)


def test_other_unknown_keywords_stay_pythons_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        MultiHeadAttention(E, H, seed=0)(rng_x(B, S, E), bogus=1)


# ---------------------------------------------------------------- point 6: seq-first

@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_seq_first_copy_takes_torchs_layout(dtype):
    torch.manual_seed(0)
    t = nn.MultiheadAttention(E, H, dtype=getattr(torch, dtype)).eval()  # batch_first=False
    m = MultiHeadAttention.from_torch(t)
    assert m.batch_first is False
    q, k = rng_x(S, B, E, dtype=dtype), rng_x(S + 2, B, E, seed=1, dtype=dtype)
    kpm = np.zeros((B, S + 2), bool)
    kpm[1, -3:] = True
    out, w = m(q, k, k, key_padding_mask=kpm, average_weights=True)
    with torch.no_grad():
        t_out, t_w = t(*(torch.from_numpy(x) for x in (q, k, k)),
                       key_padding_mask=torch.from_numpy(kpm))
    assert out.shape == (S, B, E) and out.flags.c_contiguous
    assert_close(out, t_out, dtype)
    assert_close(w, t_w, dtype)
    # self-attention and unbatched inputs too
    with torch.no_grad():
        assert_close(m(q)[0], t(*(torch.from_numpy(q),) * 3)[0], dtype)
        assert_close(m(q[:, 0])[0], t(*(torch.from_numpy(q[:, 0]),) * 3)[0], dtype)


def test_seq_first_shape_errors_quote_the_shapes_passed():
    """The drop-in class with batch_first=False (torch's default) checks the
    transposed (B, S, E) inputs: its message also gives the shapes the caller
    passed, so that (S, B, E) mistakes read as they were made."""
    from mha_ext.torch import MultiheadAttention
    m = MultiheadAttention(E, H)
    with pytest.raises(ValueError, match=r"you passed query \(4, 2, 8\), key \(5, 3, 8\)"):
        m(torch.randn(4, 2, E), torch.randn(5, 3, E), torch.randn(5, 3, E))
    # and the NumPy module from a seq-first torch module (its checks see (B, S, E))
    n = MultiHeadAttention.from_torch(nn.MultiheadAttention(E, H))
    with pytest.raises(ValueError, match=r"you passed query \(4, 2, 8\), key \(5, 3, 8\)"):
        n(rng_x(4, 2, E), rng_x(5, 3, E, seed=1), rng_x(5, 3, E, seed=2))
    with pytest.raises(ValueError, match=r"attn_mask.*you passed query \(4, 2, 8\)"):
        n(rng_x(4, 2, E), attn_mask=np.zeros((3, 3), bool))


def test_batch_first_attribute_survives_copies_and_is_checked():
    m = MultiHeadAttention(E, H, seed=0)
    assert m.batch_first is True and m.mask_polarity == "block"
    m.batch_first = False
    m.mask_polarity = "keep"
    c = pickle.loads(pickle.dumps(m))
    assert c.batch_first is False and c.mask_polarity == "keep"
    # repr shows both: they change what a call computes (API.md §2)
    assert repr(c).endswith(", batch_first=False, mask_polarity='keep')")
    assert "batch_first" not in repr(MultiHeadAttention(E, H))
    with pytest.raises(TypeError, match="batch_first"):
        m.batch_first = [True]
    with pytest.raises(ValueError, match="mask_polarity"):
        m.mask_polarity = "zero"


@pytest.mark.parametrize("attr,value,word", [("batch_first", False, "batch-first"),
                                             ("mask_polarity", "keep", "block polarity")])
def test_training_and_trace_refuse_other_layouts(attr, value, word):
    # the methods and the functions behind them alike (the functions once
    # ran such a module as batch-first, block polarity: other numbers)
    from mha_ext import autograd
    m = MultiHeadAttention(E, H, seed=0)
    setattr(m, attr, value)
    for call in (m.forward_train, m.trace, lambda x: autograd.forward_train(m, x),
                 lambda x: mha_ext.trace(m, x)):
        with pytest.raises(ValueError, match=word):
            call(rng_x(B, S, E))


# ---------------------------------------------------------------- point 7: layouts

def attend(q, k, v, lq, lk, lv, lo, h, mask, blocked):
    """Multi-head attention with torch ops over four Linear layers; `blocked`
    is the value of `mask` that blocks."""
    B, d_k = q.size(0), lq.out_features // h
    q, k, v = (lin(x).view(B, -1, h, d_k).transpose(1, 2) for lin, x in
               ((lq, q), (lk, k), (lv, v)))
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == blocked, float("-inf"))
    ctx = torch.softmax(scores, -1) @ v
    return lo(ctx.transpose(1, 2).reshape(B, -1, h * d_k))


def attend_per_head(q, k, v, qs, ks, vs, lo, mask):
    outs = []
    for lq, lk, lv in zip(qs, ks, vs):
        s = lq(q) @ lk(k).transpose(-2, -1) / math.sqrt(lq.out_features)
        if mask is not None:
            s = s.masked_fill(mask == 1, float("-inf"))
        outs.append(torch.softmax(s, -1) @ lv(v))
    return lo(torch.cat(outs, -1))


class QLinear(nn.Module):
    """The teaching texts' other layout: mask == 0 blocks, returns output only."""

    def __init__(self, h, d_model):
        super().__init__()
        self.d_k, self.h = d_model // h, h
        self.q_linear = nn.Linear(d_model, d_model)
        self.k_linear = nn.Linear(d_model, d_model)
        self.v_linear = nn.Linear(d_model, d_model)
        self.out_linear = nn.Linear(d_model, d_model)

    def forward(self, q, k, v, mask=None):
        return attend(q, k, v, self.q_linear, self.k_linear, self.v_linear,
                      self.out_linear, self.h, mask, 0)


class Proj(nn.Module):
    """Hugging Face naming: q_proj, k_proj, v_proj, o_proj, num_heads, no bias."""

    def __init__(self, h, d_model):
        super().__init__()
        self.num_heads, self.head_dim = h, d_model // h
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    def forward(self, x, mask=None):
        return attend(x, x, x, self.q_proj, self.k_proj, self.v_proj, self.o_proj,
                      self.num_heads, mask, 0)


class Head(nn.Module):
    def __init__(self, d_model, d_k):
        super().__init__()
        self.query = nn.Linear(d_model, d_k)
        self.key = nn.Linear(d_model, d_k)
        self.value = nn.Linear(d_model, d_k)


class PerHead(nn.Module):
    """One small module per head (heads), concatenated, then proj."""

    def __init__(self, h, d_model):
        super().__init__()
        self.heads = nn.ModuleList(Head(d_model, d_model // h) for _ in range(h))
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, q, k, v, mask=None):
        return attend_per_head(q, k, v, [h.query for h in self.heads],
                               [h.key for h in self.heads], [h.value for h in self.heads],
                               self.proj, mask)


class ListedProjections(nn.Module):
    """W_q, W_k, W_v as ModuleLists of per-head Linear, W_o one Linear."""

    def __init__(self, h, d_model):
        super().__init__()
        d_k = d_model // h
        self.W_q, self.W_k, self.W_v = (nn.ModuleList(nn.Linear(d_model, d_k)
                                                      for _ in range(h)) for _ in range(3))
        self.W_o = nn.Linear(d_model, d_model)

    def forward(self, q, k, v, mask=None):
        return attend_per_head(q, k, v, self.W_q, self.W_k, self.W_v, self.W_o, mask)


class Custom(nn.Module):
    """Projections under names no rule knows: needs names=."""

    def __init__(self, h, d_model):
        super().__init__()
        self.n_heads = h
        self.wq, self.wk, self.wv, self.fc = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, q, k, v, mask=None):
        return attend(q, k, v, self.wq, self.wk, self.wv, self.fc, self.n_heads, mask, 1)


def build(cls, seed=0):
    torch.manual_seed(seed)
    mod = cls(H, E).double().eval()
    with torch.no_grad():
        for n, p in mod.named_parameters():
            if n.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    return mod


def keep_mask():
    # (B, 1, S, S): 1 = attend; a causal pattern, plus padding in batch 1
    keep = np.tril(np.ones((S, S), np.int64))[None, None].repeat(B, 0)
    keep[1, :, :, -2:] = 0
    keep[1, :, :, 0] = 1
    return keep


@pytest.mark.parametrize("cls,kw", [(QLinear, dict(mask_polarity="keep")),
                                    (PerHead, {}), (ListedProjections, {}),
                                    (Custom, dict(names={"W_q": "wq", "W_k": "wk",
                                                         "W_v": "wv", "W_o": "fc"}))])
def test_layouts_convert(cls, kw):
    t = build(cls)
    m = MultiHeadAttention.from_torch(t, **kw)
    assert (m.d_model, m.n_heads, m.dtype) == (E, H, np.float64)
    q, k = rng_x(B, S, E), rng_x(B, S, E, seed=1)
    mask = keep_mask() if cls is QLinear else 1 - keep_mask()
    # per-head modules score (B, S, S) per head: their mask has no head axis
    theirs = mask[:, 0] if cls in (PerHead, ListedProjections) else mask
    with torch.no_grad():
        want = t(*(torch.from_numpy(x) for x in (q, k, k)), torch.from_numpy(theirs))
    got, _ = m(q, k, k, mask)
    assert_close(got, want)
    # without a mask too
    with torch.no_grad():
        want = t(*(torch.from_numpy(x) for x in (q, k, k)))
    assert_close(m(q, k, k)[0], want)


def test_hugging_face_naming_with_o_proj():
    t = build(Proj)
    m = MultiHeadAttention.from_torch(t, mask_polarity="keep")
    assert m.bias is False
    x = rng_x(B, S, E)
    with torch.no_grad():
        want = t(torch.from_numpy(x), torch.from_numpy(keep_mask()))
    assert_close(m(x, mask=keep_mask())[0], want)


def test_names_with_a_star_for_per_head_lists():
    t = build(PerHead)
    names = {"W_q": "heads.*.query", "W_k": "heads.*.key", "W_v": "heads.*.value",
             "W_o": "proj"}
    a = MultiHeadAttention.from_torch(t, names=names)
    b = MultiHeadAttention.from_torch(t)
    for k, v in a.state_dict().items():
        np.testing.assert_array_equal(v, b.state_dict()[k])


def test_keep_polarity_is_never_guessed():
    # the q_linear module blocks where mask == 0; without mask_polarity="keep"
    # the mask reads 1 = blocked, and the numbers differ from the module's
    t = build(QLinear)
    q = rng_x(B, S, E)
    with torch.no_grad():
        want = t(*(torch.from_numpy(q),) * 3, torch.from_numpy(keep_mask())).numpy()
    got = MultiHeadAttention.from_torch(t)(q, mask=keep_mask())[0]
    assert not np.allclose(np.nan_to_num(got), want)
    with pytest.raises(ValueError, match="mask_polarity is 'keep'"):
        MultiHeadAttention.from_torch(t, mask_polarity="keep")(q, mask=keep_mask() * 2)


@pytest.mark.parametrize("names,word", [({"W_q": "wq"}, "must map each"),
                                        ({"W_q": "nope", "W_k": "wk", "W_v": "wv",
                                          "W_o": "fc"}, "'nope' is not a linear")])
def test_bad_names(names, word):
    with pytest.raises((ValueError, TypeError), match=word):
        MultiHeadAttention.from_torch(build(Custom), names=names)


def test_unknown_layout_says_how_to_name_it():
    with pytest.raises(TypeError, match="pass names="):
        MultiHeadAttention.from_torch(build(Custom))


def test_heads_unknown_says_n_heads():
    t = build(QLinear)
    del t.h, t.d_k
    with pytest.raises(ValueError, match="pass n_heads="):
        MultiHeadAttention.from_torch(t)
    assert MultiHeadAttention.from_torch(t, n_heads=4).n_heads == 4


# ---------------------------------------------------------------- compare on them

def test_compare_on_a_seed_style_module():
    t = build(QLinear).float()
    q = torch.from_numpy(rng_x(B, S, E, dtype=np.float32))
    mask = torch.from_numpy(keep_mask())
    table = mha_ext.compare(t, q, q, q, mask, from_torch_options={"mask_polarity": "keep"})
    assert len(table) == 1 and table[0].layer == "QLinear"
    assert table[0].nan_agree and table[0].mha_ext_error < 1e-5


@pytest.mark.parametrize("kind", [bool, np.int64])
def test_a_keep_polarity_module_reads_bool_and_int_keep_masks_alike(kind):
    # mask_polarity="keep": 1/True attends; torch's attn_mask is the other
    # polarity (True blocks), so torch gets ~keep
    torch.manual_seed(0)
    E, H, B, S = 8, 2, 2, 5
    t = nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    m = MultiHeadAttention.from_torch(t)
    m.mask_polarity = "keep"
    x = rng_x(B, S, E)
    keep = np.tril(np.ones((S, S), bool))
    keep[2, 0] = False                           # not only causal: a hole below the diagonal
    got = m(x, x, x, keep.astype(kind))[0]
    with torch.no_grad():
        want = t(*(torch.from_numpy(x),) * 3, attn_mask=torch.from_numpy(~keep))[0].numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
