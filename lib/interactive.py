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
    query_angle            ch. 4   sliders turn the query in the plane and lengthen it: scores, weights, output
    score_products         ch. 2/4 a slider picks a query row: each scaled score written out, adding up as written
    mask_alignment         ch. 5   L, S and the causal alignment: which keys each query sees; an empty row gives 0
    online_softmax         ch. 7   a step slider from no block read: the running max, ℓ (its terms) and output
    tile_roofline          ch. 8   radio buttons pick the query tile: HBM bytes and the point on the roofline
    head_ablation          ch. 11  a checkbox per head: the attention maps and accuracy with those heads ablated
    ring_steps             ch. 12  a step slider: each key block moves one rank on round the ring
    sliding_window         ch. 13  window and layer sliders: the band, its weights and the reach through the layers

Every tooltip names its numbers in words; the controls come before the picture; the spec carries the colours of
the book's dark mode (``usermeta.dark``), which tools/interactive_figures.py applies there.
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
GREY = "#D9D9D9"  # a masked cell, a bar not yet reached
FOREGROUND = "#222222"  # text and lines drawn on the figure's face, not on a coloured cell
MASKED_INK = "#555555"  # text on a masked (grey) cell
INKS = ["black", "white", MASKED_INK]  # text on a light cell, on a dark cell, on a masked cell
# The same figure on a dark page (the book's dark mode): tools/interactive_figures.py swaps these colours in the spec
# and adds this configuration before Vega draws it. A colour drawn on a coloured cell (INKS' black and white, the
# palette) keeps its contrast there and is not swapped.
LIGHT_TEXT = "#E3E3E3"
DARK = {
    "colours": {FOREGROUND: LIGHT_TEXT, GREY: "#4A5059", MASKED_INK: "#C8C8C8"},
    "config": {
        "background": "transparent",
        "axis": {"labelColor": LIGHT_TEXT, "titleColor": LIGHT_TEXT, "domainColor": "#A0A0A0",
                 "tickColor": "#A0A0A0", "gridColor": "#4A5059"},
        "legend": {"labelColor": LIGHT_TEXT, "titleColor": LIGHT_TEXT},
        "title": {"color": LIGHT_TEXT, "subtitleColor": LIGHT_TEXT},
        "text": {"color": LIGHT_TEXT},
    },
}
EMBED_OPTIONS = {"actions": False, "renderer": "svg"}
DIGITS = 4  # every number a figure holds is rounded to this many decimals, so its text is the same on every run
MARKER = "sdpa-interactive"  # the class of the snippet's wrapper: tools/interactive_figures.py looks for it
# Altair's snippet lays the chart and its controls out in a row (display: flex), which squeezes a wide chart and
# puts the controls beside it. Here the controls come first, at the text's size, one per line, and the picture
# under them: a reader who moves a control sees what it moves, on a phone too (where the book also keeps them in
# view while the picture scrolls: _static/custom.css).
STYLE = (
    f".{MARKER} .vega-embed {{flex-direction: column; align-items: flex-start; max-width: 100%; overflow-x: auto}}"
    f" .{MARKER} .vega-bindings {{order: -1; font-size: 0.9rem; margin: 0 0 0.4rem 0.5rem}}"
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
        self.spec["usermeta"] = {"dark": DARK}  # read by the book's dark mode (tools/interactive_figures.py)
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


def _num(text):
    """A written operand (a decimal string) as a sum shows it: a minus sign, and a negative one in brackets."""
    return f"({text.replace('-', '−')})" if text.startswith("-") else text


def _written(Qa, Ka, scale, S):
    """Each score S_ij written out by hand: the operands q_ic and k_jc as decimal strings, and the result computed
    from the operands as written (exactly, then rounded to 3 decimals), so that the line adds up as it reads. The
    operands get the fewest digits (2, 3 or 4) at which every written result, to 2 decimals, is the score the
    matrix shows to 2 decimals. Returns the operand strings of Q and of K, the scale as written and the results.
    """
    from decimal import ROUND_HALF_UP, Decimal

    short = f"{scale:.3f}".rstrip("0").rstrip(".")
    root = round(1 / scale**2) if scale > 0 else 0
    if abs(float(short) - scale) < 1e-12:
        written_scale, factor = f"× {short}", Decimal(short)
    elif root > 1 and abs(scale - 1 / math.sqrt(root)) < 1e-12:
        written_scale, factor = f"/ √{root}", 1 / Decimal(root).sqrt()
    else:
        raise ValueError(f"scale {scale} is neither a number of at most 3 decimals nor 1/sqrt(an integer): a "
                         "written-out sum could not show it exactly")
    for digits in (2, 3, 4):
        q = [[f"{x:.{digits}f}".replace("-0." + "0" * digits, "0." + "0" * digits) for x in row] for row in Qa]
        k = [[f"{x:.{digits}f}".replace("-0." + "0" * digits, "0." + "0" * digits) for x in row] for row in Ka]
        results = np.array([[(sum(Decimal(a) * Decimal(b) for a, b in zip(qi, kj)) * factor)
                             .quantize(Decimal("0.001"), rounding=ROUND_HALF_UP) for kj in k] for qi in q])
        if all(f"{float(results[i, j]):.2f}" == f"{S[i, j]:.2f}" for i in range(len(q)) for j in range(len(k))):
            break
    return q, k, written_scale, results


def _text_width(texts, font_size=11):
    """Pixels a panel of text needs for its longest line: half the font size per character (a written-out sum in
    Vega's default sans-serif measures about 0.45 of it per character in Chromium), plus 10 px."""
    return math.ceil(max(len(t) for t in texts) * 0.5 * font_size) + 10


def _tip(field, title, fmt=None):
    """A tooltip line: the field's value under a title in words (not the field's name)."""
    alt = _alt()
    return alt.Tooltip(field, title=title, format=fmt) if fmt else alt.Tooltip(field, title=title)


def _line(rows, where, width):
    """A line of text, flush left, showing the row that ``where`` keeps: a figure's running commentary."""
    alt = _alt()
    return (alt.Chart(_data(rows)).transform_filter(where)
            .mark_text(align="left", baseline="middle", fontSize=12, color=FOREGROUND)
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
                tooltip=[_tip("key:N", "key of"), _tip("w:Q", "weight", ".4f")])
        .transform_filter(_at("c", "c"))
        .properties(width=220, height=220)
    )
    base = alt.Chart(_data(jac), title="Jacobian ∂pᵢ/∂sⱼ").transform_filter(_at("c", "c"))
    cells = base.mark_rect().encode(
        x=alt.X("j:N", sort=names, title="score j"), y=alt.Y("i:N", sort=names, title="weight i"),
        color=alt.Color("J:Q", scale=alt.Scale(scheme="cividis", domain=[-0.25, 0.25]), title="∂pᵢ/∂sⱼ"),
        tooltip=[_tip("i:N", "weight i"), _tip("j:N", "score j"), _tip("J:Q", "Jacobian entry ∂pᵢ/∂sⱼ", "+.4f")])
    text = base.mark_text(fontSize=10).encode(
        x=alt.X("j:N", sort=names), y=alt.Y("i:N", sort=names), text=alt.Text("J:Q", format="+.3f"),
        color=alt.condition("datum.J > 0.05", alt.value(INKS[0]), alt.value(INKS[1])))
    jacobian = (cells + text).properties(width=220, height=220)
    line = _line(summary, _at("c", "c"), 460)
    chart = alt.vconcat(alt.hconcat(bars, jacobian).resolve_scale(color="independent"), line).add_params(c)
    return Interactive(chart, "temperature", "a slider: the multiplier c of the scores")


