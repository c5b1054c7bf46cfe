"""Fuzz harness: the fuzzer's bytes become a module (widths, heads, dtype,
bias), inputs (shapes, strides, byte order, alignment, dtypes from bool to
strings), masks and call flags, and the module is called.  Bad input must be
a TypeError, ValueError, KeyError or MemoryError; anything else -- another
exception, a wrong result shape, a crash or a sanitizer report -- is a bug.

    python tests/fuzz/fuzz_mha.py -max_total_time=30      # atheris (libFuzzer flags)
    python tests/fuzz/fuzz_mha.py --random -max_total_time=30   # no atheris needed

tests/fuzz/run.sh runs it under AddressSanitizer; see README, "Hardening".
Legend: B batch, Sq/Sk lengths, E = d_model, H = n_heads.
"""
import os
import random
import sys
import time

import numpy as np

ALLOWED = (TypeError, ValueError, KeyError, MemoryError)

try:
    import atheris
except ImportError:  # the --random fallback needs no atheris
    atheris = None

if atheris is not None and "--random" not in sys.argv:
    with atheris.instrument_imports():
        import mha_ext
else:
    import mha_ext

DTYPES = [np.float32, np.float64, np.float32, np.float64, np.float32, np.float16, np.int8, np.int64, np.uint8, np.bool_,
          np.complex64, object, "U3", "S2", ">f4", ">f8", "<i2"]
MASK_DTYPES = [np.bool_, np.bool_, np.bool_, np.float32, np.uint8, np.int32, np.float32, np.float64, ">f8", np.complex64,
               object, "U1"]


class Bytes:
    """The fuzzer's bytes as small choices (zeros once they run out)."""

    def __init__(self, data):
        self.data, self.pos = data, 0

    def byte(self):
        b = self.data[self.pos] if self.pos < len(self.data) else 0
        self.pos += 1
        return b

    def int(self, lo, hi):
        return lo + (self.byte() | self.byte() << 8) % (hi - lo + 1)

    def pick(self, seq):
        return seq[self.byte() % len(seq)]

    def flag(self):
        return self.byte() & 1 == 1

    def floats(self, n):
        """n floats: mostly small, sometimes 0/1, NaN, +-inf or huge."""
        special = [0.0, 1.0, -1.0, np.nan, np.inf, -np.inf, 1e38, -1e300, 5e-324, 0.5, 2.0]
        out = np.empty(n)
        for i in range(n):
            b = self.byte()
            out[i] = special[b % len(special)] if b >= 200 else (b - 100) / 25.0
        return out


class ArrayRaises:
    def __array__(self, *args, **kwargs):
        raise RuntimeError("fuzz: broken __array__")


def array(fz, shape, dtype=None, binary=False):
    """An array of `shape` in a layout and dtype the bytes choose (or, now and
    then, something that is not an array at all)."""
    kind = fz.byte() % 16
    if kind == 15:
        return fz.pick([None, "text", 3.5, ArrayRaises(), [1, [2, 3]], {"a": 1}, b"xy"])
    n = int(np.prod(shape)) if shape else 1
    if binary and fz.byte() < 192:                    # a mask: mostly 0/1 values
        vals = np.array([fz.byte() & 1 for _ in range(min(n, 64))], float)
    else:
        vals = fz.floats(min(n, 64))
    base = np.resize(vals, n).reshape(shape) if n else np.zeros(shape)
    dt = dtype or fz.pick(DTYPES)
    try:
        with np.errstate(all="ignore"):
            a = base.astype(dt)
    except (TypeError, ValueError, OverflowError):
        a = base
    layout = fz.byte() % 8
    if layout == 1 and a.ndim:
        a = np.asfortranarray(a)
    elif layout == 2 and a.ndim:
        a = np.flip(np.flip(a, -1).copy(), -1)                       # negative strides
    elif layout == 3 and a.ndim and a.shape[-1]:
        a = np.broadcast_to(a[..., :1], a.shape)                    # zero stride
    elif layout == 4 and a.dtype.kind in "biufc":
        raw = np.zeros(a.nbytes + 1, np.uint8)                      # misaligned
        v = raw[1:].view(a.dtype).reshape(a.shape)
        v[...] = a
        a = v
    elif layout == 5 and a.ndim:
        a = np.repeat(a, 2, axis=-1)[..., ::2]                      # step 2
    elif layout == 6 and a.dtype.kind in "biuf":
        a = a.astype(a.dtype.newbyteorder())                        # byte-swapped
    elif layout == 7 and a.size < 200:
        a = a.tolist()
    return a


