"""mha_ext.cpu_info() (issue 17): the cache sizes the CPU reports, the FMA
width and 512-bit FMA units, the blocking drawn from them (src/cpu.c) and
the weight gradients' way of reading Aᵀ measured at first use (tn_pack,
gemm_impl.h); and the guarantee that makes the run-time choices safe:
neither changes a bit of any result.

Both are fixed at first use (MHA_EXT_GEMM_NC and MHA_EXT_TN_PACK override
them), so each choice runs in a fresh interpreter.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import mha_ext
from mha_ext import _core

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KC = 512


def child(code, nc=None, timeout=300, tn=None):
    # two threads whatever the machine: the backward's choice between its two
    # tilings (below) counts tiles per thread
    env = {k: v for k, v in os.environ.items()
           if k not in ("MHA_EXT_GEMM_NC", "MHA_EXT_TN_PACK")}
    env["MHA_EXT_NUM_THREADS"] = "2"
    if nc is not None:
        env["MHA_EXT_GEMM_NC"] = nc
    if tn is not None:
        env["MHA_EXT_TN_PACK"] = tn
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def nc_in_child(nc):
    out = child("import mha_ext; d = mha_ext.cpu_info()['gemm_nc']; "
                "print(d['float32'], d['float64'])", nc)
    return tuple(int(v) for v in out.split())


def nc_rule(l2, size):
    # KC x NC scalars in half the L2, NC a multiple of 64 in [64, 512]
    return min(max(l2 // 2 // (KC * size) // 64 * 64, 64), 512)


def test_cpu_info_fields():
    info = mha_ext.cpu_info()
    assert set(info) == {"isa", "l1d_bytes", "l2_bytes", "l3_bytes", "cache_source", "fma_bits",
                         "fma512_per_cycle", "fma_ratio", "gemm_kc", "gemm_nc", "tn_pack",
                         "threads"}
    assert set(info["tn_pack"]) == {"float32", "float64"}
    assert set(info["tn_pack"].values()) <= {0, 1}
    if info["isa"] not in ("avx512", "amx"):  # the narrow kernels always pack Aᵀ
        assert info["tn_pack"] == {"float32": 1, "float64": 1}
    assert info["isa"] == _core._get_isa()
    assert info["cache_source"] in ("cpuid", "sysconf", "default")
    assert 4096 <= info["l1d_bytes"] < info["l2_bytes"]
    assert info["l3_bytes"] == 0 or info["l3_bytes"] >= info["l2_bytes"]
    assert info["fma_bits"] == {"amx": 512, "avx512": 512, "avx2": 256, "portable": 0}[info["isa"]]
    assert info["gemm_kc"] == KC
    assert info["threads"] == mha_ext.get_num_threads()
    if _core._isa_available("avx512"):
        assert info["fma512_per_cycle"] in (1, 2)
        assert info["fma_ratio"] > 0
        assert (info["fma512_per_cycle"] == 2) == (info["fma_ratio"] > 0.9)
    else:
        assert info["fma512_per_cycle"] == 0


def getconf(name):
    try:
        run = subprocess.run(["getconf", name], capture_output=True, text=True, timeout=30)
        return int(run.stdout.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def test_cache_sizes_agree_with_the_c_library():
    # glibc reads the same CPUID leaves: two readings of one machine agree
    info = mha_ext.cpu_info()
    l1, l2 = getconf("LEVEL1_DCACHE_SIZE"), getconf("LEVEL2_CACHE_SIZE")
    if info["cache_source"] == "default" or l1 <= 0 or l2 <= 0:
        pytest.skip("no cache sizes from both the CPU and getconf to compare")
    assert (info["l1d_bytes"], info["l2_bytes"]) == (l1, l2)


def test_gemm_nc_follows_the_l2():
    info = mha_ext.cpu_info()
    want = (nc_rule(info["l2_bytes"], 4), nc_rule(info["l2_bytes"], 8))
    assert nc_in_child(None) == want
    if not os.environ.get("MHA_EXT_GEMM_NC"):  # this process: the same rule
        assert (info["gemm_nc"]["float32"], info["gemm_nc"]["float64"]) == want


@pytest.mark.parametrize("value,want", [("64", 64), ("192", 192), ("512", 512)])
def test_env_sets_gemm_nc(value, want):
    assert nc_in_child(value) == (want, want)


@pytest.mark.parametrize("value", ["100", "0", "-64", "1024", "abc", "128x", ""])
def test_invalid_gemm_nc_ignored(value):
    assert nc_in_child(value) == nc_in_child(None)


BITS = """
import hashlib, numpy as np, mha_ext
h = hashlib.sha256()
for dtype, E, H, S in (("float32", 1088, 8, 40), ("float64", 1088, 8, 40),
                       ("float32", 640, 10, 200), ("float32", 1024, 8, 40),
                       ("float32", 1024, 8, 200), ("float64", 512, 8, 40),
                       ("float64", 512, 8, 200)):
    m = mha_ext.MultiHeadAttention(E, H, dtype=dtype, seed=3)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, S, E)).astype(dtype)
    kv = rng.standard_normal((3, S + 7, E)).astype(dtype)
    for causal in (False, True):
        out, w = m(x, is_causal=causal)
        h.update(out.tobytes()); h.update(w.tobytes())
        h.update(m(x, need_weights=False, is_causal=causal)[0].tobytes())
    ctx = m.forward_train(x, kv, kv)
    g = m.backward(ctx, rng.standard_normal(ctx.output.shape).astype(dtype))
    for name in sorted(g):
        h.update(name.encode()); h.update(g[name].tobytes())
