"""Interactive figures: one control, one idea, every value computed here with ``lib`` before the page is drawn.

Each function takes a chapter's own numbers, computes with :mod:`lib` what the figure shows at every position of its
control (the grid is precomputed: the page never computes attention), and returns an :class:`Interactive`, which a
chapter draws with a one-line call in a cell whose metadata numbers, captions and describes the figure
(``mystnb.figure.name``, ``mystnb.figure.caption``, ``mystnb.image.alt``), as for any other figure.

The figures are Vega-Lite charts written with Vega-Altair. A control is a parameter bound to a real HTML input (a
slider, radio buttons or checkboxes, each with its label), so it works from the keyboard. An :class:`Interactive`
shows itself as
    text/html   Altair's own "universal" snippet: the chart's data and spec, and vega-embed. Where the page already
                holds Vega (the built book: ``tools/interactive_figures.py`` serves vl-convert's bundle from the
                book's own folder, once per page), nothing is fetched; elsewhere (Jupyter, Colab) the snippet loads
                Vega from jsDelivr, online, as Altair's renderer does;
    image/png   the first frame, drawn by vl-convert, for a reader without JavaScript (a PDF build, a viewer that
                strips scripts); left out where vl-convert is not installed (Colab has Altair, not vl-convert);
    text/plain  one line naming the figure and its control.
The snippet's element id is derived from the spec, and the numbers are rounded, so a fresh run prints the same text
and strict nbval compares it like any output.

    temperature_jacobian   ch. 3   a slider multiplies one row of scores: its weights and softmax Jacobian collapse
    query_angle            ch. 4   a slider turns the query in the plane: scores, weights and output follow
    score_products         ch. 2/4 a slider picks a query row: each score written out as q_i · k_j / sqrt(d)
    mask_alignment         ch. 5   L, S and the causal alignment: which keys each query sees; an empty row gives 0
    online_softmax         ch. 7   a step slider: the running max, sum and output after each block of keys
    tile_roofline          ch. 8   radio buttons pick the query tile: HBM bytes and the point on the roofline
    head_ablation          ch. 11  a checkbox per head: the attention maps and accuracy with those heads ablated
    ring_steps             ch. 12  a step slider: which key block each rank holds and the causal tiles it computes
    sliding_window         ch. 13  a window slider: the band mask and the weights under it
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import numbers
import warnings

import numpy as np

__all__ = [
    "Interactive",
    "head_ablation",
    "mask_alignment",
    "online_softmax",
    "query_angle",
    "ring_steps",
    "score_products",
    "sliding_window",
    "temperature_jacobian",
    "tile_roofline",
]

# The book's look (lib.notebook.use_book_style): a white face, viridis for weights, the colour-blind-safe cycle.
BLUE, ORANGE, GREEN, PINK, SKY, RED = "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00"
GREY = "#D9D9D9"
INKS = ["black", "white", "#555555"]  # text on a light cell, on a dark cell, on a masked (grey) cell
EMBED_OPTIONS = {"actions": False, "renderer": "svg"}
DIGITS = 4  # every number a figure holds is rounded to this many decimals, so its text is the same on every run
MARKER = "sdpa-interactive"  # the class of the snippet's wrapper: tools/interactive_figures.py looks for it
# Altair's snippet lays the chart and its controls out in a row (display: flex), which squeezes a wide chart and
# puts the controls beside it; in the book's column they go under it, at the text's size, one per line.
STYLE = (
    f".{MARKER} .vega-embed {{flex-direction: column; align-items: flex-start; max-width: 100%; overflow-x: auto}}"
    f" .{MARKER} .vega-bindings {{font-size: 0.9rem; margin: 0.4rem 0 0 0.5rem}}"
    f" .{MARKER} .vega-bind {{margin: 0.15rem 0}} .{MARKER} .vega-bind-name {{margin-right: 0.5rem}}"
    f" .{MARKER} .vega-bind input[type=range] {{vertical-align: middle; width: 12rem; margin-right: 0.6rem}}"
    f" .{MARKER} .vega-bind-radio label {{margin: 0 0.8rem 0 0.2rem}}"
)


def _alt():
    import altair as alt

    return alt


def _data(rows):
    """Inline rows, which Altair stores once under the spec's ``datasets`` however many layers use them."""
    return {"values": rows}


def _r(x, digits=DIGITS):
    """A plain float rounded for the figure's data (-0.0 written as 0.0)."""
    return round(float(x), digits) + 0.0


class Interactive:
    """An interactive figure: an Altair chart whose controls are bound HTML inputs, and what it shows as output."""

    def __init__(self, chart, name: str, control: str):
        self.chart, self.name, self.control = chart, name, control
        self.spec = chart.to_dict()
        config = self.spec.setdefault("config", {})
        config.setdefault("view", {})["stroke"] = None  # no frame around a panel of text
        config.setdefault("axisX", {})["labelAngle"] = 0  # key labels upright
        text = json.dumps(self.spec, sort_keys=True)
        self.element_id = f"sdpa-{name}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"

    def __repr__(self):
        return f"<interactive figure {self.name}: {self.control}>"

    def html(self) -> str:
        """The snippet a page shows: Altair's universal template inside a wrapper the book's extension finds."""
        alt = _alt()
        from altair.utils.html import spec_to_html

        snippet = spec_to_html(
            self.spec,
            mode="vega-lite",
            vega_version=alt.VEGA_VERSION,
            vegalite_version=alt.VEGALITE_VERSION,
            vegaembed_version=alt.VEGAEMBED_VERSION,
            output_div=self.element_id,
            embed_options=dict(EMBED_OPTIONS),
            json_kwds={"sort_keys": True, "separators": (",", ":")},
            fullhtml=False,
            template="universal",
        )
        return f'<div class="{MARKER}" data-figure="{self.name}"><style>{STYLE}</style>{snippet}</div>'

    def png(self) -> bytes:
        """The figure's first frame (every control at its starting value), drawn by vl-convert."""
        import vl_convert

        return vl_convert.vegalite_to_png(self.spec, scale=1.0)

    def _repr_mimebundle_(self, include=None, exclude=None):
        import base64

        bundle = {"text/html": self.html(), "text/plain": repr(self)}
        try:  # Colab has Altair but not vl-convert: there the figure shows without its first frame
            bundle["image/png"] = base64.b64encode(self.png()).decode("ascii")
        except ImportError:
            pass
        return bundle


