"""torch interop, the one home for it: MultiHeadAttention.from_torch for a
torch.nn.MultiheadAttention or a seed-style module, and the discovery of
dtype, dropout, training mode and number of heads.

Seed-style layouts recognised (tried in this order):

  W_q, W_k, W_v, W_o                         the seed notebook's
  q_linear, k_linear, v_linear, out_linear   the teaching texts' other one
  q_proj, k_proj, v_proj, out_proj | o_proj  most Hugging Face models
                                 (k_proj, v_proj may project to fewer
                                 features, n_kv_heads * head_dim: a
                                 grouped-query module, as Llama's)
  per-head lists: each of Q, K, V a ModuleList (or list) of one Linear per
    head, either as the projection attributes above (``W_q = ModuleList``)
    or as a list of head modules (``heads``, ``attention_heads``,
    ``attn_heads``) each with q/k/v linears under one of the names above or
    ``query``/``key``/``value`` or ``q``/``k``/``v``; head h's rows become
    rows h*Dk..(h+1)*Dk of our projection
  names={"W_q": "path", ...}                  explicit, for anything else;
    a path may contain one ``*`` standing for every index of a list
    (``"heads.*.query"``)

torch is never imported here: the torch module is read through its
attributes, its tensors converted by _convert.to_numpy.  The class to build
is passed in (``cls``), so this module does not import module.py.
"""
from __future__ import annotations

import numpy as np

from ._convert import to_numpy
from ._params import LINEARS

__all__ = ["from_torch"]

_LAYOUTS = (("W_q", "W_k", "W_v", ("W_o",)),
            ("q_linear", "k_linear", "v_linear", ("out_linear",)),
            ("q_proj", "k_proj", "v_proj", ("out_proj", "o_proj")))
_HEAD_LISTS = ("heads", "attention_heads", "attn_heads")
_HEAD_QKV = tuple(lay[:3] for lay in _LAYOUTS) + (("query", "key", "value"), ("q", "k", "v"))
_OUTS = ("W_o", "out_linear", "out_proj", "o_proj", "proj", "out", "output", "linear")
_HEAD_COUNTS = ("n_heads", "num_heads", "nhead", "n_head", "num_attention_heads", "h")
_HEAD_WIDTHS = ("d_k", "head_dim", "d_head", "head_size")


def from_torch(cls, module, dtype=None, seed=None, names=None, n_heads=None,
               mask_polarity=None, causal=None):
    """A `cls` (a MultiHeadAttention class) holding a copy of `module`."""
    _check_materialised(module)
    if names is None and hasattr(module, "in_proj_weight") and hasattr(module, "out_proj"):
        m = _from_torch_mha(cls, module, dtype, seed)
    else:
        found = _find(module, names)
        m = _from_linears(cls, module, found, dtype, seed, n_heads)
        extra = _extra_parameters(module, found)  # after _from_linears' own checks
        if extra:
            shown = ", ".join(map(repr, extra[:6])) + (", ..." if len(extra) > 6 else "")
            raise ValueError(
                f"from_torch: this {type(module).__name__} holds parameters besides its four "
                f"projections ({shown}), which its forward presumably uses (a q_norm/k_norm, "
                f"a learned bias or temperature, LoRA weights); from_torch copies the "
                f"projections, not the forward, so the copy would compute other numbers "
                f"without a word. Copy a module holding only the projections, or build the "
                f"copy yourself (MultiHeadAttention(...).load_state_dict) if plain attention "
                f"over them is what you want")
        buffer = _causal_buffer(module) if causal is None else None
        if buffer is not None:
            raise ValueError(
                f"from_torch: this {type(module).__name__} holds a buffer {buffer!r} shaped "
                f"as a causal mask (one value on and below the diagonal, another above it), "
                f"which its forward presumably applies; from_torch copies the projections, "
                f"not the forward, so say what the copy does: causal=True (every call "
                f"causal, query i sees keys j <= i) or causal=False (calls as given); in "
                f"mha_ext.compare: from_torch_options={{'causal': True}}")
    if mask_polarity is not None:
        m.mask_polarity = mask_polarity
    if causal is not None:
        m.causal = causal
    return m


_PROJECTIONS = {n for lay in _LAYOUTS for n in lay[:3] + lay[3]} | set(_OUTS)