# ----------------------------------------------------------------------------------------------------------------
# chapter 4: the query's angle in the plane of chapter 4's keys


def query_angle(keys, values, labels=None, *, length=1.0, angles=range(0, 360, 15), lengths=range(1, 9)):
    """Chapter 4: a query turned to each angle, at each length; its scores q·k/sqrt(2), weights and output.

    ``keys`` and ``values``: (n, 2) arrays (chapter 4's tokens); ``angles``: the first slider's evenly spaced
    positions in degrees; ``lengths``: the second slider's evenly spaced positions, the query's norm (a longer query
    multiplies every score, as an inverse temperature does, so its weights sharpen); ``length``: where that slider
    starts. Each position runs :func:`lib.attention.attention` on that query. A line under the picture reads the
    angle, the length, the weights and the output.
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
    norms = [_r(x) for x in _array(list(lengths), "lengths", 1, min_size=1)]
    if min(norms) <= 0 or (len(norms) > 1 and (not (np.diff(norms) > 0).all()
                                               or not np.allclose(np.diff(norms), norms[1] - norms[0]))):
        raise ValueError(f"lengths must be positive, evenly spaced and increasing, got {norms}")
    if not any(abs(x - length) < 1e-9 for x in norms):
        raise ValueError(f"length must be one of lengths {norms}, got {length!r}")
    names = _labels(labels, len(K))
    step = np.diff(degrees)
    if len(degrees) < 2 or not (step > 0).all() or len(set(step)) != 1:
        raise ValueError("angles must be evenly spaced and increasing (a slider's positions)")
    reach = float(np.abs(K).max()) * 1.25
    arrows, bars, outputs, readout = [], [], [], []
    for a in degrees:
        unit = np.array([math.cos(math.radians(a)), math.sin(math.radians(a))])
        arrows.append({"a": a, "x0": 0.0, "y0": 0.0, "x": _r(unit[0] * reach * 0.8), "y": _r(unit[1] * reach * 0.8)})
        for n in norms:
            q = n * unit
            out, w = attention(q[None, :], K, V, return_weights=True)
            scores = K @ q / math.sqrt(2)
            bars += [{"a": a, "n": n, "key": names[j], "score": _r(scores[j]), "weight": _r(w[0, j])}
                     for j in range(len(K))]
            outputs.append({"a": a, "n": n, "x": _r(out[0, 0]), "y": _r(out[0, 1])})
            weights = ", ".join(f"{names[j]} {w[0, j]:.2f}" for j in range(len(K)))
            readout.append({"a": a, "n": n, "text": f"angle {a}°, query length {n:g}\nweights {weights}; "
                            f"output ({out[0, 0]:.2f}, {out[0, 1]:.2f})".replace("-", "−")})
    theta = _slider("angle", "query angle (degrees) ", degrees[0], degrees[-1], int(step[0]))
    size = _slider("qlen", "query length ", norms[0], norms[-1], _r(norms[1] - norms[0]) if len(norms) > 1 else 1,
                   _r(length))
    now = "datum.a == angle && abs(datum.n - qlen) < 1e-6"
    side = 150
    plane = alt.Scale(domain=[-reach, reach])
    key_rows = [{"x": _r(k[0]), "y": _r(k[1]), "label": f"k {n}", "token": n} for k, n in zip(K, names)]
    key_chart = alt.Chart(_data(key_rows))
    key_lines = key_chart.mark_rule(color=BLUE, strokeWidth=2, strokeDash=[4, 3]).encode(
        x=alt.X("x0:Q", scale=plane, title="dimension 1"), y=alt.Y("y0:Q", scale=plane, title="dimension 2"),
        x2="x:Q", y2="y:Q").transform_calculate(x0="0", y0="0")
    key_tips = key_chart.mark_point(filled=True, size=50, color=BLUE).encode(
        x="x:Q", y="y:Q", tooltip=[_tip("token:N", "key of"), _tip("x:Q", "dimension 1", ".3f"),
                                   _tip("y:Q", "dimension 2", ".3f")])
    key_text = key_chart.mark_text(dx=12, dy=-8, color=BLUE).encode(x="x:Q", y="y:Q", text="label:N")
    query = alt.Chart(_data(arrows)).transform_filter("datum.a == angle")
    query_line = query.mark_rule(color=ORANGE, strokeWidth=3).encode(
        x="x0:Q", y="y0:Q", x2="x:Q", y2="y:Q")
    query_tip = query.mark_point(filled=True, size=90, shape="triangle", color=ORANGE).encode(x="x:Q", y="y:Q")
    plane_chart = (key_lines + key_tips + key_text + query_line + query_tip).properties(
        width=side, height=side, title="query direction (orange), keys")
    bar_base = alt.Chart(_data(bars)).transform_filter(now)
    tips = [_tip("key:N", "key of"), _tip("score:Q", "scaled score q·k/√2", ".3f"), _tip("weight:Q", "weight", ".3f")]
    top = max(abs(r["score"]) for r in bars) * 1.05
    score_bars = bar_base.mark_bar(color=BLUE).encode(
        x=alt.X("key:N", sort=names, title=None),
        y=alt.Y("score:Q", title="scaled score", scale=alt.Scale(domain=[-top, top])), tooltip=tips).properties(
        width=side, height=side, title="scaled scores (blue)")
    weight_bars = bar_base.mark_bar(color=ORANGE).encode(
        x=alt.X("key:N", sort=names, title=None),
        y=alt.Y("weight:Q", title="weight", scale=alt.Scale(domain=[0, 1])), tooltip=tips).properties(
        width=side, height=side, title="weights (orange)")
    low, high = float(V.min()), float(V.max())
    pad = 0.15 * (high - low or 1.0)
    vscale = alt.Scale(domain=[low - pad, high + pad])
    value_points = [{"x": _r(v[0]), "y": _r(v[1]), "label": f"v {n}", "token": n} for v, n in zip(V, names)]
    values_layer = alt.Chart(_data(value_points)).mark_square(size=70, color=GREEN).encode(
        x=alt.X("x:Q", scale=vscale, title="value dimension 1"),
        y=alt.Y("y:Q", scale=vscale, title="value dimension 2"),
        tooltip=[_tip("token:N", "value of"), _tip("x:Q", "dimension 1", ".3f"), _tip("y:Q", "dimension 2", ".3f")])
    value_text = values_layer.mark_text(dx=12, dy=-8, color=GREEN).encode(text="label:N")
    out_layer = (alt.Chart(_data(outputs)).transform_filter(now)
                 .mark_circle(size=110, color=ORANGE, stroke=FOREGROUND, strokeWidth=1)
                 .encode(x="x:Q", y="y:Q", tooltip=[_tip("x:Q", "output, dimension 1", ".3f"),
                                                    _tip("y:Q", "output, dimension 2", ".3f")]))
    value_chart = (values_layer + value_text + out_layer).properties(
        width=side, height=side, title="values (green), output (orange)")
    line = (alt.Chart(_data(readout)).transform_filter(now)
            .mark_text(align="left", baseline="top", fontSize=12, lineBreak="\n", color=FOREGROUND)
            .encode(x=alt.value(0), y=alt.value(2), text="text:N").properties(width=2 * side + 60, height=34))
    chart = alt.vconcat(alt.hconcat(plane_chart, value_chart), alt.hconcat(score_bars, weight_bars), line)
    return Interactive(chart.add_params(theta, size), "query-angle", "sliders: the query's angle and its length")


# ----------------------------------------------------------------------------------------------------------------
# chapters 2 and 4: each score written out as a dot product


def score_products(Q, K, labels=None, *, scale=None):
    """Chapters 2 and 4: the score matrix S = Q Kᵀ · scale, and each score of the chosen row written out.

    A slider picks the query row i: the row is outlined, and beside the matrix each scaled score of that row reads
    S_ij = (sum of the products of components) × scale: the bracket is the dot product q_i · k_j. Hovering on any cell
    shows the same. The components are written with the fewest digits (2 to 4) at which every written sum rounds to
    the score, and the result shown is the sum as written, so a reader who redoes it by hand gets the number shown.
    ``Q`` and ``K``: (n, d) arrays with n <= 8 and d <= 4 (the sums must fit a line); ``scale`` defaults to
    1/sqrt(d) and must have at most 3 decimals (0.5 for d = 4).
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
    q_text, k_text, written_scale, results = _written(Qa, Ka, scale, S)
    cells = []
    for i in range(n):
        for j in range(len(Ka)):
            terms = [f"{_num(q_text[i][c])}·{_num(k_text[j][c])}" for c in range(d)]
            products = "(" + " + ".join(terms) + ")"
            value = f"{results[i, j]:.3f}".replace("-", "−")
            tail = (f"{written_scale} " if scale != 1 else "") + f"= {value}"
            # beside the matrix, more than two products break after the first half, so that a line fits a phone
            half = (d + 1) // 2 if d > 2 else d
            written = [f"k {cols[j]}: (" + " + ".join(terms[:half]) + ("" if half < d else ")")]
            written += ["+ " + " + ".join(terms[half:]) + ")"] if half < d else []
            cells.append({"i": i, "q": rows[i], "k": cols[j], "S": _r(S[i, j]), "value": value,
                          "sum": f"{products} {tail}", "short": "\n".join([*written, tail])})
    row = _slider("row", "query row i ", 0, n - 1, 1, 0)
    base = alt.Chart(_data(cells))
    heat = base.mark_rect().encode(
        x=alt.X("k:N", sort=cols, title="key j"), y=alt.Y("q:N", sort=rows, title="query i"),
        color=alt.Color("S:Q", scale=alt.Scale(scheme="viridis"), legend=None),
        tooltip=[_tip("q:N", "query"), _tip("k:N", "key"),
                 _tip("sum:N", f"scaled score S = q·k {written_scale}" if scale != 1 else "score S = q·k")])
    outline = base.mark_rect(fill=None, stroke=RED, strokeWidth=3).encode(
        x=alt.X("k:N", sort=cols), y=alt.Y("q:N", sort=rows)).transform_filter("datum.i == row")
    values = base.mark_text(fontSize=11).encode(
        x=alt.X("k:N", sort=cols), y=alt.Y("q:N", sort=rows), text=alt.Text("S:Q", format=".2f"),
        color=alt.condition(f"datum.S > {_r((S.min() + S.max()) / 2)}", alt.value(INKS[0]), alt.value(INKS[1])))
    matrix = (heat + values + outline).properties(width=32 * len(Ka) + 40, height=32 * n + 40,
                                                  title=f"scaled scores S = Q Kᵀ {written_scale}" if scale != 1
                                                  else "scores S = Q Kᵀ")
    # each score on two or three lines, its products and then its scale and value, so that the panel stays narrow
    # enough for a phone's column; every row's sums are also drawn unseen, so that the figure is laid out for the
    # longest of them whichever row the slider shows
    text = {"align": "left", "fontSize": 11, "lineBreak": "\n", "color": FOREGROUND}
    sums_text = base.mark_text(**text).encode(
        x=alt.value(0), y=alt.Y("k:N", sort=cols, title=None, axis=None), text="short:N")
    lines = [line for c in cells for line in c["short"].split("\n")]
    lines_per_sum = max(len(c["short"].split("\n")) for c in cells)
    sums = (alt.layer(sums_text.mark_text(**text, opacity=0, aria=False),
                      sums_text.transform_filter("datum.i == row"))
            .properties(width=max(120, _text_width(lines)), height=(13 * lines_per_sum + 10) * len(Ka),
                        title=f"S_ij = (q_i · k_j) {written_scale}, row i written out" if scale != 1
                        else "S_ij = q_i · k_j, row i written out"))
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
                   "seen": "yes" if mask[i, j] else "no: masked",
                   "ink": INKS[0] if w[i, j] > 0.5 else (INKS[1] if mask[i, j] else INKS[2])}
                  for i in range(L) for j in range(S)]
        sums += [{"L": L, "S": S, "al": align, "i": i, "sum": _r(w[i].sum(), 3)} for i in range(L)]
    pL = _slider("L", "queries L ", 1, max_L, 1, min(3, max_L))
    pS = _slider("S", "keys S ", 1, max_S, 1, max_S)
    pA = _radio("align", "alignment ", ["top-left", "bottom-right"])
    current = "datum.L == L && datum.S == S && datum.al == align"
    # only the rows and columns that exist: the scales take their domains from the rows the controls keep, and a
    # cell keeps its size (a step), so the grid grows and shrinks with L and S
    cell = 34
    axis_i = alt.Y("i:O", title="query i")
    base = alt.Chart(_data(cells)).transform_filter(current)
    heat = base.mark_rect(stroke="white").encode(
        x=alt.X("j:O", title="key j"), y=axis_i,
        color=alt.condition("datum.ok", alt.Color("w:Q", scale=alt.Scale(scheme="viridis", domain=[0, 1]),
                                                  title="weight", legend=alt.Legend(orient="bottom")),
                            alt.value(GREY)),
        tooltip=[_tip("i:O", "query i"), _tip("j:O", "key j"), _tip("seen:N", "key seen"),
                 _tip("w:Q", "weight", ".3f")])
    text = base.mark_text(fontSize=10).encode(
        x=alt.X("j:O"), y=axis_i,
        text=alt.condition("datum.ok", alt.Text("w:Q", format=".2f"), alt.value("×")),
        color=alt.Color("ink:N", legend=None, scale=alt.Scale(domain=INKS, range=INKS)))
    grid = (heat + text).properties(width=alt.Step(cell), height=alt.Step(cell), title="weights (grey ×: masked)")
    row_sums = (alt.Chart(_data(sums)).transform_filter(current).mark_text(fontSize=12)
                .encode(y=alt.Y("i:O", title=None, axis=alt.Axis(labels=False, ticks=False, domain=False)),
                        text=alt.Text("sum:Q", format=".0f"),
                        color=alt.condition("datum.sum < 0.5", alt.value(RED), alt.value(FOREGROUND)),
                        tooltip=[_tip("i:O", "query i"), _tip("sum:Q", "sum of its weights", ".3f")])
                .properties(width=40, height=alt.Step(cell), title="row sum"))
    chart = alt.hconcat(grid, row_sums, spacing=8).add_params(pL, pS, pA)
    return Interactive(chart, "mask-alignment", "sliders L and S, radio buttons for the alignment")


