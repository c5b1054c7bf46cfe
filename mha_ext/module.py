"""MultiHeadAttention: the Python face of the C type in _core.c.

The C base class owns the parameter memory and runs the forward pass with
the GIL released.  This subclass adds what is easier in Python: the mask
semantics of the seed notebook and of torch.nn.MultiheadAttention, torch
tensors as inputs, unbatched inputs, state dicts, train()/eval() and repr().

Legend: B batch, Sq query length, Sk key length, E = d_model, H = n_heads,
Dk = E / H.
"""
from __future__ import annotations

from collections import namedtuple
from collections.abc import Mapping

import numpy as np

from . import _core

__all__ = ["MultiHeadAttention", "Linear"]

# parameter names in the order of the C block (src/mha.h, mha_param_layout)
_KEYS = ("W_q.weight", "W_q.bias", "W_k.weight", "W_k.bias",
         "W_v.weight", "W_v.bias", "W_o.weight", "W_o.bias")

IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


def _to_numpy(x):
    """A torch tensor (also one that requires grad) as a NumPy array; anything
    else unchanged.  torch is never imported here."""
    if type(x).__module__.startswith("torch") and hasattr(x, "detach"):
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        return x.numpy()
    return x


def _as_array(x, name):
    """x as an ndarray (no copy for an ndarray), with a message naming `name`
    when it cannot be one."""
    x = _to_numpy(x)
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name} must be array-like: {exc}") from None


def _check_real(arr, name):
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{name} must hold real numbers (bool, int or float), "
                        f"got dtype {arr.dtype}")


def _assign(target, value, name):
    """`linear.weight = value` (and `linear.weight += 1`, which Python ends with
    that assignment) copies value into the module's memory, never rebinds."""
    if value is target:
        return
    arr = _as_array(value, name)
    _check_real(arr, name)
    if arr.shape != target.shape:
        raise ValueError(f"{name} must have shape {target.shape}, got {arr.shape}")
    target[...] = arr


class Linear:
    """The weight (out_features, in_features) and bias (out_features,) of one
    projection, laid out like torch.nn.Linear.  Both are NumPy arrays that share
    the module's memory: write into them in place (``m.W_q.weight[...] = w``)
    to change what the next call computes."""

    __slots__ = ("_weight", "_bias")

    def __init__(self, weight, bias):
        self._weight = weight
        self._bias = bias

    @property
    def weight(self) -> np.ndarray:
        """(out_features, in_features), live memory of the module."""
        return self._weight

    @weight.setter
    def weight(self, value):
        _assign(self._weight, value, "weight")

    @property
    def bias(self):
        """(out_features,), live memory of the module; None when bias=False."""
        return self._bias

    @bias.setter
    def bias(self, value):
        if self._bias is None:
            raise AttributeError("this module was built with bias=False: it has no bias")
        _assign(self._bias, value, "bias")

    def __repr__(self):
        out, inp = self._weight.shape
        return (f"Linear(in_features={inp}, out_features={out}, "
                f"bias={self._bias is not None}, dtype={self._weight.dtype})")