def _extra_parameters(module, found):
    """The names of `module`'s parameters (its children's included) that are
    neither the weight or bias of one of the projections `found` (_find's)
    nor of another linear child under a projection's name (an o_proj beside
    the out_proj that _find took)."""
    named = getattr(module, "named_parameters", None)
    if not callable(named):
        return []
    ours = set()
    others = [getattr(module, n, None) for n in _PROJECTIONS]
    for x in [*found.values(), *(o for o in others if _is_linear(o))]:
        for lin in (x if isinstance(x, list) else [x]):
            for attr in ("weight", "bias"):
                p = getattr(lin, attr, None)
                if p is not None:
                    ours.add(id(p))
    return [name for name, p in named() if id(p) not in ours]


def _causal_buffer(module):
    """The name of the first buffer of `module` (its children's included)
    shaped as a causal mask: (..., n, n), n >= 2, each (n, n) slice one value
    on and below the diagonal and another above it, the same two in every
    slice (a tril of ones, a triu of True, 0 below and -inf above, one per
    head); None if there is none."""
    named = getattr(module, "named_buffers", None)
    if not callable(named):
        return None
    for name, b in named():
        shape = tuple(getattr(b, "shape", ()))
        if (len(shape) < 2 or shape[-1] != shape[-2] or shape[-1] < 2 or b.is_complex()
                or b.is_meta or b.is_sparse or b.numel() == 0):
            continue
        if _causal_pattern(b.detach().reshape(-1, shape[-1], shape[-1])):
            return name
    return None


def _causal_pattern(s):
    # s (m, n, n): every slice is lo on and below the diagonal, up above it
    # (corners first, then rows in chunks: a large buffer costs no copy of it)
    import torch  # a torch module's buffer: torch is there
    n = s.shape[-1]
    lo, up = s[0, 0, 0], s[0, 0, 1]
    if bool(lo == up) or bool(lo != lo) or bool(up != up):
        return False
    if not bool((s[:, -1, :] == lo).all()) or not bool((s[:, 0, 1:] == up).all()):
        return False
    idx = torch.arange(n, device=s.device)
    for r0 in range(0, n, 256):
        blk = s[:, r0:r0 + 256, :]
        below = idx[None, :] <= idx[r0:r0 + 256, None]
        if not bool(torch.where(below, blk == lo, blk == up).all()):
            return False
    return True


def _check_materialised(module):
    # parameters on the meta device have a shape but no data to copy
    named = getattr(module, "named_parameters", None)
    if not callable(named):
        return
    for name, p in named():
        if getattr(getattr(p, "device", None), "type", None) == "meta":
            raise ValueError(
                f"from_torch: the parameters of this {type(module).__name__} are on the "
                f"meta device ({name!r} first), which holds shapes but no data; materialise "
                f"them first, e.g. module.to_empty(device='cpu') and then initialise them "
                f"(module.reset_parameters() or _reset_parameters()) or "
                f"module.load_state_dict(...), or build the module on the CPU")


def _dtype(tensor, dtype):
    # the dtype of the copy: given, or the module's when mha_ext computes in it
    if dtype is not None:
        return dtype
    name = str(tensor.dtype).replace("torch.", "")
    if name in ("float32", "float64"):
        return name
    raise ValueError(f"from_torch: the module's parameters are {name}; mha_ext computes "
                     f"in float32 or float64, so pass dtype='float32' or 'float64'")


def _dropout(module):
    p = getattr(module, "dropout", 0.0)
    p = getattr(p, "p", p)  # an nn.Dropout child, or a float
    if p is None:
        return 0.0
    return float(p)