print(mha_ext.cpu_info()["gemm_nc"]["float32"], h.hexdigest())
"""


def test_blocking_changes_no_bits():
    # forward (with and without weights, causal or not) and backward, E 1088
    # (N spans 3 to 17 column blocks), with NC from 64 to 512: the same bits.
    # With NC 64 (17 and 10 column tiles, >= 4 per thread) the backward's
    # input gradients take the packed-W tiling (mha_product.pack_b), with
    # the default NC the 96 x 64 tiles reading W in place: both paths, the
    # same bits
    results = {nc: child(BITS, nc).split() for nc in ("64", "128", "320", "512")}
    default = child(BITS).split()
    for nc, (used, digest) in results.items():
        assert used == nc
        assert digest == default[1], f"MHA_EXT_GEMM_NC={nc} changed the results"


TN = "import mha_ext; d = mha_ext.cpu_info()['tn_pack']; print(d['float32'], d['float64'])"


def wide():
    return _core._get_isa() in ("avx512", "amx")


@pytest.mark.parametrize("value", ["0", "1"])
def test_env_sets_tn_pack(value):
    # MHA_EXT_TN_PACK replaces the first-use measurement; a narrow kernel
    # packs whatever it says
    want = value if wide() else "1"
    assert child(TN, tn=value).split() == [want, want]


def test_tn_pack_changes_no_bits():
    # the weight gradients' TN products (and the attention backward's dV,
    # dK) with Aᵀ read in place and packed: the same bits, as the measured
    # default gives.  A wide kernel packs only an Aᵀ whose rows lie a
    # multiple of 4 KiB apart (mha_tn_packs): E 1024 float and 512 double
    # in BITS, whose backwards reach both packed forms in both dtypes:
    # depth B·S = 120 (panels packed as the nest goes) and 600 (past
    # MHA_GEMM_NB_K: gemm_nest_nb).  On a narrow kernel both runs pack: the test then only
    # checks the override is harmless
    code = BITS.replace('mha_ext.cpu_info()["gemm_nc"]["float32"]',
                        'mha_ext.cpu_info()["tn_pack"]["float64"]')
    runs = {tn: child(code, tn=tn).split() for tn in ("0", "1")}
    default = child(code).split()
    for tn, (used, digest) in runs.items():
        assert used == (tn if wide() else "1")
        assert digest == default[1], f"MHA_EXT_TN_PACK={tn} changed the results"
