"""The Python layer (mha_ext/*.py): its structure (one home per job, imports
flowing one way, one caller of the private C methods) and the Python side of
issue 11's defect 7 (unclear errors), each case a regression test.

Legend: B batch, Sq query length, Sk key length, E = d_model, H = n_heads.
"""
import ast
from pathlib import Path

import numpy as np
import pytest

import mha_ext
from _support import need
from mha_ext import MultiHeadAttention

E, H = 8, 2
PKG = Path(mha_ext.__file__).resolve().parent
X = np.random.default_rng(0).standard_normal((2, 3, E)).astype(np.float32)


def _module(**kw):
    return MultiHeadAttention(E, H, seed=0, **kw)


def _not_numpys_message(exc):
    # NumPy's own message names no argument
    assert "truth value of an array" not in str(exc.value)


# ---------------------------------------------------------------- structure

def _run_time_nodes(tree):
    """ast.walk without the bodies of ``if TYPE_CHECKING:``: the checkers'
    imports (annotations only) may point back up; what runs may not."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _imports(path):
    """The mha_ext modules `path` imports when it runs, at module level or in
    functions (not the checkers' ``if TYPE_CHECKING:`` imports)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in _run_time_nodes(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                if node.module:
                    out.add(node.module.split(".")[0])
                else:
                    out.update(a.name for a in node.names)
            elif node.level == 0 and (node.module or "").startswith("mha_ext."):
                out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names
                       if a.name.startswith("mha_ext."))
    return out


def test_python_modules_import_one_way():
    # the package's modules form a DAG: no module imports one that imports it
    # back, also not from inside a function (module.py <-> autograd.py did)
    names = {p.stem for p in PKG.glob("*.py")} - {"__init__", "__main__"}
    graph = {n: _imports(PKG / f"{n}.py") & names for n in names}
    state = {}

    def visit(n, path):
        if state.get(n) == "done":
            return
        assert state.get(n) != "open", f"import cycle: {' -> '.join(path + [n])}"
        state[n] = "open"
        for m in sorted(graph[n]):
            visit(m, path + [n])
        state[n] = "done"

    for n in sorted(graph):
        visit(n, [])
    # the low-level helpers import nothing above them
    assert graph["_convert"] == set()
    assert "module" not in graph["autograd"] and "torch" not in graph["module"]


def test_only_calls_uses_the_private_c_methods():
    private = {"_forward", "_forward_train", "_forward_with", "_backward"}
    users = set()
    for path in PKG.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in private:
                users.add(path.name)
    assert users == {"_calls.py"}


def test_no_python_file_over_600_lines():
    for path in PKG.glob("*.py"):
        n = len(path.read_text(encoding="utf-8").splitlines())
        assert n <= 600, f"{path.name} has {n} lines"


def test_parameter_keys_have_one_home():
    from mha_ext import _params

    m = _module(kdim=5, vdim=3)
    assert tuple(m.state_dict()) == _params.SEED_KEYS
    grads = m.backward(m.forward_train(X, rng_inputs(5), rng_inputs(3)),
                       np.ones_like(X))
    assert tuple(grads)[:8] == _params.SEED_KEYS
    for i, k in enumerate(_params.SEED_KEYS):
        assert grads[k].shape == m.state_dict()[k].shape == _params.shape(m, i)


def rng_inputs(width, seed=1):
    return np.random.default_rng(seed).standard_normal((2, 4, width)).astype(np.float32)


# ---------------------------------------------------------------- defect 7: scalars

@pytest.mark.parametrize("p", [np.float32(0.5), np.float64(0.5), np.float16(0.5)])
def test_forward_train_takes_numpy_dropout(p):
    # the constructor took np.float32(0.5); forward_train refused it
    m = _module()
    ref = m.forward_train(X, dropout=0.5, dropout_counter=7)
    ctx = m.forward_train(X, dropout=p, dropout_counter=7)
    assert ctx.dropout == 0.5 and type(ctx.dropout) is float
    np.testing.assert_array_equal(ctx.output, ref.output)
    np.testing.assert_array_equal(ctx.weights, ref.weights)


@pytest.mark.parametrize("bad", [True, np.bool_(True), np.float32(1.5), float("nan"),
                                 np.float64("nan"), -0.1, "0.5", [0.5]])
def test_forward_train_still_refuses_bad_dropout(bad):
    with pytest.raises(ValueError, match="dropout"):
        _module().forward_train(X, dropout=bad)


