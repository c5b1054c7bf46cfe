"""python -m mha_ext: the demo.

Builds the seed configuration (B=2, S=10, E=512, H=8) or the one given on
the command line, prints the shape flow of one call, the parameter count
and, where torch is installed, the largest difference from
torch.nn.MultiheadAttention loaded with the same weights and the time per
call of both (same thread count, median of several runs).

    python -m mha_ext [--batch 2] [--seq 10] [--d-model 512] [--heads 8]
                      [--dtype float32] [--seed 0] [--causal]
                      [--repeat 20] [--threads N] [--no-torch] [--plot FILE]
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np

import mha_ext
from mha_ext.plot import plot_heads
from mha_ext.trace import trace as _trace

from mha_ext._need_torch import TORCH_CPU_INDEX, TORCH_VERSION  # the torch to install
MAX_THREADS = 256           # mha_ext.set_num_threads's limit


def _positive(text):
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("%r is not an integer" % text)
    if n < 1:
        raise argparse.ArgumentTypeError("must be at least 1, got %d" % n)
    return n


def _threads(text):
    n = _positive(text)
    if n > MAX_THREADS:
        raise argparse.ArgumentTypeError("at most %d, got %d" % (MAX_THREADS, n))
    return n


def _plot_file(text):
    # checked before the run, not after it
    if not text:
        raise argparse.ArgumentTypeError("needs a file name, such as heads.png")
    text = os.path.expanduser(text)  # "~/x.png" quoted, which no shell expanded
    if text.endswith(("/", os.sep)) or os.path.isdir(text):
        raise argparse.ArgumentTypeError("%r is a folder: give a file name, such as %s"
                                         % (text, os.path.join(text, "heads.png")))
    folder = os.path.dirname(text) or "."
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError("folder %r does not exist" % folder)
    if not os.path.splitext(os.path.basename(text))[1][1:]:
        # matplotlib would add one of its own choosing (a file of another name)
        stem = text.rstrip(".")
        raise argparse.ArgumentTypeError("%r has no extension: name the format, such as "
                                         "%s.png or %s.svg" % (text, stem, stem))
    try:  # the format too, when matplotlib is there (without it: said after the run)
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return text
    ext = os.path.splitext(text)[1][1:].lower()
    kinds = FigureCanvasBase.get_supported_filetypes()
    if ext not in kinds:
        raise argparse.ArgumentTypeError("matplotlib cannot write .%s files; use one of: %s"
                                         % (ext, ", ".join(sorted(kinds))))
    return text


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: ...)" only for options that take a value and have a
    default: an option whose default is None says in its own help what
    happens then, and a flag's default is to be off."""

    def _get_help_string(self, action):
        if action.default is None or action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m mha_ext",
        description="mha_ext demo: trace one multi-head attention call, count "
                    "its parameters and compare it with PyTorch (when torch "
                    "is installed).",
        formatter_class=_Help)
    p.add_argument("-b", "--batch", type=_positive, default=2,
                   help="batch size B")
    p.add_argument("-s", "--seq", "--seq-len", dest="seq", type=_positive,
                   default=10, help="sequence length S (self-attention)")
    p.add_argument("-e", "--d-model", dest="d_model", type=_positive,
                   default=512, help="model width E (d_model)")
    p.add_argument("-n", "--heads", type=_positive, default=8,
                   help="number of heads H (must divide d_model)")
    p.add_argument("--dtype", choices=("float32", "float64"),
                   default="float32", help="floating-point type")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the weights and of the input")
    p.add_argument("--causal", action="store_true",
                   help="block key j > query i (is_causal=True)")
    p.add_argument("--repeat", type=_positive, default=20,
                   help="timed runs per library (the median is reported)")
    p.add_argument("--threads", type=_threads, default=None,
                   help="threads for both libraries (default: mha_ext's own "
                        "count: MHA_EXT_NUM_THREADS if set, else the CPUs this "
                        "process may use)")
    p.add_argument("--no-torch", action="store_true",
                   help="skip the comparison with torch")
    p.add_argument("--plot", metavar="FILE", type=_plot_file, default=None,
                   help="save the attention heatmaps of batch 0 to FILE, its "
                        "extension the format, such as heads.png (needs matplotlib; "
                        "default: no plot)")
    return p