# ----------------------------------------------------------------------------------------------------------------
# chapter 7: the online softmax, block by block


def online_softmax(scores, values, block):
    """Chapter 7: one query's running maximum m, total ℓ and output before any block and after each block of keys.

    ``scores``: the query's n scores; ``values``: (n, d_v) value rows, d_v <= 4; ``block``: keys per block. After
    block t the state is :func:`lib.merge.attention_state` over the first t blocks' keys (its logsumexp gives
    ℓ = exp(lse - m)), which is what the online softmax holds; before block 1 it is m = -inf, ℓ = 0 and a zero output.
    After the last block the output equals :func:`lib.attention.attention`. A step slider, from 0 (before block 1),
    moves through the blocks. ℓ is drawn as a stack of its terms exp(s_j - m), one per key read: when m rises,
    every earlier term shrinks by the rescale factor exp(m_old - m_new).
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
    bars, states, outs, terms = [], [], [], []
    for t in range(n_blocks + 1):
        seen = min(t * block, len(s))
        bars += [{"t": t, "j": j, "s": _r(s[j]),
                  "state": "this block" if (t - 1) * block <= j < seen else ("read" if j < seen else "not yet")}
                 for j in range(len(s))]
        if t == 0:
            out, m, ell = np.zeros((1, V.shape[1])), None, 0.0
            text = f"before block 1: m = −∞, ℓ = 0, output = ({', '.join('0' for _ in range(V.shape[1]))})"
            factor = ""
        else:
            out, lse = attention_state(q, k[:seen], V[:seen], scale=1.0)
            m, previous = float(s[:seen].max()), (float(s[:seen - block].max()) if t > 1 else None)
            ell = math.exp(float(lse[0]) - m)
            factor = (f", earlier terms × {math.exp(previous - m):.3f}" if previous is not None and previous < m
                      else "")
            text = (f"after block {t}: m = {m:.3f}, ℓ = {ell:.4f}, "
                    f"output = ({', '.join(f'{x:.3f}' for x in out[0])})").replace("-", "−")
            terms += [{"t": t, "j": j, "sum": "ℓ", "term": _r(math.exp(s[j] - m)),
                       "state": bars[-len(s) + j]["state"]}
                      for j in range(seen)]
        states.append({"t": t, "m": None if m is None else _r(m), "ell": _r(ell), "text": text + factor})
        outs += [{"t": t, "c": f"out {c}", "o": _r(out[0, c]), "final": _r(final[c])} for c in range(V.shape[1])]
    step = _slider("t", "blocks read ", 0, n_blocks, 1, 0)
    colour = alt.Color("state:N", scale=alt.Scale(domain=["read", "this block", "not yet"],
                                                  range=[BLUE, ORANGE, GREY]),
                       legend=alt.Legend(orient="top", title=None))
    score_bars = (alt.Chart(_data(bars)).transform_filter("datum.t == t").mark_bar()
                  .encode(x=alt.X("j:O", title="key j"), y=alt.Y("s:Q", title="score"), color=colour,
                          tooltip=[_tip("j:O", "key j"), _tip("s:Q", "score", ".3f"), _tip("state:N", "key")]))
    state_data = alt.Chart(_data(states)).transform_filter("datum.t == t && datum.m != null")
    # the rule and ℓ's stack have no mark before block 1, and an empty group of marks would have no accessible
    # name: they stay out of the accessibility tree (the figure's label and the line of text say what they show)
    max_rule = state_data.mark_rule(color=RED, strokeDash=[4, 3], strokeWidth=2, aria=False).encode(
        y="m:Q", tooltip=[_tip("m:Q", "running max m", ".3f")])
    left = (score_bars + max_rule).properties(width=min(18 * len(s), 220), height=180,
                                              title="scores (dashed: running max m)")
    total = max(r["ell"] for r in states) * 1.05
    ell_bar = (alt.Chart(_data(terms)).transform_filter("datum.t == t")
               .mark_bar(stroke="white", strokeWidth=1, aria=False)
               .encode(x=alt.X("sum:N", title=None, axis=alt.Axis(labels=False, ticks=False)),
                       y=alt.Y("term:Q", stack="zero", title="ℓ = Σ exp(s_j − m)",
                               scale=alt.Scale(domain=[0, _r(total, 2)])),
                       color=alt.Color("state:N", scale=alt.Scale(domain=["read", "this block", "not yet"],
                                                                  range=[BLUE, ORANGE, GREY]), legend=None),
                       order=alt.Order("j:O"),
                       tooltip=[_tip("j:O", "key j"), _tip("term:Q", "its term exp(s_j − m)", ".4f")]))
    middle = ell_bar.properties(width=44, height=180, title="ℓ")
    out_scale = alt.Scale(domain=[float(min(V.min(), 0)), float(max(V.max(), 0))])
    out_bars = (alt.Chart(_data(outs)).transform_filter("datum.t == t")
                .mark_bar(color=GREEN).encode(x=alt.X("c:N", title=None),
                                              y=alt.Y("o:Q", scale=out_scale, title="output"),
                                              tooltip=[_tip("c:N", "component"), _tip("o:Q", "so far", ".3f"),
                                                       _tip("final:Q", "exact", ".3f")]))
    final_ticks = (alt.Chart(_data(outs)).transform_filter("datum.t == t")
                   .mark_tick(color=FOREGROUND, thickness=2, size=30).encode(x="c:N", y="final:Q"))
    right = (out_bars + final_ticks).properties(width=40 * V.shape[1] + 10, height=180,
                                                title="output (tick: exact)")
    caption = _line(states, "datum.t == t", 460)
    chart = alt.vconcat(alt.hconcat(left, middle, right), caption).add_params(step)
    return Interactive(chart, "online-softmax", "a slider: the number of key blocks read, from none")


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
    line = alt.Chart(_data(roof)).mark_line(color=FOREGROUND).encode(x=xs, y=ys)
    marks = alt.Chart(_data(fixed)).mark_point(size=90, filled=False, strokeWidth=2).encode(
        x="I:Q", y="tflops:Q",
        # one legend for both encodings: the same field, domain and legend on each
        shape=alt.Shape("what:N", scale=alt.Scale(domain=[f["what"] for f in fixed], range=["diamond", "square"]),
                        legend=alt.Legend(orient="bottom", title=None)),
        color=alt.Color("what:N", scale=alt.Scale(domain=[f["what"] for f in fixed], range=[RED, GREEN]),
                        legend=alt.Legend(orient="bottom", title=None)),
        tooltip=[_tip("what:N", "path"), _tip("MB:Q", "MB moved", ".1f"), _tip("I:Q", "FLOP per byte", ".0f")])
    base = alt.Chart(_data(points)).transform_filter("datum.tile == tile")
    moving = base.mark_circle(size=140, color=BLUE).encode(
        x="I:Q", y="tflops:Q", tooltip=[_tip("tile:Q", "query tile B_r"), _tip("MB:Q", "MB moved", ".1f"),
                                        _tip("I:Q", "FLOP per byte", ".0f")])
    plot = (line + marks + moving).properties(width=520, height=280,
                                             title=f"{device.name}, one head, n = {n}, d = {d} (blue: the tiles)")
    chart = alt.vconcat(plot, _line(points, "datum.tile == tile", 520)).add_params(tile)
    return Interactive(chart, "tile-roofline", "radio buttons: the query tile")


# ----------------------------------------------------------------------------------------------------------------
# chapter 11: ablating heads


def head_ablation(model, tokens, *, example=0, scored=None, length=16):
    """Chapter 11: a checkbox per head of a :class:`lib.model.TinyLM`; maps and accuracy without them, one row of
    maps per layer, an ablated head's map faded under a title that says "ablated".

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

    def panel(k, name, first):
        # an ablated head's output is replaced by its mean: its map still shows where it looks, drawn faded under
        # a title that says so
        title = {"text": {"expr": f"off_{k} ? '{name}: ablated' : '{name}'"},
                 "color": {"expr": f"off_{k} ? '{RED}' : '{FOREGROUND}'"}}
        return (alt.Chart(data, title=title).transform_filter(f"{current} && datum.head == '{name}'")
                .transform_flatten(["w"]).transform_window(j="row_number()", groupby=["i"])
                .transform_calculate(j="datum.j - 1").mark_rect()
                .encode(x=alt.X("j:O", title="key", axis=alt.Axis(labels=False, ticks=False)),
                        y=alt.Y("i:O", title="query" if first else None, axis=alt.Axis(labels=False, ticks=False)),
                        color=alt.Color("w:Q", scale=alt.Scale(scheme="viridis", domain=[0, 1]), title="weight",
                                        legend=alt.Legend(orient="bottom")),
                        opacity=alt.condition(f"off_{k}", alt.value(0.3), alt.value(1.0)),
                        tooltip=[_tip("head:N", "attention head"), _tip("i:O", "query position"),
                                 _tip("j:O", "key position"), _tip("w:Q", "weight", ".2f")])
                .properties(width=cell * length, height=cell * length))

    layers = [[k for k, (la, _) in enumerate(heads) if la == layer] for layer in range(len(blocks))]
    rows = [alt.hconcat(*[panel(k, names[k], k == ks[0]) for k in ks]) for ks in layers if ks]
    text = _line(accuracy, current, 2 * cell * length + 60)
    chart = alt.vconcat(*rows, text).add_params(*params)
    return Interactive(chart, "head-ablation", "a checkbox per head: ablate it")