@pytest.mark.parametrize("c", [np.uint64(7), np.int64(7), np.int32(7), np.uint8(7)])
def test_forward_train_takes_numpy_dropout_counter(c):
    m = _module()
    ref = m.forward_train(X, dropout=0.5, dropout_counter=7)
    ctx = m.forward_train(X, dropout=0.5, dropout_counter=c)
    assert ctx.counter == 7 and type(ctx.counter) is int
    np.testing.assert_array_equal(ctx.weights, ref.weights)


@pytest.mark.parametrize("bad", [True, np.bool_(False), np.int64(-1), 2 ** 64, 7.0,
                                 np.float32(7)])
def test_forward_train_still_refuses_bad_dropout_counter(bad):
    with pytest.raises(ValueError, match="dropout_counter"):
        _module().forward_train(X, dropout=0.5, dropout_counter=bad)


def test_train_takes_numpy_bool():
    m = _module()
    assert m.train(np.bool_(False)) is m
    assert m.training is False
    m.train(np.bool_(True))
    assert m.training is True


@pytest.mark.parametrize("bad", [np.array([True, False]), 1, "yes"])
def test_train_refuses_non_bools_naming_mode(bad):
    with pytest.raises(ValueError, match="mode") as exc:
        _module().train(bad)
    _not_numpys_message(exc)


# ---------------------------------------------------------------- defect 7: flags

FLAGS = ["is_causal", "need_weights", "average_weights"]
ARRAYS = [np.array([True, False]), [True, False], np.zeros((2, 2), bool)]


def _call(m, **kw):
    return m(X, **kw)


def _train(m, **kw):
    return m.forward_train(X, **kw)


def _trace(m, **kw):
    return m.trace(X, **kw)


def _adapter(m, **kw):
    need("torch")
    import mha_ext.torch as mt

    return mt.MultiHeadAttention(E, H, seed=0)(X, **kw)


@pytest.mark.parametrize("entry", [_call, _train, _trace, _adapter],
                         ids=["call", "forward_train", "trace", "torch-adapter"])
@pytest.mark.parametrize("name", FLAGS)
@pytest.mark.parametrize("value", ARRAYS, ids=["array", "list", "2d"])
def test_array_valued_flag_names_the_argument(entry, name, value):
    with pytest.raises(TypeError, match=name) as exc:
        entry(_module(), **{name: value})
    _not_numpys_message(exc)


@pytest.mark.parametrize("name", FLAGS)
def test_flags_take_numpy_bools_and_0d_arrays(name):
    m = _module().eval()
    want = m(X, **{name: True})
    for v in (np.bool_(True), np.array(True), 1):
        got = m(X, **{name: v})
        np.testing.assert_array_equal(got[0], want[0])
        assert (got[1] is None) == (want[1] is None)


def test_masked_rows_array_names_the_argument():
    with pytest.raises(ValueError, match="masked_rows") as exc:
        _module()(X, masked_rows=np.array(["nan", "zero"]))
    _not_numpys_message(exc)


def test_strict_array_names_the_argument():
    m = _module()
    with pytest.raises(TypeError, match="strict") as exc:
        m.load_state_dict(m.state_dict(), strict=np.array([True, False]))
    _not_numpys_message(exc)


def test_save_projections_array_names_the_argument():
    with pytest.raises(TypeError, match="save_projections") as exc:
        _module().forward_train(X, save_projections=np.array([True, False]))
    _not_numpys_message(exc)


# ---------------------------------------------------------------- defect 7: torch

def test_from_torch_meta_module_says_how_to_materialise():
    torch = need("torch")
    t = torch.nn.MultiheadAttention(E, H, device="meta")
    with pytest.raises(ValueError, match="meta") as exc:
        MultiHeadAttention.from_torch(t)
    assert "no data" in str(exc.value) and "to_empty" in str(exc.value)
    # materialised as the message says, the copy works
    t = t.to_empty(device="cpu")
    t._reset_parameters()
    m = MultiHeadAttention.from_torch(t)
    np.testing.assert_array_equal(m.W_o.weight, t.out_proj.weight.detach().numpy())


def test_from_torch_meta_seed_layout():
    torch = need("torch")

    class Seed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n_heads = H
            for n in ("W_q", "W_k", "W_v", "W_o"):
                setattr(self, n, torch.nn.Linear(E, E, device="meta"))

    with pytest.raises(ValueError, match="meta.*no data"):
        MultiHeadAttention.from_torch(Seed())


