"""Type aliases of the public signatures: what the run-time checks accept
(NumPy scalars included), spelled once.  Annotations only: nothing here
checks a value."""
from __future__ import annotations

from typing import Any, Literal, Optional, Tuple, Union

import numpy as np

__all__ = ["Flag", "Causal", "Int", "Real", "Window", "MaskedRows"]

# a single truth value (_convert.flag)
Flag = Union[bool, np.bool_]
# is_causal: False, True (top-left) or "lower_right"
Causal = Union[bool, np.bool_, Literal["lower_right"]]
# a Python or NumPy integer (not a bool at run time, which also takes a 0-d
# integer array or tensor: _convert.as_int)
Int = Union[int, np.integer[Any]]
# a Python or NumPy real number (an int is a float to the checkers)
Real = Union[float, np.floating[Any], np.integer[Any]]
# a sliding window (left, right), each bound an int >= 0 or None (unbounded)
Window = Optional[Tuple[Optional[Int], Optional[Int]]]
# masked_rows: NaN rows (the seed module's) or zero rows (torch's SDPA)
MaskedRows = Literal["nan", "zero"]