def _median_times(fns, repeat, rounds=3):
    """Median seconds per call of each function.  Each function is timed in
    blocks of its own (so torch's OpenMP threads, which keep spinning for a
    while after a call, do not slow the other library down), and the blocks
    alternate over a few rounds so that both see the same machine load."""
    times = [[] for _ in fns]
    rounds = min(rounds, repeat)
    for r in range(rounds):
        n = repeat // rounds + (r < repeat % rounds)
        for i, fn in enumerate(fns):
            fn()
            fn()                                # warm-up of the block
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _ms(seconds):
    return "%.3f ms" % (seconds * 1e3)


def _compare_with_torch(m, x, args, out, weights):
    # Two thread pools share the cores: let torch's OpenMP threads sleep when
    # idle, like mha_ext's, instead of spinning into our calls (as
    # benchmarks/bench.py does; set OMP_WAIT_POLICY yourself to override).
    # It only takes effect if torch was not imported yet.
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        import torch
    except ModuleNotFoundError as exc:
        if exc.name not in (None, "torch"):   # installed but broken: a module of its missing
            print("torch could not be imported (%s: %s): comparison with torch skipped "
                  "(--no-torch skips it without trying)" % (type(exc).__name__, exc))
            return
        print("torch is not installed: comparison with torch skipped.  To "
              "see it, install the version the tests use, CPU-only: pip "
              "install torch==%s --index-url %s" % (TORCH_VERSION, TORCH_CPU_INDEX))
        return
    except Exception as exc:            # installed but broken (a missing library, ...),
        # or hidden: Python started in mha_ext's own folder (mha_ext/torch.py says so)
        print("torch could not be imported (%s: %s): comparison with torch skipped "
              "(--no-torch skips it without trying)" % (type(exc).__name__, exc))
        return
    tdtype = torch.float64 if args.dtype == "float64" else torch.float32
    E, H = args.d_model, args.heads
    sd = m.state_dict()
    ref = torch.nn.MultiheadAttention(E, H, dropout=0.0, bias=True,
                                      batch_first=True, dtype=tdtype)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.from_numpy(np.concatenate(
            [sd["W_q.weight"], sd["W_k.weight"], sd["W_v.weight"]])))
        ref.in_proj_bias.copy_(torch.from_numpy(np.concatenate(
            [sd["W_q.bias"], sd["W_k.bias"], sd["W_v.bias"]])))
        ref.out_proj.weight.copy_(torch.from_numpy(sd["W_o.weight"]))
        ref.out_proj.bias.copy_(torch.from_numpy(sd["W_o.bias"]))
    ref.eval()

    xt = torch.from_numpy(x)
    tmask = None
    if args.causal:
        tmask = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool),
                           diagonal=1)

    def run_torch():
        with torch.inference_mode():
            return ref(xt, xt, xt, attn_mask=tmask, need_weights=True,
                       average_attn_weights=False)

    def run_ours():
        return m(x, is_causal=args.causal)

    t_out, t_w = run_torch()
    d_out = float(np.max(np.abs(out - t_out.numpy()), initial=0.0))
    d_w = float(np.max(np.abs(weights - t_w.numpy()), initial=0.0))

    threads = args.threads
    if threads is None:
        threads = (mha_ext.get_num_threads()
                   if hasattr(mha_ext, "get_num_threads")
                   else torch.get_num_threads())
    old_torch = torch.get_num_threads()
    torch.set_num_threads(threads)
    if hasattr(mha_ext, "set_num_threads"):
        old_ours = mha_ext.get_num_threads()
        mha_ext.set_num_threads(threads)
    try:
        t_ours, t_torch = _median_times([run_ours, run_torch], args.repeat)
    finally:
        torch.set_num_threads(old_torch)
        if hasattr(mha_ext, "set_num_threads"):
            mha_ext.set_num_threads(old_ours)

    print("comparison with torch %s (torch.nn.MultiheadAttention, batch_first,"
          " same weights, eval mode):" % torch.__version__)
    print("  largest difference from torch: output %.3g, weights %.3g"
          % (d_out, d_w))
    ratio = t_torch / t_ours if t_ours > 0 else float("inf")
    print("  time per call (median of %d runs, %d thread%s): mha_ext %s, "
          "torch %s" % (args.repeat, threads, "" if threads == 1 else "s",
                        _ms(t_ours), _ms(t_torch)))
    print("  speed-up over torch (torch time / mha_ext time): %.2fx "
          "(torch's OpenMP threads: OMP_WAIT_POLICY=%s)"
          % (ratio, os.environ.get("OMP_WAIT_POLICY", "libgomp's default")))


