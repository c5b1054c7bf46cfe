"""mha_ext: multi-head attention as a C extension for NumPy.

    >>> import numpy as np, mha_ext
    >>> mha = mha_ext.MultiHeadAttention(d_model=512, n_heads=8, seed=0)
    >>> x = np.random.default_rng(0).standard_normal((2, 10, 512), dtype=np.float32)
    >>> out, weights = mha(x)          # self-attention: key = value = query
    >>> out.shape, weights.shape
    ((2, 10, 512), (2, 8, 10, 10))

The contract is PyTorch's: torch.nn.Linear weight layout, the seed module's
0/1 ``mask`` (1 = blocked; see docs/API.md) and torch.nn.MultiheadAttention's
(attn_mask, key_padding_mask, is_causal).  The numbers come from a C core
(src/) that releases the GIL and runs on its own worker threads.

Imported from a source checkout that has no built extension (for instance
``python -m mha_ext`` at the repository root after ``pip install .``: the
current directory comes first on sys.path, so the source folder shadows the
installed package), this package hands over to the installed mha_ext of the
same version; see _installed_package().
"""
# The one source of the version: setuptools reads this literal
# (pyproject.toml: [tool.setuptools.dynamic]), so the installed metadata
# always agrees with it (tests/test_packaging.py checks both).
__version__ = "0.1.0"

import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import TYPE_CHECKING


def _first_differing(tree: str, installed: str) -> "str | None":
    """The first of the tree's files that `pip install .` installs (the
    package's .py, .pyi and py.typed, _html's .js and .css; not hidden ones:
    an editor's lock or backup, a copier's ._ file) missing from the
    installed package or not the same text there (line endings aside), as
    a path relative to the package; None when all are the same."""
    for sub, kinds in (("", (".py", ".pyi", "py.typed")), ("_html", (".js", ".css"))):
        try:
            names = sorted(os.listdir(os.path.join(tree, sub)))
        except OSError:
            continue
        for name in names:
            rel = os.path.join(sub, name) if sub else name
            if name.startswith(".") or not name.endswith(kinds) \
                    or not os.path.isfile(os.path.join(tree, rel)):
                continue
            try:
                with open(os.path.join(tree, rel), "rb") as a, \
                        open(os.path.join(installed, rel), "rb") as b:
                    if a.read().replace(b"\r\n", b"\n") != b.read().replace(b"\r\n", b"\n"):
                        return rel
            except OSError:
                return rel
    return None


# what to do when this tree's extension is not built (setup.py checks the same)
_BUILD_HINT = ("install it (`pip install .`, needs a C compiler) or build it in place "
               "(`python setup.py build_ext --inplace`, with NumPy 2 and setuptools>=77 "
               "installed)")


def _installed_package(source_dir: str) -> types.ModuleType:
    """The installed mha_ext that a source checkout without a built
    extension stands in front of, or an ImportError that says what to do.

    Looks on sys.path past the entry holding this source folder for another
    mha_ext package that has its _core extension, and checks that its
    distribution's version is this one and that it was installed from this
    tree as it is (its Python files, stubs and page assets the same bytes):
    an installed package of another version or of older sources (a pull, an
    edit since `pip install .`) would pair this tree's docs and tests with
    other code.  Returns the imported installed package."""
    here = os.path.realpath(source_dir)
    others = [p for p in sys.path
              if os.path.realpath(os.path.join(p or os.curdir, "mha_ext")) != here]
    spec = importlib.machinery.PathFinder.find_spec("mha_ext", others)
    found: "tuple[importlib.machinery.ModuleSpec, str] | None" = None
    if spec is not None and spec.submodule_search_locations:
        pkg_dir = list(spec.submodule_search_locations)[0]
        if importlib.machinery.PathFinder.find_spec(
                "_core", [pkg_dir]) is not None:
            found = (spec, pkg_dir)
    if found is None:
        raise ImportError(
            "mha_ext's C extension (mha_ext._core) is not built in %s and no "
            "installed mha_ext was found on sys.path: %s" % (source_dir, _BUILD_HINT),
            name="mha_ext._core")
    spec, pkg_dir = found
    site = os.path.dirname(pkg_dir)
    # imported here only (~30 ms an import of mha_ext need not pay), under
    # another name: `import importlib.metadata` would make importlib a local
    # of this whole function, unbound where it is used above
    from importlib import metadata as _metadata
    dists = list(_metadata.distributions(name="mha_ext", path=[site]))
    installed = dists[0].version if dists else None
    if installed != __version__:
        raise ImportError(
            "mha_ext's C extension is not built in the source tree %s, and the "
            "mha_ext installed in %s is version %s, not this tree's %s: %s"
            % (source_dir, site, installed or "(unknown)", __version__, _BUILD_HINT),
            name="mha_ext._core")
    stale = _first_differing(here, pkg_dir)
    if stale is not None:
        raise ImportError(
            "mha_ext's C extension is not built in the source tree %s, and the "
            "mha_ext installed in %s was installed from other sources (its %s is not "
            "this tree's): %s" % (source_dir, site, stale, _BUILD_HINT),
            name="mha_ext._core")
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    previous = sys.modules.get("mha_ext")
    sys.modules["mha_ext"] = module      # what `import mha_ext` returns
    try:
        spec.loader.exec_module(module)
    except BaseException:                # the entry as it was, not the failed module
        if previous is None:
            sys.modules.pop("mha_ext", None)
        else:
            sys.modules["mha_ext"] = previous
        raise
    return module


