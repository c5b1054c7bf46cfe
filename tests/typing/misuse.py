"""Misuse the checkers must report (tests/test_typing.py; type-checked, not
run): each line marked "error[checkers]" must give those checkers an error,
and no other line may.  Each of these calls is a TypeError at run time; the
catch-all keyword parameters are typed NoReturn so that the checkers say so
first, and mha_ext's module __getattr__ is hidden from them."""
from __future__ import annotations

import numpy as np

import mha_ext

mha = mha_ext.MultiHeadAttention(8, 2, seed=0)
x = np.zeros((2, 5, 8), np.float32)


def misspelt_keywords() -> None:
    mha(x, need_weight=False)  # error[mypy,pyright]: need_weights
    mha.forward(x, is_casual=True)  # error[mypy,pyright]: is_causal
    mha.trace(x, is_casual=True)  # error[mypy,pyright]: is_causal
    mha.forward_train(x, dropuot=0.1)  # error[mypy,pyright]: dropout
    mha_ext.trace(mha, x, need_weight=False)  # error[mypy,pyright]: need_weights
    mha(x, average_attn_weights=False)  # error[mypy,pyright]: torch's name
    mha_ext.MultiHeadAttention(embed_dim=8, num_heads=2)  # error[mypy,pyright]: torch's names


def misspelt_attribute() -> None:
    mha_ext.comapre  # error[mypy,pyright]: compare (the module __getattr__ is hidden)


def text_as_a_colour_limit() -> None:
    mha_ext.plot_heads(x, vmin="0.5")  # error[mypy,pyright]: a real number (a TypeError at run time)