# ----------------------------------------------------------------------------------------------------------------
# argument checks


def _array(x, name, ndim, *, min_size=1, max_size=None):
    if isinstance(x, (str, bytes)) or x is None:
        raise TypeError(f"{name} must be an array of numbers, got {type(x).__name__}")
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu().numpy()
    try:
        a = np.asarray(x, dtype=float)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be an array of numbers") from None
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {a.shape}")
    if a.shape[0] < min_size or (max_size is not None and a.shape[0] > max_size):
        raise ValueError(f"{name} must have between {min_size} and {max_size} rows, got {a.shape[0]}")
    if not np.isfinite(a).all():
        raise ValueError(f"{name} must be finite")
    return a


def _int(value, name, low, high=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be between {low} and {high}, got {value}" if high is not None
                         else f"{name} must be at least {low}, got {value}")
    return int(value)


def _labels(labels, n, name="labels"):
    if labels is None:
        return [str(j) for j in range(n)]
    labels = [str(x) for x in labels]
    if len(labels) != n or len(set(labels)) != n:
        raise ValueError(f"{name} must be {n} distinct names, got {labels}")
    return labels


def _slider(name, label, low, high, step, value=None):
    alt = _alt()
    return alt.param(name=name, value=low if value is None else value,
                     bind=alt.binding_range(min=low, max=high, step=step, name=label))


def _radio(name, label, options, labels=None, value=None):
    alt = _alt()
    extra = {"labels": [str(x) for x in labels]} if labels is not None else {}
    binding = alt.binding_radio(options=list(options), name=label, **extra)
    return alt.param(name=name, value=options[0] if value is None else value, bind=binding)


def _num(x):
    """A component as a sum shows it: 2 decimals at most, a negative one in brackets."""
    text = f"{_r(x, 2):g}".replace("-", "−")
    return f"({text})" if x < 0 else text


def _text_width(texts, font_size=11):
    """Pixels a panel of text needs for its longest line: half the font size per character (a written-out sum in
    Vega's default sans-serif measures about 0.45 of it per character in Chromium), plus 10 px."""
    return math.ceil(max(len(t) for t in texts) * 0.5 * font_size) + 10


def _line(rows, where, width):
    """A line of text, flush left, showing the row that ``where`` keeps: a figure's running commentary."""
    alt = _alt()
    return (alt.Chart(_data(rows)).transform_filter(where).mark_text(align="left", baseline="middle", fontSize=12)
            .encode(x=alt.value(0), y=alt.value(10), text="text:N").properties(width=width, height=20))


def _at(param_name, field):
    """A filter keeping the rows computed for the control's current position (grid values compared rounded)."""
    return f"abs(datum.{field} - {param_name}) < 1e-6"


# ----------------------------------------------------------------------------------------------------------------
# chapter 3: a row of scores multiplied by c, its weights and its softmax Jacobian


def temperature_jacobian(scores, multipliers=range(1, 21), labels=None):
    """Chapter 3: the weights softmax(c·s) of one row of scores s and the Jacobian diag(p) - p pᵀ, for each c.

    A slider sets the multiplier c (unscaled scores grow like sqrt(d_k); a temperature tau is c = 1/tau). As c grows
    the weights saturate on the largest score and every entry of the Jacobian, what the gradient passes through,
    goes to zero. ``scores``: 2 to 8 numbers; ``multipliers``: the slider's evenly spaced values.
    """
    from lib.attention import softmax

    alt = _alt()
    s = _array(scores, "scores", 1, min_size=2, max_size=8)
    cs = [_r(c) for c in _array(list(multipliers), "multipliers", 1, min_size=2)]
    steps = np.diff(cs)
    if not (steps > 0).all() or not np.allclose(steps, steps[0]):
        raise ValueError("multipliers must be evenly spaced and increasing (a slider's positions)")
    names = _labels(labels, len(s))
    weights, jac, summary = [], [], []
    for c in cs:
        p = softmax(c * s)
        J = np.diag(p) - np.outer(p, p)
        weights += [{"c": c, "key": names[j], "w": _r(p[j])} for j in range(len(s))]
        jac += [{"c": c, "i": names[i], "j": names[j], "J": _r(J[i, j])}
                for i in range(len(s)) for j in range(len(s))]
        summary.append({"c": c, "text": f"c = {c:g}: largest weight {p.max():.3f}, "
                        f"Jacobian norm {np.linalg.norm(J):.3g}"})
    c = _slider("c", "scores multiplied by c ", cs[0], cs[-1], _r(steps[0]), cs[0])
    bars = (
        alt.Chart(_data(weights), title="weights softmax(c·s)")
        .mark_bar(color=ORANGE)
        .encode(x=alt.X("key:N", sort=names, title="key"),
                y=alt.Y("w:Q", scale=alt.Scale(domain=[0, 1]), title="weight"),
                tooltip=["key:N", alt.Tooltip("w:Q", format=".4f")])
        .transform_filter(_at("c", "c"))
        .properties(width=220, height=220)
    )
    base = alt.Chart(_data(jac), title="Jacobian ∂pᵢ/∂sⱼ").transform_filter(_at("c", "c"))
    cells = base.mark_rect().encode(
        x=alt.X("j:N", sort=names, title="score j"), y=alt.Y("i:N", sort=names, title="weight i"),
        color=alt.Color("J:Q", scale=alt.Scale(scheme="cividis", domain=[-0.25, 0.25]), title="∂pᵢ/∂sⱼ"),
        tooltip=["i:N", "j:N", alt.Tooltip("J:Q", format="+.4f")])
    text = base.mark_text(fontSize=10).encode(
        x=alt.X("j:N", sort=names), y=alt.Y("i:N", sort=names), text=alt.Text("J:Q", format="+.3f"),
        color=alt.condition("datum.J > 0.05", alt.value("black"), alt.value("white")))
    jacobian = (cells + text).properties(width=220, height=220)
    line = _line(summary, _at("c", "c"), 460)
    chart = alt.vconcat(alt.hconcat(bars, jacobian).resolve_scale(color="independent"), line).add_params(c)
    return Interactive(chart, "temperature", "a slider: the multiplier c of the scores")


