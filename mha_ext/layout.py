"""Block-sparse attention layouts: which (query block, key block) pairs are
computed.  A :class:`BlockLayout` is passed as ``layout=`` to every call
(the module, ``forward_train``, ``trace``, the torch classes,
``scaled_dot_product_attention``); the C kernels skip, forward and backward,
the key ranges whose blocks are all empty for a task of queries, and no
(Sq, Sk) mask is ever built.

Polarity: a layout says what is KEPT.  ``keep[qb, kb]`` True means the
queries of block qb see the keys of block kb (still subject to every other
mask); False blocks them.  That is the opposite of our boolean masks
(``mask``, ``attn_mask``, ``key_padding_mask``: True = blocked, as torch's
nn.MultiheadAttention), hence the different name: a layout is never a mask
argument, and a mask is never a layout.

FlexAttention's ``BlockMask`` is the model (the names here are ours).  The
pattern helpers build the classic layouts: :func:`local_blocks` (a band),
:func:`strided` (Sparse Transformer), :func:`global_local` (Longformer:
global tokens + a band) and :func:`bigbird` (global + band + random blocks).

Legend: B batch, H heads, Sq/Sk query/key lengths, nqb/nkb the numbers of
query/key blocks: ceil(Sq / q_block), ceil(Sk / k_block).
"""
from __future__ import annotations

from typing import Union

import numpy as np
from numpy.typing import ArrayLike

from ._convert import as_array, seed as seed_value
from ._types import Flag, Int

__all__ = ["BlockLayout", "local_blocks", "strided", "global_local", "bigbird"]

# an int > 0 (square blocks) or a pair (q_block, k_block) of them
BlockSize = Union[Int, tuple[Int, Int], list[Int]]


_MAX_BLOCK = 2**63 - 1


def _block_size(block_size: BlockSize) -> tuple[int, int]:
    """block_size checked: an int > 0, or a pair (q_block, k_block) of them."""
    pair = block_size if isinstance(block_size, (tuple, list)) else (block_size, block_size)
    if len(pair) != 2:
        raise TypeError(f"block_size must be an int > 0 or a pair (q_block, k_block), "
                        f"got {block_size!r}")
    out = []
    for name, b in zip(("q_block", "k_block"), pair):
        if isinstance(b, (bool, np.bool_)) or not isinstance(b, (int, np.integer)):
            raise TypeError(f"block_size's {name} must be an int > 0, got {b!r}")
        if int(b) <= 0:
            raise ValueError(f"block_size's {name} must be an int > 0, got {int(b)}")
        if int(b) > _MAX_BLOCK:  # the C core's sizes are int64: every call would refuse it
            raise ValueError(f"block_size's {name} is too large: {int(b)} (at most 2**63 - 1)")
        out.append(int(b))
    return out[0], out[1]


