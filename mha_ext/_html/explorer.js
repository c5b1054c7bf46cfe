/* mha_ext attention explorer: plain JavaScript, no library, nothing fetched.
 *
 * mhaExplorer(root, data) draws into root (a div.mha-explorer).  data is the
 * JSON that mha_ext/explorer.py embeds:
 *   B, H, Sq, Sk        sizes (legend: B batch, H heads, Sq queries, Sk keys)
 *   qTokens, kTokens    labels of the queries and keys
 *   layers              [{name, masked, probability, values}] masked: the
 *                       layer the masks wrote -inf into; values: flat (B, H, Sq, Sk), row-major,
 *                       numbers (±inf as ±1e999, which JSON.parse reads as
 *                       ±Infinity) or null for NaN
 *   blocked             flat 0/1 (B, H, Sq, Sk) or null when unknown
 *   layer               the name of the layer shown first
 *   title               a caption
 * root.mhaExplorer exposes the state and signature() (a hash of the drawn
 * pixels) for tests.
 */
function mhaExplorer(root, data) {
  "use strict";
  var B = data.B, H = data.H, Sq = data.Sq, Sk = data.Sk;
  var layers = data.layers;
  var MAX_SIDE = 16384, MAX_AREA = 1.2e8;  // a heatmap canvas's pixels at most
  var state = { layer: 0, batch: 0, head: 0, query: -1, scale: "row", cell: 0 };
  for (var li = 0; li < layers.length; li++) if (layers[li].name === data.layer) state.layer = li;
  state.cell = Math.max(4, Math.min(28, Math.floor(520 / Math.max(Sq, Sk, 1))));
  state.head = data.allHeads ? -1 : (data.head || 0);

  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    if (attrs) for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function idx(b, h, i, j) { return ((b * H + h) * Sq + i) * Sk + j; }
  function isBlocked(b, h, i, j) { return data.blocked ? data.blocked[idx(b, h, i, j)] === 1 : false; }
  function fmt(v) {
    // the 4 significant digits the page holds
    if (v === null || v === undefined || v !== v) return "NaN";
    if (v === Infinity) return "\u221e";
    if (v === -Infinity) return "\u2212\u221e";
    if (v === 0) return "0";
    var a = Math.abs(v);
    return (a >= 1e4 || a < 1e-3) ? v.toExponential(3) : String(Number(v.toPrecision(4)));
  }
  function short(s, n) { s = String(s); return s.length > n ? s.slice(0, n - 1) + "\u2026" : s; }

  // viridis, sampled at 9 points and interpolated
  var VIR = [[68,1,84],[71,44,122],[59,81,139],[44,113,142],[33,144,141],
             [39,173,129],[92,200,99],[170,220,50],[253,231,37]];
  function colour(t) {
    if (!(t >= 0)) t = 0; if (t > 1) t = 1;
    var x = t * (VIR.length - 1), k = Math.min(Math.floor(x), VIR.length - 2), f = x - k;
    var a = VIR[k], c = VIR[k + 1];
    return "rgb(" + Math.round(a[0] + f * (c[0] - a[0])) + "," + Math.round(a[1] + f * (c[1] - a[1])) +
      "," + Math.round(a[2] + f * (c[2] - a[2])) + ")";
  }

  // -- controls ---------------------------------------------------------------
  var nojs = root.querySelector(".mha-nojs");
  if (nojs) nojs.parentNode.removeChild(nojs);
  var ui = root.querySelector(".mha-ui");
  if (ui) ui.parentNode.removeChild(ui);                   // drawn again: start afresh
  ui = el("div", { "class": "mha-ui" });
  root.appendChild(ui);
  if (data.title) ui.appendChild(el("div", { "class": "mha-title" }, data.title));
  var controls = el("div", { "class": "mha-controls" });
  ui.appendChild(controls);
  function picker(label, options, value, onchange, name) {
    var lab = el("label", null, label);
    var sel = el("select", { "data-control": name });
    options.forEach(function (o) {
      var opt = el("option", { value: String(o[0]) }, o[1]);
      sel.appendChild(opt);
    });
    sel.value = String(value);
    sel.addEventListener("change", function () { onchange(sel.value); draw(); });
    lab.appendChild(sel);
    controls.appendChild(lab);
    return sel;
  }
  var range = function (n, f) { var r = []; for (var i = 0; i < n; i++) r.push([i, f(i)]); return r; };
  picker("show", layers.map(function (l, i) { return [i, l.name]; }), state.layer,
         function (v) { state.layer = +v; }, "layer");
  if (B > 1) picker("batch", range(B, String), 0, function (v) { state.batch = +v; }, "batch");
  var headSel = picker("head", [[-1, "all heads"]].concat(range(H, String)), state.head,
                       function (v) { state.head = +v; }, "head");
  picker("query", [[-1, "all"]].concat(range(Sq, function (i) { return i + ": " + short(data.qTokens[i], 16); })),
         -1, function (v) { state.query = +v; }, "query");
  picker("colour scale", [["row", "per row"], ["head", "shared, per head"], ["all", "shared, all heads"]],
         state.scale, function (v) { state.scale = v; }, "scale");
  var zl = el("label", null, "zoom");
  var zoom = el("input", { type: "range", min: "3", max: "40", value: String(state.cell), "data-control": "zoom" });
  zoom.addEventListener("input", function () { state.cell = +zoom.value; draw(); });
  zl.appendChild(zoom);
  controls.appendChild(zl);

  var view = el("div", { "class": "mha-view" });
  ui.appendChild(view);
  var legend = el("div", { "class": "mha-legend" });
  ui.appendChild(legend);
  var info = el("div", { "class": "mha-info" });
  ui.appendChild(info);
  var tip = el("div", { "class": "mha-tip" });
  ui.appendChild(tip);

  var hatch = (function () {
    var c = document.createElement("canvas"); c.width = 6; c.height = 6;
    var g = c.getContext("2d");
    g.fillStyle = "#eeeeee"; g.fillRect(0, 0, 6, 6);
    g.strokeStyle = "#888888"; g.lineWidth = 1;
    g.beginPath(); g.moveTo(0, 6); g.lineTo(6, 0); g.moveTo(-1, 1); g.lineTo(1, -1);
    g.moveTo(5, 7); g.lineTo(7, 5); g.stroke();
    return c;
  })();

  // -- colour scale -------------------------------------------------------------
  function limits(b, h, i) {
    // [lo, hi] of the finite values the current scale covers
    var v = layers[state.layer].values, lo = Infinity, hi = -Infinity;
    var h0 = h, h1 = h + 1, i0 = 0, i1 = Sq;
    if (state.scale === "all") { h0 = 0; h1 = H; }
    if (state.scale === "row") { i0 = i; i1 = i + 1; }
    for (var hh = h0; hh < h1; hh++) for (var ii = i0; ii < i1; ii++) for (var j = 0; j < Sk; j++) {
      var x = v[idx(b, hh, ii, j)];
      if (x !== null && isFinite(x) && !isBlocked(b, hh, ii, j)) { if (x < lo) lo = x; if (x > hi) hi = x; }
    }
    var none = lo === Infinity;                 // no finite value there but in blocked cells
    if (none) { lo = 0; hi = 1; }
    if (layers[state.layer].probability) lo = Math.min(lo, 0);
    if (hi <= lo) hi = lo + 1;
    return [lo, hi, none];
  }

  // -- drawing ------------------------------------------------------------------
  function heatmap(h, cs, withLabels) {
    var b = state.batch, v = layers[state.layer].values;
    var ctx0 = document.createElement("canvas").getContext("2d");
    ctx0.font = "11px sans-serif";
    var step = Math.max(1, Math.ceil(13 / cs));              // label thinning
    var left = 0, top = 0;
    if (withLabels) {
      for (var i = 0; i < Sq; i += step) left = Math.max(left, ctx0.measureText(i + " " + short(data.qTokens[i], 14)).width);
      for (var j = 0; j < Sk; j += step) top = Math.max(top, ctx0.measureText(short(data.kTokens[j], 14)).width);
      left = Math.ceil(left) + 8; top = Math.ceil(top * 0.75) + 12;
    }
    var right = withLabels ? top : 0;                          // room for the last rotated label
    var w = left + Sk * cs + right, hgt = top + Sq * cs;
    // drawn at the display's pixel ratio, or fewer pixels where that canvas
    // would pass what browsers draw (Chromium: 32767 a side, 268M pixels;
    // past it the canvas stays blank): then scaled up by the page, blurred
    var dpr = Math.min(window.devicePixelRatio || 1, MAX_SIDE / w, MAX_SIDE / hgt,
                       Math.sqrt(MAX_AREA / (w * hgt)));
    var cv = el("canvas", { width: String(Math.max(1, Math.floor(w * dpr))),
                            height: String(Math.max(1, Math.floor(hgt * dpr))) });
    cv.style.width = w + "px"; cv.style.height = hgt + "px";
    var g = cv.getContext("2d");
    g.scale(cv.width / w, cv.height / hgt);
    var pattern = g.createPattern(hatch, "repeat");
    var lim = state.scale === "row" ? null : limits(b, h, 0);
    for (var i = 0; i < Sq; i++) {
      var li = lim || limits(b, h, i);
      for (var j = 0; j < Sk; j++) {
        var x = v[idx(b, h, i, j)], X = left + j * cs, Y = top + i * cs;
        if (isBlocked(b, h, i, j)) g.fillStyle = pattern;
        else if (x === null || !isFinite(x)) g.fillStyle = "#bbbbbb";
        else g.fillStyle = colour((x - li[0]) / (li[1] - li[0]));
        g.fillRect(X, Y, cs, cs);
      }
    }
    if (state.query >= 0) {                                  // fade the other rows
      g.fillStyle = "rgba(255,255,255,0.6)";
      if (state.query > 0) g.fillRect(left, top, Sk * cs, state.query * cs);
      g.fillRect(left, top + (state.query + 1) * cs, Sk * cs, (Sq - state.query - 1) * cs);
      g.strokeStyle = "#d62728"; g.lineWidth = 2;
      g.strokeRect(left + 1, top + state.query * cs + 1, Sk * cs - 2, cs - 2);
    }
    if (withLabels) {
      g.fillStyle = "#222"; g.font = "11px sans-serif"; g.textBaseline = "middle";
      g.textAlign = "right";
      for (var qi = 0; qi < Sq; qi += step) g.fillText(short(data.qTokens[qi], 14), left - 4, top + qi * cs + cs / 2);
      g.textAlign = "left";
      for (var kj = 0; kj < Sk; kj += step) {
        g.save(); g.translate(left + kj * cs + cs / 2, top - 4); g.rotate(-Math.PI / 4);
        g.fillText(short(data.kTokens[kj], 14), 0, 0); g.restore();
      }
    }
    cv.mhaGeom = { h: h, left: left, top: top, cs: cs };
    cv.addEventListener("mousemove", hover);
    cv.addEventListener("mouseleave", function () { tip.style.display = "none"; });
    return cv;
  }

  function cellAt(cv, ev) {
    var r = cv.getBoundingClientRect(), gm = cv.mhaGeom;
    var j = Math.floor((ev.clientX - r.left - gm.left) / gm.cs);
    var i = Math.floor((ev.clientY - r.top - gm.top) / gm.cs);
    return (i >= 0 && i < Sq && j >= 0 && j < Sk) ? [gm.h, i, j] : null;
  }

  function describe(h, i, j) {
    var b = state.batch, lines = ["head " + h + (B > 1 ? ", batch " + b : ""),
      "query " + i + " " + JSON.stringify(String(data.qTokens[i])) + " \u2192 key " + j + " " +
      JSON.stringify(String(data.kTokens[j]))];
    var bl = isBlocked(b, h, i, j);
    layers.forEach(function (l) {
      var x = l.values[idx(b, h, i, j)];
      // a mask's -inf is in the masked scores; the raw ones come before it
      var s = fmt(x) + ((x === -Infinity && bl && l.masked) ? " (blocked)" : "");
      lines.push((l.name + ":              ").slice(0, 15) + s);
    });
    if (bl) lines.push("blocked by the mask");
    return lines.join("\n");
  }

  function hover(ev) {
    var c = cellAt(ev.currentTarget, ev);
    if (!c) { tip.style.display = "none"; return; }
    tip.textContent = describe(c[0], c[1], c[2]);
    var r = root.getBoundingClientRect();
    tip.style.left = (ev.clientX - r.left + 14) + "px";
    tip.style.top = (ev.clientY - r.top + 14) + "px";
    tip.style.display = "block";
  }

  function drawLegend() {
    legend.textContent = "";
    var l = layers[state.layer], bar = el("canvas", { width: "160", height: "12" });
    var g = bar.getContext("2d");
    for (var x = 0; x < 160; x++) { g.fillStyle = colour(x / 159); g.fillRect(x, 0, 1, 12); }
    // the range each scale spans (limits() above); a probability's starts at 0
    var low = l.probability ? "0" : "its smallest value", what;
    if (state.scale === "row") {
      what = "each row from " + low + " to its largest";
    } else if (state.scale === "head" && state.head < 0) {
      what = "each head from " + low + " to its largest";       // the all-heads view
    } else {
      var lim = limits(state.batch, state.scale === "all" ? 0 : state.head, 0);
      what = (state.scale === "all" ? "all heads, " : "head " + state.head + ", ") +
        (lim[2] ? "no finite values outside the blocked cells" : fmt(lim[0]) + " \u2026 " + fmt(lim[1]));
    }
    var span = el("span");
    span.appendChild(bar); bar.style.display = "inline-block"; bar.style.verticalAlign = "middle";
    span.appendChild(document.createTextNode(" " + l.name + ": " + what));
    legend.appendChild(span);
    var hb = el("span"), sw = el("span", { "class": "mha-swatch" });
    sw.style.backgroundImage = "url(" + hatch.toDataURL() + ")";
    hb.appendChild(sw); hb.appendChild(document.createTextNode(data.blocked ? "blocked by a mask" : "blocked: unknown (weights only)"));
    legend.appendChild(hb);
    var nb = el("span"), sw2 = el("span", { "class": "mha-swatch" });
    sw2.style.background = "#bbbbbb";
    nb.appendChild(sw2); nb.appendChild(document.createTextNode("NaN or \u00b1\u221e"));
    legend.appendChild(nb);
  }

  function drawInfo() {
    info.textContent = "";
    if (state.query < 0 || state.head < 0) {
      info.textContent = "hover a cell for its values; pick a query to see where it looks" +
        (state.head < 0 ? "; click a head to open it" : "");
      return;
    }
    var v = layers[state.layer].values, b = state.batch, h = state.head, i = state.query, keys = [];
    for (var j = 0; j < Sk; j++) {
      var x = v[idx(b, h, i, j)];
      if (x !== null && !isBlocked(b, h, i, j)) keys.push([x, j]);  // ±inf too, not NaN
    }
    keys.sort(function (a, c) { return (c[0] > a[0]) - (c[0] < a[0]) || a[1] - c[1]; });
    info.textContent = "query " + i + " " + JSON.stringify(String(data.qTokens[i])) + ", head " + h +
      ", largest " + layers[state.layer].name + ": " + (keys.length ? keys.slice(0, 5).map(function (k) {
        return JSON.stringify(String(data.kTokens[k[1]])) + " (key " + k[1] + ") " + fmt(k[0]);
      }).join(", ") : "none (every key blocked or NaN)");
  }

  function draw() {
    view.textContent = "";
    tip.style.display = "none";
    if (state.head >= 0) {
      view.appendChild(heatmap(state.head, state.cell, true));
    } else {
      var grid = el("div", { "class": "mha-grid" });
      var cs = Math.max(2, Math.min(state.cell, Math.floor(200 / Math.max(Sq, Sk, 1))));
      for (var h = 0; h < H; h++) {
        var fig = el("figure", { "class": "mha-panel", "data-head": String(h) });
        fig.appendChild(el("figcaption", null, "head " + h));
        fig.appendChild(heatmap(h, cs, false));
        fig.addEventListener("click", (function (hh) {
          return function () { state.head = hh; headSel.value = String(hh); draw(); };
        })(h));
        grid.appendChild(fig);
      }
      view.appendChild(grid);
    }
    drawLegend();
    drawInfo();
    root.setAttribute("data-head", String(state.head));
  }

  function signature() {
    // FNV-1a over the pixels of every drawn heatmap: changes when the cells do
    var hsh = 2166136261 >>> 0;
    var cvs = view.querySelectorAll("canvas");
    for (var c = 0; c < cvs.length; c++) {
      var d = cvs[c].getContext("2d").getImageData(0, 0, cvs[c].width, cvs[c].height).data;
      for (var k = 0; k < d.length; k += 4) {
        hsh ^= d[k] | (d[k + 1] << 8) | (d[k + 2] << 16);
        hsh = Math.imul(hsh, 16777619) >>> 0;
      }
    }
    return hsh.toString(16);
  }

  root.mhaExplorer = { state: state, data: data, draw: draw, signature: signature, describe: describe };
  draw();
  root.setAttribute("data-ready", "1");
}
