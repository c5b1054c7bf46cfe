"""Parity with the seed notebook's torch module (tests/torch_seed.py).

Legend: B batch, Sq/Sk query/key length, E = d_model, H = n_heads, Dk = E/H.
float32 is held to rtol = atol = 2e-5 against torch float32, float64 to
rtol = atol = 1e-10 against torch float64; output and weights both.
"""

import numpy as np
import pytest

from mha_ext import MultiHeadAttention

DTYPES = ["float32", "float64"]

# (B, Sq, Sk, E, H): B = 1..4, Sq != Sk, odd lengths, Dk from 1 to 128.
SHAPES = [
    pytest.param(1, 1, 1, 1, 1, id="B1-S1-E1-H1-Dk1"),
    pytest.param(2, 3, 5, 4, 4, id="B2-Sq3-Sk5-E4-H4-Dk1"),
    pytest.param(3, 7, 4, 8, 2, id="B3-Sq7-Sk4-E8-H2-Dk4"),
    pytest.param(4, 5, 9, 16, 8, id="B4-Sq5-Sk9-E16-H8-Dk2"),
    pytest.param(1, 13, 11, 24, 4, id="B1-Sq13-Sk11-E24-H4-Dk6"),
    pytest.param(2, 9, 17, 40, 8, id="B2-Sq9-Sk17-E40-H8-Dk5"),
    pytest.param(2, 17, 1, 12, 2, id="B2-Sq17-Sk1-E12-H2-Dk6"),
    pytest.param(1, 1, 23, 32, 1, id="B1-Sq1-Sk23-E32-H1-Dk32"),
    pytest.param(3, 6, 6, 128, 1, id="B3-S6-E128-H1-Dk128"),
    pytest.param(2, 5, 3, 256, 2, id="B2-Sq5-Sk3-E256-H2-Dk128"),
    pytest.param(4, 31, 33, 64, 4, id="B4-Sq31-Sk33-E64-H4-Dk16"),
    pytest.param(1, 2, 65, 96, 2, id="B1-Sq2-Sk65-E96-H2-Dk48"),
    pytest.param(2, 19, 7, 56, 8, id="B2-Sq19-Sk7-E56-H8-Dk7"),
    pytest.param(2, 10, 10, 512, 8, id="seed-B2-S10-E512-H8"),
]


def check_parity(seed_ref, parity_record, helpers, B, Sq, Sk, E, H, dtype,
                 rng_seed=0, mask=None, where=""):
    ref, ours = seed_ref.pair(E, H, dtype=dtype, seed=rng_seed)
    rng = np.random.default_rng(rng_seed)
    q = rng.standard_normal((B, Sq, E)).astype(dtype)
    k = rng.standard_normal((B, Sk, E)).astype(dtype)
    v = rng.standard_normal((B, Sk, E)).astype(dtype)
    out, w = ours(q, k, v, mask=mask)
    out_ref, w_ref = seed_ref.run(ref, q, k, v, mask)
    assert out.shape == (B, Sq, E)
    assert w.shape == (B, H, Sq, Sk)
    assert out.dtype == np.dtype(dtype) and w.dtype == np.dtype(dtype)
    tol = helpers.TOL[dtype]
    where = where or f"B={B} Sq={Sq} Sk={Sk} E={E} H={H}"
    parity_record(dtype, f"{where} output", out, out_ref)
    parity_record(dtype, f"{where} weights", w, w_ref)
    helpers.assert_close(out, out_ref, what=f"output {dtype} {where}", **tol)
    helpers.assert_close(w, w_ref, what=f"weights {dtype} {where}", **tol)
    return out, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, Sq, Sk, E, H", SHAPES)
def test_parity_with_seed_module(seed_ref, parity_record, helpers,
                                 B, Sq, Sk, E, H, dtype):
    check_parity(seed_ref, parity_record, helpers, B, Sq, Sk, E, H, dtype)


