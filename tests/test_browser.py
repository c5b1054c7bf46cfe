"""The explorer and the trace's HTML in a real browser: Debian's headless
Chromium, offline.

Each page gets a probe script (inserted first in <head>) that records JS
errors and Content-Security-Policy violations, then, after the page loaded,
drives the explorer as a user would (picks head 0, then head 1, and compares
a hash of the drawn pixels; picks a query; hovers a cell) and lists every
resource the page requested (performance.getEntriesByType("resource")).  It
writes its findings as JSON into <pre id="mha-probe">, which the test reads
from ``chromium --dump-dom``.  A second run takes a screenshot, kept under
$MHA_ARTIFACTS (default: <tmp>/mha_ext-artifacts) and printed.

Two negative controls prove the probe can see what it looks for: a page that
throws, and a page that tries to fetch.

Without chromium the tests skip, except under CI (the CI variable set),
where they fail: CI installs Debian's ``chromium``.
"""
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

import mha_ext
from mha_ext.explorer import explore

TOKENS = "the cat sat on the mat because it was warm".split()

PROBE = r"""<script>
window.__mha = {errors: [], violations: []};
window.addEventListener("error", function (e) { __mha.errors.push(String(e.message)); });
document.addEventListener("securitypolicyviolation", function (e) {
  __mha.violations.push(e.violatedDirective + " " + e.blockedURI); });
function cells(root) {
  // the colour drawn at the centre of every cell of the one-head heatmap
  var cv = root.querySelector(".mha-view canvas"), g = cv.mhaGeom, d = root.mhaExplorer.data;
  var dpr = cv.width / parseFloat(cv.style.width), ctx = cv.getContext("2d"), grid = [];
  for (var i = 0; i < d.Sq; i++) {
    var row = [];
    for (var j = 0; j < d.Sk; j++) {
      var p = ctx.getImageData(Math.floor((g.left + (j + 0.5) * g.cs) * dpr),
                               Math.floor((g.top + (i + 0.5) * g.cs) * dpr), 1, 1).data;
      row.push([p[0], p[1], p[2]]);
    }
    grid.push(row);
  }
  return grid;
}
window.addEventListener("load", function () { setTimeout(function () {
  var out = {errors: __mha.errors, violations: __mha.violations};
  try {
    var root = document.querySelector(".mha-explorer");
    if (root) {
      out.ready = root.getAttribute("data-ready") === "1";
      out.nojs_left = !!root.querySelector(".mha-nojs");
      var pick = function (name, v) {
        var s = root.querySelector('select[data-control="' + name + '"]');
        s.value = String(v); s.dispatchEvent(new Event("change")); };
      pick("head", 0); out.sig0 = root.mhaExplorer.signature(); out.cells0 = cells(root);
      pick("head", 1); out.sig1 = root.mhaExplorer.signature(); out.cells1 = cells(root);
      pick("head", 0); out.sig0again = root.mhaExplorer.signature();
      pick("head", 1);
      pick("query", 6);
      out.info = root.querySelector(".mha-info").textContent;
      var cv = root.querySelector(".mha-view canvas"), g = cv.mhaGeom, r = cv.getBoundingClientRect();
      cv.dispatchEvent(new MouseEvent("mousemove", {bubbles: true,
        clientX: r.left + g.left + 2.5 * g.cs, clientY: r.top + g.top + 6.5 * g.cs}));
      var tip = root.querySelector(".mha-tip");
      out.tip = tip.textContent; out.tip_shown = tip.style.display === "block";
    }
    var td = document.querySelector("table.mha-trace td");
    if (td) {
      out.trace_align = getComputedStyle(td).textAlign;
      var d = document.querySelectorAll("table.mha-trace details");
      out.details = d.length;
      if (d.length > 11) d[11].open = true;
    }
    if (window.__mhaExtra) out.extra = window.__mhaExtra();
  } catch (e) { out.errors.push("probe: " + e); }
  out.resources = performance.getEntriesByType("resource").map(function (e) { return e.name; });
  var pre = document.createElement("pre"); pre.id = "mha-probe";
  pre.textContent = JSON.stringify(out); document.body.appendChild(pre);
}, 50); });
</script>"""


def _chromium():
    for name in (os.environ.get("MHA_CHROMIUM"), "chromium", "chromium-browser"):
        if name and shutil.which(name):
            return shutil.which(name)
    if "CI" in os.environ:
        pytest.fail("chromium is required when CI is set (apt-get install chromium)",
                    pytrace=False)
    pytest.skip("chromium is not installed (Debian: apt-get install chromium)")


