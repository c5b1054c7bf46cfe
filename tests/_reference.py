"""A float64 NumPy reference of the contract (API.md §3, §3.1), written
independently of the C core: the oracle of the hardening and property tests.

Legend: B batch, Sq query length, Sk key length, E = d_model, H = n_heads,
Dk = E / H.
"""
import numpy as np


def as_block_mask(mask, B, H, Sq, Sk):
    """The seed notebook's mask (0/1, 1 = blocked) broadcast to (B, H, Sq, Sk)."""
    return np.broadcast_to(np.asarray(mask) != 0, (B, H, Sq, Sk))


def reference(state, n_heads, query, key=None, value=None, mask=None, *, attn_mask=None,
              key_padding_mask=None, is_causal=False, masked_rows="nan"):
    """(output, weights) of a call, in float64, batched or unbatched like the
    module.  `state` is a state_dict() (keys W_q.weight, ... W_o.bias)."""
    f = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    q = f(query)
    k = q if key is None else f(key)
    v = k if value is None else f(value)
    batched = q.ndim == 3
    if not batched:
        q, k, v = q[None], k[None], v[None]
    B, Sq, E = q.shape
    Sk = k.shape[1]
    H = n_heads
    Dk = E // H

    def lin(x, name):
        y = x @ f(state[f"{name}.weight"]).T
        b = state.get(f"{name}.bias")
        return y if b is None else y + f(b)

    def heads(x, S):  # (B, S, E) -> (B, H, S, Dk)
        return x.reshape(B, S, H, Dk).transpose(0, 2, 1, 3)

    Q, K, V = heads(lin(q, "W_q"), Sq), heads(lin(k, "W_k"), Sk), heads(lin(v, "W_v"), Sk)
    with np.errstate(all="ignore"):
        s = Q @ K.transpose(0, 1, 3, 2) / np.sqrt(Dk)            # (B, H, Sq, Sk)
        blocked = np.zeros((B, H, Sq, Sk), dtype=bool)
        if mask is not None:
            blocked |= as_block_mask(mask, B, H, Sq, Sk)  # right-aligned, as NumPy
        if attn_mask is not None:
            a = np.asarray(attn_mask)
            if a.ndim == 3:
                a = a.reshape(B, H, Sq, Sk)
            if a.dtype == bool:
                blocked |= np.broadcast_to(a, (B, H, Sq, Sk))
            else:
                s = s + f(a)
        if key_padding_mask is not None:
            p = np.asarray(key_padding_mask).reshape(B, 1, 1, Sk)
            if p.dtype == bool:
                blocked |= np.broadcast_to(p, (B, H, Sq, Sk))
            else:
                s = s + f(p)
        if is_causal:
            blocked |= np.triu(np.ones((Sq, Sk), dtype=bool), k=1)
        s = np.where(blocked, -np.inf, s)
        if Sk > 0:
            mx = s.max(axis=-1, keepdims=True)
            dead = mx == -np.inf                                   # no key visible
        else:  # no key at all: an empty sum, context 0, as in every torch path
            mx = np.zeros((B, H, Sq, 1))
            dead = np.zeros((B, H, Sq, 1), dtype=bool)
        e = np.exp(s - np.where(dead, 0.0, mx))
        w = e / e.sum(axis=-1, keepdims=True)
        fill = 0.0 if masked_rows == "zero" else np.nan
        w = np.where(dead, fill, w)
        ctx = w @ V                                                # (B, H, Sq, Dk)
        ctx = np.where(dead, fill, ctx)
        out = lin(ctx.transpose(0, 2, 1, 3).reshape(B, Sq, E), "W_o")
    if not batched:
        return out[0], w[0]
    return out, w


def assert_close(got, want, dtype, what=""):
    """Equal within the rounding of `dtype`, with NaN exactly where the
    reference has NaN."""
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    tol = 2e-4 if np.dtype(dtype) == np.float32 else 1e-10
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN positions")
    ok = ~np.isnan(want)
    scale = max(1.0, float(np.max(np.abs(want[ok]), initial=0.0)))
    np.testing.assert_allclose(got[ok], want[ok], rtol=tol, atol=tol * scale, err_msg=what)