def _blocks(n: int, b: int) -> int:
    return -(-n // b)


class BlockLayout:
    """Booleans over (query block, key block): True = the block is KEPT
    (computed), False = its keys are blocked for its queries.

    keep: a bool array of shape (nqb, nkb) (every batch and head), (H, nqb,
      nkb) (one per head) or (B, H, nqb, nkb) (a leading axis of 1
      broadcasts).  Only bool is taken: 0/1 integers could mean either
      polarity.
    block_size: an int (square blocks) or (q_block, k_block).  Sq and Sk
      need not be multiples: the last block of each may be partial, and a
      call checks that nqb = ceil(Sq / q_block), nkb = ceil(Sk / k_block).

    The layout covers the given keys only: add_bias_kv's and
    add_zero_attn's keys are never blocked.  A query whose keys are all
    blocked follows the fully-masked-row rule of the call (NaN, or zeros
    with masked_rows="zero"; zeros in scaled_dot_product_attention).
    """

    __slots__ = ("_keep", "q_block", "k_block")

    q_block: int
    k_block: int

    def __init__(self, keep: ArrayLike, block_size: BlockSize) -> None:
        k = as_array(keep, "keep")
        if k.dtype != np.bool_:
            raise TypeError(f"keep must be a bool array (True = the block is kept, computed), "
                            f"got dtype {k.dtype}")
        if k.ndim not in (2, 3, 4):
            raise ValueError(f"keep must have shape (nqb, nkb), (H, nqb, nkb) or (B, H, nqb, "
                             f"nkb), got {k.shape}")
        self.q_block, self.k_block = _block_size(block_size)
        self._keep = np.array(k, dtype=bool, copy=True)
        self._keep.flags.writeable = False

    @property
    def keep(self) -> np.ndarray:
        """The kept flags (read-only), as given: (..., nqb, nkb)."""
        return self._keep

    @property
    def block_size(self) -> tuple[int, int]:
        """(q_block, k_block): queries and keys per block."""
        return self.q_block, self.k_block

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of keep: (nqb, nkb), (H, nqb, nkb) or (B, H, nqb, nkb)."""
        return self._keep.shape

    @property
    def density(self) -> float:
        """The fraction of blocks kept (1.0 is dense)."""
        return float(self._keep.mean()) if self._keep.size else 0.0

    def __repr__(self) -> str:
        return (f"BlockLayout(shape={self.shape}, block_size=({self.q_block}, {self.k_block}), "
                f"density={self.density:.3f})")

    def fitted(self, B: int, H: int, Sq: int, Sk: int) -> np.ndarray:
        """keep as (1 or B, 1 or H, nqb, nkb) for a call of (B, H, Sq, Sk),
        or a ValueError saying what does not fit."""
        nqb, nkb = _blocks(Sq, self.q_block), _blocks(Sk, self.k_block)
        k = self._keep
        k4 = k.reshape((1,) * (4 - k.ndim) + k.shape)
        want = (B, H, nqb, nkb)
        have: tuple[int, ...] = k4.shape
        bad = [f"its {n} axis is {d}, not {w}" for n, d, w, one in
               zip(("batch", "heads", "query-block", "key-block"), have, want,
                   (True, True, False, False)) if d != w and not (one and d == 1)]
        if bad:
            raise ValueError(
                f"layout of shape {k.shape} with blocks ({self.q_block}, {self.k_block}) does "
                f"not fit this call: Sq {Sq}, Sk {Sk} need {nqb} query blocks and {nkb} key "
                f"blocks (ceil(S / block)), batch {B}, heads {H}; " + ", ".join(bad))
        return k4

    def to_dense(self, Sq: Int, Sk: Int) -> np.ndarray:
        """The elementwise kept mask, (..., Sq, Sk) bool with the leading
        axes of keep: True = query i may see key j.  Its negation is the
        equivalent blocking mask (True = blocked) for attn_mask or torch."""
        Sq, Sk = _count(Sq, "Sq"), _count(Sk, "Sk")
        nqb, nkb = _blocks(Sq, self.q_block), _blocks(Sk, self.k_block)
        if self._keep.shape[-2:] != (nqb, nkb):
            raise ValueError(f"layout of shape {self.shape} with blocks ({self.q_block}, "
                             f"{self.k_block}) does not fit Sq {Sq}, Sk {Sk}: they need "
                             f"({nqb}, {nkb}) blocks")
        qi = np.arange(Sq) // self.q_block
        kj = np.arange(Sk) // self.k_block
        return self._keep[..., qi[:, None], kj[None, :]]

    @classmethod
    def from_dense(cls, keep: ArrayLike, block_size: BlockSize) -> BlockLayout:
        """The layout keeping every block with at least one True of the
        elementwise kept mask `keep` (..., Sq, Sk) (True = visible): exact
        (to_dense gives keep back) when keep is constant on each block."""
        k = as_array(keep, "keep")
        if k.dtype != np.bool_ or k.ndim < 2:
            raise TypeError("from_dense takes a bool array (..., Sq, Sk), True = visible")
        qb, kb = _block_size(block_size)
        Sq, Sk = k.shape[-2:]
        nqb, nkb = _blocks(Sq, qb), _blocks(Sk, kb)
        pad = np.zeros(k.shape[:-2] + (nqb * qb, nkb * kb), dtype=bool)
        pad[..., :Sq, :Sk] = k
        blocks = pad.reshape(k.shape[:-2] + (nqb, qb, nkb, kb)).any(axis=(-3, -1))
        return cls(blocks, (qb, kb))


# ---------------------------------------------------------------- patterns

def _grid(Sq: Int, Sk: Int, block_size: BlockSize,
          ) -> tuple[int, int, np.ndarray, np.ndarray]:
    qb, kb = _block_size(block_size)
    nqb, nkb = _blocks(_count(Sq, "Sq"), qb), _blocks(_count(Sk, "Sk"), kb)
    return qb, kb, np.arange(nqb)[:, None], np.arange(nkb)[None, :]


def _count(x: object, name: str, low: int = 0) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < low:
        raise ValueError(f"{name} must be an int >= {low}, got {x!r}")
    return int(x)


def _reach(x: object, name: str, low: int = 0) -> int:
    """A count that block indices are compared against (a band's width, a
    stride): _count's checks, then at most 2**62, above every block index,
    so that NumPy's int64 arithmetic takes it (10**30 means what 2**62
    means: every block within reach)."""
    return min(_count(x, name, low), 2**62)


def _causal(causal: object) -> bool:
    """the pattern helpers' causal= checked: True or False only.  It cuts
    block indices (kb <= qb); a string such as is_causal's "lower_right"
    would otherwise read as True, the top-left cut."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False (it keeps key blocks kb <= qb, "
                        f"block indices aligned top-left), got {causal!r}; for the "
                        f"lower-right diagonal pass is_causal='lower_right' to the call "
                        f"with the layout")
    return bool(causal)