# ----------------------------------------------------------------------------------------------------------------
# chapter 4: the query's angle in the plane of chapter 4's keys


def query_angle(keys, values, labels=None, *, length=1.0, angles=range(0, 360, 15)):
    """Chapter 4: a query of the given length turned to each angle; its scores q·k/sqrt(2), weights and output.

    ``keys`` and ``values``: (n, 2) arrays (chapter 4's tokens); ``length``: the query's norm; ``angles``: the
    slider's evenly spaced positions in degrees. Each position runs :func:`lib.attention.attention` on that query.
    """
    from lib.attention import attention

    alt = _alt()
    K = _array(keys, "keys", 2, max_size=6)
    V = _array(values, "values", 2, max_size=6)
    if K.shape[1] != 2 or V.shape != K.shape:
        raise ValueError(f"keys and values must both be (n, 2) arrays, got {K.shape} and {V.shape}")
    if not (isinstance(length, numbers.Real) and length > 0):
        raise ValueError(f"length must be a positive number, got {length!r}")
    degrees = [_int(a, "angles", -360, 360) for a in angles]
    names = _labels(labels, len(K))
    step = np.diff(degrees)
    if len(degrees) < 2 or not (step > 0).all() or len(set(step)) != 1:
        raise ValueError("angles must be evenly spaced and increasing (a slider's positions)")
    arrows, bars, outputs = [], [], []
    for a in degrees:
        q = length * np.array([math.cos(math.radians(a)), math.sin(math.radians(a))])
        out, w = attention(q[None, :], K, V, return_weights=True)
        scores = K @ q / math.sqrt(2)
        arrows.append({"a": a, "x0": 0.0, "y0": 0.0, "x": _r(q[0]), "y": _r(q[1])})
        bars += [{"a": a, "key": names[j], "what": what, "v": _r(val)}
                 for j in range(len(K)) for what, val in (("score", scores[j]), ("weight", w[0, j]))]
        outputs.append({"a": a, "x": _r(out[0, 0]), "y": _r(out[0, 1]), "label": "output"})
    theta = _slider("angle", "query angle (degrees) ", degrees[0], degrees[-1], int(step[0]))
    reach = max(float(np.abs(K).max()), float(length)) * 1.15
    plane = alt.Scale(domain=[-reach, reach])
    key_points = [{"x": _r(k[0]), "y": _r(k[1]), "label": f"k {n}"} for k, n in zip(K, names)]
    keys_layer = alt.Chart(_data(key_points)).mark_point(filled=True, size=70, color=BLUE).encode(
        x=alt.X("x:Q", scale=plane, title="dimension 1"), y=alt.Y("y:Q", scale=plane, title="dimension 2"))
    key_text = keys_layer.mark_text(dx=12, dy=-8, color=BLUE).encode(text="label:N")
    query = alt.Chart(_data(arrows)).transform_filter(_at("angle", "a"))
    query_line = query.mark_rule(color=ORANGE, strokeWidth=3).encode(
        x="x0:Q", y="y0:Q", x2="x:Q", y2="y:Q")
    query_tip = query.mark_point(filled=True, size=90, shape="triangle", color=ORANGE).encode(x="x:Q", y="y:Q")
    plane_chart = (keys_layer + key_text + query_line + query_tip).properties(
        width=200, height=200, title="query (orange) and keys")
    bar_chart = (
        alt.Chart(_data(bars), title="scores and weights")
        .transform_filter(_at("angle", "a"))
        .mark_bar()
        .encode(x=alt.X("key:N", sort=names, title=None), xOffset="what:N",
                y=alt.Y("v:Q", title="score or weight", scale=alt.Scale(domain=[-reach, reach])),
                color=alt.Color("what:N", scale=alt.Scale(domain=["score", "weight"], range=[BLUE, ORANGE]),
                                legend=alt.Legend(orient="bottom", title=None)),
                tooltip=["key:N", "what:N", alt.Tooltip("v:Q", format=".3f")])
        .properties(width=150, height=200)
    )
    low, high = float(V.min()), float(V.max())
    pad = 0.15 * (high - low or 1.0)
    vscale = alt.Scale(domain=[low - pad, high + pad])
    value_points = [{"x": _r(v[0]), "y": _r(v[1]), "label": f"v {n}"} for v, n in zip(V, names)]
    values_layer = alt.Chart(_data(value_points)).mark_square(size=70, color=GREEN).encode(
        x=alt.X("x:Q", scale=vscale, title="value dimension 1"), y=alt.Y("y:Q", scale=vscale, title="dimension 2"))
    value_text = values_layer.mark_text(dx=12, dy=-8, color=GREEN).encode(text="label:N")
    out_layer = (alt.Chart(_data(outputs)).transform_filter(_at("angle", "a"))
                 .mark_circle(size=110, color=ORANGE).encode(x="x:Q", y="y:Q",
                                                            tooltip=[alt.Tooltip("x:Q", format=".3f"),
                                                                     alt.Tooltip("y:Q", format=".3f")]))
    value_chart = (values_layer + value_text + out_layer).properties(
        width=200, height=200, title="values and the output")
    chart = alt.hconcat(plane_chart, bar_chart, value_chart).add_params(theta)
    return Interactive(chart, "query-angle", "a slider: the query's angle")