@pytest.mark.parametrize("name", ["query", "key", "value"])
def test_adapter_sparse_input_names_the_argument(name):
    torch = need("torch")
    import mha_ext.torch as mt

    m = mt.MultiHeadAttention(E, H, seed=0)
    args = {n: torch.from_numpy(X) for n in ("query", "key", "value")}
    args[name] = args[name].to_sparse()
    with pytest.raises(TypeError, match=f"{name} must be a dense tensor") as exc:
        m(args["query"], args["key"], args["value"])
    assert "to_dense" in str(exc.value)


@pytest.mark.parametrize("name", ["query", "key", "attn_mask"])
def test_numpy_module_sparse_tensor_names_the_argument(name):
    torch = need("torch")
    args = {"query": torch.from_numpy(X), "key": torch.from_numpy(X)}
    if name == "attn_mask":
        args["attn_mask"] = torch.zeros(3, 3, dtype=torch.bool).to_sparse()
    else:
        args[name] = args[name].to_sparse()
    with pytest.raises(TypeError, match=f"{name} must be a dense tensor"):
        _module()(**args)


def test_numpy_module_meta_tensor_names_the_argument():
    torch = need("torch")
    with pytest.raises(ValueError, match="query is a tensor on the meta device"):
        _module()(torch.ones(2, 3, E, device="meta"))


@pytest.mark.parametrize("nbytes", [16, 0])
def test_a_shrunk_or_freed_storage_is_refused_not_read(nbytes):
    # untyped_storage().resize_() (FSDP-style code frees parameters so):
    # torch's own operations refuse the tensor; reading it would run past
    # the block (16 bytes) or take NumPy's fresh uninitialised array (0)
    torch = need("torch")
    import mha_ext.torch as mt

    def shrunk(t):
        t.untyped_storage().resize_(nbytes)
        return t

    tm = mt.MultiHeadAttention(E, H, seed=0).eval()
    x = torch.from_numpy(X.copy())
    shrunk(tm.W_q.weight.data)
    with pytest.raises(RuntimeError):
        torch.nn.functional.linear(x, tm.W_q.weight)
    with torch.no_grad(), pytest.raises(RuntimeError, match=f"holds {nbytes} bytes.*needs 256"):
        tm(x, x, x)
    with pytest.raises(RuntimeError, match=f"query: its storage holds {nbytes} bytes"):
        _module()(shrunk(torch.tensor(X)))
    q = torch.tensor(X)
    with pytest.raises(RuntimeError, match=f"holds {nbytes} bytes"):
        mha_ext.scaled_dot_product_attention(q, shrunk(q.clone()), q)
    # a view inside its storage is still read (the bound is the view's, not
    # the whole storage's)
    big = torch.tensor(np.concatenate([X, X]))
    np.testing.assert_array_equal(_module()(big[2:])[0], _module()(X)[0])
    strided = torch.tensor(X.transpose(1, 0, 2)).transpose(0, 1)  # not contiguous
    np.testing.assert_array_equal(_module()(strided)[0], _module()(X)[0])


@pytest.mark.parametrize("bad, exc", [([[1.0, 2.0], [3.0]], ValueError),
                                      (np.array([["a"]]), TypeError),
                                      (np.ones((2, 3, E), complex), TypeError)])
def test_adapter_non_tensor_input_names_the_argument(bad, exc):
    need("torch")
    import mha_ext.torch as mt

    with pytest.raises(exc, match="query"):
        mt.MultiHeadAttention(E, H, seed=0)(bad)


def test_adapter_array_input_still_works():
    torch = need("torch")
    import mha_ext.torch as mt

    m = mt.MultiHeadAttention(E, H, seed=0).eval()
    out_np, _ = m(X)
    out_t, _ = m(torch.from_numpy(X))
    assert torch.equal(out_np, out_t)


# ---------------------------------------------------------------- defect 7: plot

@pytest.mark.parametrize("bad, exc", [([[[[1.0, 2.0], [3.0]]]], ValueError),
                                      (np.array([[[["a"]]]]), TypeError)])
def test_plot_heads_bad_weights_name_the_argument(bad, exc):
    need("matplotlib")
    with pytest.raises(exc, match="weights"):
        mha_ext.plot_heads(bad)


def test_plot_heads_sparse_tensor_names_the_argument():
    torch = need("torch")
    need("matplotlib")
    w = torch.ones(1, 2, 3, 3).to_sparse()
    with pytest.raises(TypeError, match="weights must be a dense tensor"):
        mha_ext.plot_heads(w)