def _artifacts():
    d = Path(os.environ.get("MHA_ARTIFACTS") or Path(tempfile.gettempdir()) / "mha_ext-artifacts")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _run(browser, page, tmp_path, *extra):
    # offline: no proxy reachable, every host name unresolvable, no sync or updates
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--disable-background-networking", "--disable-component-update",
           "--disable-sync", "--proxy-server=127.0.0.1:9",
           "--host-resolver-rules=MAP * ~NOTFOUND", "--user-data-dir=%s" % (tmp_path / "profile"),
           "--window-size=1100,900", "--virtual-time-budget=5000", *extra, page.as_uri()]
    # the browser is not ours to sanitise: no preloaded ASan, no sanitizer logs
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS", "PYTHONMALLOC")}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("chromium did not finish within 120 s: %s" % " ".join(cmd))
    return r


def _probe(browser, html_text, tmp_path, name, *extra):
    """Load the page with the probe (chromium's flags `extra` too); returns
    the probe's findings."""
    page = tmp_path / (name + ".html")
    page.write_text(html_text.replace("<head>", "<head>" + PROBE, 1), encoding="utf-8")
    r = _run(browser, page, tmp_path, "--dump-dom", *extra)
    m = re.search(r'<pre id="mha-probe">(.*?)</pre>', r.stdout, re.S)
    assert m, "the probe did not report (exit %d): %s" % (r.returncode, r.stderr[-2000:])
    import html as _html
    return json.loads(_html.unescape(m.group(1)))


def _screenshot(browser, html_text, tmp_path, name, capsys, drive=True):
    """A screenshot of the page, after the probe drove it (drive) or as it
    opens; returns its path (kept: a CI artifact)."""
    page = tmp_path / (name + "-shot.html")
    page.write_text(html_text.replace("<head>", "<head>" + PROBE, 1) if drive else html_text,
                    encoding="utf-8")
    shot = _artifacts() / (name + ".png")
    if shot.exists():
        shot.unlink()
    _run(browser, page, tmp_path, "--screenshot=%s" % shot, "--hide-scrollbars")
    assert shot.exists() and shot.stat().st_size > 5000, "no screenshot at %s" % shot
    with capsys.disabled():
        print("\n[browser] screenshot: %s" % shot)
    return shot


YELLOW = np.array([253, 231, 37])      # the top of the colour map


def _check_cells(cells, weights, blocked):
    """cells (Sq, Sk, 3) drawn with the per-row scale: each row's largest
    weight is the top colour, blocked cells are grey hatching."""
    cells = np.array(cells)
    for i in range(weights.shape[0]):
        free = ~blocked[i]
        assert np.all(cells[i, ~free, 0] == cells[i, ~free, 1]), "blocked cell not grey"
        dist = np.abs(cells[i] - YELLOW).sum(-1).astype(float)
        dist[~free] = np.inf
        want = np.argmax(np.where(free, weights[i], -np.inf))
        assert dist.argmin() == want, "row %d: drew its top at key %d, not %d" % (
            i, dist.argmin(), want)


def _trace():
    m = mha_ext.MultiHeadAttention(64, 4, seed=0).eval()
    x = np.random.default_rng(0).standard_normal((2, 10, 64))
    return m.trace(x, is_causal=True)


def test_explorer_in_chromium(tmp_path, capsys):
    browser = _chromium()
    page = explore(_trace(), tokens=TOKENS, title="causal self-attention, random weights")
    text = page.to_html(full_page=True)
    out = _probe(browser, text, tmp_path, "explorer")
    assert out["errors"] == [] and out["violations"] == [], out
    assert out["ready"] and not out["nojs_left"], out
    assert out["sig0"] != out["sig1"], "picking another head did not change the drawn cells"
    assert out["sig0"] == out["sig0again"], "the same head drew different cells"
    tr = _trace()
    blocked = np.isneginf(tr["masked scores"].array[0])
    _check_cells(out["cells0"], tr["softmax"].array[0, 0], blocked[0])
    _check_cells(out["cells1"], tr["softmax"].array[0, 1], blocked[1])
    assert out["resources"] == [], "the page requested %s" % out["resources"]
    assert out["tip_shown"], out
    # query 6 ("because") -> key 2 ("sat"), head 1, batch 0, with its values
    assert '"because"' in out["tip"] and '"sat"' in out["tip"] and "head 1" in out["tip"]
    assert "raw scores" in out["tip"] and "softmax" in out["tip"]
    assert 'query 6 "because", head 1' in out["info"], out["info"]
    _screenshot(browser, text, tmp_path, "explorer", capsys)


