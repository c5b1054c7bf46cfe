"""mha_ext: multi-head attention as a C extension for NumPy.

    >>> import numpy as np, mha_ext
    >>> mha = mha_ext.MultiHeadAttention(d_model=512, n_heads=8, seed=0)
    >>> x = np.random.default_rng(0).standard_normal((2, 10, 512), dtype=np.float32)
    >>> out, weights = mha(x)          # self-attention: key = value = query
    >>> out.shape, weights.shape
    ((2, 10, 512), (2, 8, 10, 10))

The contract is PyTorch's: torch.nn.Linear weight layout, the seed notebook's
masks (1 = blocked) and torch.nn.MultiheadAttention's (attn_mask,
key_padding_mask, is_causal).  The numbers come from a C core (src/) that
releases the GIL and runs on its own worker threads.
"""
from ._core import get_num_threads, set_num_threads
from ._sdpa_api import scaled_dot_product_attention
from .module import Linear, MultiHeadAttention
from .plot import plot_heads
from .trace import Step, Trace, trace

__all__ = ["MultiHeadAttention", "Linear", "Trace", "Step", "trace", "plot_heads",
           "scaled_dot_product_attention", "set_num_threads", "get_num_threads"]
__version__ = "0.1.0"


def __getattr__(name):
    # mha_ext.compare needs torch: imported on first use only
    if name == "compare":
        from ._compare import compare
        return compare
    raise AttributeError(f"module 'mha_ext' has no attribute {name!r}")
