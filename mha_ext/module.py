"""MultiHeadAttention: the Python face of the C type in _core.c.

The C base class owns the parameter memory and runs the forward pass with
the GIL released.  This subclass is the public face and stays thin; the
work lives in one home each:

  _convert   torch tensors and array-likes to arrays, scalar argument checks
  _params    parameter keys, the block layout, state dicts <-> blocks
  _masks     mask, attn_mask, key_padding_mask -> the C side's (kind, array)
  _calls     call arguments, output shaping, the only caller of _forward,
             _forward_train and _backward
  _interop   from_torch
  _habits    torch habits: torch keyword names, batch_first, mask_polarity
  autograd   forward_train / backward / ForwardContext

Imports flow one way: _convert <- _params, _masks <- _calls <- autograd <-
module <- torch (mha_ext.torch); _interop and trace sit beside autograd.

Legend: B batch, Sq query length, Sk key length, E = d_model, H = n_heads,
Dk = E / H.
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import _calls, _core, _habits, _interop, _params
from . import autograd as _autograd
from .trace import trace as _trace
from ._convert import as_array, as_real
from ._params import IncompatibleKeys
from ._types import Causal, Flag, Int, MaskedRows, Real, Window
from .autograd import ForwardContext
from .cache import KVCache
from .layout import BlockLayout

if TYPE_CHECKING:  # from_torch's argument; torch is imported only when used
    from torch import nn

__all__ = ["MultiHeadAttention", "Linear"]


def _assign(target: np.ndarray, value: ArrayLike, name: str) -> None:
    """`linear.weight = value` (and `linear.weight += 1`, which Python ends with
    that assignment) copies value into the module's memory, never rebinds."""
    if value is target:
        return
    arr = as_real(value, name)
    if arr.shape != target.shape:
        raise ValueError(f"{name} must have shape {target.shape}, got {arr.shape}")
    target[...] = arr


def _rebuild(cls: type[MultiHeadAttention], d_model: int, n_heads: int,
             kwargs: dict[str, Any]) -> MultiHeadAttention:
    """Unpickling: a fresh module (its own memory) for __setstate__ to fill."""
    return cls.__new__(cls, d_model, n_heads, **kwargs)


class Linear:
    """The weight (out_features, in_features) and bias (out_features,) of one
    projection, laid out like torch.nn.Linear.  Both are NumPy arrays that share
    the module's memory: write into them in place (``m.W_q.weight[...] = w``)
    to change what the next call computes."""

    __slots__ = ("_weight", "_bias")

    def __init__(self, weight: np.ndarray, bias: np.ndarray | None) -> None:
        self._weight = weight
        self._bias = bias

    @property
    def weight(self) -> np.ndarray:
        """(out_features, in_features), live memory of the module."""
        return self._weight

    @weight.setter
    def weight(self, value: ArrayLike) -> None:
        _assign(self._weight, value, "weight")

    @property
    def bias(self) -> np.ndarray | None:
        """(out_features,), live memory of the module; None when bias=False."""
        return self._bias

    @bias.setter
    def bias(self, value: ArrayLike) -> None:
        if self._bias is None:
            raise AttributeError("this module was built with bias=False: it has no bias")
        _assign(self._bias, value, "bias")

    def __repr__(self) -> str:
        out, inp = self._weight.shape
        return (f"Linear(in_features={inp}, out_features={out}, "
                f"bias={self._bias is not None}, dtype={self._weight.dtype})")