def _from_torch_mha(cls, module, dtype, seed):
    # torch.nn.MultiheadAttention: packed in_proj_weight, or q/k/v_proj_weight;
    # bias_k and bias_v (1, 1, E) with add_bias_kv
    bias_k, bias_v = getattr(module, "bias_k", None), getattr(module, "bias_v", None)
    if (bias_k is None) != (bias_v is None):
        raise ValueError("from_torch: the module has one of bias_k and bias_v but not the "
                         "other (torch's add_bias_kv sets both)")
    E, H = int(module.embed_dim), int(module.num_heads)
    kdim, vdim = int(module.kdim), int(module.vdim)
    w_out = module.out_proj.weight
    in_bias, out_bias = module.in_proj_bias, module.out_proj.bias
    bias = in_bias is not None or out_bias is not None
    m = cls(E, H, _dropout(module), bias=bias, kdim=kdim, vdim=vdim,
            dtype=_dtype(w_out, dtype), seed=seed, add_bias_kv=bias_k is not None,
            add_zero_attn=bool(getattr(module, "add_zero_attn", False)))
    if module.in_proj_weight is not None:
        w = to_numpy(module.in_proj_weight, "in_proj_weight")
        ws = (w[:E], w[E:2 * E], w[2 * E:])
    else:
        ws = tuple(to_numpy(getattr(module, f"{n}_proj_weight"), f"{n}_proj_weight")
                   for n in "qkv")
    state = {"W_q.weight": ws[0], "W_k.weight": ws[1], "W_v.weight": ws[2],
             "W_o.weight": to_numpy(w_out, "out_proj.weight")}
    if bias:
        b = np.zeros(3 * E) if in_bias is None else to_numpy(in_bias, "in_proj_bias")
        state.update({"W_q.bias": b[:E], "W_k.bias": b[E:2 * E], "W_v.bias": b[2 * E:],
                      "W_o.bias": np.zeros(E) if out_bias is None
                      else to_numpy(out_bias, "out_proj.bias")})
    if bias_k is not None:
        state["bias_k"] = to_numpy(bias_k, "bias_k").reshape(-1)
        state["bias_v"] = to_numpy(bias_v, "bias_v").reshape(-1)
    m.load_state_dict(state)
    m.train(bool(module.training))
    # torch's layout of the inputs: a seq-first module's copy takes (S, B, E) too
    m.batch_first = bool(getattr(module, "batch_first", True))
    return m


# ---------------------------------------------------------------- seed-style layouts

def _get(obj, path):
    # the attribute at a dotted path (list indices as numbers), or None
    for part in path.split("."):
        if obj is None:
            return None
        if part.isdigit() and not hasattr(obj, part):
            try:
                obj = obj[int(part)]
            except (TypeError, IndexError, KeyError):
                return None
        else:
            obj = getattr(obj, part, None)
    return obj


def _is_linear(x):
    w = getattr(x, "weight", None)
    return w is not None and getattr(w, "ndim", 0) == 2


def _as_list(x):
    # a ModuleList / list / tuple of linears, or None
    if x is None or _is_linear(x) or isinstance(x, (str, bytes)):
        return None
    try:
        items = list(x)
    except TypeError:
        return None
    return items if items and all(_is_linear(i) for i in items) else None


def _resolve(module, path, ours):
    # a linear, or a list of per-head linears, at `path` (which may hold one *)
    if "*" in path:
        head, _, tail = path.partition("*")
        seq = _get(module, head.rstrip(".")) if head.rstrip(".") else module
        try:
            items = list(seq)
        except TypeError:
            raise TypeError(f"from_torch: names[{ours!r}] = {path!r}: "
                            f"{head.rstrip('.') or 'the module'} is not a list") from None
        found = [_get(i, tail.lstrip(".")) if tail.strip(".") else i for i in items]
    else:
        x = _get(module, path)
        if _is_linear(x):
            return x
        found = _as_list(x)
    if not found or not all(_is_linear(i) for i in found):
        raise TypeError(f"from_torch: names[{ours!r}] = {path!r} is not a linear layer "
                        f"(or a list of them) with a 2-D .weight")
    return found


def _find(module, names):
    """{W_q, W_k, W_v, W_o: a linear or a list of per-head linears}."""
    if names is not None:
        if not isinstance(names, dict) or set(names) != set(LINEARS):
            raise ValueError(f"from_torch: names must map each of {', '.join(LINEARS)} to "
                             f"an attribute path of the module, got {names!r}")
        return {ours: _resolve(module, path, ours) for ours, path in names.items()}
    for q, k, v, outs in _LAYOUTS:
        out = next((o for o in outs if _is_linear(getattr(module, o, None))), None)
        parts = [getattr(module, n, None) for n in (q, k, v)]
        if out is None:
            continue
        if all(_is_linear(p) for p in parts):
            return dict(zip(LINEARS, parts + [getattr(module, out)]))
        lists = [_as_list(p) for p in parts]
        if all(lists):
            return dict(zip(LINEARS, lists + [getattr(module, out)]))
    for lst in _HEAD_LISTS:
        heads = getattr(module, lst, None)
        out = next((o for o in _OUTS if _is_linear(getattr(module, o, None))), None)
        if heads is None or out is None:
            continue
        try:
            heads = list(heads)
        except TypeError:
            continue
        for qkv in _HEAD_QKV:
            if heads and all(all(_is_linear(getattr(h, n, None)) for n in qkv) for h in heads):
                per = [[getattr(h, n) for h in heads] for n in qkv]
                return dict(zip(LINEARS, per + [getattr(module, out)]))
    raise TypeError(
        f"from_torch expects a torch.nn.MultiheadAttention or an attention module with "
        f"W_q, W_k, W_v, W_o (or q_linear/k_linear/v_linear/out_linear, or q_proj/k_proj/"
        f"v_proj/out_proj or o_proj) linear children, or per-head lists of them; "
        f"{type(module).__name__} has none of these: pass names={{'W_q': 'path', 'W_k': ..., "
        f"'W_v': ..., 'W_o': ...}} naming its projections")