def test_trained_model_explorer_in_chromium(tmp_path, capsys):
    """The explorer of the example's trained model, all heads (screenshot)."""
    browser = _chromium()
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    try:
        import heads_model
    finally:
        sys.path.pop(0)
    model = heads_model.train(steps=200)
    x = np.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    tr = model.attn.trace(model.embed(x))
    text = explore(tr, tokens=[str(t) for t in x[0]],
                   title="trained heads: previous / mirror / first").to_html(full_page=True)
    out = _probe(browser, text, tmp_path, "trained")
    assert out["errors"] == [] and out["violations"] == [] and out["resources"] == [], out
    assert out["sig0"] != out["sig1"]
    w = tr["softmax"].array[0]
    none = np.zeros(w.shape[1:], dtype=bool)
    _check_cells(out["cells0"], w[0], none)
    _check_cells(out["cells1"], w[1], none)
    _screenshot(browser, text, tmp_path, "explorer-trained", capsys, drive=False)


def test_trace_html_in_chromium(tmp_path, capsys):
    browser = _chromium()
    tr = _trace()
    path = tr.save_html(tmp_path / "trace-saved.html")
    text = Path(path).read_text(encoding="utf-8")
    out = _probe(browser, text, tmp_path, "trace")
    assert out["errors"] == [] and out["violations"] == [] and out["resources"] == [], out
    assert out["trace_align"] == "left"
    assert out["details"] == len(tr)                 # a values preview per step
    _screenshot(browser, text, tmp_path, "trace", capsys)


@pytest.mark.parametrize("bad, what", [
    ("<script>throw new Error('boom')</script>", "errors"),
    ("<script>fetch('http://example.com/x.js').catch(function () {})</script>", "violations"),
])
def test_probe_sees_errors_and_requests(tmp_path, bad, what):
    """Negative controls: the probe reports a JS error and a request."""
    browser = _chromium()
    text = explore(np.full((1, 2, 3, 3), 1 / 3)).to_html(full_page=True)
    out = _probe(browser, text.replace("</body>", bad + "</body>"), tmp_path, "bad")
    assert out[what], out


# What Jupyter Notebook / Lab do with a trusted text/html output: set it as
# innerHTML, then replace each <script> by a fresh one so that it runs.  An
# untrusted output in JupyterLab goes through a sanitiser that drops <script>
# and <style> (with their content): the explorer must then say what to do.
FRONT_END = r"""<!DOCTYPE html><html><head><meta charset="utf-8"><title>outputs</title></head>
<body><div id="out1"></div><div id="out2"></div><div id="untrusted"></div>
<script>
var frags = %s;
function render(host, html) {
  host.innerHTML = html;
  host.querySelectorAll("script").forEach(function (old) {
    var s = document.createElement("script");
    for (var i = 0; i < old.attributes.length; i++) s.setAttribute(old.attributes[i].name, old.attributes[i].value);
    s.textContent = old.textContent;
    old.parentNode.replaceChild(s, old);
  });
}
render(document.getElementById("out1"), frags[0]);
render(document.getElementById("out2"), frags[1]);
document.getElementById("untrusted").innerHTML =
  frags[0].replace(/<script[\s\S]*?<\/script>/g, "").replace(/<style>[\s\S]*?<\/style>/g, "");
window.__mhaExtra = function () {
  var roots = document.querySelectorAll("#out1 .mha-explorer, #out2 .mha-explorer");
  var u = document.getElementById("untrusted");
  return {ready: Array.prototype.map.call(roots, function (r) { return r.getAttribute("data-ready"); }),
          ids: Array.prototype.map.call(roots, function (r) { return r.id; }),
          heads: Array.prototype.map.call(roots, function (r) { return r.querySelectorAll(".mha-view canvas").length; }),
          untrusted_text: u.textContent, untrusted_canvases: u.querySelectorAll("canvas").length};
};
</script></body></html>"""


def test_notebook_outputs_in_chromium(tmp_path, capsys):
    """_repr_html_ as a notebook front-end inserts it: two explorers in one
    page each draw into their own output; sanitised (untrusted), the output
    says how to see it."""
    browser = _chromium()
    tr = _trace()
    frags = [explore(tr, tokens=TOKENS)._repr_html_(),
             explore(np.asarray(tr.weights)[:, :3], head=2)._repr_html_()]
    text = FRONT_END % json.dumps(frags).replace("</", "<\\/")
    out = _probe(browser, text, tmp_path, "frontend")
    assert out["errors"] == [] and out["resources"] == [], out
    extra = out["extra"]
    assert extra["ready"] == ["1", "1"] and len(set(extra["ids"])) == 2, extra
    assert extra["heads"][1] == 1                    # head=2: one heatmap
    assert out["sig0"] != out["sig1"]
    assert "JavaScript did not run" in extra["untrusted_text"]
    assert extra["untrusted_canvases"] == 0
    _screenshot(browser, text, tmp_path, "frontend", capsys, drive=False)


