"""A user's script, type-checked by mypy --strict and pyright in strict mode
(tests/test_typing.py, run in CI): every public name used the way the README
uses it.  An untyped public function, or a stub that hides the Python class
from an editor, makes a checker report an error here.  tests/test_typing.py
also runs it.

A line marked "pending[checkers]" in a comment is a known gap in another
file's annotations: the test requires those checkers to report an error on
exactly the marked lines (so a marker must go when its annotation lands)
and nowhere else."""
from __future__ import annotations

import numpy as np
import numpy.typing as npt

import mha_ext
from mha_ext import MultiHeadAttention, Trace, plot_heads  # pending[pyright]: plot_heads untyped

mha = MultiHeadAttention(64, 4, dropout=0.1, seed=0)
same: MultiHeadAttention = mha.eval()
x: npt.NDArray[np.float32] = np.zeros((2, 5, 64), dtype=np.float32)
causal = np.triu(np.ones((5, 5), dtype=bool), k=1)

out, weights = mha(x, mask=causal)
shape: tuple[int, ...] = out.shape
if weights is not None:
    heads: int = weights.shape[1]
d: int = mha.d_model + mha.n_heads + mha.d_k + mha.num_parameters
w: np.ndarray = mha.W_q.weight

t: Trace = mha.trace(x, is_causal=True)  # pending[pyright]: trace(**kwargs) untyped
flow: str = str(t)
masked: np.ndarray = t["masked scores"].array  # pending[pyright]: Step fields untyped
t2: Trace = mha_ext.trace(mha, x)  # pending[mypy,pyright]: mha_ext.trace untyped

state: dict[str, np.ndarray] = mha.state_dict()
mha.load_state_dict(state)
with mha.editing():
    mha.W_o.bias[...] = 0.0

mha.train()
ctx = mha.forward_train(x, mask=causal)  # pending[mypy,pyright]: forward_train untyped
grads = mha.backward(ctx, np.ones_like(ctx.output))  # pending[pyright]: backward's ctx untyped
dq: np.ndarray = grads["query"]

gqa = mha_ext.MultiHeadAttention(8, 4, n_kv_heads=2, seed=0).eval()
cache: mha_ext.KVCache = gqa.new_cache(2, 8)
step, _ = gqa(np.zeros((2, 3, 8), np.float32), cache=cache, need_weights=False)
length: int = cache.length
cached_keys: np.ndarray = cache.keys
memory = gqa.cache_memory(np.zeros((2, 5, 8), np.float32))
cross, _ = gqa(np.zeros((2, 1, 8), np.float32), cache=memory)

n: int = mha_ext.get_num_threads()
mha_ext.set_num_threads(n)
l2_bytes: int = mha_ext.cpu_info()["l2_bytes"]
nc32: int = mha_ext.cpu_info()["gemm_nc"]["float32"]
cached: int = mha_ext.memory_info()["cached_bytes"]
freed: int = mha_ext.release_memory()
version: str = mha_ext.__version__


def draw(path: str) -> None:
    """Not run (needs matplotlib): only type-checked."""
    fig = plot_heads(t.weights, tokens=list("abcde"))  # pending[mypy,pyright]: plot_heads, Trace.weights untyped
    fig.savefig(path)  # pending[pyright]: plot_heads returns an untyped figure