def _random_configs(n, seed=1234):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        H = int(rng.choice([1, 2, 4, 8]))
        Dk = int(rng.choice([1, 2, 3, 5, 8, 13, 16, 31, 64, 128]))
        B = int(rng.integers(1, 5))
        Sq = int(rng.integers(1, 20))
        Sk = int(rng.integers(1, 20))
        if H * Dk > 256:
            Dk = 256 // H
        out.append(pytest.param(B, Sq, Sk, H * Dk, H, i,
                                id=f"r{i}-B{B}-Sq{Sq}-Sk{Sk}-H{H}-Dk{Dk}"))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, Sq, Sk, E, H, i", _random_configs(16))
def test_parity_random_configs(seed_ref, parity_record, helpers,
                               B, Sq, Sk, E, H, i, dtype):
    check_parity(seed_ref, parity_record, helpers, B, Sq, Sk, E, H, dtype,
                 rng_seed=100 + i)


@pytest.mark.parametrize("dtype", DTYPES)
def test_self_attention_defaults_match_torch(seed_ref, helpers, dtype):
    """key defaults to query and value to key: ours(q) == seed(q, q, q)."""
    ref, ours = seed_ref.pair(32, 4, dtype=dtype, seed=5)
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 7, 32)).astype(dtype)
    k = rng.standard_normal((2, 9, 32)).astype(dtype)
    tol = helpers.TOL[dtype]
    out, w = ours(q)
    out_ref, w_ref = seed_ref.run(ref, q, q, q)
    helpers.assert_close(out, out_ref, **tol)
    helpers.assert_close(w, w_ref, **tol)
    out, w = ours(q, k)
    out_ref, w_ref = seed_ref.run(ref, q, k, k)
    helpers.assert_close(out, out_ref, **tol)
    helpers.assert_close(w, w_ref, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unbatched_matches_batched_and_torch(seed_ref, helpers, dtype):
    """Unbatched (Sq, E) gives output (Sq, E) and weights (H, Sq, Sk)."""
    ref, ours = seed_ref.pair(24, 4, dtype=dtype, seed=6)
    rng = np.random.default_rng(6)
    q = rng.standard_normal((5, 24)).astype(dtype)
    k = rng.standard_normal((8, 24)).astype(dtype)
    v = rng.standard_normal((8, 24)).astype(dtype)
    out, w = ours(q, k, v)
    assert out.shape == (5, 24)
    assert w.shape == (4, 5, 8)
    out_ref, w_ref = seed_ref.run(ref, q[None], k[None], v[None])
    tol = helpers.TOL[dtype]
    helpers.assert_close(out, out_ref[0], **tol)
    helpers.assert_close(w, w_ref[0], **tol)


@pytest.mark.parametrize("edit", ["setitem", "augmented"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_inplace_parameter_edits_match_torch(seed_ref, torch, helpers, dtype,
                                             edit):
    """W_*.weight / .bias share the module's memory: edits change the next
    result exactly as the same edit changes the torch module's.
    "setitem": ``m.W_q.weight[...] = w``; "augmented": ``m.W_o.bias += 1``."""
    E, H = 16, 4
    ref, ours = seed_ref.pair(E, H, dtype=dtype, seed=7)
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 6, E)).astype(dtype) for _ in range(3))
    out0, _ = ours(q, k, v)

    if edit == "setitem":
        new_wq = (rng.standard_normal((E, E)) * 0.3).astype(dtype)
        ours.W_q.weight[...] = new_wq
        ours.W_v.weight[0, :] = 0.5
        ours.W_k.bias[3] = -2.0
        with torch.no_grad():
            ref.W_q.weight[...] = torch.from_numpy(new_wq)
            ref.W_v.weight[0, :] = 0.5
            ref.W_k.bias[3] = -2.0
    else:
        ours.W_o.bias += 1
        ours.W_q.weight *= 2
        with torch.no_grad():
            ref.W_o.bias += 1
            ref.W_q.weight *= 2

    out, w = ours(q, k, v)
    out_ref, w_ref = seed_ref.run(ref, q, k, v)
    assert not np.allclose(out, out0), "parameter edits had no effect"
    tol = helpers.TOL[dtype]
    helpers.assert_close(out, out_ref, **tol)
    helpers.assert_close(w, w_ref, **tol)