def shape_near(fz, shape):
    """`shape`, or now and then a wrong one."""
    shape = list(shape)
    r = fz.byte()
    if r < 200 or not shape:
        return tuple(shape)
    if r < 215:
        return tuple(shape[1:])                       # one axis short
    if r < 230:
        return (1,) + tuple(shape)                    # one axis too many
    i = r % len(shape)
    shape[i] = fz.int(0, 5)                           # one axis wrong
    return tuple(shape)


def one_input(data):
    fz = Bytes(data)
    H = fz.int(1, 4)
    E = H * fz.int(1, 4)
    if fz.byte() > 250:
        E = fz.int(1, 9)                              # maybe not divisible
    kdim = fz.pick([None, None, fz.int(1, 6)])
    vdim = fz.pick([None, None, fz.int(1, 6)])
    try:
        m = mha_ext.MultiHeadAttention(
            E, H, fz.pick([0.0, 0.0, 0.5, 1.0, 1.5, float("nan")]),
            bias=fz.flag(), kdim=kdim, vdim=vdim,
            dtype=fz.pick(["float32", "float64", "float32", "float16"]), seed=fz.int(0, 9),
            n_kv_heads=fz.pick([None, None, None, 1, H, fz.int(0, 5)]))
    except ALLOWED:
        return
    if fz.flag():
        m.eval()
    B, Sq, Sk = fz.int(0, 3), fz.int(0, 9), fz.int(0, 9)
    batched = fz.flag() or fz.flag()
    lead = (B,) if batched else ()
    q = array(fz, shape_near(fz, lead + (Sq, E)))
    k = None if fz.byte() < 60 else array(fz, shape_near(fz, lead + (Sk, m.kdim)))
    v = None if k is None or fz.byte() < 40 else array(fz, shape_near(fz, lead + (Sk, m.vdim)))
    if k is None:
        Sk = Sq
    kw = {}
    if fz.byte() < 90:
        kw["mask"] = array(fz, shape_near(fz, fz.pick([(Sq, Sk), (Sk,), (H, Sq, Sk),
                                                       lead + (H, Sq, Sk), (1, 1)])),
                           fz.pick(MASK_DTYPES), binary=True)
    if fz.byte() < 90:
        kw["attn_mask"] = array(fz, shape_near(fz, fz.pick([(Sq, Sk), ((B if batched else 1) * H, Sq, Sk)])),
                                fz.pick(MASK_DTYPES), binary=True)
    if fz.byte() < 70:
        kw["key_padding_mask"] = array(fz, shape_near(fz, lead + (Sk,)), fz.pick(MASK_DTYPES),
                                       binary=True)
    if fz.flag():
        kw["is_causal"] = fz.flag()
    if fz.flag():
        kw["need_weights"] = fz.flag()
    if fz.flag():
        kw["average_weights"] = fz.flag()
    if fz.byte() < 50:
        kw["masked_rows"] = fz.pick(["nan", "zero", "zeros", None])
    if fz.byte() < 60:                                # a block-sparse layout (issue 14)
        qb, kb = fz.int(0, 5), fz.int(1, 12)
        nqb, nkb = -(-Sq // max(qb, 1)), -(-Sk // kb)
        keep = array(fz, shape_near(fz, fz.pick([(nqb, nkb), (H, nqb, nkb),
                                                 lead + (H, nqb, nkb)])),
                     fz.pick([np.bool_, np.bool_, np.uint8]), binary=True)
        try:
            kw["layout"] = mha_ext.layout.BlockLayout(keep, fz.pick([(qb, kb), qb, (qb,)]))
        except ALLOWED:
            pass
        if fz.byte() < 40 and isinstance(keep, np.ndarray):   # the C method's own checks
            k4 = keep.reshape((1,) * (4 - keep.ndim) + keep.shape) if keep.ndim <= 4 else keep
            try:
                m._forward(np.zeros((1, Sq, E)), np.zeros((1, Sk, m.kdim)),
                           np.zeros((1, Sk, m.vdim)),
                           layout=(k4 if fz.flag() else keep, qb, fz.pick([kb, -1, 2 ** 63])))
            except ALLOWED:
                pass
    if fz.byte() > 252:
        kw["atn_mask"] = None                         # a misspelled keyword
    if fz.byte() > 240:                               # a state dict, maybe broken
        sd = m.state_dict()
        key = fz.pick(sorted(sd))
        what = fz.byte() % 4
        if what == 0:
            del sd[key]
        elif what == 1:
            sd[key] = array(fz, shape_near(fz, sd[key].shape))
        elif what == 2:
            sd["extra"] = 1
        try:
            m.load_state_dict(sd, strict=fz.flag())
        except ALLOWED:
            pass
    if fz.byte() > 200:  # through a key/value cache (or the private call's cache arrays)
        cached_calls(fz, m, q, k, v, kw)
        return
    try:
        out, w = m(q, k, v, **kw)
    except ALLOWED:
        return
    # it succeeded: the result must have the contract's shapes and dtype
    q_shape = np.shape(q)
    assert out.dtype == m.dtype and out.shape == q_shape, (out.shape, q_shape)
    if w is not None:
        Sk_real = np.shape(k)[-2] if k is not None else q_shape[-2]
        want = q_shape[:-2] + ((H,) if not kw.get("average_weights") else ()) + \
            (q_shape[-2], Sk_real)
        assert w.shape == want, (w.shape, want)
    if fz.byte() < 60:  # its backward, maybe with the masked scores' gradient
        try:
            ctx = m.forward_train(q, k, v, save_projections=fz.flag(), **kw)
            go = array(fz, shape_near(fz, np.shape(ctx.output)))
            grads = m.backward(ctx, go, scores_grad=fz.pick([True, False, 1, "yes"]))
        except ALLOWED:
            return
        if "scores" in grads:
            s = grads["scores"]
            assert s.dtype == m.dtype and s.shape[-2] == q_shape[-2], s.shape
            assert s.shape[-3] == H and s.ndim == len(q_shape) + 1, s.shape


def cached_calls(fz, m, q, k, v, kw):
    """Calls with a cache: a KVCache of fuzzed size (maybe a cross one, maybe
    another module's), one to three calls; or the private _forward with
    fuzzed cache arrays.  Errors must be the allowed ones, the cache's
    length must advance by the new keys exactly when a call succeeds."""
    Hkv, Dk = m.n_kv_heads, m.d_k
    if fz.flag():
        shp = lambda a, b: shape_near(fz, (fz.int(0, 3), Hkv, a, b))  # noqa: E731
        cap = fz.int(0, 12)
        kc = array(fz, shp(Dk, cap), fz.pick([m.dtype, m.dtype, np.float16]))
        vc = array(fz, shp(cap, Dk), fz.pick([m.dtype, m.dtype, np.float16]))
        try:
            qa = np.asarray(q, dtype=m.dtype)
        except (*ALLOWED, RuntimeError):  # the harness's broken __array__
            return
        try:
            m._forward(qa, qa, qa, cache=(kc, vc, fz.pick([0, 1, 5, -1, 2**40, "x"])),
                       is_causal=fz.pick([False, True, "lower_right"]))
        except ALLOWED:
            pass
        return
    try:
        if fz.flag():
            cache = m.cache_memory(k if k is not None else q, v)
        else:
            cache = m.new_cache(fz.int(0, 4), fz.int(0, 20))
    except ALLOWED:
        return
    for _ in range(fz.int(1, 3)):
        before = cache.length
        try:
            out, w = m(q, None if cache.cross else k, None if cache.cross else v,
                       cache=cache, **kw)
        except ALLOWED:
            assert cache.length == before
            continue
        n = 0 if cache.cross else np.shape(k if k is not None else q)[-2]
        assert cache.length == before + n and out.shape == np.shape(q)
        if w is not None and not kw.get("average_weights"):
            assert w.shape[-1] == cache.length


def random_mode(argv):
    """A plain random-bytes loop, for machines without atheris."""
    seconds, runs, seed = 30.0, None, 0
    for a in argv:
        if a.startswith("-max_total_time="):
            seconds = float(a.split("=", 1)[1])
        elif a.startswith("-runs="):
            runs = int(a.split("=", 1)[1])
        elif a.startswith("-seed="):
            seed = int(a.split("=", 1)[1])
    rng = random.Random(seed)
    t0, n = time.monotonic(), 0
    while (runs is None or n < runs) and time.monotonic() - t0 < seconds:
        one_input(bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300))))
        n += 1
    print(f"Done {n} runs in {int(time.monotonic() - t0)} second(s) (random mode)")


def main():
    print(f"fuzzing {mha_ext.__file__}", flush=True)
    if atheris is None or "--random" in sys.argv:
        random_mode([a for a in sys.argv[1:] if a != "--random"])
        return
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
