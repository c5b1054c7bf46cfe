"""A user's script, type-checked by mypy --strict and pyright in strict mode
(tests/test_typing.py, run in CI): every public name used the way the README
and docs/API.md use it.  An untyped public function, or a stub that hides
the Python class from an editor, makes a checker report an error here.
tests/test_typing.py also runs it.  NumPy only: torch's part is
user_script_torch.py, matplotlib's user_script_plot.py.

A line marked "pending[checkers]" in a comment is a known gap in another
file's annotations: the test requires those checkers to report an error on
exactly the marked lines (so a marker must go when its annotation lands)
and nowhere else."""
from __future__ import annotations

import numpy as np
import numpy.typing as npt

import mha_ext
from mha_ext import BlockLayout, Explorer, MultiHeadAttention, Step, Trace, layout
from mha_ext.autograd import ForwardContext, forward_train
from mha_ext.heads import HeadReport

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
out2, _ = mha.forward(x, attn_mask=causal, need_weights=False, window=(2, None), scale=0.5)

# NumPy scalars where Python's are taken
small = MultiHeadAttention(np.int64(8), np.int64(2), dropout=np.float32(0.0), seed=np.uint64(1))
xs = np.zeros((2, 5, 8), np.float32)
small(xs, is_causal=np.bool_(True), scale=np.float32(0.5), need_weights=np.bool_(False))
small.train(np.bool_(False))

# the step-by-step trace
t: Trace = mha.trace(x, is_causal=True)
flow: str = str(t)
masked: np.ndarray = t["masked scores"].array
first: Step = t[0]
step_name: str = first.name
step_formula: str = first.formula
step_shape: tuple[int, ...] = first.shape
step_dims: tuple[str, ...] = first.dims
names: list[str] = t.names
traced_out: np.ndarray = t.output
traced_weights: np.ndarray | None = t.weights
t2: Trace = mha_ext.trace(mha, x, mask=causal, masked_rows="zero")

# explorer and head statistics (README: "Explore attention")
words = "the cat sat on the".split()
ex: Explorer = mha_ext.explore(t, tokens=words)
page: str = ex.save("attention.html")
saved_trace: str = t.save_html("trace.html")
# NumPy scalars wherever Python's are (docs/API.md §9)
brief: Explorer = mha_ext.explore(t, max_values=np.int64(100_000))
fragment: str = brief.to_html(full_page=np.bool_(False)) + t.to_html(values=np.bool_(False))
saved_plain: str = t.save_html("trace_plain.html", values=np.bool_(False))
report: HeadReport = mha_ext.heads.analyze(t)
if t.weights is not None:
    report = mha_ext.heads.analyze(t.weights)
rows: list[dict[str, float]] = report.rows()
top: int | None = report.top("entropy")
ablated = mha_ext.heads.analyze(t, module=mha, loss=lambda: float(mha(x)[0].sum()))

# parameters
state: dict[str, np.ndarray] = mha.state_dict()
mha.load_state_dict(state)
missing, unexpected = mha.load_state_dict(state, strict=False)
missing_keys: list[str] = missing + unexpected
with mha.editing():
    mha.W_o.weight[...] = 0.0
    bias = mha.W_o.bias         # None for a module built with bias=False
    if bias is not None:
        bias[...] = 0.0

# block-sparse layouts (README: "Block-sparse attention")
lay = layout.global_local(1000, 1000, 64, global_blocks=1, width=1)
band: BlockLayout = layout.local_blocks(10, 10, 2, width=1, causal=True)
stripes: BlockLayout = layout.strided(10, 10, (2, 5), 2, width=0)
bird: BlockLayout = layout.bigbird(10, 10, 2, random_blocks=1, seed=0, heads=4)
dense: np.ndarray = ~lay.to_dense(1000, 1000)
again: BlockLayout = BlockLayout.from_dense(~dense, 64)
q_block, k_block = band.block_size
density: float = band.density
sparse_out, _ = mha(np.zeros((1, 10, 64), np.float32), layout=band, need_weights=False)
band_page: Explorer = mha_ext.explore(np.full((1, 2, 10, 10), 0.1), blocked=band)

# training (README: "Training")
mha.train()
ctx = mha.forward_train(x, mask=causal, dropout=0.0, save_projections=False)
ctx_out: np.ndarray = ctx.output
ctx_weights: np.ndarray | None = ctx.weights
p: float = ctx.dropout
stream: int = ctx.counter
grads = mha.backward(ctx, np.ones_like(ctx.output))
if ctx.weights is not None:
    grads = mha.backward(ctx, np.ones_like(ctx.output), np.zeros_like(ctx.weights))
dq: np.ndarray = grads["query"]
ctx2: ForwardContext = forward_train(mha, x, dropout_counter=ctx.counter)
mha.load_state_dict({k: v - 0.01 * grads[k] for k, v in mha.state_dict().items()})

# incremental decoding
gqa = mha_ext.MultiHeadAttention(8, 4, n_kv_heads=2, seed=0).eval()
cache: mha_ext.KVCache = gqa.new_cache(2, 8)
step, _ = gqa(np.zeros((2, 3, 8), np.float32), cache=cache, need_weights=False)
length: int = cache.length
cached_keys: np.ndarray = cache.keys
memory = gqa.cache_memory(np.zeros((2, 5, 8), np.float32))
cross, _ = gqa(np.zeros((2, 1, 8), np.float32), cache=memory)

# the SDPA twin on arrays: an array out
q = np.zeros((2, 4, 5, 16), np.float32)
o: np.ndarray = mha_ext.scaled_dot_product_attention(q, q, q, is_causal=True)
o = mha_ext.scaled_dot_product_attention(q, q, q, ~causal, scale=0.25, window=(1, 1), seed=3)

n: int = mha_ext.get_num_threads()
mha_ext.set_num_threads(n)
l2_bytes: int = mha_ext.cpu_info()["l2_bytes"]
nc32: int = mha_ext.cpu_info()["gemm_nc"]["float32"]
cached: int = mha_ext.memory_info()["cached_bytes"]
freed: int = mha_ext.release_memory()
version: str = mha_ext.__version__

