"""The seed notebook's multi-head attention, written with torch's own ops.

This is the oracle of the parity tests: nothing here calls mha_ext.  It is
imported only after conftest.require_torch() has found torch.

Legend: B batch, Sq/Sk query/key length, E = d_model, H = n_heads, Dk = E/H.
"""

import math

import numpy as np
import torch
from torch import nn


class SeedMultiHeadAttention(nn.Module):
    """Multi-head attention as the seed notebook writes it."""

    def __init__(self, d_model, n_heads, dropout=0.0):
        super().__init__()
        assert d_model % n_heads == 0
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(d_model, d_model)
        self.W_v = nn.Linear(d_model, d_model)
        self.W_o = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def split_heads(self, x):
        # x is (B, S, E) -> (B, H, S, Dk)
        B, S, _ = x.shape
        return x.view(B, S, self.n_heads, self.d_k).transpose(1, 2)

    def combine_heads(self, x):
        # x is (B, H, S, Dk) -> (B, S, E)
        B, _, S, _ = x.shape
        return x.transpose(1, 2).contiguous().view(B, S, self.d_model)

    def forward(self, query, key, value, mask=None):
        Q = self.split_heads(self.W_q(query))   # (B, H, Sq, Dk)
        K = self.split_heads(self.W_k(key))     # (B, H, Sk, Dk)
        V = self.split_heads(self.W_v(value))   # (B, H, Sk, Dk)
        scores = torch.matmul(Q, K.transpose(-2, -1)) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(mask == 1, float('-inf'))
        weights = torch.softmax(scores, dim=-1)  # (B, H, Sq, Sk)
        weights = self.dropout(weights)
        context = torch.matmul(weights, V)       # (B, H, Sq, Dk)
        output = self.W_o(self.combine_heads(context))  # (B, Sq, E)
        return output, weights


def make_seed_module(d_model, n_heads, dropout=0.0, seed=0, dtype="float32"):
    """A seed module initialised from torch.manual_seed(seed), with random
    non-zero biases (|b| in [0.05, 0.5], random signs), in eval mode."""
    torch.manual_seed(seed)
    mod = SeedMultiHeadAttention(d_model, n_heads, dropout)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for lin in (mod.W_q, mod.W_k, mod.W_v, mod.W_o):
            mag = torch.rand(d_model, generator=gen) * 0.45 + 0.05
            sign = torch.randint(0, 2, (d_model,), generator=gen) * 2 - 1
            lin.bias.copy_(mag * sign)
    if np.dtype(dtype) == np.float64:
        mod = mod.double()
    return mod.eval()


def _tensor(x):
    return None if x is None else torch.from_numpy(np.ascontiguousarray(x))


def run(mod, query, key=None, value=None, mask=None):
    """Run the seed module on NumPy inputs; NumPy (output, weights) back."""
    key = query if key is None else key
    value = key if value is None else value
    with torch.no_grad():
        out, w = mod(_tensor(query), _tensor(key), _tensor(value),
                     _tensor(mask))
    return out.numpy(), w.numpy()