def test_long_sequence_in_chromium(tmp_path, capsys):
    """S = 64 with long tokens: thinned labels, a scrolling view, hover works."""
    browser = _chromium()
    m = mha_ext.MultiHeadAttention(32, 2, seed=0).eval()
    S = 64
    tr = m.trace(np.random.default_rng(0).standard_normal((1, S, 32)), is_causal=True)
    tokens = ["word%d" % i if i % 7 else "a_much_longer_token_%d" % i for i in range(S)]
    text = explore(tr, tokens=tokens, head=0).to_html(full_page=True)
    out = _probe(browser, text, tmp_path, "long")
    assert out["errors"] == [] and out["violations"] == [] and out["resources"] == [], out
    assert out["sig0"] != out["sig1"]
    assert '"because"' not in out["tip"] and '"word6"' in out["tip"] and '"word2"' in out["tip"]
    blocked = np.isneginf(tr["masked scores"].array[0])
    _check_cells(out["cells1"], tr["softmax"].array[0, 1], blocked[1])
    _screenshot(browser, text, tmp_path, "explorer-long", capsys, drive=False)


LEGEND_PROBE = r"""<script>
window.__mhaExtra = function () {
  var root = document.querySelector(".mha-explorer"), ex = root.mhaExplorer, out = {};
  var legend = function () { return root.querySelector(".mha-legend").textContent; };
  var show = function (layer, head, scale) {
    ex.state.layer = layer; ex.state.head = head; ex.state.scale = scale; ex.draw();
    return legend(); };
  out.soft_row = show(2, 0, "row");
  out.raw_row = show(0, 0, "row");
  out.raw_head1 = show(0, 1, "head");
  out.soft_all_heads = show(2, -1, "head");
  out.raw_shared = show(0, -1, "all");
  show(2, 0, "row");
  out.tip = ex.describe(1, 3, 1);
  out.tip_blocked = ex.describe(1, 1, 3);
  return out;
};
</script>"""


def test_legend_and_hover_say_what_is_drawn(tmp_path):
    """The legend names the range each colour scale spans (each head's own in
    the all-heads view; 0 for probabilities), hover values keep the page's 4
    significant digits, a blocked cell's score reads -inf (blocked)."""
    browser = _chromium()
    tr = _trace()
    text = explore(tr).to_html(full_page=True).replace("</body>", LEGEND_PROBE + "</body>")
    out = _probe(browser, text, tmp_path, "legend")
    assert out["errors"] == [] and out["violations"] == [], out
    x = out["extra"]
    assert "softmax: each row from 0 to its largest" in x["soft_row"], x
    assert "raw scores: each row from its smallest value to its largest" in x["raw_row"], x
    assert "softmax: each head from 0 to its largest" in x["soft_all_heads"], x
    # the scales span the cells drawn in colour: not the causal mask's hatched ones
    raw = tr["raw scores"].array[0]
    seen = raw[:, ~np.triu(np.ones(raw.shape[1:], bool), 1)]
    lo, hi = seen[1].min(), seen[1].max()
    assert "raw scores: head 1, %.4g \u2026 %.4g" % (lo, hi) in x["raw_head1"], x
    assert "raw scores: all heads, %.4g \u2026 %.4g" % (seen.min(), seen.max()) in x["raw_shared"], x
    lines = dict(line.split(":", 1) for line in x["tip"].split("\n")[2:] if ":" in line)
    for name in ("raw scores", "softmax"):
        v = float("%.4g" % tr[name].array[0, 1, 3, 1])
        assert lines[name].strip() == ("%.4g" % v), (name, lines[name], v)
    assert "masked scores: \u2212\u221e (blocked)" in x["tip_blocked"], x
    # a scale of +inf: raw scores of -inf are the scale's, not "(blocked)"; a
    # layer with no finite value says so in the legend
    m = mha_ext.MultiHeadAttention(64, 4, seed=0).eval()
    x0 = np.random.default_rng(0).standard_normal((1, 10, 64))
    sign = -np.sign(m.trace(x0)["raw scores"].array[0, 1, 1, 3])   # that cell's raw score -inf
    tr = m.trace(x0, is_causal=True, scale=sign * np.inf)
    assert np.isneginf(tr["raw scores"].array[0, 1, 1, 3])
    text = explore(tr).to_html(full_page=True).replace("</body>", LEGEND_PROBE + "</body>")
    out = _probe(browser, text, tmp_path, "legend-inf")
    assert out["errors"] == [] and out["violations"] == [], out
    x = out["extra"]
    assert "raw scores: head 1, no finite values" in x["raw_head1"], x
    raw = [line for line in x["tip_blocked"].split("\n") if line.startswith("raw scores:")]
    assert raw and "blocked" not in raw[0], x["tip_blocked"]
    assert "masked scores: \u2212\u221e (blocked)" in x["tip_blocked"], x


