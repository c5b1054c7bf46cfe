"""MultiHeadAttention: the Python face of the C type in _core.c.

The C base class owns the parameter memory and runs the forward pass with
the GIL released.  This subclass adds what is easier in Python: the mask
semantics of the seed notebook and of torch.nn.MultiheadAttention, torch
tensors as inputs, unbatched inputs, state dicts, train()/eval() and repr().

Legend: B batch, Sq query length, Sk key length, E = d_model, H = n_heads,
Dk = E / H.
"""
from __future__ import annotations

import contextlib
from collections import namedtuple
from collections.abc import Mapping
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import _core

__all__ = ["MultiHeadAttention", "Linear"]

# parameter names in the order of the C block (src/mha.h, mha_param_layout)
_KEYS = ("W_q.weight", "W_q.bias", "W_k.weight", "W_k.bias",
         "W_v.weight", "W_v.bias", "W_o.weight", "W_o.bias")

# torch.nn.MultiheadAttention's keys: packed (kdim == vdim == d_model) or separate
_TORCH_PACKED = ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")
_TORCH_SEPARATE = ("q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
                   "out_proj.weight", "out_proj.bias")
_TORCH_KEYS = frozenset(_TORCH_PACKED + _TORCH_SEPARATE)
_TORCH_UNSUPPORTED = {"bias_k": "add_bias_kv=True", "bias_v": "add_bias_kv=True"}

IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


def _to_numpy(x):
    """A torch tensor (also one that requires grad) as a NumPy array; anything
    else unchanged.  torch is never imported here."""
    if type(x).__module__.startswith("torch") and hasattr(x, "detach"):
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        if str(x.dtype) == "torch.bfloat16":  # NumPy has no bfloat16
            x = x.float()
        return x.resolve_conj().resolve_neg().numpy()
    return x


def _as_array(x, name):
    """x as an ndarray (no copy for an ndarray), with a message naming `name`
    when it cannot be one."""
    try:
        x = _to_numpy(x)
        if isinstance(x, np.ndarray):
            return x
        return np.asarray(x)
    except MemoryError as exc:
        raise MemoryError(f"{name}: {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name} must be array-like: {exc}") from None
    except Exception as exc:  # e.g. an __array__ that raises: still bad input
        raise TypeError(f"{name} must be array-like, converting it raised "
                        f"{type(exc).__name__}: {exc}") from exc


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