# ----------------------------------------------------------------------------------------------------------------
# chapter 12: the ring's schedule, step by step


RING, BLOCKS = 1.0, 0.62  # the ring's radius, where the ranks sit; the circle the blocks move on, inside it


def ring_steps(N=1024, world_size=4, *, tile=64, layouts=("contiguous", "zigzag")):
    """Chapter 12: at ring step s, rank r holds the key block of rank (r - s) mod P and computes its causal tiles.

    A step slider and radio buttons for the layout. The P ranks sit on a ring (a circle, rank 0 at the top, the
    ring running clockwise); each key/value block is drawn beside the rank that holds it, so at every step each
    block moves one place round the ring, to the next rank. A block is coloured and labelled by the tiles
    :func:`lib.ring.causal_tile_counts` counts for its rank at that step (grey: none); bars beside the ring give the
    same counts per rank, and the text gives each step's busiest rank, which sets the step's time.
    """
    from lib.ring import causal_tile_counts

    alt = _alt()
    P = _int(world_size, "world_size", 2, 8)

    def on_ring(position, radius):  # rank 0 at the top, clockwise
        angle = math.pi / 2 - 2 * math.pi * position / P
        return _r(radius * math.cos(angle), 3), _r(radius * math.sin(angle), 3)

    ranks = []
    for r in range(P):
        x, y = on_ring(r, RING)
        lx, ly = on_ring(r, RING + 0.4)
        ranks.append({"rank": f"rank {r}", "x": x, "y": y, "lx": lx, "ly": ly})
    circle = [dict(zip(("x", "y"), on_ring(k / 8, RING)), k=k) for k in range(8 * P + 1)]
    blocks, totals = [], []
    for layout in layouts:
        counts = causal_tile_counts(N, P, layout, tile=tile)
        for step in range(P):
            for rank in range(P):
                owner = (rank - step) % P
                x, y = on_ring(rank, BLOCKS)
                blocks.append({"layout": layout, "step": step, "rank": f"rank {rank}", "block": f"K, V {owner}",
                               "x": x, "y": y, "tiles": counts[step][rank]})
            busiest = max(counts[step])
            totals.append({"layout": layout, "step": step,
                           "text": f"step {step}: busiest rank computes {busiest} tiles, "
                                   f"least busy {min(counts[step])}"})
    most = max(b["tiles"] for b in blocks)
    step = _slider("step", "ring step ", 0, P - 1, 1, 0)
    layout = _radio("layout", "layout ", list(layouts))
    room = alt.Scale(domain=[-RING - 0.75, RING + 0.75])
    xs, ys = alt.X("x:Q", scale=room, axis=None), alt.Y("y:Q", scale=room, axis=None)
    ring = alt.Chart(_data(circle)).mark_line(color=FOREGROUND, strokeWidth=1.5).encode(x=xs, y=ys, order="k:Q")
    rank_chart = alt.Chart(_data(ranks))
    nodes = rank_chart.mark_circle(size=260, color=FOREGROUND).encode(x="x:Q", y="y:Q")
    rank_text = rank_chart.mark_text(fontSize=11, color=FOREGROUND).encode(x="lx:Q", y="ly:Q", text="rank:N")
    here = alt.Chart(_data(blocks)).transform_filter("datum.layout == layout && datum.step == step")
    tips = [_tip("rank:N", "rank"), _tip("block:N", "key/value block it holds"),
            _tip("tiles:Q", "causal tiles it computes now")]
    squares = here.mark_square(size=1100, stroke=FOREGROUND, strokeWidth=1).encode(
        x="x:Q", y="y:Q", tooltip=tips,
        color=alt.condition("datum.tiles > 0", alt.Color("tiles:Q", scale=alt.Scale(scheme="viridis",
                                                                                   domain=[0, most]),
                                                        title="tiles", legend=None), alt.value(GREY)))
    ink = alt.Color("ink:N", legend=None, scale=alt.Scale(domain=INKS, range=INKS))
    here = here.transform_calculate(ink=f"datum.tiles == 0 ? '{INKS[2]}' : datum.tiles > {most / 2} ? "
                                        f"'{INKS[0]}' : '{INKS[1]}'")
    block_text = here.mark_text(fontSize=10, baseline="bottom", dy=-1).encode(x="x:Q", y="y:Q", text="block:N",
                                                                              color=ink)
    tile_text = here.mark_text(fontSize=10, baseline="top", dy=1).encode(x="x:Q", y="y:Q", text="tiles:Q",
                                                                         color=ink)
    picture = (ring + nodes + rank_text + squares + block_text + tile_text).properties(
        width=240, height=240, title="each block moves one rank on at each step")
    bars = here.mark_bar().encode(
        y=alt.Y("rank:N", sort=[f"rank {r}" for r in range(P)], title=None),
        x=alt.X("tiles:Q", scale=alt.Scale(domain=[0, most]), title="tiles at this step"),
        color=alt.Color("tiles:Q", scale=alt.Scale(scheme="viridis", domain=[0, most]), legend=None),
        tooltip=tips).properties(width=130, height=24 * P, title="tiles per rank")
    line = _line(totals, "datum.layout == layout && datum.step == step", 400)
    chart = alt.vconcat(alt.hconcat(picture, bars), line).add_params(step, layout)
    return Interactive(chart, "ring-steps", "a slider: the ring step; radio buttons: the layout")