ZOOM_PROBE = r"""<script>
window.__mhaExtra = function () {
  var root = document.querySelector(".mha-explorer");
  var pick = root.querySelector('select[data-control="head"]');
  pick.value = "0"; pick.dispatchEvent(new Event("change"));
  var z = root.querySelector('input[data-control="zoom"]');
  z.value = z.max; z.dispatchEvent(new Event("input"));
  var cv = root.querySelector(".mha-view canvas"), g = cv.mhaGeom;
  var k = cv.width / parseFloat(cv.style.width), out = {w: cv.width, h: cv.height, cs: g.cs,
                                                       dpr: window.devicePixelRatio};
  // cell (200, 100): below the diagonal (drawn in colour) and (100, 200) above it (blocked)
  out.drawn = Array.prototype.slice.call(cv.getContext("2d").getImageData(
      Math.floor((g.left + 100.5 * g.cs) * k), Math.floor((g.top + 200.5 * g.cs) * k), 1, 1).data);
  return out;
};
</script>"""


def test_the_largest_zoom_over_many_tokens_stays_drawn(tmp_path):
    """256 tokens at the zoom's largest cells on a display of pixel ratio 2:
    a canvas at that ratio would pass what Chromium draws (32767 pixels a
    side, 268M in all; it then stays blank, no error): it is drawn with
    fewer pixels, and the cells keep their colours."""
    browser = _chromium()
    m = mha_ext.MultiHeadAttention(16, 2, seed=0).eval()
    tr = m.trace(np.random.default_rng(0).standard_normal((1, 256, 16)), is_causal=True)
    text = explore(tr, head=0).to_html(full_page=True).replace("</body>", ZOOM_PROBE + "</body>")
    out = _probe(browser, text, tmp_path, "zoom", "--force-device-scale-factor=2")
    assert out["errors"] == [] and out["violations"] == [], out
    x = out["extra"]
    assert x["dpr"] == 2 and x["cs"] == 40, x
    assert x["w"] * x["h"] <= 268435456 and max(x["w"], x["h"]) <= 32767, x
    assert x["drawn"][3] == 255 and x["drawn"][:3] != [0, 0, 0], x  # an opaque colour


BLOCKED_PROBE = r"""<script>
window.__mhaExtra = function () {
  var root = document.querySelector(".mha-explorer"), ex = root.mhaExplorer, out = {};
  ex.state.layer = 0; ex.state.head = 0; ex.state.scale = "head"; ex.state.query = -1; ex.draw();
  out.legend = root.querySelector(".mha-legend").textContent;
  ex.state.query = 2; ex.draw();
  out.info = root.querySelector(".mha-info").textContent;
  return out;
};
</script>"""


def test_the_colour_scale_leaves_out_blocked_cells_and_a_dead_row_says_none(tmp_path):
    """Blocked cells are hatched, so their values do not stretch the scale
    (as plot_heads' NaN there): weights 0.1 with blocked cells of 5 span
    0 ... 0.1, not 0 ... 5; the info line of a query whose keys are all
    blocked or NaN says none, not an empty list."""
    browser = _chromium()
    w = np.full((1, 1, 3, 3), 0.1)
    np.fill_diagonal(w[0, 0], 5.0)
    w[0, 0, 2] = np.nan
    blocked = np.eye(3, dtype=bool)
    text = explore(w, blocked=blocked, head=0).to_html(full_page=True)
    out = _probe(browser, text.replace("</body>", BLOCKED_PROBE + "</body>"), tmp_path, "blk")
    assert out["errors"] == [] and out["violations"] == [], out
    x = out["extra"]
    assert "weights: head 0, 0 \u2026 0.1" in x["legend"], x
    assert x["info"].endswith("largest weights: none (every key blocked or NaN)"), x
    # every cell blocked (finite values under the hatching): the legend says so
    text = explore(w, blocked=np.ones((3, 3), bool), head=0).to_html(full_page=True)
    out = _probe(browser, text.replace("</body>", BLOCKED_PROBE + "</body>"), tmp_path, "blk2")
    assert "weights: head 0, no finite values outside the blocked cells" in \
        out["extra"]["legend"], out