def _writable_stdout():
    # a stream whose encoding cannot write the shape flow's ᵀ √ → · (a
    # latin-1 or ASCII locale, PYTHONIOENCODING=ascii): those characters as
    # "?", not a UnicodeEncodeError half way through the demo
    try:
        "ᵀ√→·−∞²".encode(getattr(sys.stdout, "encoding", None) or "ascii")
    except (UnicodeEncodeError, LookupError):
        try:
            sys.stdout.reconfigure(errors="replace")
        except (AttributeError, ValueError):        # not a TextIOWrapper: left as it is
            pass


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    _writable_stdout()
    if args.threads is not None:
        mha_ext.set_num_threads(args.threads)
    too_big = "B %d, S %d, E %d, H %d needs more memory than this machine gives (%s): " \
        "try smaller sizes"
    # the input (B, S, E) and the trace's (B, H, S, S) steps, in bytes: past what
    # an address can count, NumPy says only "array is too big" (a configuration
    # the module refuses is left to its own message, before any weight is made)
    if args.heads >= 1 and args.d_model % args.heads == 0 and \
            args.batch * args.seq * max(args.d_model, args.heads * args.seq) * 8 > sys.maxsize:
        parser.error(too_big % (args.batch, args.seq, args.d_model, args.heads,
                                "more bytes than an address can count"))
    try:
        m = mha_ext.MultiHeadAttention(args.d_model, args.heads,
                                       dtype=args.dtype, seed=args.seed)
        m.eval()
        rng = np.random.default_rng(args.seed)
        x = rng.standard_normal((args.batch, args.seq, args.d_model)).astype(
            args.dtype)
        tr = _trace(m, x, is_causal=args.causal)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    except MemoryError as exc:
        # the trace keeps every step: (B, H, S, S) scores several times over
        parser.error(too_big % (args.batch, args.seq, args.d_model, args.heads, exc))

    print("mha_ext demo: %r, %s, %s" % (m, args.dtype, "causal" if args.causal
                                         else "no mask"))
    print()
    print(tr)
    print()
    E = args.d_model
    print("parameters: {:,} (4·E² + 4·E with E = {}: W_q, W_k, W_v, W_o "
          "and their biases)".format(m.num_parameters, E))
    print()
    if args.no_torch:
        print("comparison with torch skipped (--no-torch).")
    else:
        _compare_with_torch(m, x, args, tr.output, tr.weights)

    if args.plot:
        try:
            fig = plot_heads(
                tr, batch=0,
                tokens=["t%d" % i for i in range(args.seq)],
                title="attention weights of %d heads, batch 0 (seed %d%s)"
                      % (args.heads, args.seed,
                         ", causal" if args.causal else ""))
        except ImportError as exc:
            print("cannot plot: %s" % exc, file=sys.stderr)
            return 1
        try:
            fig.savefig(args.plot, dpi=100)
        except (OSError, ValueError) as exc:    # no write access, an unknown format
            print("cannot save the plot to %s: %s" % (args.plot, exc), file=sys.stderr)
            return 1
        print()
        print("head heatmaps saved to %s" % args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