# ----------------------------------------------------------------------------------------------------------------
# chapter 13: a sliding window


def sliding_window(n=12, *, d=4, seed=0, windows=None, layers=4):
    """Chapter 13: causal attention limited to the last w keys (j in (i - w, i]), for each window w, and how far
    back a query reaches through a stack of such layers.

    A slider sets w from 1 to n (``windows``: its evenly spaced positions), a second the number of layers, 1 to
    ``layers``. The band is the causal mask of :func:`lib.attention.causal_mask` without the keys w or more positions
    back; the weights are :func:`lib.attention.attention_weights` of random queries and keys under it. At w = n the
    band is the whole causal triangle; the text counts the pairs attended, n·w - w(w - 1)/2. Through l layers a
    query reaches a position along any path of l attention steps, each inside the band: position i reaches back to
    i - l(w - 1). The right panel marks, for every pair, the first layer that reaches it (the band's boolean
    matrix powers), so the reach grows by w - 1 positions per layer: what one picture of one layer cannot show.
    """
    from lib.attention import attention_weights, causal_mask

    alt = _alt()
    n, d, seed = _int(n, "n", 2, 24), _int(d, "d", 1), _int(seed, "seed", 0)
    layers = _int(layers, "layers", 1, 8)
    windows = list(range(1, n + 1)) if windows is None else [_int(w, "windows", 1, n) for w in windows]
    if len(windows) < 2 or len(set(np.diff(windows))) != 1 or windows[1] <= windows[0]:
        raise ValueError("windows must be evenly spaced and increasing (a slider's positions)")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    q, k = x, x @ rng.standard_normal((d, d))
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    cells, counts, reach = [], [], []
    for w in windows:
        band = causal_mask(n) & (i - j < w)
        weights = attention_weights(q, k, band)
        cells += [{"w": w, "i": a, "j": b, "ok": bool(band[a, b]), "a": _r(weights[a, b], 3),
                   "seen": "yes" if band[a, b] else "no: masked"}
                  for a in range(n) for b in range(n)]
        counts.append({"w": w, "text": f"window {w}: {int(band.sum())} of {n * (n + 1) // 2} causal pairs"})
        first = np.zeros((n, n), dtype=int)  # the first layer at which query i reaches key j (0: not by `layers`)
        reached = np.eye(n, dtype=bool)
        for layer in range(1, layers + 1):
            reached = (reached.astype(int) @ band.astype(int)) > 0
            first[(first == 0) & reached] = layer
        reach += [{"w": w, "i": a, "j": b, "first": int(first[a, b])} for a in range(n) for b in range(n)
                  if first[a, b]]
        for stack in range(1, layers + 1):
            back = min(n - 1, stack * (w - 1))
            counts.append({"w": w, "l": stack, "text": f"{stack} layer{'s' if stack > 1 else ''}: query {n - 1} "
                           f"reaches keys {n - 1 - back} to {n - 1}"})
    window = _slider("window", "window w ", windows[0], windows[-1], windows[1] - windows[0], windows[len(windows) // 3])
    depth = _slider("depth", "layers ", 1, layers, 1, 1)
    cell = max(10, 200 // n)
    base = alt.Chart(_data(cells)).transform_filter("datum.w == window")
    heat = base.mark_rect().encode(
        x=alt.X("j:O", title="key j"), y=alt.Y("i:O", title="query i"),
        color=alt.condition("datum.ok", alt.Color("a:Q", scale=alt.Scale(scheme="viridis", domain=[0, 1]),
                                                  title="weight", legend=alt.Legend(orient="bottom")),
                            alt.value(GREY)),
        tooltip=[_tip("i:O", "query i"), _tip("j:O", "key j"), _tip("seen:N", "in the window"),
                 _tip("a:Q", "weight", ".3f")])
    far = (alt.Chart(_data(reach)).transform_filter("datum.w == window && datum.first <= depth")
           .mark_rect().encode(
               x=alt.X("j:O", title="key j", scale=alt.Scale(domain=list(range(n)))),
               y=alt.Y("i:O", title=None, scale=alt.Scale(domain=list(range(n)))),
               color=alt.Color("first:O", scale=alt.Scale(domain=list(range(1, layers + 1)),
                                                          range=[BLUE, SKY, ORANGE, PINK, GREEN, RED, GREY,
                                                                 FOREGROUND][:layers]),
                               title="first reached at layer", legend=alt.Legend(orient="bottom")),
               tooltip=[_tip("i:O", "query i"), _tip("j:O", "key j"), _tip("first:O", "first reached at layer")]))
    text = alt.vconcat(_line(counts, "datum.w == window && !datum.l", cell * n),
                       _line(counts, "datum.w == window && datum.l == depth", cell * n), spacing=2)
    chart = alt.vconcat(
        alt.hconcat(heat.properties(width=cell * n, height=cell * n, title="one layer: weights in the band"),
                    far.properties(width=cell * n, height=cell * n, title="reach through the layers"))
        .resolve_scale(color="independent"), text).add_params(window, depth)
    return Interactive(chart, "sliding-window", "sliders: the window w and the number of layers")
