"""Type stubs of the C extension mha_ext._core (_core.c, _core_calls.c,
_core_sdpa.c).

The underscored methods are the private protocol between the Python layer
and the C binding: keyword arguments, each result of one fixed shape.
"""
from typing import Any, Literal, Optional, Sequence, Tuple, TypedDict, TypeVar, Union, final

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

_Self = TypeVar("_Self", bound="MultiHeadAttention")

# a mask: (kind, array), kind 0 blocking (nonzero = blocked) or 1 additive,
# broadcastable to (B, H, Sq, Sk)
_Mask = Tuple[Literal[0, 1], npt.ArrayLike]
# None (the module's own), the flat block, or one array per block tensor (None where
# the layout has none), read in place
_Params = Union[None, npt.ArrayLike, Tuple[Optional[npt.ArrayLike], ...]]
_Flag = bool | int | np.bool_
_Real = float | np.floating[Any] | np.integer[Any]
# is_causal: False, True (top-left) or "lower_right"
# window: None, or (left, right), each an int >= 0 or None (unbounded)
_Window = Optional[Tuple[Optional[int], Optional[int]]]
# layout: None, or (keep, q_block, k_block): keep a 4-D bool or uint8 array
# (1 or B, 1 or H, ceil(Sq / q_block), ceil(Sk / k_block)), nonzero = the
# block is KEPT (computed); block sizes ints > 0
_Layout = Optional[Tuple[npt.ArrayLike, int, int]]
_Causal = _Flag | Literal["lower_right"]
# (Q, K, V, ctx, P | None): Q (B, H, Sq, Dk), K (B, Hkv, Dk, Sk'), V (B, Hkv, Sk', Dk),
# ctx (B, Sq, E), P (B, H, Sq, Sk'); Sk' = Sk + the extra keys of add_bias_kv
# and add_zero_attn
_Saved = Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Optional[np.ndarray]]
# (params | None, query, key, value): the forward's copies of its inputs
_Copies = Tuple[Optional[np.ndarray], np.ndarray, np.ndarray, np.ndarray]
# a key/value cache: (K (B, Hkv, Dk, cap), V (B, Hkv, cap, Dk), length), the
# module's dtype, C-contiguous and writeable (the call writes its keys at
# [length, length + Sk)); masks then cover (B, H, Sq, length + Sk)
_Cache = Tuple[np.ndarray, np.ndarray, int]

def set_num_threads(n: int | np.integer[Any], /) -> None:
    """Use n threads (1 to 256) for the library's own parallel work."""

def get_num_threads() -> int:
    """The number of threads the library uses (default: the CPUs this process may use)."""

class _GemmNC(TypedDict):
    float32: int
    float64: int

class _TnPack(TypedDict):
    float32: int
    float64: int

class _CpuInfo(TypedDict):
    isa: str
    l1d_bytes: int
    l2_bytes: int
    l3_bytes: int
    cache_source: Literal["cpuid", "sysconf", "default"]
    fma_bits: int
    fma512_per_cycle: int
    fma_ratio: float
    gemm_kc: int
    gemm_nc: _GemmNC
    tn_pack: _TnPack
    threads: int

def cpu_info() -> _CpuInfo:
    """What the CPU reports (cache sizes, FMA width, 512-bit FMAs per cycle
    measured) and the blocking drawn from it (the packed GEMM's NC; tn_pack:
    whether the weight gradients' products pack an Aᵀ whose rows lie a
    multiple of 4 KiB apart, measured at first use);
    the probes take some tens of ms."""

class _MemoryInfo(TypedDict):
    cached_bytes: int
    cached_blocks: int
    limit_bytes: int

def memory_info() -> _MemoryInfo:
    """The output cache: the bytes and blocks of freed result arrays kept
    for reuse, and its bound (MHA_EXT_CACHE_MB, else 1 GiB or an eighth of
    the memory; 0: off)."""

def release_memory() -> int:
    """Return the memory mha_ext keeps for reuse to the system (the cached
    blocks of freed result arrays and the calling thread's workspace); the
    cached bytes freed."""

def _set_isa(name: Literal["portable", "avx2", "avx512", "amx"], /) -> None: ...
def _get_isa() -> str: ...
# a KVCache's hold (cache.py): d[key] = token unless another is there / removed if token
def _isa_available(name: str, /) -> bool: ...
# attention on projected heads: q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv)
def _sdpa(q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, *,
          masks: Sequence[_Mask] = ..., is_causal: _Causal = ..., scale: Optional[float] = ...,
          dropout: float = ..., seed: int = ..., counter: int = ..., need_weights: _Flag = ...,
          zero_rows: _Flag = ..., reference: _Flag = ..., window: _Window = ...,
          layout: _Layout = ..., head_mask: Optional[npt.ArrayLike] = ...,
          ) -> Tuple[np.ndarray, Optional[np.ndarray]]: ...
def _sdpa_backward(q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike,
                   grad_output: npt.ArrayLike, *, masks: Sequence[_Mask] = ...,
                   is_causal: _Causal = ..., scale: Optional[float] = ..., dropout: float = ...,
                   seed: int = ..., counter: int = ..., zero_rows: _Flag = ...,
                   grad_weights: Optional[npt.ArrayLike] = ..., reference: _Flag = ...,
                   window: _Window = ..., layout: _Layout = ...,
                   head_mask: Optional[npt.ArrayLike] = ..., scores_grad: _Flag = ...,
                   ) -> Tuple[np.ndarray, ...]: ...  # dq, dk, dv[, d scores]