# ----------------------------------------------------------------------------------------------------------------
# chapters 2 and 4: each score written out as a dot product


def score_products(Q, K, labels=None, *, scale=None):
    """Chapters 2 and 4: the score matrix S = Q Kᵀ · scale, and each score of the chosen row written out.

    A slider picks the query row i: the row is outlined, and beside the matrix each score of that row reads
    q_i · k_j = (sum of the products of components) · scale = S_ij. Hovering on any cell shows the same. ``Q`` and
    ``K``: (n, d) arrays with n <= 8 and d <= 4 (the sums must fit a line); ``scale`` defaults to 1/sqrt(d).
    """
    from lib.attention import attention_weights, softmax

    alt = _alt()
    Qa = _array(Q, "Q", 2, max_size=8)
    Ka = _array(K, "K", 2, max_size=8)
    if Qa.shape[1] != Ka.shape[1] or Qa.shape[1] > 4:
        raise ValueError(f"Q and K must have the same number of columns, at most 4; got {Qa.shape} and {Ka.shape}")
    n, d = Qa.shape
    scale = 1 / math.sqrt(d) if scale is None else float(scale)
    if labels is not None and len(labels) == n and len(set(map(str, labels))) < n:  # "the" twice: add positions
        labels = [f"{t} {word}" for t, word in enumerate(labels)]
    rows = _labels(labels, n)
    cols = rows if len(Ka) == n else _labels(None, len(Ka))
    weights = attention_weights(Qa, Ka, scale=scale)  # the same scores, through the library's softmax
    S = (Qa @ Ka.T) * scale
    if not np.allclose(softmax(S), weights, atol=1e-9):
        raise AssertionError("the written-out scores disagree with lib.attention")  # pragma: no cover
    cells = []
    for i in range(n):
        for j in range(len(Ka)):
            products = "(" + " + ".join(f"{_num(Qa[i, c])}·{_num(Ka[j, c])}" for c in range(d)) + ")"
            tail = (f"× {_r(scale, 3):g} " if scale != 1 else "") + f"= {S[i, j]:.3f}"
            products, tail = products.replace("-", "−"), tail.replace("-", "−")
            cells.append({"i": i, "q": rows[i], "k": cols[j], "S": _r(S[i, j]),
                          "sum": f"q {rows[i]} · k {cols[j]} = {products} {tail}",
                          "short": f"k {cols[j]}: {products}\n{tail}"})
    row = _slider("row", "query row i ", 0, n - 1, 1, 0)
    base = alt.Chart(_data(cells))
    heat = base.mark_rect().encode(
        x=alt.X("k:N", sort=cols, title="key j"), y=alt.Y("q:N", sort=rows, title="query i"),
        color=alt.Color("S:Q", scale=alt.Scale(scheme="viridis"), legend=None),
        tooltip=[alt.Tooltip("sum:N", title="score")])
    outline = base.mark_rect(fill=None, stroke=RED, strokeWidth=3).encode(
        x=alt.X("k:N", sort=cols), y=alt.Y("q:N", sort=rows)).transform_filter("datum.i == row")
    values = base.mark_text(fontSize=11).encode(
        x=alt.X("k:N", sort=cols), y=alt.Y("q:N", sort=rows), text=alt.Text("S:Q", format=".2f"),
        color=alt.condition(f"datum.S > {_r((S.min() + S.max()) / 2)}", alt.value("black"), alt.value("white")))
    matrix = (heat + values + outline).properties(width=32 * len(Ka) + 40, height=32 * n + 40,
                                                  title="scores S = Q Kᵀ · scale")
    # each score on two lines, its products and then its scale and value, so that the panel stays narrow enough
    # for a phone's column; every row's sums are also drawn unseen, so that the figure is laid out for the longest
    # of them whichever row the slider shows
    text = {"align": "left", "fontSize": 11, "lineBreak": "\n"}
    sums_text = base.mark_text(**text).encode(
        x=alt.value(0), y=alt.Y("k:N", sort=cols, title=None, axis=None), text="short:N")
    lines = [line for c in cells for line in c["short"].split("\n")]
    sums = (alt.layer(sums_text.mark_text(**text, opacity=0, aria=False),
                      sums_text.transform_filter("datum.i == row"))
            .properties(width=max(80 * d + 70, _text_width(lines)), height=36 * len(Ka),
                        title="q_i · k_j, the chosen row written out"))
    chart = alt.hconcat(matrix, sums).add_params(row)
    return Interactive(chart, "score-products", "a slider: the query row i")


# ----------------------------------------------------------------------------------------------------------------
# chapter 5: L queries against S keys, aligned top-left or bottom-right


