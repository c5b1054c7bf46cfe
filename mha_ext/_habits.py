"""Torch habits that would otherwise give silent wrong numbers or unclear
errors with the NumPy module, the one home for them:

- torch's keyword names (``embed_dim``, ``num_heads``,
  ``average_attn_weights``, ``batch_first`` as an argument): a TypeError
  naming mha_ext's spelling;
- the module's ``batch_first`` attribute (default True; from_torch of a
  seq-first torch module sets False): 3-D inputs are then (S, B, E) as in
  torch and the output comes back (Sq, B, E);
- the module's ``mask_polarity`` attribute (default "block": 1 = blocked;
  "keep": 1 = attend, as teaching modules that ``masked_fill(mask == 0,
  -inf)`` write it): the seed ``mask`` argument is read in that polarity.
  Never guessed: it is set explicitly (or by from_torch(mask_polarity=)).
- the module's ``causal`` attribute (default False; True: every call is
  causal, is_causal=True unless the call asks for "lower_right"), for the
  copy of a module whose forward applies a causal mask buffer of its own
  (a ``tril``, as the nanoGPT ``Head`` does).  Never guessed either:
  from_torch refuses such a module unless told causal=True or False.

Legend: B batch, S sequence length, E = d_model.
"""
from __future__ import annotations

import numpy as np

from ._convert import as_array, flag, refuse_huge_ints

__all__ = ["TORCH_NAMES", "constructor_keywords", "call_keywords", "batch_first",
           "set_batch_first", "mask_polarity", "set_mask_polarity", "causal", "set_causal",
           "causal_call", "adapt_call",
           "seq_first_output", "plain_layout_only"]

# torch's spelling -> ours
TORCH_NAMES = {"embed_dim": "d_model", "num_heads": "n_heads",
               "average_attn_weights": "average_weights", "nhead": "n_heads"}

_BATCH_FIRST = ("mha_ext.MultiHeadAttention takes no batch_first argument{}: its calls are "
                "batch-first, (B, S, E), by default; for torch's seq-first (S, B, E) set the "
                "module's attribute, mha.batch_first = False (from_torch of a seq-first "
                "torch module does that)")


def constructor_keywords(kwargs):
    """TypeError for torch's constructor keywords, naming ours."""
    for k in kwargs:
        if k in TORCH_NAMES:
            raise TypeError(f"MultiHeadAttention() got torch's keyword {k!r}; mha_ext spells "
                            f"it {TORCH_NAMES[k]!r}")
        if k == "batch_first":
            raise TypeError(_BATCH_FIRST.format(" in its constructor"))


def call_keywords(kwargs, where):
    """TypeError for keywords a call does not take: torch's names named with
    ours, anything else as Python would say it."""
    for k in kwargs:
        if k in TORCH_NAMES:
            raise TypeError(f"{where}() got torch's keyword {k!r}; mha_ext spells it "
                            f"{TORCH_NAMES[k]!r}")
        if k == "batch_first":
            raise TypeError(_BATCH_FIRST.format(" in a call"))
        raise TypeError(f"{where}() got an unexpected keyword argument {k!r}")


def batch_first(module):
    """The module's batch_first attribute (True unless set)."""
    return module.__dict__.get("_batch_first", True)


def set_batch_first(module, value):
    module.__dict__["_batch_first"] = flag(value, "batch_first")


def mask_polarity(module):
    """The module's mask_polarity attribute ("block" unless set)."""
    return module.__dict__.get("_mask_polarity", "block")


def set_mask_polarity(module, value):
    if not isinstance(value, str) or value not in ("block", "keep"):
        raise ValueError(f"mask_polarity must be 'block' (1 = blocked, the default) or "
                         f"'keep' (1 = attend), got {value!r}")
    module.__dict__["_mask_polarity"] = value


def causal(module):
    """The module's causal attribute (False unless set; the core objects
    the torch classes call through have none)."""
    return getattr(module, "__dict__", {}).get("_causal", False)


def set_causal(module, value):
    module.__dict__["_causal"] = flag(value, "causal")


def causal_call(module, is_causal, cache=None):
    """A call's is_causal under the module's causal attribute: a false
    truth value (False, None, 0, a false 0-d array) becomes True (top-left)
    on a causal module, but for a cross-attention cache's call (its memory
    has no order); anything else as given (checked by the call)."""
    if not causal(module) or isinstance(is_causal, str) or getattr(cache, "cross", False):
        return is_causal
    try:
        false = not bool(is_causal)
    except Exception:  # not a single truth value: the call's TypeError names it
        return is_causal
    return True if false else is_causal


def _swap(x, name):
    # (S, B, ...) -> (B, S, ...) for 3-D inputs, others unchanged
    arr = as_array(x, name)
    return arr.swapaxes(0, 1) if arr.ndim == 3 else arr


def _keep_to_block(mask):
    m = as_array(mask, "mask")
    if m.dtype.kind == "b":
        return ~m
    if m.dtype.kind not in "iuf":
        refuse_huge_ints(m, "mask")
        raise TypeError(f"mask must be bool, int or float with 0/1 values (with "
                        f"mask_polarity='keep', 1 = attend), got dtype {m.dtype}")
    if not np.all((m == 0) | (m == 1)):
        raise ValueError("mask must hold only 0 and 1 (this module's mask_polarity is "
                         "'keep': 1 = attend, 0 = blocked); for additive float masks "
                         "use attn_mask")
    return m == 0


def adapt_call(module, query, key, value, mask, kwargs, where):
    """The call's arguments in the module's native form: torch keywords
    refused, (S, B, E) inputs made (B, S, E) when batch_first is False, a
    keep-polarity mask made blocking.  Returns (query, key, value, mask,
    seq_first) where seq_first says the output must go back to (S, B, E)."""
    if kwargs:
        call_keywords(kwargs, where)
    if mask is not None and mask_polarity(module) == "keep":
        mask = _keep_to_block(mask)
    if batch_first(module):
        return query, key, value, mask, False
    q = _swap(query, "query")
    k = None if key is None else (q if key is query else _swap(key, "key"))
    if value is None:
        v = None
    elif value is query:
        v = q
    elif value is key:
        v = k
    else:
        v = _swap(value, "value")
    return q, k, v, mask, q.ndim == 3


def seq_first_shapes(exc, passed):
    """A call's ValueError for a batch_first=False module: the shapes it
    names are the transposed ones the checks saw, so the message says so and
    gives the shapes the caller passed."""
    shapes = ", ".join(f"{name} {tuple(np.shape(x))}"
                       for name, x in zip(("query", "key", "value"), passed) if x is not None)
    return (f"{exc} (shapes as (batch, seq, feature): with batch_first=False the inputs "
            f"(seq, batch, feature) are transposed first; you passed {shapes})")


def seq_first_output(out):
    """(B, Sq, E) -> a new C-contiguous (Sq, B, E)."""
    return np.ascontiguousarray(out.swapaxes(0, 1))


def plain_layout_only(module, where):
    """forward_train and trace work in the native layout and polarity only."""
    if not batch_first(module):
        raise ValueError(f"{where} takes batch-first (B, S, E) inputs only; this module has "
                         f"batch_first=False: set mha.batch_first = True and pass "
                         f"x.swapaxes(0, 1)")
    if mask_polarity(module) != "block":
        raise ValueError(f"{where} takes the mask in block polarity (1 = blocked) only; "
                         f"this module has mask_polarity='keep': set "
                         f"mha.mask_polarity = 'block' and pass 1 - mask")