# a C type with its own instance layout: no second such base (PEP 800)
@disjoint_base
class MultiHeadAttention:
    """The C part of mha_ext.MultiHeadAttention: parameter memory and the calls."""

    def __new__(cls: type[_Self], d_model: int | np.integer[Any],
                n_heads: int | np.integer[Any], dropout: _Real = ..., *, bias: _Flag = ...,
                kdim: int | np.integer[Any] | None = ...,
                vdim: int | np.integer[Any] | None = ...,
                dtype: npt.DTypeLike = ...,
                seed: int | np.integer[Any] | None = ...,
                add_bias_kv: _Flag = ..., add_zero_attn: _Flag = ...,
                n_kv_heads: int | np.integer[Any] | None = ...,
                _empty: _Flag = ...) -> _Self: ...
    @property
    def d_model(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def d_k(self) -> int: ...
    @property
    def kdim(self) -> int: ...
    @property
    def vdim(self) -> int: ...
    @property
    def bias(self) -> bool: ...
    @property
    def add_bias_kv(self) -> bool: ...
    @property
    def add_zero_attn(self) -> bool: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def num_parameters(self) -> int: ...
    @property
    def dtype(self) -> np.dtype[Any]: ...
    @property
    def dropout(self) -> float: ...
    @dropout.setter
    def dropout(self, value: _Real, /) -> None: ...
    @property
    def training(self) -> bool: ...
    @training.setter
    def training(self, value: _Flag, /) -> None: ...
    @property
    def _counter(self) -> int: ...
    @_counter.setter
    def _counter(self, value: int | np.integer[Any], /) -> None: ...
    def _forward(self, query: npt.ArrayLike, key: npt.ArrayLike, value: npt.ArrayLike, *,
                 params: _Params = ..., masks: Sequence[_Mask] = ..., is_causal: _Causal = ...,
                 need_weights: _Flag = ..., zero_rows: _Flag = ...,
                 reference: _Flag = ..., scale: Optional[float] = ...,
                 window: _Window = ..., head_mask: Optional[npt.ArrayLike] = ...,
                 layout: _Layout = ...,
                 cache: Optional[_Cache] = ..., average_weights: _Flag = ...,
                 ) -> Tuple[np.ndarray, Optional[np.ndarray]]: ...
    def _forward_train(self, query: npt.ArrayLike, key: npt.ArrayLike, value: npt.ArrayLike, *,
                       params: _Params = ..., masks: Sequence[_Mask] = ...,
                       is_causal: _Causal = ..., need_weights: _Flag = ...,
                       zero_rows: _Flag = ..., dropout: float = ..., counter: int = ...,
                       save: _Flag = ..., save_p: _Flag = ..., scale: Optional[float] = ...,
                       window: _Window = ..., head_mask: Optional[npt.ArrayLike] = ...,
                       layout: _Layout = ..., average_weights: _Flag = ...,
                       ) -> Tuple[np.ndarray, Optional[np.ndarray], Optional[_Saved], _Copies]: ...
    def _backward(self, query: npt.ArrayLike, key: npt.ArrayLike, value: npt.ArrayLike,
                  grad_output: npt.ArrayLike, *, params: _Params = ...,
                  masks: Sequence[_Mask] = ..., is_causal: _Causal = ...,
                  zero_rows: _Flag = ..., dropout: float = ..., counter: int = ...,
                  grad_weights: Optional[npt.ArrayLike] = ...,
                  saved: Optional[_Saved] = ..., scale: Optional[float] = ...,
                  window: _Window = ..., head_mask: Optional[npt.ArrayLike] = ...,
                  layout: _Layout = ..., scores_grad: _Flag = ...,
                  ) -> Tuple[np.ndarray, ...]: ...  # params, query, key, value[, scores]
    def _block(self) -> np.ndarray: ...
    def _layout(self) -> Tuple[Tuple[int, int], ...]: ...
    def _load(self, block: npt.ArrayLike, /) -> None: ...
    def _snapshot(self) -> npt.NDArray[Any]: ...
    def _edits(self) -> int: ...
    def _write_lock(self) -> int: ...
    def _write_unlock(self, token: Optional[int] = ..., /) -> None: ...
    def _take_counter(self) -> int: ...

@final
class _Editing:
    """editing()'s context manager: the module's write lock, taken and released in C."""
    def __new__(cls, module: MultiHeadAttention, /) -> _Editing: ...
    def __enter__(self) -> Any: ...
    def __exit__(self, *exc_info: object) -> bool: ...

class _Guarded:
    """A context manager's base whose __enter__ / __exit__ call _enter() /
    _exit() from C (_exit again if an exception stopped it)."""
    def __enter__(self) -> Any: ...
    def __exit__(self, *exc_info: object) -> Optional[bool]: ...

@final
class _Holding:
    """A KVCache's hold as a context manager, taken and given back in C."""
    def __new__(cls, d: dict[str, Any], busy: str, /) -> _Holding: ...
    def __enter__(self) -> None: ...
    def __exit__(self, *exc_info: object) -> bool: ...