def test_torch_tensor_inputs(seed_ref, torch, helpers):
    """torch CPU tensors, also ones that require grad, are accepted."""
    ref, ours = seed_ref.pair(16, 2, seed=8)
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, 5, 16)).astype("float32")
               for _ in range(3))
    tq = torch.tensor(q, requires_grad=True)
    tk = torch.tensor(k, requires_grad=True)
    tv = torch.tensor(v)
    out_t, w_t = ours(tq, tk, tv)
    out_n, w_n = ours(q, k, v)
    assert isinstance(out_t, np.ndarray) and isinstance(w_t, np.ndarray)
    np.testing.assert_array_equal(out_t, out_n)
    np.testing.assert_array_equal(w_t, w_n)
    # float64 tensors into a float32 module are converted
    out_d, _ = ours(tq.double(), tk.double(), tv.double())
    np.testing.assert_array_equal(out_d, out_n)


def test_load_state_dict_accepts_torch_tensors(seed_ref, torch, helpers):
    ref, _ = seed_ref.pair(16, 4, seed=9)
    ours = MultiHeadAttention(16, 4, seed=123)
    ours.load_state_dict(ref.state_dict())
    ours.eval()
    sd = ours.state_dict()
    for name, t in ref.state_dict().items():
        np.testing.assert_array_equal(sd[name], t.numpy())
    rng = np.random.default_rng(9)
    q = rng.standard_normal((2, 5, 16)).astype("float32")
    out, w = ours(q)
    out_ref, w_ref = seed_ref.run(ref, q, q, q)
    helpers.assert_close(out, out_ref, **helpers.TOL["float32"])
    helpers.assert_close(w, w_ref, **helpers.TOL["float32"])


def test_float64_matches_numpy_float64(seed_ref, np_ref):
    """A float64 module really computes in float64 (1e-12 against a plain
    float64 NumPy forward pass, tighter than torch parity needs)."""
    ref64, ours64 = seed_ref.pair(64, 4, dtype="float64", seed=10)
    rng = np.random.default_rng(10)
    q = rng.standard_normal((2, 9, 64))
    out64, w64 = ours64(q)
    exact, wexact = np_ref.forward(ours64.state_dict(), 4, q)
    np.testing.assert_allclose(out64, exact, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(w64, wexact, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------
# need_weights=False: (output, None), the same output
# --------------------------------------------------------------------------

NW_SHAPES = [
    pytest.param(1, 1, 1, 4, 1, id="tiny"),
    pytest.param(2, 7, 5, 16, 4, id="B2-Sq7-Sk5-E16-H4"),
    pytest.param(3, 33, 65, 64, 8, id="B3-Sq33-Sk65-E64-H8"),
    pytest.param(2, 10, 10, 512, 8, id="seed"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_mask", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("B, Sq, Sk, E, H", NW_SHAPES)
def test_need_weights_false_same_output(helpers, B, Sq, Sk, E, H, dtype,
                                        with_mask):
    m = MultiHeadAttention(E, H, dtype=dtype, seed=11).eval()
    rng = np.random.default_rng(11)
    q = rng.standard_normal((B, Sq, E)).astype(dtype)
    k = rng.standard_normal((B, Sk, E)).astype(dtype)
    v = rng.standard_normal((B, Sk, E)).astype(dtype)
    mask = None
    if with_mask:
        mask = rng.random((B, 1, Sq, Sk)) < 0.3
        mask[0, 0, 0, :] = True  # one fully blocked row: NaN in both paths
    out_w, w = m(q, k, v, mask=mask, need_weights=True)
    res = m(q, k, v, mask=mask, need_weights=False)
    assert isinstance(res, tuple) and len(res) == 2
    out, none = res
    assert none is None
    assert out.shape == (B, Sq, E) and out.dtype == np.dtype(dtype)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == "float32" else \
        dict(rtol=1e-10, atol=1e-10)
    helpers.assert_close(out, out_w, what="need_weights=False output", **tol)