def _stack(x, name, ours):
    # (weight, bias or None, number of heads or None) of a linear or a per-head list
    if isinstance(x, list):
        ws = [to_numpy(lin.weight, f"{ours}[{h}].weight") for h, lin in enumerate(x)]
        bs = [getattr(lin, "bias", None) for lin in x]
        if any(b is None for b in bs) and not all(b is None for b in bs):
            raise ValueError(f"from_torch: some heads of {ours} have a bias and some not")
        b = None if bs[0] is None else np.concatenate(
            [to_numpy(b, f"{ours}[{h}].bias") for h, b in enumerate(bs)])
        return np.concatenate(ws, axis=0), b, len(x)
    b = getattr(x, "bias", None)
    return to_numpy(x.weight, f"{name}.weight"), (None if b is None else
                                                   to_numpy(b, f"{name}.bias")), None


def _heads(module, E, listed, n_heads):
    if n_heads is not None:
        return int(n_heads)
    if listed:
        return listed
    for a in _HEAD_COUNTS:
        h = getattr(module, a, None)
        if isinstance(h, (int, np.integer)) and not isinstance(h, bool):
            return int(h)
    for a in _HEAD_WIDTHS:
        d = getattr(module, a, None)
        if isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0:
            return E // int(d)
    raise ValueError(f"from_torch: {type(module).__name__} has none of the attributes "
                     f"{', '.join(_HEAD_COUNTS + _HEAD_WIDTHS)}, so the number of heads is "
                     f"unknown; pass n_heads=")


def _kv_heads(parts, E, H):
    # grouped-query attention: W_k and W_v project to fewer features than
    # W_q, a whole number of heads dividing H (Llama's k_proj, v_proj)
    ek, ev = int(parts["W_k"][0].shape[0]), int(parts["W_v"][0].shape[0])
    if ek == E and ev == E:
        return None
    dk = E // H
    if ek != ev or ek % dk != 0 or H % (ek // dk) != 0 or ek > E:
        raise ValueError(f"from_torch: W_k and W_v project to {ek} and {ev} features; with "
                         f"{H} heads of width {dk} they must both project to n_kv_heads * "
                         f"{dk} features, n_kv_heads dividing {H} (grouped-query attention)")
    return ek // dk


def _from_linears(cls, module, found, dtype, seed, n_heads):
    # the four projections (linears or per-head lists) into a `cls`
    parts = {ours: _stack(found[ours], ours, ours) for ours in LINEARS}
    counts = {n for _, _, n in parts.values() if n is not None}
    if len(counts) > 1:
        raise ValueError(f"from_torch: the per-head lists have different lengths {counts}")
    wq = parts["W_q"][0]
    E = int(wq.shape[0])
    H = _heads(module, E, counts.pop() if counts else None, n_heads)
    bias = any(b is not None for _, b, _ in parts.values())
    first = found["W_q"][0] if isinstance(found["W_q"], list) else found["W_q"]
    m = cls(E, H, _dropout(module), bias=bias,
            kdim=int(parts["W_k"][0].shape[1]), vdim=int(parts["W_v"][0].shape[1]),
            dtype=_dtype(first.weight, dtype), seed=seed,
            n_kv_heads=_kv_heads(parts, E, H))
    state = {}
    for ours, (w, b, _) in parts.items():
        state[f"{ours}.weight"] = w
        if bias:
            state[f"{ours}.bias"] = np.zeros(w.shape[0]) if b is None else b
    m.load_state_dict(state)
    m.train(bool(getattr(module, "training", True)))
    return m