def mask_alignment(max_L=6, max_S=6, *, d=4, seed=0):
    """Chapter 5: the causal mask of L queries against S keys in either alignment, and the weights it leaves.

    Sliders set L and S (1 to max_L, 1 to max_S), radio buttons the alignment. For every combination the mask is
    :func:`lib.attention.causal_mask` and the weights :func:`lib.attention.attention_weights` of random queries
    and keys (``d`` components, ``seed``). Bottom-right with L > S leaves the first L - S queries no key at all:
    their row is masked everywhere and the library returns zeros there, so the row sums read 0 instead of 1.
    """
    from lib.attention import attention_weights, causal_mask

    alt = _alt()
    max_L, max_S = _int(max_L, "max_L", 1, 8), _int(max_S, "max_S", 1, 8)
    d, seed = _int(d, "d", 1), _int(seed, "seed", 0)
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((max_L, d)), rng.standard_normal((max_S, d))
    cells, sums = [], []
    for L, S, align in itertools.product(range(1, max_L + 1), range(1, max_S + 1), ("top-left", "bottom-right")):
        with warnings.catch_warnings():  # bottom-right with L > S warns that rows are empty: that is the lesson
            warnings.simplefilter("ignore")
            mask = causal_mask(L, S, align=align)
        w = attention_weights(q[:L], k[:S], mask)
        cells += [{"L": L, "S": S, "al": align, "i": i, "j": j, "ok": bool(mask[i, j]), "w": _r(w[i, j], 3),
                   "ink": "black" if w[i, j] > 0.5 else ("white" if mask[i, j] else "#555555")}
                  for i in range(L) for j in range(S)]
        sums += [{"L": L, "S": S, "al": align, "i": i, "sum": _r(w[i].sum(), 3)} for i in range(L)]
    pL = _slider("L", "queries L ", 1, max_L, 1, min(3, max_L))
    pS = _slider("S", "keys S ", 1, max_S, 1, max_S)
    pA = _radio("align", "alignment ", ["top-left", "bottom-right"])
    current = "datum.L == L && datum.S == S && datum.al == align"
    axis_i = alt.Y("i:O", title="query i", scale=alt.Scale(domain=list(range(max_L))))
    base = alt.Chart(_data(cells)).transform_filter(current)
    heat = base.mark_rect(stroke="white").encode(
        x=alt.X("j:O", title="key j", scale=alt.Scale(domain=list(range(max_S)))), y=axis_i,
        color=alt.condition("datum.ok", alt.Color("w:Q", scale=alt.Scale(scheme="viridis", domain=[0, 1]),
                                                  title="weight"), alt.value(GREY)),
        tooltip=["i:O", "j:O", "ok:N", alt.Tooltip("w:Q", format=".3f")])
    text = base.mark_text(fontSize=10).encode(
        x=alt.X("j:O", scale=alt.Scale(domain=list(range(max_S)))), y=axis_i,
        text=alt.condition("datum.ok", alt.Text("w:Q", format=".2f"), alt.value("×")),
        color=alt.Color("ink:N", legend=None, scale=alt.Scale(domain=INKS, range=INKS)))
    grid = (heat + text).properties(width=36 * max_S, height=36 * max_L, title="weights (grey ×: masked)")
    row_sums = (alt.Chart(_data(sums)).transform_filter(current).mark_text(fontSize=12)
                .encode(y=axis_i, text=alt.Text("sum:Q", format=".0f"),
                        color=alt.condition("datum.sum < 0.5", alt.value(RED), alt.value("black")))
                .properties(width=40, height=36 * max_L, title="row sum"))
    chart = alt.hconcat(grid, row_sums).add_params(pL, pS, pA)
    return Interactive(chart, "mask-alignment", "sliders L and S, radio buttons for the alignment")


# ----------------------------------------------------------------------------------------------------------------
# chapter 7: the online softmax, block by block