def local_blocks(Sq: Int, Sk: Int, block_size: BlockSize, width: Int = 1,
                 causal: Flag = False) -> BlockLayout:
    """A band: query block qb keeps key blocks qb - width .. qb + width
    (causal: qb - width .. qb).  Block indices align top-left (qb against
    kb = qb); with square blocks and causal=True, combine it with is_causal
    for the elementwise diagonal."""
    qb, kb, i, j = _grid(Sq, Sk, block_size)
    w = _reach(width, "width")
    keep = (j >= i - w) & (j <= (i if _causal(causal) else i + w))
    return BlockLayout(keep, (qb, kb))


def strided(Sq: Int, Sk: Int, block_size: BlockSize, stride: Int, width: Int = 0,
            causal: Flag = False) -> BlockLayout:
    """Sparse Transformer's strided pattern in blocks: the local band of
    `width` blocks (as local_blocks) plus every key block kb with
    kb % stride == stride - 1 (the "summary" columns every later query
    reads); causal keeps only kb <= qb."""
    qb, kb, i, j = _grid(Sq, Sk, block_size)
    s = _reach(stride, "stride", 1)
    w = _reach(width, "width")
    keep = ((j >= i - w) & (j <= i + w)) | (j % s == s - 1)
    if _causal(causal):
        keep &= j <= i
    return BlockLayout(keep, (qb, kb))


def global_local(Sq: Int, Sk: Int, block_size: BlockSize, global_blocks: Int = 1,
                 width: Int = 1, causal: Flag = False) -> BlockLayout:
    """Longformer: a band of `width` blocks plus global tokens: the first
    `global_blocks` key blocks are seen by every query and the first
    `global_blocks` query blocks see every key (causal: only keys of blocks
    kb <= qb)."""
    qb, kb, i, j = _grid(Sq, Sk, block_size)
    g = _reach(global_blocks, "global_blocks")
    w = _reach(width, "width")
    keep = ((j >= i - w) & (j <= i + w)) | (j < g) | (i < g)
    if _causal(causal):
        keep &= j <= i
    return BlockLayout(keep, (qb, kb))


def bigbird(Sq: Int, Sk: Int, block_size: BlockSize, global_blocks: Int = 1,
            width: Int = 1, random_blocks: Int = 2, seed: Int | None = 0,
            causal: Flag = False, heads: Int | None = None) -> BlockLayout:
    """BigBird: global_local plus `random_blocks` random key blocks per
    query block, drawn among the blocks global_local does not keep (as
    BigBird draws outside its window and global blocks; all of them where
    fewer are left), with numpy's default_rng(seed), seed an int in
    [0, 2**64) or None for a fresh draw; causal: among kb <= qb.  heads:
    None, one layout for every head; an int H, a different random draw per
    head, shape (H, nqb, nkb)."""
    base = global_local(Sq, Sk, block_size, global_blocks, width, causal).keep
    r = _count(random_blocks, "random_blocks")
    nh = 1 if heads is None else _count(heads, "heads", 1)
    rng = np.random.default_rng(None if seed is None else seed_value(seed))
    nqb, nkb = base.shape
    keep = np.repeat(base[None], nh, axis=0)
    pick: np.ndarray | list[int]
    for h in range(nh):
        for i in range(nqb):
            pool = np.flatnonzero(~base[i, :min(nkb, i + 1) if causal else nkb])
            pick = rng.choice(pool, size=min(r, pool.size), replace=False) if pool.size else []
            keep[h, i, pick] = True
    return BlockLayout(keep if heads is not None else keep[0], _block_size(block_size))