try:
    # not `from . import _core`: that turns a missing module into a plain
    # ImportError ("cannot import name"), this keeps ModuleNotFoundError.name
    _core = importlib.import_module(__name__ + "._core")
except ModuleNotFoundError as _exc:
    if _exc.name != __name__ + "._core":
        raise
    # The source tree without a built extension: become the installed package
    # (its Python files and its extension, which belong together).  The
    # import system returns sys.modules["mha_ext"], which is now that
    # package; nothing below runs for this stand-in module.
    _installed = _installed_package(os.path.dirname(os.path.abspath(__file__)))
    globals().update({k: v for k, v in vars(_installed).items()
                      if not k.startswith("__") or k in ("__all__", "__file__",
                                                          "__path__")})
else:
    _core_dir = os.path.dirname(os.path.abspath(getattr(_core, "__file__", None) or __file__))
    _here = os.path.dirname(os.path.abspath(__file__))
    if os.path.normcase(_core_dir) != os.path.normcase(_here):
        # another tree's build, found by its editable install's finder (which
        # answers for mha_ext._core when this tree has none): its C code would
        # run under this tree's Python files, unchecked
        del sys.modules[__name__ + "._core"]
        raise ImportError(
            "mha_ext's C extension is not built in the source tree %s; the one found is "
            "%s, another tree's (an editable install: `pip install -e`), whose code may "
            "not be this tree's: %s, or start Python outside it"
            % (_here, _core.__file__, _BUILD_HINT), name="mha_ext._core")
    del _core_dir, _here
    from ._core import cpu_info, get_num_threads, memory_info, release_memory, set_num_threads
    from ._sdpa_api import scaled_dot_product_attention
    from .module import Linear, MultiHeadAttention
    from .cache import KVCache
    from . import heads, layout
    from .layout import BlockLayout
    from .explorer import Explorer, explore
    from .plot import plot_heads
    from .trace import Step, Trace, trace

    __all__ = ["MultiHeadAttention", "Linear", "KVCache", "Trace", "Step", "trace", "plot_heads",
               "explore", "Explorer", "heads", "scaled_dot_product_attention",
               "set_num_threads", "get_num_threads", "cpu_info", "memory_info",
               "release_memory", "BlockLayout", "layout", "__version__"]

    def _check_isa_env() -> None:
        # the core ignores an MHA_EXT_ISA it cannot follow (a name it does
        # not know, or kernels this CPU or build lacks) and takes the widest
        # it has: say so, once, rather than run other kernels silently
        want = os.environ.get("MHA_EXT_ISA")
        got = _core._get_isa()
        if want and want != got:
            import warnings
            why = ("not one of portable, avx2, avx512, amx"
                   if want not in ("portable", "avx2", "avx512", "amx")
                   else "this CPU or this build lacks it")
            warnings.warn("MHA_EXT_ISA=%r is ignored (%s): mha_ext uses %r"
                          % (want, why, got), RuntimeWarning, stacklevel=3)

    _check_isa_env()
    del _check_isa_env

if TYPE_CHECKING:
    # what __getattr__ gives, typed; the checkers do not see __getattr__, so
    # a misspelt attribute of mha_ext stays an error for them
    from ._compare import compare as compare
else:
    def __getattr__(name):
        # mha_ext.compare needs torch: imported on first use only
        if name == "compare":
            from ._compare import compare
            return compare
        raise AttributeError(f"module 'mha_ext' has no attribute {name!r}")
