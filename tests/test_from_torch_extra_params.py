"""from_torch of a seed-style module holding parameters besides its four
projections (docs/API.md §4): a ValueError naming them, since its forward
presumably uses them and the copy would compute other numbers without a
word (Qwen3's q_norm/k_norm, a bias_k, a learned temperature).  A module
holding only its projections, or another projection-named linear beside
them, is copied as before, and its copy gives the module's numbers."""
import pytest

from _support import need, require_torch

torch = require_torch()
from torch import nn  # noqa: E402
from torch_seed import make_seed_module  # noqa: E402 (it imports torch)

import mha_ext  # noqa: E402

E, H = 8, 2


class _WithExtra(nn.Module):
    def __init__(self, **params):
        super().__init__()
        seed = make_seed_module(E, H, seed=3, dtype="float64")
        self.W_q, self.W_k, self.W_v, self.W_o = seed.W_q, seed.W_k, seed.W_v, seed.W_o
        for name, p in params.items():
            setattr(self, name, p)


@pytest.mark.parametrize("extra", [
    dict(bias_k=nn.Parameter(torch.zeros(1, 1, E))),
    dict(temperature=nn.Parameter(torch.ones(()))),
    dict(q_norm=nn.LayerNorm(E // H), k_norm=nn.LayerNorm(E // H)),
], ids=["bias_k", "temperature", "qk_norm"])
def test_extra_parameters_are_refused_by_name(extra):
    mod = _WithExtra(**extra)
    name = next(iter(extra))
    with pytest.raises(ValueError, match=f"besides its four projections.*'{name}"):
        mha_ext.MultiHeadAttention.from_torch(mod, n_heads=H)
    with pytest.raises(ValueError, match="besides its four projections"):
        mha_ext.MultiHeadAttention.from_torch(
            mod, n_heads=H, names={k: k for k in ("W_q", "W_k", "W_v", "W_o")})


def test_qwen3_attention_is_refused():
    transformers = need("transformers")
    cfg = transformers.Qwen3Config(hidden_size=16, num_attention_heads=2,
                                   num_key_value_heads=2, intermediate_size=32,
                                   num_hidden_layers=1, vocab_size=50, head_dim=8)
    att = transformers.Qwen3ForCausalLM(cfg).model.layers[0].self_attn
    with pytest.raises(ValueError, match="'q_norm.weight', 'k_norm.weight'"):
        mha_ext.MultiHeadAttention.from_torch(att)


def test_projections_only_are_copied_with_their_numbers():
    seed = make_seed_module(E, H, seed=3, dtype="float64").eval()
    x = torch.randn(2, 5, E, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = seed(x, x, x)[0]
    got = mha_ext.MultiHeadAttention.from_torch(seed)(x.numpy())[0]
    torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-10, atol=1e-12)