class MultiHeadAttention(_core.MultiHeadAttention):
    """Multi-head attention, called like the PyTorch module it mirrors.

    MultiHeadAttention(d_model, n_heads, dropout=0.0, *, bias=True,
                       kdim=None, vdim=None, dtype="float32", seed=None,
                       add_bias_kv=False, add_zero_attn=False, n_kv_heads=None)

    d_model, n_heads : positive ints, d_model divisible by n_heads.
    n_kv_heads : None (= n_heads) or a divisor of n_heads: grouped-query
        attention (Llama, Mistral, Qwen; 1 is multi-query attention).  W_k
        and W_v project to n_kv_heads * d_k features, and query head h
        reads key/value head h // (n_heads // n_kv_heads).
    dropout : probability in [0, 1] of dropping an attention weight in
        training mode (the module starts in training mode, like torch's).
    bias : whether the four projections have biases.
    kdim, vdim : widths of key and value inputs (default d_model).
    dtype : "float32" or "float64" (or the NumPy equivalents).
    seed : int or None; fixes the initialisation, U(-1/sqrt(fan_in),
        1/sqrt(fan_in)) like torch.nn.Linear, and the dropout stream.
    add_bias_kv : torch.nn.MultiheadAttention's: learned vectors bias_k and
        bias_v (n_kv_heads * d_k,) (initialised N(0, 1/E) as torch does) are appended to
        the projected keys and values as one more key per batch.
    add_zero_attn : torch's: then a zero key and value are appended.
        The extra keys are never blocked by a mask or by is_causal, and the
        weights cover them: (B, H, Sq, Sk + extra), as torch returns them.

    Parameters: W_q, W_k, W_v, W_o, each with .weight (out, in) and .bias,
    live NumPy views of the module's memory (and bias_k, bias_v with
    add_bias_kv).

    Incremental decoding: new_cache(batch_size, max_len) makes a KVCache
    and ``m(x, cache=cache)`` projects x's keys and values into it and
    attends over everything cached (see forward); cache_memory(memory)
    caches a fixed memory's keys and values for cross-attention.

    MultiHeadAttention.from_torch(module) copies a torch.nn.MultiheadAttention
    (or a module with W_q/W_k/W_v/W_o linear children); load_state_dict also
    takes torch's keys.  pickle and copy.deepcopy give copies that own their
    memory.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> MultiHeadAttention:
        # torch's names -> a TypeError naming ours; the signature help() and
        # inspect show is __init__'s (set below the class)
        _habits.constructor_keywords(kwargs)
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, d_model: Int, n_heads: Int, dropout: Real = 0.0, *,
                 bias: Flag = True, kdim: Int | None = None, vdim: Int | None = None,
                 dtype: DTypeLike = "float32", seed: Int | None = None,
                 add_bias_kv: Flag = False, add_zero_attn: Flag = False,
                 n_kv_heads: Int | None = None) -> None:
        """A new module: arguments as in the class docstring (the C base
        class's __new__ checks them and builds the parameters; this signature
        is here for help() and editors)."""

    # ------------------------------------------------------------ layouts
    @property
    def batch_first(self) -> bool:
        """True (default): 3-D inputs are (B, S, E).  False: they are torch's
        seq-first (S, B, E) and the output is (Sq, B, E); masks and weights
        keep their shapes.  from_torch copies a torch module's setting."""
        return _habits.batch_first(self)

    @batch_first.setter
    def batch_first(self, value: Flag) -> None:
        _habits.set_batch_first(self, value)

    @property
    def mask_polarity(self) -> str:
        """How the seed ``mask`` argument reads: "block" (default, 1 =
        blocked) or "keep" (1 = attend, 0 = blocked, as modules that
        ``masked_fill(mask == 0, -inf)`` write it)."""
        return _habits.mask_polarity(self)

    @mask_polarity.setter
    def mask_polarity(self, value: Literal["block", "keep"]) -> None:
        _habits.set_mask_polarity(self, value)

    @property
    def causal(self) -> bool:
        """False (default): calls are causal as their is_causal says.  True:
        every call is causal (a false is_causal reads as True; "lower_right"
        stays), as the copy of a module that applies its own causal mask
        (from_torch(..., causal=True)) must be."""
        return _habits.causal(self)

    @causal.setter
    def causal(self, value: Flag) -> None:
        _habits.set_causal(self, value)

    # ------------------------------------------------------------ parameters
    def _linear(self, i: int) -> Linear:
        return Linear(_params.tensor(self, i), _params.tensor(self, i + 1))

    @property
    def W_q(self) -> Linear:
        """The query projection: weight (E, E), bias (E,)."""
        return self._linear(0)

    @property
    def W_k(self) -> Linear:
        """The key projection: weight (Ekv, kdim), bias (Ekv,), Ekv =
        n_kv_heads * d_k (E unless grouped-query attention)."""
        return self._linear(2)

    @property
    def W_v(self) -> Linear:
        """The value projection: weight (Ekv, vdim), bias (Ekv,)."""
        return self._linear(4)

    @property
    def W_o(self) -> Linear:
        """The output projection: weight (E, E), bias (E,)."""
        return self._linear(6)

    @property
    def bias_k(self) -> np.ndarray | None:
        """add_bias_kv's extra key (E,), live memory of the module (write into
        it in place); None without add_bias_kv."""
        return _params.tensor(self, 8)

    @bias_k.setter
    def bias_k(self, value: ArrayLike) -> None:
        if self.bias_k is None:
            raise AttributeError("this module was built without add_bias_kv: it has no bias_k")
        _assign(self.bias_k, value, "bias_k")

    @property
    def bias_v(self) -> np.ndarray | None:
        """add_bias_kv's extra value (E,), live memory; None without add_bias_kv."""
        return _params.tensor(self, 9)

    @bias_v.setter
    def bias_v(self, value: ArrayLike) -> None:
        if self.bias_v is None:
            raise AttributeError("this module was built without add_bias_kv: it has no bias_v")
        _assign(self.bias_v, value, "bias_v")

    def state_dict(self) -> dict[str, np.ndarray]:
        """A dict of NumPy copies under the seed module's keys: 'W_q.weight',
        'W_q.bias', ... 'W_o.bias' (no bias keys when bias=False), and
        'bias_k', 'bias_v' (Ekv,) with add_bias_kv."""
        return _params.state_dict(self)

    def load_state_dict(self, state_dict: Mapping[str, ArrayLike],
                        strict: Flag = True) -> IncompatibleKeys:
        """Load parameters from a dict like state_dict()'s, or from
        torch.nn.MultiheadAttention's state_dict() (NumPy arrays, torch
        tensors or nested lists as values).

        The seed layout has the keys 'W_q.weight', 'W_q.bias', ... 'W_o.bias'.
        torch's has 'in_proj_weight' (3E, E), the rows of W_q, W_k and W_v
        stacked (or 'q_proj_weight', 'k_proj_weight', 'v_proj_weight' when
        kdim or vdim differ from d_model), 'in_proj_bias' (3E,),
        'out_proj.weight' and 'out_proj.bias'; no bias keys with bias=False.
        With add_bias_kv both layouts have 'bias_k' and 'bias_v', (E,) or
        torch's (1, 1, E).

        A missing key is a KeyError and a wrong shape a ValueError, each naming
        the key; with strict=True an unexpected key is a KeyError too.  On any
        error nothing is changed; the new parameters replace the old ones at
        once, so a concurrent call sees either all old or all new ones.
        Returns (missing_keys, unexpected_keys) like torch."""
        block, incompatible = _params.load_block(self, state_dict, strict)
        self._load(block)
        return incompatible

    @classmethod
    def from_torch(cls, module: nn.Module, *, dtype: DTypeLike | None = None,
                   seed: Int | None = None, names: Mapping[str, str] | None = None,
                   n_heads: Int | None = None,
                   mask_polarity: Literal["block", "keep"] | None = None,
                   causal: Flag | None = None,
                   **unknown: NoReturn) -> "MultiHeadAttention":
        """A copy of a torch module: torch.nn.MultiheadAttention, or a
        seed-style attention module: W_q/W_k/W_v/W_o,
        q_linear/k_linear/v_linear/out_linear or q_proj/k_proj/v_proj/out_proj
        (or o_proj) linear children, or per-head lists of Q, K, V linears
        (see mha_ext._interop); ``names={"W_q": "path", ...}`` names the four
        projections of any other module (a path may hold one ``*`` for every
        head of a list, e.g. "heads.*.query").

        Takes over the weights, biases, kdim/vdim, dtype (float32 or float64;
        pass dtype= for a float16/bfloat16 module), dropout, training mode
        and, from an nn.MultiheadAttention, batch_first (a seq-first
        module's copy takes (S, B, E) inputs, as torch does).  The number of
        heads comes from the module (n_heads, num_heads, ... or d_k,
        head_dim, ...; the length of per-head lists) or n_heads=.
        A q/k/v/o_proj module whose k_proj and v_proj project to fewer
        features (n_kv_heads * head_dim, e.g. Hugging Face's LlamaAttention)
        gives a grouped-query copy (n_kv_heads); Llama's rotary embeddings
        are its caller's business (they are not part of these projections).
        mask_polarity="keep" makes ``mask`` read 1 = attend, as modules that
        ``masked_fill(mask == 0, -inf)`` do; it is never guessed.
        A seed module holding a buffer shaped as a causal mask (a ``tril``
        of ones, a ``triu`` of True, 0 and -inf: one value on and below the
        diagonal, another above), which its forward presumably applies, is
        a ValueError unless ``causal=`` says what the copy does: True, every
        call causal (the ``causal`` attribute), or False, calls as given.
        add_bias_kv (bias_k, bias_v) and add_zero_attn are copied too.  A
        module on the meta device is a ValueError (it has no data to copy).  The
        copy owns its memory: later changes to either module do not reach
        the other.  torch's keyword names are a TypeError naming ours
        (num_heads: n_heads; embed_dim: none, the width is the module's).
        """
        if "embed_dim" in unknown:
            raise TypeError("MultiHeadAttention.from_torch() got torch's keyword 'embed_dim': "
                            "the copy takes its width (d_model) from the module")
        if unknown:
            _habits.call_keywords(unknown, "MultiHeadAttention.from_torch")
        return _interop.from_torch(cls, module, dtype, seed, names, n_heads, mask_polarity,
                                   causal)

    # ------------------------------------------------------------ copies
    def __reduce__(self) -> tuple[Any, ...]:
        # the C type's __new__ needs d_model and n_heads: rebuild through it,
        # then restore parameters, dropout, mode and the dropout stream
        kwargs = dict(bias=self.bias, kdim=self.kdim, vdim=self.vdim,
                      dtype=self.dtype.name, seed=self.seed, add_bias_kv=self.add_bias_kv,
                      add_zero_attn=self.add_zero_attn)
        if self.n_kv_heads != self.n_heads:
            kwargs["n_kv_heads"] = self.n_kv_heads
        state = {"params": self.state_dict(), "dropout": self.dropout,
                 "training": self.training, "counter": self._counter,
                 "dict": dict(self.__dict__)}
        return (_rebuild, (type(self), self.d_model, self.n_heads, kwargs), state)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state["params"])
        self.dropout = state["dropout"]
        self.training = state["training"]
        self._counter = state["counter"]
        self.__dict__.update(state["dict"])

    def editing(self) -> contextlib.AbstractContextManager[MultiHeadAttention]:
        """``with mha.editing(): mha.W_q.weight[...] = w`` -- in-place writes
        into the parameter views made inside the block are atomic for calls
        from other threads: those wait, and then see all the new values (the
        writing thread itself may call the module inside the block).  Writes
        outside such a block are not synchronised with concurrent calls.

        The lock belongs to the thread that entered the block (blocks nest).
        Leaving the block releases it whichever thread leaves it (a block
        entered in one thread and left in another, or a block object
        dropped without leaving: the garbage collector releases it): it is
        never left held by a thread that has gone.  The lock is taken and
        released in C (_core._Editing): Ctrl-C cannot fall between taking
        it and the block's start, nor between the block's end and the
        release."""
        return _core._Editing(self)

    # ------------------------------------------------------------ modes
    def train(self, mode: Flag = True) -> MultiHeadAttention:
        """Training mode (dropout active) when mode is True; returns self.
        mode is a bool (Python's or NumPy's), else a ValueError, as torch's
        nn.Module.train."""
        if not isinstance(mode, (bool, np.bool_)):
            raise ValueError(f"train(mode): the training mode must be a bool, got {mode!r}")
        self.training = bool(mode)
        return self

    def eval(self) -> MultiHeadAttention:
        """Evaluation mode (no dropout); returns self."""
        return self.train(False)

    def __repr__(self) -> str:
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
        if self.add_bias_kv:
            s += ", add_bias_kv=True"
        if self.add_zero_attn:
            s += ", add_zero_attn=True"
        if self.n_kv_heads != self.n_heads:
            s += f", n_kv_heads={self.n_kv_heads}"
        if not self.batch_first:
            s += ", batch_first=False"
        if self.mask_polarity != "block":
            s += f", mask_polarity={self.mask_polarity!r}"
        if self.causal:
            s += ", causal=True"
        return s + ")"

    # ------------------------------------------------------------ caches
    def new_cache(self, batch_size: Int, max_len: Int) -> KVCache:
        """An empty key/value cache for incremental decoding: up to max_len
        keys of a batch of batch_size, in this module's dtype (memory:
        2 * batch_size * n_kv_heads * d_k * max_len scalars).  Pass it as
        ``m(x, cache=cache)``: see forward.  Both sizes are ints >= 1
        (TypeError, ValueError); too large to allocate is a MemoryError.  A
        module with add_bias_kv or add_zero_attn takes no cache (ValueError)."""
        return KVCache(self, batch_size, max_len)

    def cache_memory(self, memory: ArrayLike, value: ArrayLike | None = None) -> KVCache:
        """A cross-attention cache: the keys and values of a fixed memory
        (B, M, kdim) (value (B, M, vdim), default memory) projected once;
        (M, B, kdim) and (M, B, vdim) when ``batch_first`` is False, as the
        module's calls take them.  Later calls ``m(query, cache=cache)``
        attend over all M of them (no causality; masks cover the M keys)
        and never extend it."""
        seq_first = not _habits.batch_first(self)
        dims = "(length, batch, {})" if seq_first else "(batch, length, {})"
        mem = as_real(memory, "memory")
        given = mem.shape
        if seq_first and mem.ndim == 3:  # (M, B, kdim) -> (B, M, kdim), as a call's key
            mem = mem.swapaxes(0, 1)
        if mem.ndim != 3 or mem.shape[0] < 1 or mem.shape[1] < 1:
            raise ValueError(f"memory must be 3-D {dims.format('kdim')} with batch and "
                             f"length >= 1, got shape {given}")
        if mem.shape[2] != self.kdim:
            raise ValueError(f"memory must be {dims.format(f'kdim = {self.kdim}')}, got shape "
                             f"{given}")
        B, M = mem.shape[:2]
        want = (M, B, self.vdim) if seq_first else (B, M, self.vdim)
        if value is None and self.vdim != self.kdim:
            raise ValueError(f"value is needed: this module's vdim ({self.vdim}) is not its "
                             f"kdim ({self.kdim}), so the memory cannot be its own value; "
                             f"pass cache_memory(memory, value) with value {dims.format('vdim')}"
                             f" = {want}")
        val = None
        if value is not None:
            val = as_real(value, "value")
            if val.shape != want:
                raise ValueError(f"value must be {dims.format('vdim')} = {want}, the memory's "
                                 f"batch and length, got shape {val.shape}")
            if seq_first:
                val = val.swapaxes(0, 1)
        cache = KVCache(self, B, M)
        empty = np.zeros((B, 0, self.d_model), dtype=self.dtype)
        call = _calls.prepare(self, empty, mem, val, need_weights=False, cache=cache)
        _calls.c_forward(self, call)  # Sq = 0: only the cache is filled
        cache._cross = True
        return cache

    # ------------------------------------------------------------ the call
    def forward(self, query: ArrayLike, key: ArrayLike | None = None,
                value: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                attn_mask: ArrayLike | None = None, key_padding_mask: ArrayLike | None = None,
                is_causal: Causal = False, need_weights: Flag = True,
                average_weights: Flag = False, masked_rows: MaskedRows = "nan",
                scale: Real | None = None, window: Window = None,
                head_mask: ArrayLike | None = None, layout: BlockLayout | None = None,
                cache: KVCache | None = None,
                **unknown: NoReturn,  # none taken: checkers flag a misspelt keyword
                ) -> tuple[np.ndarray, np.ndarray | None]:
        """Attention of query over key and value; returns (output, weights).

        query (B, Sq, E), key (B, Sk, kdim), value (B, Sk, vdim), or unbatched
        (Sq, E), (Sk, kdim), (Sk, vdim).  key defaults to query, value to key.
        Anything NumPy can read as real numbers, torch tensors included.

        output is (B, Sq, E); weights (B, H, Sq, Sk) after dropout, the mean
        over heads (B, Sq, Sk) with average_weights=True (summed head by head
        in order, then divided by H; formed by the C core, which writes no
        per-head array when the call has enough rows for its threads), or
        None with need_weights=False (then no (Sq, Sk) buffer per head is
        made).  With
        add_bias_kv / add_zero_attn the weights have Sk + 1 (or + 2) keys.

        Masks (all that are given apply together; blocked scores become -inf):
          mask: the seed notebook's, 0/1 values (1 = blocked), broadcastable to
            (B, H, Sq, Sk); bool, int or float.
          attn_mask: torch's, (Sq, Sk) or (B*H, Sq, Sk) with index b*H + h
            (unbatched: (H, Sq, Sk)); bool (True = blocked) or float (added
            to the scores, -inf allowed).
          key_padding_mask: torch's, (B, Sk) (unbatched: (Sk,)); bool (True =
            ignore that key) or float (added).
          is_causal: True: query i does not see key j > i (top-left);
            "lower_right": query i does not see key j > i + Sk - Sq (torch's
            causal_lower_right: the last query sees every key, as when
            decoding).  Never blocks add_bias_kv's or add_zero_attn's keys.
          window: (left, right), a sliding window: query i sees keys j with
            i - left <= j <= i + right (None = unbounded on that side; the
            diagonal shifted by Sk - Sq with is_causal="lower_right"; with
            is_causal the right side is 0 anyway).  The kernels skip the key
            blocks outside it: no (Sq, Sk) mask is built.  Never blocks
            add_bias_kv's or add_zero_attn's keys.
          layout: a mha_ext.layout.BlockLayout, block-sparse attention: query
            block qb sees key block kb only where layout.keep[..., qb, kb] is
            True (True = KEPT, the opposite polarity of the masks above).
            Its shape must fit: ceil(Sq / q_block) x ceil(Sk / k_block)
            blocks, per head (H, ...) or per batch and head (B, H, ...)
            optional.  The kernels skip the key ranges whose blocks are
            empty for a task of queries: no (Sq, Sk) mask is built.  Never
            blocks add_bias_kv's or add_zero_attn's keys.
        head_mask: None, or (H,) or (B, H) finite factors multiplying each
          head's weights after dropout (Hugging Face's head_mask: 0 switches
          the head off, 1 keeps it); the weights returned are multiplied.
          Gradients flow to everything else as before; head_mask gets none.
        scale: None (1/sqrt(Dk)) or the factor of the scores (any real, 0 and
          +-inf too; NaN is a ValueError).
        masked_rows: "nan" (default) gives NaN weights and output for a query
          that sees no key, like the seed module; "zero" gives zero weights and
          the context 0·V, like torch's SDPA: an output row equal to W_o.bias
          (NaN where V holds NaN or inf).
        cache: None, or a KVCache of this module (new_cache, cache_memory).
          Self-attention cache of length L: the call's keys and values (key
          and value default to query; n = key's length) are projected into
          the cache at [L, L + n) and the queries attend over all L + n
          keys, causally with the lower-right alignment (query i of Sq sees
          keys j <= L + n - Sq + i), whatever is_causal says (False, True
          or "lower_right" all mean that here); the cache's length becomes
          L + n.  Prefill (many tokens) and decode (one) are the same call.
          attn_mask is (Sq, L + n), key_padding_mask (B, L + n) (left-padded
          prompts: block the pad keys in every later call too), window and
          head_mask work as usual; the weights are (B, H, Sq, L + n)
          ((B, Sq, L + n) with average_weights).  The
          outputs are bit-identical to those rows of one causal call over
          the whole sequence (same instruction set, finite inputs, eval
          mode).  More keys than the capacity: a ValueError, the cache
          unchanged.  Cross cache (cache_memory): pass the query alone; it
          attends over the cached memory without causality.  Not with
          add_bias_kv / add_zero_attn (ValueError), nor forward_train.
        is_causal, need_weights and average_weights are single truth values
        (bools, NumPy bools); a sequence or array is a TypeError naming it.
        torch's keyword names (average_attn_weights, batch_first) are a
        TypeError naming ours.  With ``batch_first = False`` 3-D inputs are
        (S, B, E) and the output (Sq, B, E); with ``mask_polarity = "keep"``
        mask reads 1 = attend.
        """
        passed = (query, key, value)
        query, key, value, mask, seq_first = _habits.adapt_call(
            self, query, key, value, mask, unknown, "forward")
        try:
            call = _calls.prepare(self, query, key, value, mask, attn_mask, key_padding_mask,
                                  is_causal, need_weights, average_weights, masked_rows,
                                  scale=scale, window=window, head_mask=head_mask,
                                  layout=layout, cache=cache)
            out, weights = _calls.c_forward(self, call)
        except ValueError as exc:
            if not seq_first:
                raise
            raise ValueError(_habits.seq_first_shapes(exc, passed)) from None
        out, weights = _calls.shape_output(call, out, weights)
        return (_habits.seq_first_output(out) if seq_first else out), weights

    __call__ = forward

    # ------------------------------------------------------------ training
    # the functions themselves (their first argument is the module): one
    # signature each, and the checks of a seq-first or keep-polarity module
    # made there, however they are called
    forward_train = _autograd.forward_train

    def backward(self, ctx: ForwardContext, grad_output: ArrayLike,
                 grad_weights: ArrayLike | None = None, *,
                 head_mask_grad: Flag = False,
                 scores_grad: Flag = False) -> dict[str, np.ndarray]:
        """Gradients of the forward_train call that made ctx, from dL/d output
        (and optionally dL/d weights): a dict keyed like state_dict() plus
        'query', 'key' and 'value', 'head_mask' with head_mask_grad=True and
        'scores' (dL/d masked scores, a float mask's gradient before its
        broadcast is summed) with scores_grad=True (see
        mha_ext.autograd.backward)."""
        return _autograd.backward(self, ctx, grad_output, grad_weights,
                                  head_mask_grad=head_mask_grad, scores_grad=scores_grad)

    trace = _trace


# help(), inspect.signature() and editors show the constructor's arguments,
# not __new__'s (*args, **kwargs)
MultiHeadAttention.__new__.__signature__ = inspect.signature(  # type: ignore[attr-defined]
    MultiHeadAttention.__init__)