def _rebuild(cls, d_model, n_heads, kwargs):
    """Unpickling: a fresh module (its own memory) for __setstate__ to fill."""
    return cls.__new__(cls, d_model, n_heads, **kwargs)


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

    MultiHeadAttention.from_torch(module) copies a torch.nn.MultiheadAttention
    (or a module with W_q/W_k/W_v/W_o linear children); load_state_dict also
    takes torch's keys.  pickle and copy.deepcopy give copies that own their
    memory.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, *,
                 bias: bool = True, kdim: int | None = None, vdim: int | None = None,
                 dtype: DTypeLike = "float32", seed: int | None = None) -> None:
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

    def state_dict(self) -> dict[str, np.ndarray]:
        """A dict of NumPy copies under the seed module's keys: 'W_q.weight',
        'W_q.bias', ... 'W_o.bias' (no bias keys when bias=False)."""
        return {k: self._tensor(_KEYS.index(k)).copy() for k in self._keys()}

    def load_state_dict(self, state_dict: Mapping[str, ArrayLike],
                        strict: bool = True) -> IncompatibleKeys:
        """Load parameters from a dict like state_dict()'s, or from
        torch.nn.MultiheadAttention's state_dict() (NumPy arrays, torch
        tensors or nested lists as values).

        The seed layout has the keys 'W_q.weight', 'W_q.bias', ... 'W_o.bias'.
        torch's has 'in_proj_weight' (3E, E), the rows of W_q, W_k and W_v
        stacked (or 'q_proj_weight', 'k_proj_weight', 'v_proj_weight' when
        kdim or vdim differ from d_model), 'in_proj_bias' (3E,),
        'out_proj.weight' and 'out_proj.bias'; no bias keys with bias=False.

        A missing key is a KeyError and a wrong shape a ValueError, each naming
        the key; with strict=True an unexpected key is a KeyError too.  On any
        error nothing is changed; the new parameters replace the old ones at
        once, so a concurrent call sees either all old or all new ones.
        Returns (missing_keys, unexpected_keys) like torch."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of names to arrays, "
                            f"not {type(state_dict).__name__}")
        for k, option in _TORCH_UNSUPPORTED.items():
            if k in state_dict:
                raise ValueError(f"state_dict has {k!r}: torch.nn.MultiheadAttention with "
                                 f"{option} is not supported by mha_ext")
        seed_keys = self._keys()
        if (any(k in _TORCH_KEYS for k in state_dict)
                and not any(k in seed_keys for k in state_dict)):
            keys, parts = self._torch_layout(state_dict)
        else:
            keys = seed_keys
            parts = {k: (_KEYS.index(k),) for k in keys}
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
            value = _as_array(state_dict[k], f"state_dict[{k!r}]")
            _check_real(value, f"state_dict[{k!r}]")
            # a key holds one tensor, or several stacked along the first axis
            shapes = [self._tensor(i).shape for i in parts[k]]
            want = (sum(sh[0] for sh in shapes),) + shapes[0][1:]
            if value.shape != want:
                raise ValueError(f"state_dict[{k!r}] must have shape {want}, "
                                 f"got {value.shape}")
            row = 0
            for i, sh in zip(parts[k], shapes):
                offset, size = layout[i]
                block[offset:offset + size] = value[row:row + sh[0]].reshape(-1)
                row += sh[0]
        self._load(block)
        return IncompatibleKeys(missing, unexpected)

    def _torch_layout(self, state_dict):
        """The keys torch.nn.MultiheadAttention would have for this module, and
        for each the indices of the C block's tensors it stacks."""
        E = self.d_model
        same = self.kdim == E and self.vdim == E
        separate = any(k in state_dict for k in ("q_proj_weight", "k_proj_weight",
                                                  "v_proj_weight"))
        if "in_proj_weight" in state_dict and not same:
            raise ValueError(
                f"state_dict['in_proj_weight'] is torch's packed layout, which needs "
                f"kdim == vdim == d_model; this module has d_model={E}, kdim={self.kdim}, "
                f"vdim={self.vdim}, so torch stores 'q_proj_weight' ({E}, {E}), "
                f"'k_proj_weight' ({E}, {self.kdim}) and 'v_proj_weight' ({E}, {self.vdim})")
        if "in_proj_weight" in state_dict or (same and not separate):
            keys = list(_TORCH_PACKED)
        else:
            keys = list(_TORCH_SEPARATE)
        if not self.bias:
            keys = [k for k in keys if not k.endswith("_bias") and not k.endswith(".bias")]
        parts = {"in_proj_weight": (0, 2, 4), "in_proj_bias": (1, 3, 5),
                 "q_proj_weight": (0,), "k_proj_weight": (2,), "v_proj_weight": (4,),
                 "out_proj.weight": (6,), "out_proj.bias": (7,)}
        return tuple(keys), parts

    @classmethod
    def from_torch(cls, module, *, dtype: DTypeLike | None = None,
                   seed: int | None = None) -> "MultiHeadAttention":
        """A copy of a torch module: torch.nn.MultiheadAttention (either
        batch_first; mha_ext calls are always batch-first) or any module with
        W_q, W_k, W_v, W_o linear children (the seed notebook's layout).

        Takes over the weights, biases, kdim/vdim, dtype (float32 or float64;
        pass dtype= for a float16/bfloat16 module), dropout and training mode.
        add_bias_kv and add_zero_attn are not supported (ValueError).  The copy
        owns its memory: later changes to either module do not reach the other.
        """
        if hasattr(module, "in_proj_weight") and hasattr(module, "out_proj"):
            return cls._from_torch_mha(module, dtype, seed)
        if all(hasattr(module, n) for n in ("W_q", "W_k", "W_v", "W_o")):
            return cls._from_torch_seed(module, dtype, seed)
        raise TypeError(f"from_torch expects a torch.nn.MultiheadAttention or a module with "
                        f"W_q, W_k, W_v, W_o linear children, not {type(module).__name__}")

    @staticmethod
    def _torch_dtype(tensor, dtype):
        if dtype is not None:
            return dtype
        name = str(tensor.dtype).replace("torch.", "")
        if name in ("float32", "float64"):
            return name
        raise ValueError(f"from_torch: the module's parameters are {name}; mha_ext computes "
                         f"in float32 or float64, so pass dtype='float32' or 'float64'")

    @staticmethod
    def _torch_dropout(module):
        p = getattr(module, "dropout", 0.0)
        p = getattr(p, "p", p)  # an nn.Dropout child, or a float
        if p is None:
            return 0.0
        return float(p)

    @classmethod
    def _from_torch_mha(cls, module, dtype, seed):
        if getattr(module, "bias_k", None) is not None or getattr(module, "bias_v", None) is not None:
            raise ValueError("from_torch: torch.nn.MultiheadAttention with add_bias_kv=True "
                             "is not supported (mha_ext has no learned extra key/value)")
        if getattr(module, "add_zero_attn", False):
            raise ValueError("from_torch: torch.nn.MultiheadAttention with add_zero_attn=True "
                             "is not supported (mha_ext adds no zero key/value)")
        E, H = int(module.embed_dim), int(module.num_heads)
        kdim, vdim = int(module.kdim), int(module.vdim)
        w_out = module.out_proj.weight
        in_bias, out_bias = module.in_proj_bias, module.out_proj.bias
        bias = in_bias is not None or out_bias is not None
        m = cls(E, H, cls._torch_dropout(module), bias=bias, kdim=kdim, vdim=vdim,
                dtype=cls._torch_dtype(w_out, dtype), seed=seed)
        if module.in_proj_weight is not None:
            w = _to_numpy(module.in_proj_weight)
            ws = (w[:E], w[E:2 * E], w[2 * E:])
        else:
            ws = tuple(_to_numpy(getattr(module, f"{n}_proj_weight")) for n in "qkv")
        state = {"W_q.weight": ws[0], "W_k.weight": ws[1], "W_v.weight": ws[2],
                 "W_o.weight": _to_numpy(w_out)}
        if bias:
            b = np.zeros(3 * E) if in_bias is None else _to_numpy(in_bias)
            state.update({"W_q.bias": b[:E], "W_k.bias": b[E:2 * E], "W_v.bias": b[2 * E:],
                          "W_o.bias": np.zeros(E) if out_bias is None else _to_numpy(out_bias)})
        m.load_state_dict(state)
        m.train(bool(module.training))
        return m

    @classmethod
    def _from_torch_seed(cls, module, dtype, seed):
        lins = [getattr(module, n) for n in ("W_q", "W_k", "W_v", "W_o")]
        for n, lin in zip(("W_q", "W_k", "W_v", "W_o"), lins):
            if getattr(lin, "weight", None) is None or getattr(lin.weight, "ndim", 0) != 2:
                raise TypeError(f"from_torch: {type(module).__name__}.{n} must be a linear "
                                f"layer with a 2-D .weight")
        E = int(lins[0].weight.shape[0])
        H = getattr(module, "n_heads", None) or getattr(module, "num_heads", None)
        if H is None:
            d_k = getattr(module, "d_k", None)
            if d_k is None:
                raise ValueError(f"from_torch: {type(module).__name__} has no n_heads, "
                                 f"num_heads or d_k attribute, so the number of heads is unknown")
            H = E // int(d_k)
        biases = [getattr(lin, "bias", None) for lin in lins]
        bias = any(b is not None for b in biases)
        m = cls(E, int(H), cls._torch_dropout(module), bias=bias,
                kdim=int(lins[1].weight.shape[1]), vdim=int(lins[2].weight.shape[1]),
                dtype=cls._torch_dtype(lins[0].weight, dtype), seed=seed)
        state = {}
        for n, lin, b in zip(("W_q", "W_k", "W_v", "W_o"), lins, biases):
            state[f"{n}.weight"] = _to_numpy(lin.weight)
            if bias:
                state[f"{n}.bias"] = np.zeros(E) if b is None else _to_numpy(b)
        m.load_state_dict(state)
        m.train(bool(module.training))
        return m

    # ------------------------------------------------------------ copies
    def __reduce__(self):
        # the C type's __new__ needs d_model and n_heads: rebuild through it,
        # then restore parameters, dropout, mode and the dropout stream
        kwargs = dict(bias=self.bias, kdim=self.kdim, vdim=self.vdim,
                      dtype=self.dtype.name, seed=self.seed)
        state = {"params": self.state_dict(), "dropout": self.dropout,
                 "training": self.training, "counter": self._counter,
                 "dict": dict(self.__dict__)}
        return (_rebuild, (type(self), self.d_model, self.n_heads, kwargs), state)

    def __setstate__(self, state):
        self.load_state_dict(state["params"])
        self.dropout = state["dropout"]
        self.training = state["training"]
        self._counter = state["counter"]
        self.__dict__.update(state["dict"])

    @contextlib.contextmanager
    def editing(self):
        """``with mha.editing(): mha.W_q.weight[...] = w`` -- in-place writes
        into the parameter views made inside the block are atomic for calls
        from other threads: those wait, and then see all the new values (the
        writing thread itself may call the module inside the block).  Writes
        outside such a block are not synchronised with concurrent calls.

        The lock belongs to the thread that entered the block (blocks nest).
        Leaving the block releases it whichever thread leaves it (a block
        entered in one thread and left in another, or a generator of this
        block finalised by the garbage collector): it is never left held
        by a thread that has gone."""
        token = self._write_lock()
        try:
            yield self
        finally:
            self._write_unlock(token)

    # ------------------------------------------------------------ modes
    def train(self, mode: bool = True) -> "MultiHeadAttention":
        """Training mode (dropout active) when mode is True; returns self."""
        if not isinstance(mode, bool):
            raise ValueError(f"training mode must be a bool, got {mode!r}")
        self.training = mode
        return self

    def eval(self) -> "MultiHeadAttention":
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
    def forward(self, query: ArrayLike, key: ArrayLike | None = None,
                value: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                attn_mask: ArrayLike | None = None, key_padding_mask: ArrayLike | None = None,
                is_causal: bool = False, need_weights: bool = True,
                average_weights: bool = False,
                masked_rows: Literal["nan", "zero"] = "nan",
                ) -> tuple[np.ndarray, np.ndarray | None]:
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
          attn_mask: torch's, (Sq, Sk) or (B*H, Sq, Sk) with index b*H + h
            (unbatched: (H, Sq, Sk)); bool (True = blocked) or float (added
            to the scores, -inf allowed).
          key_padding_mask: torch's, (B, Sk) (unbatched: (Sk,)); bool (True =
            ignore that key) or float (added).
          is_causal: query i does not see key j > i.
        masked_rows: "nan" (default) gives NaN weights and output for a query
          that sees no key, like the seed module; "zero" gives zero weights and
          an output row equal to W_o.bias, like torch's SDPA.
        """
        q3, k3, v3, masks, batched = self._call_args(query, key, value, mask, attn_mask,
                                                     key_padding_mask, masked_rows)
        zero_rows = masked_rows == "zero"
        out, weights = self._forward(q3, k3, v3, masks=masks, is_causal=bool(is_causal),
                                     need_weights=bool(need_weights), zero_rows=zero_rows)
        if weights is not None and average_weights:
            weights = weights.mean(axis=1)
        if not batched:
            out = out[0]
            weights = None if weights is None else weights[0]
        return out, weights

    __call__ = forward

    def _call_args(self, query, key, value, mask, attn_mask, key_padding_mask, masked_rows,
                   convert=None):
        """A call's arguments checked and brought to the C side's form:
        (query, key, value) as 3-D arrays, the masks as (kind, array) pairs
        (kind 0 blocking, 1 additive) and whether the call was batched.
        convert(x, name) makes an input an array (default: no copy for an
        ndarray); shared by forward() and autograd.forward_train()."""
        convert = convert or _as_array
        q = convert(query, "query")
        k = q if key is None else convert(key, "key")
        v = k if value is None else convert(value, "value")
        if q.ndim == 2:
            for name, x in (("key", k), ("value", v)):
                if x.ndim != 2:
                    raise ValueError(f"query is unbatched (2-D, shape {q.shape}), so {name} "
                                     f"must be 2-D too, got shape {x.shape}")
            batched = False
            # keep self-attention visible to the C side (no second copy)
            q3 = q[None]
            k3 = q3 if k is q else k[None]
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
            masks.append(self._seed_mask(mask, batched, (B, H, Sq, Sk)))
        if attn_mask is not None:
            masks.append(self._attn_mask(attn_mask, batched, B, H, Sq, Sk))
        if key_padding_mask is not None:
            masks.append(self._padding_mask(key_padding_mask, batched, B, Sk))
        return q3, k3, v3, masks, batched

    @staticmethod
    def _seed_mask(mask, batched, dims):
        m = _as_array(mask, "mask")
        if m.dtype.kind not in "biuf":
            raise TypeError(f"mask must be bool, int or float with 0/1 values (1 = blocked), "
                            f"got dtype {m.dtype}")
        if m.ndim > (4 if batched else 3):
            raise ValueError(f"mask must broadcast to (B, H, Sq, Sk) (unbatched: (H, Sq, Sk)), "
                             f"got shape {m.shape}")
        target = dims if batched else dims[1:]
        try:
            fits = np.broadcast_shapes(m.shape, target) == target
        except ValueError:
            fits = False
        if not fits:
            names = ("batch", "heads", "query length", "key length")[-len(target):]
            bad = [f"its {n} axis is {d}, not {t}" for n, d, t in
                   zip(names[-m.ndim:], m.shape, target[-m.ndim:]) if d not in (1, t)]
            raise ValueError(f"mask of shape {m.shape} does not broadcast to "
                             f"{'(B, H, Sq, Sk)' if batched else '(H, Sq, Sk)'} = {target}"
                             + (f": {', '.join(bad)}" if bad else ""))
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

    def backward(self, ctx, grad_output: ArrayLike,
                 grad_weights: ArrayLike | None = None) -> dict[str, np.ndarray]:
        """Gradients of the forward_train call that made ctx, from dL/d output
        (and optionally dL/d weights): a dict keyed like state_dict() plus
        'query', 'key' and 'value' (see mha_ext.autograd.backward)."""
        from .autograd import backward
        return backward(self, ctx, grad_output, grad_weights)

    def trace(self, query: ArrayLike, key: ArrayLike | None = None,
              value: ArrayLike | None = None, mask: ArrayLike | None = None, **kwargs):
        """The computation step by step (see mha_ext.trace.Trace): each step's
        name, formula, shape and array.  print() it for the shape flow."""
        from .trace import trace
        return trace(self, query, key, value, mask, **kwargs)
