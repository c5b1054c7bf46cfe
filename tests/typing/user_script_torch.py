"""A user's script with torch, type-checked and run like user_script.py
(tests/test_typing.py; skipped where torch is not installed): the torch
classes, the drop-in swap, from_torch, compare and the SDPA twin on
tensors, the way the README uses them.

Where torch's own annotations fall short of the strict modes the script
says it another way: torch.autograd.backward(loss), not loss.backward()
(unannotated in torch); no optimiser step() (partially unknown)."""
from __future__ import annotations

import numpy as np
import torch

import mha_ext
import mha_ext.torch
from mha_ext.torch import MultiheadAttention, swapped

# the SDPA twin on tensors: a tensor out
tq = torch.zeros(2, 4, 5, 16, requires_grad=True)
tt: torch.Tensor = mha_ext.scaled_dot_product_attention(tq, tq, tq, is_causal=True)
tt = mha_ext.scaled_dot_product_attention(tq, tq, tq, dropout_p=0.1, seed=0, enable_gqa=False)
torch.autograd.backward(tt.sum())

# mha_ext.torch.MultiHeadAttention (README: "With torch")
attn = mha_ext.torch.MultiHeadAttention(64, 4, dropout=0.1, seed=0)
x = torch.randn(2, 10, 64)
causal = torch.ones(10, 10, dtype=torch.bool).triu(1)
out, weights = attn(x, mask=causal)
out2, weights2 = attn.forward(x, is_causal=True, need_weights=False)
typed_out: torch.Tensor = out2
loss = out2.square().mean()
torch.autograd.backward(loss)
adam = torch.optim.Adam(attn.parameters(), lr=1e-3)
widths: int = attn.d_model + attn.n_heads + attn.n_kv_heads + attn.kdim + attn.vdim
described: str = attn.extra_repr()
double = mha_ext.torch.MultiHeadAttention(8, 2, dtype=torch.float64, n_kv_heads=1)

# the drop-in: mha_ext.torch.MultiheadAttention, swapped, compare
model = torch.nn.Transformer(d_model=64, nhead=4, dropout=0.0).eval()
src, tgt = torch.randn(10, 2, 64), torch.randn(7, 2, 64)
with swapped(model) as same_model:
    y = same_model(src, tgt)
layer = torch.nn.TransformerEncoderLayer(64, 4, batch_first=True)
# ours is a subclass of torch's class, which layer.self_attn is annotated with
layer.self_attn = MultiheadAttention.from_torch(layer.self_attn)
ours = MultiheadAttention(64, 4, batch_first=True)
ours.load_state_dict(torch.nn.MultiheadAttention(64, 4, batch_first=True).state_dict())
o, w = ours.forward(x, x, x, need_weights=True, window=(2, 2))
# torch's functional's twin, put in its place for code that calls it
torchs_own = torch.nn.functional.multi_head_attention_forward
torch.nn.functional.multi_head_attention_forward = \
    mha_ext.torch.multi_head_attention_forward
ref = torch.nn.MultiheadAttention(64, 4)
fo, fw = mha_ext.torch.multi_head_attention_forward(
    src, src, src, 64, 4, ref.in_proj_weight, ref.in_proj_bias, None, None, False, 0.0,
    ref.out_proj.weight, ref.out_proj.bias, training=False, need_weights=False)
functional_out: torch.Tensor = fo
torch.nn.functional.multi_head_attention_forward = torchs_own
table = mha_ext.compare(model, src, tgt)
errors: list[float] = [row.mha_ext_error for row in table]

# the NumPy module from a torch one, and torch's state dict
torch_mha = torch.nn.MultiheadAttention(64, 4, batch_first=True)
copy = mha_ext.MultiHeadAttention.from_torch(torch_mha, dtype="float64")
numpy_mha = mha_ext.MultiHeadAttention(64, 4, seed=0)
missing, unexpected = numpy_mha.load_state_dict(
    {k: v for k, v in torch_mha.state_dict().items()})
from_tensor, _ = numpy_mha(x)          # tensors in: arrays out
arr: np.ndarray = from_tensor