def online_softmax(scores, values, block):
    """Chapter 7: one query's running maximum m, total l and output after each block of its keys.

    ``scores``: the query's n scores; ``values``: (n, d_v) value rows, d_v <= 4; ``block``: keys per block. After block t the
    state is :func:`lib.merge.attention_state` over the first t blocks' keys (its logsumexp gives l = exp(lse - m)),
    which is what the online softmax holds; after the last block the output equals :func:`lib.attention.attention`.
    A step slider moves through the blocks.
    """
    from lib.attention import attention
    from lib.merge import attention_state

    alt = _alt()
    s = _array(scores, "scores", 1, min_size=2, max_size=32)
    V = _array(values, "values", 2, min_size=len(s), max_size=len(s))
    if not 1 <= V.shape[1] <= 4:
        raise ValueError(f"values must be an (n, d_v) array with d_v <= 4, got {V.shape}")
    block = _int(block, "block", 1, len(s))
    q, k = np.ones((1, 1)), s[:, None]  # q·k_j = s_j: the scores themselves, with scale 1
    n_blocks = -(-len(s) // block)
    final = attention(q, k, V, scale=1.0)[0]
    bars, states, outs = [], [], []
    for t in range(1, n_blocks + 1):
        seen = min(t * block, len(s))
        out, lse = attention_state(q, k[:seen], V[:seen], scale=1.0)
        m = float(s[:seen].max())
        ell = math.exp(float(lse[0]) - m)
        bars += [{"t": t, "j": j, "s": _r(s[j]),
                  "state": "this block" if seen - block <= j < seen and j >= (t - 1) * block else
                  ("seen" if j < seen else "not yet")} for j in range(len(s))]
        states.append({"t": t, "m": _r(m), "text": f"after block {t}: m = {m:.3f}, ℓ = {ell:.4f}, "
                       f"output = ({', '.join(f'{x:.3f}' for x in out[0])})".replace("-", "−")})
        outs += [{"t": t, "c": f"out {c}", "o": _r(out[0, c]), "final": _r(final[c])} for c in range(V.shape[1])]
    step = _slider("t", "after block ", 1, n_blocks, 1, 1)
    colour = alt.Color("state:N", scale=alt.Scale(domain=["seen", "this block", "not yet"],
                                                  range=[BLUE, ORANGE, GREY]),
                       legend=alt.Legend(orient="top", title=None))
    score_bars = (alt.Chart(_data(bars)).transform_filter("datum.t == t").mark_bar()
                  .encode(x=alt.X("j:O", title="key j"), y=alt.Y("s:Q", title="score"), color=colour,
                          tooltip=["j:O", alt.Tooltip("s:Q", format=".3f"), "state:N"]))
    state_data = alt.Chart(_data(states)).transform_filter("datum.t == t")
    max_rule = state_data.mark_rule(color=RED, strokeDash=[4, 3]).encode(y="m:Q")
    left = (score_bars + max_rule).properties(width=min(18 * len(s), 320), height=200,
                                              title="scores (dashed line: running max m)")
    out_scale = alt.Scale(domain=[float(min(V.min(), 0)), float(max(V.max(), 0))])
    out_bars = (alt.Chart(_data(outs)).transform_filter("datum.t == t")
                .mark_bar(color=GREEN).encode(x=alt.X("c:N", title=None), y=alt.Y("o:Q", scale=out_scale,
                                                                                 title="output")))
    final_ticks = (alt.Chart(_data(outs)).transform_filter("datum.t == t")
                   .mark_tick(color="black", thickness=2, size=30).encode(x="c:N", y="final:Q"))
    right = (out_bars + final_ticks).properties(width=50 * V.shape[1] + 20, height=200, title="output (tick: exact)")
    caption = _line(states, "datum.t == t", 460)
    chart = alt.vconcat(alt.hconcat(left, right), caption).add_params(step)
    return Interactive(chart, "online-softmax", "a slider: the number of key blocks seen")


# ----------------------------------------------------------------------------------------------------------------
# chapter 8: the query tile's size, the bytes it moves and its point on the roofline


def tile_roofline(n=4096, d=64, *, tiles=(16, 32, 64, 128, 256), gpu="H100", bytes_per_number=2):
    """Chapter 8: one head of a fused kernel that fetches K and V from HBM again for every block of queries.

    Radio buttons pick the query tile B_r. Numbers moved, as chapter 8 counts them: Q read and O written once, K and
    V read once per query block, the n logsumexps written, 2nd + 2nd·ceil(n / B_r) + n; the unfused path's
    :func:`lib.cost.attention_bytes` with ``scores=True`` and the ideal count (K and V read once, from a cache) are
    drawn for comparison. FLOPs: :func:`lib.cost.attention_flops`. Each point sits at its intensity under
    :func:`lib.cost.attainable_flops` with ``gpu``'s datasheet rates: a prediction, not a measurement.
    """
    from lib import cost

    alt = _alt()
    device = cost.gpu(gpu)
    n, d = _int(n, "n", 1), _int(d, "d", 1)
    tiles = [_int(t, "tiles", 1, n) for t in tiles]
    if len(tiles) < 2 or sorted(set(tiles)) != tiles:
        raise ValueError(f"tiles must be at least two increasing sizes, got {tiles}")
    elt = _int(bytes_per_number, "bytes_per_number", 1)
    flops = cost.attention_flops(n, E=d)

    def point(label, nbytes, **extra):
        i = cost.intensity(flops, nbytes)
        return {"what": label, "I": _r(i, 2), "tflops": _r(cost.attainable_flops(i, device) / 1e12, 2),
                "MB": _r(nbytes / 1e6, 2), **extra}

    points = []
    for t in tiles:
        nbytes = (2 * n * d + 2 * n * d * math.ceil(n / t) + n) * elt
        p = point("tiled", nbytes, tile=t)
        p["text"] = (f"query tile {t}: K and V read {math.ceil(n / t)} times, {p['MB']:.1f} MB, "
                     f"{p['I']:.0f} FLOP/byte, at most {p['tflops']:.0f} TFLOP/s")
        points.append(p)
    fixed = [point("unfused (scores in HBM)", cost.attention_bytes(n, E=d, bytes_per_number=elt, scores=True)),
             point("K and V read once", (4 * n * d + n) * elt)]
    lo = 10 ** math.floor(math.log10(min(fixed[0]["I"], points[0]["I"]) / 1.5))
    hi = 10 ** math.ceil(math.log10(max(fixed[1]["I"], device.ridge) * 1.5))
    roof = [{"I": _r(x, 3), "tflops": _r(cost.attainable_flops(x, device) / 1e12, 3)}
            for x in sorted({lo, device.ridge, hi, *np.geomspace(lo, hi, 25)})]
    tile = _radio("tile", "query tile B_r ", tiles, [str(t) for t in tiles], tiles[len(tiles) // 2])
    xs = alt.X("I:Q", scale=alt.Scale(type="log", domain=[lo, hi]), title="arithmetic intensity (FLOP per byte)")
    ys = alt.Y("tflops:Q", scale=alt.Scale(type="log"), title="attainable TFLOP/s (datasheet)")
    line = alt.Chart(_data(roof)).mark_line(color="black").encode(x=xs, y=ys)
    marks = alt.Chart(_data(fixed)).mark_point(size=90, filled=False, strokeWidth=2).encode(
        x="I:Q", y="tflops:Q",
        # one legend for both encodings: the same field, domain and legend on each
        shape=alt.Shape("what:N", scale=alt.Scale(domain=[f["what"] for f in fixed], range=["diamond", "square"]),
                        legend=alt.Legend(orient="bottom", title=None)),
        color=alt.Color("what:N", scale=alt.Scale(domain=[f["what"] for f in fixed], range=[RED, GREEN]),
                        legend=alt.Legend(orient="bottom", title=None)),
        tooltip=["what:N", alt.Tooltip("MB:Q", format=".1f"), alt.Tooltip("I:Q", format=".0f")])
    base = alt.Chart(_data(points)).transform_filter("datum.tile == tile")
    moving = base.mark_circle(size=140, color=BLUE).encode(
        x="I:Q", y="tflops:Q", tooltip=["tile:Q", alt.Tooltip("MB:Q", format=".1f"), alt.Tooltip("I:Q", format=".0f")])
    plot = (line + marks + moving).properties(width=520, height=280,
                                             title=f"{device.name}, one head, n = {n}, d = {d} (blue: the tiles)")
    chart = alt.vconcat(plot, _line(points, "datum.tile == tile", 520)).add_params(tile)
    return Interactive(chart, "tile-roofline", "radio buttons: the query tile")


# ----------------------------------------------------------------------------------------------------------------
# chapter 11: ablating heads


def head_ablation(model, tokens, *, example=0, scored=None, length=16):
    """Chapter 11: a checkbox per head of a :class:`lib.model.TinyLM`; maps and accuracy without them.

    For every subset of the model's heads (at most 6 heads in all, so at most 64 subsets) the heads are mean-ablated
    through each attention module's ``ablated`` set (the model's ``fit_head_means`` must have stored the means
    first: a ValueError otherwise), and the figure stores each head's attention map over the first ``length``
    tokens of sequence ``example`` and the next-token accuracy over ``tokens`` (a (B, L) integer tensor;
    ``scored``: an optional (B, L - 1) boolean tensor of the predictions that count). Ablating a layer-1 head
    changes what the layer-2 heads can attend to, so their maps move too.
    """
    import torch

    alt = _alt()
    blocks = getattr(model, "blocks", None)
    if blocks is None or not all(hasattr(b, "attention") and hasattr(b.attention, "ablated") for b in blocks):
        raise TypeError("model must be a lib.model.TinyLM (blocks whose attention has an `ablated` set)")
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2 or tokens.is_floating_point():
        raise TypeError("tokens must be an integer tensor of shape (B, L)")
    if any(b.attention.head_means is None for b in blocks):
        raise ValueError("model: mean ablation needs each head's mean output over reference inputs; call "
                         "model.fit_head_means(reference tokens) first")
    B, L = tokens.shape
    example = _int(example, "example", 0, B - 1)
    length = _int(length, "length", 2, L)
    if scored is not None and (not isinstance(scored, torch.Tensor) or scored.shape != (B, L - 1)):
        raise ValueError(f"scored must be a boolean tensor of shape ({B}, {L - 1})")
    heads = [(layer, h) for layer, b in enumerate(blocks) for h in range(b.attention.n_heads)]
    if len(heads) > 6:
        raise ValueError(f"the model has {len(heads)} heads; a checkbox each allows at most 6")
    names = [f"L{layer + 1}h{h}" for layer, h in heads]
    params = [alt.param(name=f"off_{i}", value=False, bind=alt.binding_checkbox(name=f"ablate {name} "))
              for i, name in enumerate(names)]
    maps, accuracy = [], []
    saved = [set(b.attention.ablated) for b in blocks]
    try:
        for bits in itertools.product((0, 1), repeat=len(heads)):
            key = "".join(map(str, bits))
            for layer, b in enumerate(blocks):
                b.attention.ablated = {h for (la, h), bit in zip(heads, bits) if bit and la == layer}
            with torch.no_grad():
                logits, weights = model(tokens, return_weights=True)
            right = logits[:, :-1].argmax(-1) == tokens[:, 1:]
            acc = (right[scored] if scored is not None else right).float().mean().item()
            off = [n for n, bit in zip(names, bits) if bit]
            accuracy.append({"key": key, "text": f"next-token accuracy {acc:.2f} "
                             f"({'ablated: ' + ', '.join(off) if off else 'every head intact'})"})
            for (layer, h), name in zip(heads, names):
                w = weights[layer][example, h, :length, :length]  # mean ablation averages over all of tokens
                maps += [{"key": key, "head": name, "i": i, "w": [_r(w[i, j], 2) for j in range(i + 1)]}
                         for i in range(length)]  # one row per query: the figure unfolds it (Vega's flatten)
    finally:
        for b, s in zip(blocks, saved):
            b.attention.ablated = s
    key_expr = " + ".join(f"(off_{i} ? '1' : '0')" for i in range(len(heads)))
    current = f"datum.key == {key_expr}"
    cell = max(4, 120 // length)
    data = _data(maps)

    def panel(name, first):
        return (alt.Chart(data, title=name).transform_filter(f"{current} && datum.head == '{name}'")
                .transform_flatten(["w"]).transform_window(j="row_number()", groupby=["i"])
                .transform_calculate(j="datum.j - 1").mark_rect()
                .encode(x=alt.X("j:O", title="key", axis=alt.Axis(labels=False, ticks=False)),
                        y=alt.Y("i:O", title="query" if first else None, axis=alt.Axis(labels=False, ticks=False)),
                        color=alt.Color("w:Q", scale=alt.Scale(scheme="viridis", domain=[0, 1]), title="weight"),
                        tooltip=["head:N", "i:O", "j:O", alt.Tooltip("w:Q", format=".2f")])
                .properties(width=cell * length, height=cell * length))

    heat = alt.hconcat(*[panel(name, k == 0) for k, name in enumerate(names)])
    text = _line(accuracy, current, 500)
    chart = alt.vconcat(heat, text).add_params(*params)
    return Interactive(chart, "head-ablation", "a checkbox per head: ablate it")


# ----------------------------------------------------------------------------------------------------------------
# chapter 12: the ring's schedule, step by step


def ring_steps(N=1024, world_size=4, *, tile=64, layouts=("contiguous", "zigzag")):
    """Chapter 12: at ring step s, rank r holds the key block of rank (r - s) mod P and computes its causal tiles.

    A step slider and radio buttons for the layout. Each cell (rank, key block) is filled once the step that brings
    that block has run, and shows the tiles :func:`lib.ring.causal_tile_counts` counts for it; the text gives each
    step's busiest rank, which sets the step's time.
    """
    from lib.ring import causal_tile_counts

    alt = _alt()
    P = _int(world_size, "world_size", 2, 8)
    cells, totals = [], []
    for layout in layouts:
        counts = causal_tile_counts(N, P, layout, tile=tile)
        for step in range(P):
            for rank in range(P):
                owner = (rank - step) % P
                cells.append({"layout": layout, "step": step, "rank": f"rank {rank}", "block": f"K, V of {owner}",
                              "tiles": counts[step][rank]})
            busiest = max(counts[step])
            totals.append({"layout": layout, "step": step,
                           "text": f"step {step}: busiest rank computes {busiest} tiles, "
                                   f"least busy {min(counts[step])}"})
    most = max(c["tiles"] for c in cells)
    step = _slider("step", "ring step ", 0, P - 1, 1, 0)
    layout = _radio("layout", "layout ", list(layouts))
    ranks = [f"rank {r}" for r in range(P)]
    blocks = [f"K, V of {r}" for r in range(P)]
    base = alt.Chart(_data(cells)).transform_filter("datum.layout == layout")
    done = base.mark_rect(stroke="white", strokeWidth=2).encode(
        x=alt.X("block:N", sort=blocks, title="key block held"), y=alt.Y("rank:N", sort=ranks, title=None),
        color=alt.condition("datum.step <= step",
                            alt.Color("tiles:Q", scale=alt.Scale(scheme="viridis", domain=[0, most]), title="tiles"),
                            alt.value(GREY)),
        tooltip=["rank:N", "block:N", "step:O", "tiles:Q"])
    now = base.transform_filter("datum.step == step").mark_rect(fill=None, stroke=RED, strokeWidth=3).encode(
        x=alt.X("block:N", sort=blocks), y=alt.Y("rank:N", sort=ranks))
    text = base.transform_filter("datum.step <= step").mark_text(fontSize=11, color="white").encode(
        x=alt.X("block:N", sort=blocks), y=alt.Y("rank:N", sort=ranks), text="tiles:Q")
    grid = (done + now + text).properties(width=70 * P, height=36 * P,
                                          title="tiles each rank computes (outlined: this step)")
    line = _line(totals, "datum.layout == layout && datum.step == step", 70 * P)
    chart = alt.vconcat(grid, line).add_params(step, layout)
    return Interactive(chart, "ring-steps", "a slider: the ring step; radio buttons: the layout")


# ----------------------------------------------------------------------------------------------------------------
# chapter 13: a sliding window


def sliding_window(n=12, *, d=4, seed=0, windows=None):
    """Chapter 13: causal attention limited to the last w keys (j in (i - w, i]), for each window w.

    A slider sets w from 1 to n (``windows``: its evenly spaced positions). The band is the causal mask of
    :func:`lib.attention.causal_mask` without the keys w or more positions back; the weights are
    :func:`lib.attention.attention_weights` of random queries and keys under it. At w = n the band is the whole
    causal triangle; the text counts the pairs attended, n·w - w(w - 1)/2.
    """
    from lib.attention import attention_weights, causal_mask

    alt = _alt()
    n, d, seed = _int(n, "n", 2, 24), _int(d, "d", 1), _int(seed, "seed", 0)
    windows = list(range(1, n + 1)) if windows is None else [_int(w, "windows", 1, n) for w in windows]
    if len(windows) < 2 or len(set(np.diff(windows))) != 1 or windows[1] <= windows[0]:
        raise ValueError("windows must be evenly spaced and increasing (a slider's positions)")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    q, k = x, x @ rng.standard_normal((d, d))
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    cells, counts = [], []
    for w in windows:
        band = causal_mask(n) & (i - j < w)
        weights = attention_weights(q, k, band)
        cells += [{"w": w, "i": a, "j": b, "ok": bool(band[a, b]), "a": _r(weights[a, b], 3)}
                  for a in range(n) for b in range(n)]
        counts.append({"w": w, "text": f"window {w}: {int(band.sum())} of {n * (n + 1) // 2} causal pairs"})
    window = _slider("window", "window w ", windows[0], windows[-1], windows[1] - windows[0], windows[len(windows) // 3])
    cell = max(12, 300 // n)
    base = alt.Chart(_data(cells)).transform_filter("datum.w == window")
    heat = base.mark_rect().encode(
        x=alt.X("j:O", title="key j"), y=alt.Y("i:O", title="query i"),
        color=alt.condition("datum.ok", alt.Color("a:Q", scale=alt.Scale(scheme="viridis", domain=[0, 1]),
                                                  title="weight"), alt.value(GREY)),
        tooltip=["i:O", "j:O", "ok:N", alt.Tooltip("a:Q", format=".3f")])
    text = _line(counts, "datum.w == window", cell * n)
    chart = alt.vconcat(heat.properties(width=cell * n, height=cell * n, title="weights in the band (grey: masked)"),
                        text).add_params(window)
    return Interactive(chart, "sliding-window", "a slider: the window w")