class MultiHeadAttention(_core.MultiHeadAttention):
    """Multi-head attention, called like the PyTorch module it mirrors.

    MultiHeadAttention(d_model, n_heads, dropout=0.0, *, bias=True,
                       kdim=None, vdim=None, dtype="float32", seed=None)

    d_model, n_heads : positive ints, d_model divisible by n_heads.
    dropout : probability in [0, 1] of dropping an attention weight in
        training mode (the module starts in training mode, like torch's).
    bias : whether the four projections have biases.
    kdim, vdim : widths of key and value inputs (default d_model).
    dtype : "float32" or "float64" (or the NumPy equivalents).
    seed : int or None; fixes the initialisation, U(-1/sqrt(fan_in),
        1/sqrt(fan_in)) like torch.nn.Linear, and the dropout stream.

    Parameters: W_q, W_k, W_v, W_o, each with .weight (out, in) and .bias,
    live NumPy views of the module's memory.
    """

    def __init__(self, d_model, n_heads, dropout=0.0, *, bias=True, kdim=None,
                 vdim=None, dtype="float32", seed=None):
        # The C base class (__new__) checked the arguments and built the
        # parameters; this signature is here for help() and editors.
        pass

    # ------------------------------------------------------------ parameters
    def _tensor(self, i):
        offset, size = self._layout()[i]
        if size == 0:
            return None
        flat = self._block()[offset:offset + size]
        if i % 2 == 1:  # a bias
            return flat
        fan_in = (self.d_model, self.kdim, self.vdim, self.d_model)[i // 2]
        return flat.reshape(self.d_model, fan_in)

    def _linear(self, i):
        return Linear(self._tensor(i), self._tensor(i + 1))

    @property
    def W_q(self) -> Linear:
        """The query projection: weight (E, E), bias (E,)."""
        return self._linear(0)

    @property
    def W_k(self) -> Linear:
        """The key projection: weight (E, kdim), bias (E,)."""
        return self._linear(2)

    @property
    def W_v(self) -> Linear:
        """The value projection: weight (E, vdim), bias (E,)."""
        return self._linear(4)

    @property
    def W_o(self) -> Linear:
        """The output projection: weight (E, E), bias (E,)."""
        return self._linear(6)

    def _keys(self):
        return tuple(k for k in _KEYS if self.bias or not k.endswith(".bias"))

    def state_dict(self) -> dict:
        """A dict of NumPy copies under the seed module's keys: 'W_q.weight',
        'W_q.bias', ... 'W_o.bias' (no bias keys when bias=False)."""
        return {k: self._tensor(_KEYS.index(k)).copy() for k in self._keys()}

    def load_state_dict(self, state_dict, strict=True):
        """Load parameters from a dict like state_dict()'s (NumPy arrays, torch
        tensors or nested lists as values).

        A missing key is a KeyError and a wrong shape a ValueError, each naming
        the key; with strict=True an unexpected key is a KeyError too.  On any
        error nothing is changed; the new parameters replace the old ones at
        once, so a concurrent call sees either all old or all new ones.
        Returns (missing_keys, unexpected_keys) like torch."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of names to arrays, "
                            f"not {type(state_dict).__name__}")
        keys = self._keys()
        missing = [k for k in keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in keys]
        if strict and missing:
            raise KeyError(f"state_dict is missing {missing[0]!r} "
                           f"(expected keys: {', '.join(keys)})")
        if strict and unexpected:
            raise KeyError(f"state_dict has an unexpected key {unexpected[0]!r} "
                           f"(expected keys: {', '.join(keys)})")
        block = np.array(self._block(), copy=True)
        layout = self._layout()
        for k in keys:
            if k not in state_dict:
                continue
            i = _KEYS.index(k)
            value = _as_array(state_dict[k], f"state_dict[{k!r}]")
            _check_real(value, f"state_dict[{k!r}]")
            want = self._tensor(i).shape
            if value.shape != want:
                raise ValueError(f"state_dict[{k!r}] must have shape {want}, "
                                 f"got {value.shape}")
            offset, size = layout[i]
            block[offset:offset + size] = value.reshape(-1)
        self._load(block)
        return IncompatibleKeys(missing, unexpected)

    # ------------------------------------------------------------ modes
    def train(self, mode=True):
        """Training mode (dropout active) when mode is True; returns self."""
        if not isinstance(mode, bool):
            raise ValueError(f"training mode must be a bool, got {mode!r}")
        self.training = mode
        return self

    def eval(self):
        """Evaluation mode (no dropout); returns self."""
        return self.train(False)

    def __repr__(self):
        s = (f"{type(self).__name__}(d_model={self.d_model}, n_heads={self.n_heads}, "
             f"dropout={self.dropout!r}")
        if not self.bias:
            s += ", bias=False"
        if self.kdim != self.d_model:
            s += f", kdim={self.kdim}"
        if self.vdim != self.d_model:
            s += f", vdim={self.vdim}"
        if self.dtype != np.float32:
            s += f", dtype='{self.dtype.name}'"
        return s + ")"

    # ------------------------------------------------------------ the call
    def forward(self, query, key=None, value=None, mask=None, *, attn_mask=None,
                key_padding_mask=None, is_causal=False, need_weights=True,
                average_weights=False, masked_rows="nan"):
        """Attention of query over key and value; returns (output, weights).

        query (B, Sq, E), key (B, Sk, kdim), value (B, Sk, vdim), or unbatched
        (Sq, E), (Sk, kdim), (Sk, vdim).  key defaults to query, value to key.
        Anything NumPy can read as real numbers, torch tensors included.

        output is (B, Sq, E); weights (B, H, Sq, Sk) after dropout, the mean
        over heads (B, Sq, Sk) with average_weights=True, or None with
        need_weights=False (then no (Sq, Sk) buffer per head is made).

        Masks (all that are given apply together; blocked scores become -inf):
          mask: the seed notebook's, 0/1 values (1 = blocked), broadcastable to
            (B, H, Sq, Sk); bool, int or float.
          attn_mask: torch's, (Sq, Sk) or (B*H, Sq, Sk); bool (True =
            blocked) or float (added to the scores).
          key_padding_mask: torch's, (B, Sk); bool (True = ignore that key)
            or float (added).
          is_causal: query i does not see key j > i.
        masked_rows: "nan" (default) gives NaN weights and output for a query
          that sees no key, like the seed module; "zero" gives zero weights and
          an output row equal to W_o.bias, like torch's SDPA.
        """
        q = _as_array(query, "query")
        k = q if key is None else _as_array(key, "key")
        v = k if value is None else _as_array(value, "value")
        if q.ndim == 2:
            for name, x in (("key", k), ("value", v)):
                if x.ndim != 2:
                    raise ValueError(f"query is unbatched (2-D, shape {q.shape}), so {name} "
                                     f"must be 2-D too, got shape {x.shape}")
            batched = False
            q3, k3, v3 = q[None], (q[None] if k is q else k[None]), None
            v3 = k3 if v is k else (q3 if v is q else v[None])
        else:
            batched = True
            q3, k3, v3 = q, k, v
        if q3.ndim != 3:
            raise ValueError(f"query must be 3-D (batch, seq, d_model) or 2-D (seq, d_model), "
                             f"got shape {q.shape}")
        if k3.ndim != 3 or v3.ndim != 3:
            bad, x = ("key", k) if k3.ndim != 3 else ("value", v)
            raise ValueError(f"{bad} must be 3-D like query (shape {q.shape}), got shape {x.shape}")
        B, Sq, Sk, H = q3.shape[0], q3.shape[1], k3.shape[1], self.n_heads
        if masked_rows not in ("nan", "zero"):
            raise ValueError(f"masked_rows must be 'nan' or 'zero', got {masked_rows!r}")
        masks = []
        if mask is not None:
            masks.append(self._seed_mask(mask, batched))
        if attn_mask is not None:
            masks.append(self._attn_mask(attn_mask, batched, B, H, Sq, Sk))
        if key_padding_mask is not None:
            masks.append(self._padding_mask(key_padding_mask, batched, B, Sk))
        out, weights = self._forward(q3, k3, v3, masks, bool(is_causal), bool(need_weights),
                                     masked_rows == "zero", False)
        if weights is not None and average_weights:
            weights = weights.mean(axis=1)
        if not batched:
            out = out[0]
            weights = None if weights is None else weights[0]
        return out, weights

    __call__ = forward

    @staticmethod
    def _seed_mask(mask, batched):
        m = _as_array(mask, "mask")
        if m.dtype.kind not in "biuf":
            raise TypeError(f"mask must be bool, int or float with 0/1 values (1 = blocked), "
                            f"got dtype {m.dtype}")
        if m.ndim > (4 if batched else 3):
            raise ValueError(f"mask must broadcast to (B, H, Sq, Sk) (unbatched: (H, Sq, Sk)), "
                             f"got shape {m.shape}")
        if m.dtype.kind == "b":
            return (0, m.view(np.uint8))
        if not np.all((m == 0) | (m == 1)):
            raise ValueError("mask must hold only 0 and 1 (1 = blocked); for additive float "
                             "masks (-inf to block) use attn_mask")
        return (0, m != 0)

    @staticmethod
    def _kind(m, name):
        if m.dtype.kind == "b":
            return 0
        if m.dtype.kind == "f":
            return 1
        raise TypeError(f"{name} must be bool (True = blocked) or float (added to the "
                        f"scores), got dtype {m.dtype}")

    def _attn_mask(self, attn_mask, batched, B, H, Sq, Sk):
        m = _as_array(attn_mask, "attn_mask")
        kind = self._kind(m, "attn_mask")
        if m.shape == (Sq, Sk):
            return (kind, m)
        if batched and m.shape == (B * H, Sq, Sk):
            return (kind, m.reshape(B, H, Sq, Sk))
        if not batched and m.shape == (H, Sq, Sk):
            return (kind, m)
        third = f"(B*H, Sq, Sk) = ({B * H}, {Sq}, {Sk})" if batched else \
            f"(H, Sq, Sk) = ({H}, {Sq}, {Sk})"
        raise ValueError(f"attn_mask must have shape (Sq, Sk) = ({Sq}, {Sk}) or {third}, "
                         f"got {m.shape}")

    def _padding_mask(self, key_padding_mask, batched, B, Sk):
        m = _as_array(key_padding_mask, "key_padding_mask")
        kind = self._kind(m, "key_padding_mask")
        want = (B, Sk) if batched else (Sk,)
        if m.shape != want:
            raise ValueError(f"key_padding_mask must have shape "
                             f"{'(B, Sk)' if batched else '(Sk,)'} = {want}, got {m.shape}")
        return (kind, m.reshape(B, 1, 1, Sk) if batched else m)

    # ------------------------------------------------------------ training
    def forward_train(self, query, key=None, value=None, mask=None, **kwargs):
        """The call, for training: returns a ForwardContext (mha_ext.autograd)
        with .output, .weights and everything backward() needs (a copy of the
        parameters, the inputs, the masks, the dropout stream).  Keywords as
        for the call, plus params=, dropout= and dropout_counter= (see
        mha_ext.autograd.forward_train)."""
        from .autograd import forward_train
        return forward_train(self, query, key, value, mask, **kwargs)

    def backward(self, ctx, grad_output, grad_weights=None):
        """Gradients of the forward_train call that made ctx, from dL/d output
        (and optionally dL/d weights): a dict keyed like state_dict() plus
        'query', 'key' and 'value' (see mha_ext.autograd.backward)."""
        from .autograd import backward
        return backward(self, ctx, grad_output, grad_weights)

    def trace(self, query, key=None, value=None, mask=None, **kwargs):
        """The computation step by step (see mha_ext.trace.Trace): each step's
        name, formula, shape and array.  print() it for the shape flow."""
        from .trace import trace
        return trace(self, query, key, value, mask, **kwargs)
