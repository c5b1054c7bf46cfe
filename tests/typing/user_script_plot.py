"""A user's script with matplotlib (the "plot" extra), type-checked and run
like user_script.py (tests/test_typing.py; skipped without matplotlib):
plot_heads and HeadReport.plot return matplotlib Figures.  No savefig:
matplotlib's own stub leaves its **kwargs untyped (partially unknown to
pyright's strict mode)."""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

import mha_ext
from mha_ext import plot_heads

mha = mha_ext.MultiHeadAttention(16, 2, seed=0).eval()
x = np.zeros((1, 5, 16), np.float32)
causal = np.triu(np.ones((5, 5), dtype=bool), k=1)
t = mha.trace(x, mask=causal)

figures: list[Figure] = [plot_heads(t), mha_ext.heads.analyze(t).plot(figsize=(8.0, 4.0))]
if t.weights is not None:
    figures.append(plot_heads(t.weights, tokens=list("abcde"), scale="row", blocked=causal))
band = mha_ext.layout.local_blocks(5, 5, 2)
figures.append(plot_heads(t, batch=np.int64(0), blocked=band, title="band", vmax=1.0))
# NumPy scalars wherever Python's are (docs/API.md §9), a 0-d array as a limit (§6)
figures.append(plot_heads(t, vmin=np.float32(0.0), vmax=np.float64(0.5),
                          figsize=(np.float32(4), np.float32(3))))
if t.weights is not None:
    figures.append(plot_heads(t.weights, vmax=np.asarray(t.weights).max(keepdims=False)))
roles: list[str] = mha_ext.heads.analyze(t).roles(np.float32(0.5))
