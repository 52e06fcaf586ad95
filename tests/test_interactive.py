"""lib/interactive.py and tools/interactive_figures.py: the interactive figures' numbers, their controls, their
output, and a tiny book built with all nine, each operated from the keyboard in headless Chromium with no network.

The numbers: for every position of a figure's control, the data the figure holds equals what lib computes there.
The controls: real HTML inputs (slider, radio, checkbox) with a label. The output: the same text on every run (strict
nbval compares it), a PNG first frame, and Vega loaded only from the page's own folder in the book.
"""

from __future__ import annotations

import base64
import itertools
import json
import math
import pathlib
import re
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

from lib import interactive as I
from lib.attention import attention, attention_weights, causal_mask, softmax

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHROMIUM = next(
    (shutil.which(name) for name in ("chromium-headless-shell", "chromium", "chromium-browser") if shutil.which(name)),
    None,
)

KEYS = [[1.0, 0.2], [0.3, 1.0], [-0.8, 0.5]]
VALUES = [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]


def datasets(fig):
    """name of each dataset -> its rows, as the spec holds them (Altair moves inline data to `datasets`)."""
    return fig.spec["datasets"]


def rows_with(fig, *fields):
    """The rows of the one dataset whose rows have all these fields."""
    found = [rows for rows in datasets(fig).values() if rows and all(f in rows[0] for f in fields)]
    assert len(found) == 1, f"{len(found)} datasets with fields {fields}"
    return found[0]


def bindings(fig):
    return {p["name"]: p["bind"] for p in fig.spec.get("params", []) if "bind" in p}


def slider_positions(bind):
    n = round((bind["max"] - bind["min"]) / bind["step"])
    return [round(bind["min"] + k * bind["step"], 6) for k in range(n + 1)]


# ------------------------------------------------------------------------------------------------ the numbers


def test_temperature_weights_and_jacobian_at_every_position():
    s = np.array([1.6, 1.3, 0.9, 0.0])
    fig = I.temperature_jacobian(s)
    bind = bindings(fig)["c"]
    assert bind["input"] == "range" and bind["name"].strip()
    weights, jac = rows_with(fig, "c", "key", "w"), rows_with(fig, "c", "i", "j", "J")
    for c in slider_positions(bind):
        p = softmax(c * s)
        got = [r["w"] for r in weights if abs(r["c"] - c) < 1e-9]
        np.testing.assert_allclose(got, p, atol=1e-4)
        J = np.diag(p) - np.outer(p, p)
        got_j = np.array([r["J"] for r in jac if abs(r["c"] - c) < 1e-9]).reshape(4, 4)
        np.testing.assert_allclose(got_j, J, atol=1e-4)
    top = max(r["J"] for r in jac if r["c"] == 20)
    assert top < 0.01 < max(r["J"] for r in jac if r["c"] == 1), "the Jacobian should close as c grows"


def test_query_angle_runs_attention_at_every_angle_and_length():
    fig = I.query_angle(KEYS, VALUES, ["A", "B", "C"])
    binds = bindings(fig)
    assert binds["angle"]["input"] == binds["qlen"]["input"] == "range"
    outputs = rows_with(fig, "a", "n", "x", "y")
    bars = rows_with(fig, "a", "n", "key", "score", "weight")
    readout = rows_with(fig, "a", "n", "text")
    angles, lengths = slider_positions(binds["angle"]), slider_positions(binds["qlen"])
    assert lengths == [1, 2, 3, 4, 5, 6, 7, 8]
    assert sorted({(r["a"], r["n"]) for r in outputs}) == [(a, n) for a in angles for n in lengths]
    for row in outputs:
        a = math.radians(row["a"])
        q = row["n"] * np.array([[math.cos(a), math.sin(a)]])
        out, w = attention(q, np.array(KEYS), np.array(VALUES), return_weights=True)
        np.testing.assert_allclose([row["x"], row["y"]], out[0], atol=1e-4)
        here = [r for r in bars if (r["a"], r["n"]) == (row["a"], row["n"])]
        np.testing.assert_allclose([r["weight"] for r in here], w[0], atol=1e-4)
        np.testing.assert_allclose([r["score"] for r in here], (np.array(KEYS) @ q[0]) / math.sqrt(2), atol=1e-4)
        # the readout: the angle, the length, the three weights and the output
        text = next(r["text"] for r in readout if (r["a"], r["n"]) == (row["a"], row["n"]))
        assert text.startswith(f"angle {row['a']}°, query length {row['n']:g}\nweights A {w[0, 0]:.2f}, ")
        assert text.endswith(f"output ({out[0, 0]:.2f}, {out[0, 1]:.2f})".replace("-", "−"))


def test_query_angle_weights_sharpen_with_the_length():
    """At length 1 the weights of chapter 4's keys stay between 0.24 and 0.44 at every angle: the length slider is
    what makes them sharpen (the largest weight grows with the length at every angle)."""
    fig = I.query_angle(KEYS, VALUES, ["A", "B", "C"])
    bars = rows_with(fig, "a", "n", "key", "score", "weight")
    for a in {r["a"] for r in bars}:
        top = [max(r["weight"] for r in bars if r["a"] == a and r["n"] == n) for n in range(1, 9)]
        assert all(x < y for x, y in itertools.pairwise(top)), (a, top)
    assert max(r["weight"] for r in bars if r["n"] == 8) > 0.9 > max(r["weight"] for r in bars if r["n"] == 1)


def written_value(line):
    """The value of a written-out sum "(a·b + (−c)·d ...) × s = r", computed as written, exactly."""
    from decimal import Decimal

    products, tail = line.replace("−", "-").rsplit(") ", 1)
    total = sum(Decimal(a.strip("()")) * Decimal(b.strip("()"))
                for a, b in (term.split("·") for term in products.lstrip("(").split(" + ")))
    op, scale, shown = re.fullmatch(r"(?:([×/]) √?(\S+) )?= (\S+)", tail).groups()
    if op == "/":
        return total / Decimal(scale).sqrt(), Decimal(shown)
    return total * Decimal(scale or "1"), Decimal(shown)


def test_score_products_write_each_score_out():
    Q, K = np.array(KEYS), np.array(VALUES) + 0.1
    for scale in (0.5, None):  # None: 1/sqrt(2), written "/ √2"
        fig = I.score_products(Q, K, ["A", "B", "C"], scale=scale)
        assert bindings(fig)["row"]["max"] == 2
        cells = rows_with(fig, "i", "q", "k", "S", "sum")
        assert len(cells) == 9 and all(r["sum"].count("/ √2" if scale is None else "× 0.5") == 1 for r in cells)
    S = Q @ K.T / math.sqrt(2)
    for r in cells:
        j = "ABC".index(r["k"])
        assert abs(r["S"] - S[r["i"], j]) < 1e-4
        exact, shown = written_value(r["sum"])
        assert abs(exact - shown) <= 0.0005, f"{r['sum']} does not add up as written"
        assert f"{float(shown):.2f}" == f"{S[r['i'], j]:.2f}", "the written result disagrees with the matrix"


def test_score_products_add_up_by_hand_on_chapter_2s_kind_of_numbers():
    """Figure 2.2 wrote two-decimal operands beside the exact result, and a reader who redid a sum by hand missed
    the result shown in 21 of its 36 cells: every written sum now gives, computed as written, the result shown,
    which agrees with the matrix to its two decimals. The score is named a scaled score, not a dot product."""
    for seed in range(5):
        rng = np.random.default_rng(seed)
        Q, K = rng.standard_normal((6, 4)) * 0.8, rng.standard_normal((6, 4)) * 0.8
        fig = I.score_products(Q, K, ["the", "cat", "sat", "on", "the", "mat"])
        cells = rows_with(fig, "i", "S", "sum", "short")
        S = Q @ K.T / 2
        digits = len(re.search(r"\d\.(\d+)", cells[0]["sum"]).group(1))
        for r in cells:
            exact, shown = written_value(r["sum"])
            assert abs(exact - shown) <= 0.0005, r["sum"]
            # the result agrees with the matrix's two decimals, or (a score on a rounding boundary) the operands
            # have their most digits, and the result is within 0.001 of the score
            score = S[r["i"], cols(r)]
            assert f"{float(shown):.2f}" == f"{score:.2f}" or (digits == 4 and abs(float(shown) - score) < 1e-3)
            assert r["short"].replace("\n", " ").endswith(r["sum"])
    tooltip = json.dumps(fig.spec, ensure_ascii=False)
    assert "scaled score S = q·k × 0.5" in tooltip and "q_i · k_j =" not in tooltip


def cols(row):
    return int(row["short"].split()[1])


def test_mask_alignment_every_combination_and_the_empty_row():
    fig = I.mask_alignment(4, 3)
    binds = bindings(fig)
    assert binds["align"]["input"] == "radio" and binds["align"]["options"] == ["top-left", "bottom-right"]
    cells, sums = rows_with(fig, "L", "S", "al", "i", "j", "ok", "w"), rows_with(fig, "L", "S", "al", "i", "sum")
    assert len({(r["L"], r["S"], r["al"]) for r in cells}) == 4 * 3 * 2
    for L, S, align in {(r["L"], r["S"], r["al"]) for r in cells}:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mask = causal_mask(L, S, align=align)
        got = [r["ok"] for r in cells if (r["L"], r["S"], r["al"]) == (L, S, align)]
        assert got == mask.ravel().tolist()
        row_sums = [r["sum"] for r in sums if (r["L"], r["S"], r["al"]) == (L, S, align)]
        assert row_sums == [1.0 if mask[i].any() else 0.0 for i in range(L)]
    assert 0.0 in [r["sum"] for r in sums if r["al"] == "bottom-right"], "L > S bottom-right leaves an empty row"


def test_mask_alignment_draws_only_the_rows_that_exist():
    """Its axes stayed max_L by max_S, so rows beyond L were drawn as blank rows, which looked like the "no key"
    rows the figure is about: no row or column beyond the sequence is stored, and no axis holds a fixed domain of
    positions, so the grid has L rows and S columns at every setting, one step each."""
    fig = I.mask_alignment(6, 6)
    cells = rows_with(fig, "L", "S", "al", "i", "j", "ok", "w")
    assert all(r["i"] < r["L"] and r["j"] < r["S"] for r in cells)
    text = json.dumps(fig.spec)
    assert '"domain": [0, 1, 2' not in text
    grid = fig.spec["hconcat"][0]
    assert grid["height"] == {"step": 34} and grid["width"] == {"step": 34}


def test_online_softmax_ends_at_attention():
    rng = np.random.default_rng(0)
    s, V = rng.standard_normal(10) * 2, rng.random((10, 2))
    fig = I.online_softmax(s, V, 4)
    bind = bindings(fig)["t"]
    assert (bind["min"], bind["max"]) == (0, 3)
    assert next(p for p in fig.spec["params"] if p["name"] == "t")["value"] == 0, "it starts before block 1"
    outs = rows_with(fig, "t", "c", "o", "final")
    states = rows_with(fig, "t", "m", "ell", "text")
    exact = attention(np.ones((1, 1)), s[:, None], V, scale=1.0)[0]
    last = [r["o"] for r in outs if r["t"] == 3]
    np.testing.assert_allclose(last, exact, atol=1e-4)
    before = next(r for r in states if r["t"] == 0)
    assert before["m"] is None and before["ell"] == 0 and before["text"].startswith("before block 1: m = −∞, ℓ = 0")
    assert [r["o"] for r in outs if r["t"] == 0] == [0.0, 0.0]
    for r in states[1:]:
        seen = s[: min(4 * r["t"], 10)]
        assert abs(r["m"] - seen.max()) < 1e-4
        assert abs(r["ell"] - np.exp(seen - seen.max()).sum()) < 1e-4
    first = [r["o"] for r in outs if r["t"] == 1]
    w = softmax(s[:4])
    np.testing.assert_allclose(first, w @ V[:4], atol=1e-4)


def test_online_softmax_draws_l_as_its_terms():
    """ℓ is drawn, as a stack of its terms exp(s_j - m) under the running max: they add up to ℓ after each block,
    and when m rises the earlier terms shrink by exp(m_old - m_new)."""
    s, V = np.array([0.5, 1.0, -0.3, 2.0, 0.1, 3.0]), np.eye(6)[:, :3]
    fig = I.online_softmax(s, V, 2)
    terms, states = rows_with(fig, "t", "j", "term"), rows_with(fig, "t", "m", "ell", "text")
    assert not [r for r in terms if r["t"] == 0]
    for state in states[1:]:
        here = [r["term"] for r in terms if r["t"] == state["t"]]
        assert len(here) == 2 * state["t"] and abs(sum(here) - state["ell"]) < 1e-3
    t1, t2 = ({r["j"]: r["term"] for r in terms if r["t"] == t} for t in (1, 2))
    assert abs(t2[0] / t1[0] - math.exp(1.0 - 2.0)) < 1e-3
    assert "earlier terms × 0.368" in states[2]["text"]
    # marks that are empty before block 1 stay out of the accessibility tree (an empty group has no name)
    layers = json.dumps(fig.spec["vconcat"][0]["hconcat"][:2])
    assert layers.count('"aria": false') == 2


def test_tile_roofline_counts_bytes_as_chapter_8():
    from lib import cost

    fig = I.tile_roofline(n=4096, d=64, tiles=(32, 64, 128))
    bind = bindings(fig)["tile"]
    assert bind["input"] == "radio" and bind["options"] == [32, 64, 128]
    points = rows_with(fig, "tile", "I", "tflops", "text")
    intensities = [p["I"] for p in points]
    assert intensities == sorted(intensities) and len(set(intensities)) == 3
    flops = cost.attention_flops(4096, E=64)
    nbytes = (2 * 4096 * 64 + 2 * 4096 * 64 * 4096 // 64 + 4096) * 2  # chapter 8's count, bfloat16
    assert abs(points[1]["I"] - flops / nbytes) < 0.01
    assert abs(points[1]["MB"] - nbytes / 1e6) < 0.01
    fixed = next(rows for rows in datasets(fig).values() if rows[0].get("what", "tiled") != "tiled")
    unfused = cost.attention_bytes(4096, E=64, scores=True)
    assert any(abs(p["MB"] - unfused / 1e6) < 0.01 for p in fixed)
    assert all(p["tflops"] <= cost.gpu("H100").tensor_flops / 1e12 for p in points + fixed)


def test_ring_steps_move_each_block_round_a_ring():
    from lib.ring import causal_tile_counts

    fig = I.ring_steps(512, 4, tile=32)
    blocks = rows_with(fig, "layout", "step", "rank", "block", "x", "y", "tiles")
    ranks = rows_with(fig, "rank", "x", "y", "lx")
    for layout in ("contiguous", "zigzag"):
        counts = causal_tile_counts(512, 4, layout, tile=32)
        for r in blocks:
            if r["layout"] == layout:
                rank = int(r["rank"].split()[-1])
                assert r["block"] == f"K, V {(rank - r['step']) % 4}"
                assert r["tiles"] == counts[r["step"]][rank]
    # every rank and every block lies on a circle, a block beside the rank that holds it, one rank on per step
    assert all(abs(math.hypot(r["x"], r["y"]) - I.RING) < 2e-3 for r in ranks)
    assert all(abs(math.hypot(r["x"], r["y"]) - I.BLOCKS) < 2e-3 for r in blocks)
    angle = {r["rank"]: math.atan2(r["y"], r["x"]) for r in ranks}
    for r in blocks:
        assert abs(math.atan2(r["y"], r["x"]) - angle[r["rank"]]) < 1e-2
    where = {(r["step"], r["block"]): int(r["rank"].split()[-1]) for r in blocks if r["layout"] == "zigzag"}
    assert all(where[step + 1, block] == (where[step, block] + 1) % 4 for step, block in where if step < 3)
    assert len({(r["x"], r["y"]) for r in ranks}) == 4


def test_sliding_window_band_and_weights():
    fig = I.sliding_window(8)
    cells = rows_with(fig, "w", "i", "j", "ok", "a")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 4))
    q, k = x, x @ rng.standard_normal((4, 4))
    i, j = np.arange(8)[:, None], np.arange(8)[None, :]
    for w in range(1, 9):
        band = causal_mask(8) & (i - j < w)
        got = [r for r in cells if r["w"] == w]
        assert [r["ok"] for r in got] == band.ravel().tolist()
        np.testing.assert_allclose([r["a"] for r in got], attention_weights(q, k, band).ravel(), atol=1e-3)
    assert all(r["ok"] == (r["i"] == r["j"]) for r in cells if r["w"] == 1)


def test_sliding_window_reach_grows_by_a_window_per_layer():
    """Through l layers of a window w, query i reaches back to i - l(w - 1): the figure marks for every pair the first
    layer that reaches it, with a second slider for the layers."""
    fig = I.sliding_window(12, layers=4)
    assert bindings(fig)["depth"]["max"] == 4
    reach = rows_with(fig, "w", "i", "j", "first")
    for w in (2, 3, 5):
        for r in (r for r in reach if r["w"] == w):
            assert r["first"] == max(1, math.ceil((r["i"] - r["j"]) / (w - 1))), r
        for layers in range(1, 5):
            back = min(11, layers * (w - 1))
            assert {r["j"] for r in reach if r["w"] == w and r["i"] == 11 and r["first"] <= layers} == \
                set(range(11 - back, 12))
            line = next(r["text"] for r in rows_with(fig, "w", "text") if (r["w"], r.get("l")) == (w, layers))
            assert line.endswith(f"query 11 reaches keys {11 - back} to 11")
    assert all(r["first"] == 1 and r["i"] == r["j"] for r in reach if r["w"] == 1)


def test_head_ablation_every_subset_restores_the_model():
    import torch

    from lib.model import TinyLM

    torch.manual_seed(0)
    model = TinyLM(10, 16, 2, 2)
    tokens = torch.randint(0, 10, (4, 8))
    with pytest.raises(ValueError, match="fit_head_means"):  # mean ablation needs the means
        I.head_ablation(model, tokens)
    model.fit_head_means(torch.randint(0, 10, (16, 8)))
    model.blocks[1].attention.ablated = {1}  # the caller's setting survives the figure
    fig = I.head_ablation(model, tokens, length=6)
    assert model.blocks[1].attention.ablated == {1}
    model.blocks[1].attention.ablated = set()
    assert len(bindings(fig)) == 4 and all(b["input"] == "checkbox" for b in bindings(fig).values())
    maps = rows_with(fig, "key", "head", "i", "w")
    assert len({r["key"] for r in maps}) == 16
    # one row of maps per layer; an ablated head's map is faded under a title that says so
    assert [len(row["hconcat"]) for row in fig.spec["vconcat"][:2]] == [2, 2]
    first = fig.spec["vconcat"][0]["hconcat"][0]
    assert "off_0 ? 'L1h0: ablated' : 'L1h0'" in json.dumps(first["title"])
    assert first["encoding"]["opacity"]["condition"]["test"] == "off_0"
    with torch.no_grad():
        _, weights = model(tokens, return_weights=True)
    intact = [w for r in maps if r["key"] == "0000" and r["head"] == "L2h1" for w in r["w"]]
    expected = [round(float(weights[1][0, 1, a, b]), 2) for a in range(6) for b in range(a + 1)]
    np.testing.assert_allclose(intact, expected, atol=0.011)
    moved = [w for r in maps if r["key"] == "1000" and r["head"] == "L2h1" for w in r["w"]]
    assert moved != intact, "ablating a layer-1 head should move layer 2's map"


# ------------------------------------------------------------------------------------------------ the output


def test_output_is_the_same_on_every_run_and_carries_a_first_frame():
    a, b = I.temperature_jacobian([1.0, 0.5, 0.0]), I.temperature_jacobian([1.0, 0.5, 0.0])
    bundle = a._repr_mimebundle_()
    assert bundle["text/html"] == b.html()
    assert base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")
    assert bundle["text/plain"] == "<interactive figure temperature: a slider: the multiplier c of the scores>"
    html = bundle["text/html"]
    assert html.startswith('<div class="sdpa-interactive" data-figure="temperature">')
    assert html.count(f'id="{a.element_id}"') == 1
    assert I.temperature_jacobian([1.0, 0.5, 0.1]).element_id != a.element_id


def test_without_vl_convert_the_figure_shows_without_its_first_frame(monkeypatch):
    monkeypatch.setitem(sys.modules, "vl_convert", None)  # as on Colab, which has Altair but not vl-convert
    bundle = I.sliding_window(4)._repr_mimebundle_()
    assert set(bundle) == {"text/html", "text/plain"}


def test_every_number_is_rounded():
    fig = I.online_softmax([0.123456789, 1.0, 2.0], [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]], 2)
    text = json.dumps(fig.spec["datasets"])
    assert not re.search(r"\d\.\d{5,}", text), "unrounded numbers make the output differ between machines"


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: I.temperature_jacobian("1 2 3"), TypeError, "scores"),
        (lambda: I.temperature_jacobian([1.0]), ValueError, "scores"),
        (lambda: I.temperature_jacobian([1.0, 2.0], multipliers=[1, 2, 4]), ValueError, "multipliers"),
        (lambda: I.query_angle([[1, 0, 0]], [[1, 0, 0]]), ValueError, "keys"),
        (lambda: I.query_angle(KEYS, VALUES, length=-1), ValueError, "length"),
        (lambda: I.score_products(KEYS, [[1.0, 2.0, 3.0]]), ValueError, "Q and K"),
        (lambda: I.mask_alignment(0), ValueError, "max_L"),
        (lambda: I.mask_alignment(3, 2.5), TypeError, "max_S"),
        (lambda: I.online_softmax([1.0, 2.0], [[1.0, 2.0], [3.0, 4.0]], 3), ValueError, "block"),
        (lambda: I.online_softmax([1.0, 2.0], np.ones((2, 5)), 1), ValueError, "values"),
        (lambda: I.online_softmax([1.0, np.nan], [[1.0, 2.0], [3.0, 4.0]], 1), ValueError, "scores"),
        (lambda: I.tile_roofline(tiles=(64, 32)), ValueError, "tiles"),
        (lambda: I.tile_roofline(gpu="Z1"), ValueError, "GPU"),
        (lambda: I.head_ablation(object(), None), TypeError, "model"),
        (lambda: I.ring_steps(world_size=1), ValueError, "world_size"),
        (lambda: I.sliding_window(30), ValueError, "n"),
    ],
)
def test_bad_arguments_are_named(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_score_products_text_panel_holds_its_longest_sum():
    """Figure 2.2 clipped its written-out sums by up to 30 px: the panel is as wide as its longest line needs
    (0.45 of the font size per character, as Chromium measures Vega's sans-serif, plus room)."""
    rng = np.random.default_rng(1)
    fig = I.score_products(np.round(rng.standard_normal((6, 4)) * 1.3, 2), rng.standard_normal((6, 4)),
                           ["the", "cat", "sat", "on", "the", "mat"])
    shorts = [r["short"] for r in rows_with(fig, "short", "S")]
    # three lines each: the products in two halves, then the scale and the score, the same sum as the tooltip's
    assert all(len(s.split("\n")) == 3 and s.split("\n")[2].startswith("× 0.5 = ") for s in shorts)
    tips = {r["sum"] for r in rows_with(fig, "sum")}
    assert {s.split(": ", 1)[1].replace("\n", " ") for s in shorts} == tips
    longest = max(len(line) for s in shorts for line in s.split("\n"))
    panel = next(c for c in fig.spec["hconcat"] if "written out" in json.dumps(c.get("title", "")))
    assert panel["width"] >= 0.45 * 11 * longest + 10, (panel["width"], longest)
    # the panel is laid out for every row's sums (drawn unseen), not only the row the slider shows at first
    unseen, shown = panel["layer"]
    assert unseen["mark"]["opacity"] == 0 and "transform" not in unseen and shown["transform"]


def colour_words_and_marks(spec):
    """(title, the colours its marks are drawn in) for every titled panel of the spec."""
    found = []

    def colours(node):  # every colour written in the panel's marks, encodings and scales
        if isinstance(node, str):
            return {node.upper()} if re.fullmatch(r"#[0-9A-Fa-f]{6}", node) else set()
        values = node.values() if isinstance(node, dict) else node if isinstance(node, list) else []
        return set().union(*[colours(value) for value in values])

    def walk(node):
        if isinstance(node, dict):
            title = node.get("title")
            if isinstance(title, str) and ("layer" in node or "mark" in node):
                found.append((title, colours(node)))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(spec)
    return found


COLOUR_WORDS = {"blue": {I.BLUE}, "orange": {I.ORANGE}, "green": {I.GREEN}, "grey": {I.GREY},
                "red": set(), "yellow": set(), "pink": {I.PINK}}  # the palette has no red: #D55E00 is vermillion


def every_figure():
    import torch

    from lib.model import TinyLM

    torch.manual_seed(0)
    lm, tokens = TinyLM(12, 16, 2, 2, d_ff=0), torch.randint(0, 12, (8, 10))
    lm.fit_head_means(tokens)
    return [I.temperature_jacobian([1.6, 1.3, 0.9, 0.0]), I.query_angle(KEYS, VALUES), I.score_products(KEYS, VALUES),
            I.mask_alignment(4, 4), I.online_softmax([1.0, 3.0, 0.5, 2.0, 5.0, -1.0], np.eye(6)[:, :3], 2),
            I.tile_roofline(1024, 64, tiles=(32, 64, 128)), I.head_ablation(lm, tokens, length=8),
            I.ring_steps(512, 4, tile=32), I.sliding_window(8)]


def test_a_colour_named_in_a_title_is_the_colour_of_its_marks():
    """Figure 7.3 said "red: running max m" and 12.5 "red: this step" over vermillion marks a reader calls orange."""
    checked = 0
    for fig in every_figure():
        for title, colours in colour_words_and_marks(fig.spec):
            for word in re.findall(r"[a-z]+", title.lower()):
                if word in COLOUR_WORDS:
                    checked += 1
                    assert COLOUR_WORDS[word] & colours, f"{fig.name}: {title!r} names {word}, drawn in {colours}"
    assert checked >= 2, "no title names a colour: the check checked nothing"


def test_a_slider_leaves_room_for_its_focus_ring():
    """The keyboard focus ring of a slider covered the value printed after it."""
    assert re.search(r"input\[type=range\] \{[^}]*margin-right: 0\.[5-9]rem", I.STYLE)


def tooltips(node):
    """Every tooltip line of a spec: (its field, its title)."""
    found = []
    if isinstance(node, dict):
        tip = node.get("tooltip")
        for line in tip if isinstance(tip, list) else [tip] if isinstance(tip, dict) else []:
            found.append((line.get("field"), line.get("title")))
        for key, value in node.items():
            if key != "datasets":
                found += tooltips(value)
    elif isinstance(node, list):
        for value in node:
            found += tooltips(value)
    return found


def test_every_tooltip_names_its_number_in_words():
    """Tooltips read raw field names ("what", "ok", "w", "v"): every line of every figure's tooltips has a title in
    words."""
    checked = 0
    for fig in every_figure():
        lines = tooltips(fig.spec)
        assert lines, f"{fig.name} has no tooltip"
        for field, title in lines:
            checked += 1
            assert title and re.search(r"[A-Za-z]{2}", title), f"{fig.name}: {field!r} has no title in words"
            # a field's own name is a title only where it is a word the chapter's reader knows
            assert title != field or field in {"weight", "score", "tiles", "rank"}, f"{fig.name}: {field!r} {title!r}"
    assert checked >= 30


def test_every_figure_carries_its_dark_colours():
    """The book's dark mode draws each figure in the colours its spec carries: the text and lines on its face, a
    masked cell and the text on it swap, and Vega's axes, legends and titles take light text on no background."""
    for fig in every_figure():
        dark = fig.spec["usermeta"]["dark"]
        assert set(dark["colours"]) == {I.FOREGROUND, I.GREY, I.MASKED_INK}
        assert dark["config"]["background"] == "transparent"
        assert dark["config"]["axis"]["labelColor"] == dark["config"]["title"]["color"] == I.LIGHT_TEXT
        text = json.dumps({k: v for k, v in fig.spec.items() if k not in ("datasets", "usermeta")})
        # text drawn on the face is in the swappable colour: no "black" outside the inks of coloured cells
        assert '"color": "black"' not in text.replace('"value": "black"', ""), fig.name


def test_the_controls_come_before_the_picture():
    """On a phone Figure 4.5's slider sat 850 px below the top of its picture: the snippet puts the controls first."""
    assert re.search(r"\.vega-bindings \{order: -1;", I.STYLE)


def test_the_bundle_matches_the_snippets():
    sys.path.insert(0, str(ROOT / "tools"))
    import interactive_figures

    flags = interactive_figures.versions()
    html = I.sliding_window(4).html()
    for key, version in flags.items():
        name = key.removesuffix("_version").replace("vegaembed", "vega-embed").replace("vegalite", "vega-lite")
        assert f'maybeLoadScript("{name}", "{version}")' in html, f"the snippet asks for another {name}"
    assert "window.vegaEmbed=" in interactive_figures.bundle_text()


# ------------------------------------------------------------------------------------------------ a tiny book

def figure_meta(name, caption):
    return {"mystnb": {"figure": {"name": f"fig-demo-{name}", "caption": caption},
                       "image": {"alt": f"The first frame of the {name} figure, as the chapter describes it."}}}


# The tiny book: the two figures the brief asks for first, then the seven others, each drawn by its one-line call.
DEMO = [
    ("markdown", "# Interactive figures\n\n{numref}`fig-demo-temperature` and {numref}`fig-demo-mask` move.", {}),
    ("code", (f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nimport numpy as np\nimport torch\n"
              "from lib import interactive\nfrom lib.model import TinyLM\n"
              "torch.manual_seed(0)\nlm, tokens = TinyLM(12, 16, 2, 2, d_ff=0), torch.randint(0, 12, (8, 10))\n"
              "lm.fit_head_means(tokens)"), {}),
    ("code", "interactive.temperature_jacobian([1.6, 1.3, 0.9, 0.0])",
     {"mystnb": {"figure": {"name": "fig-demo-temperature",
                            "caption": "The slider multiplies the scores by c: the weights and the Jacobian."},
                 "image": {"alt": "Bars of four softmax weights and a four by four Jacobian heatmap."}}}),
    ("code", "interactive.mask_alignment(4, 4)", figure_meta("mask", "Sliders set L and S; radio buttons the alignment.")),
    ("code", f"interactive.query_angle({KEYS}, {VALUES}, ['A', 'B', 'C'])", figure_meta("angle", "The query turns.")),
    ("code", f"interactive.score_products({KEYS}, {VALUES})", figure_meta("products", "A row written out.")),
    ("code", "interactive.online_softmax([1.0, 3.0, 0.5, 2.0, 5.0, -1.0], np.eye(6)[:, :3], 2)",
     figure_meta("online", "Blocks read so far.")),
    ("code", "interactive.tile_roofline(1024, 64, tiles=(32, 64, 128))", figure_meta("roofline", "The query tile.")),
    ("code", "interactive.head_ablation(lm, tokens, length=8)", figure_meta("heads", "Heads ablated.")),
    ("code", "interactive.ring_steps(512, 4, tile=32)", figure_meta("ring", "The ring's steps.")),
    ("code", "interactive.sliding_window(8)", figure_meta("window", "The window's width.")),
]
FIGURES = sum(1 for kind, text, _ in DEMO if text.startswith("interactive."))


@pytest.fixture(scope="module")
def demo_book(tmp_path_factory):
    import nbformat
    from nbclient import NotebookClient

    book = tmp_path_factory.mktemp("demo_book")
    nb = nbformat.v4.new_notebook()
    for kind, text, meta in DEMO:
        cell = nbformat.v4.new_markdown_cell(text) if kind == "markdown" else nbformat.v4.new_code_cell(text)
        cell.metadata.update(meta)
        nb.cells.append(cell)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(book)}}).execute()
    nbformat.write(nb, book / "demo.ipynb")
    (book / "_toc.yml").write_text("format: jb-book\nroot: demo\n")
    (book / "_config.yml").write_text(
        "title: demo\nexecute:\n  execute_notebooks: 'off'\nsphinx:\n  recursive_update: true\n"
        f"  local_extensions:\n    interactive_figures: {ROOT / 'tools'}\n    script_once: {ROOT / 'tools'}\n"
        "  config:\n    numfig: true\n    html_context:\n      default_mode: auto\n"
    )
    result = subprocess.run([str(pathlib.Path(sys.executable).parent / "jupyter-book"), "build", str(book),
                             "--warningiserror", "--keep-going"], check=False, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return book / "_build" / "html"


def test_demo_page_loads_the_bundle_once_from_its_own_folder(demo_book):
    page = (demo_book / "demo.html").read_text()
    scripts = re.findall(r'<script[^>]*src="([^"]*vega-bundle[^"]*)"', page)
    assert len(scripts) == 1 and not re.match(r"^\w+://", scripts[0]), scripts
    assert (demo_book / scripts[0].split("?")[0]).is_file()
    # a static label: the figure's number, caption and control; the first frame's alt text stays on the PNG
    assert page.count('class="sdpa-interactive" role="group" aria-label="Interactive figure 1: The slider multiplies '
                      'the scores by c: the weights and the Jacobian. Control: a slider: the multiplier c of the '
                      'scores;') == 1
    assert page.count('class="sdpa-interactive" role="group" aria-label="Interactive figure ') == FIGURES
    assert 'aria-label="Bars of four softmax weights' not in page
    assert page.count("window.vegaEmbed = wrapped") == 1, "the phone layout's wrapper of vegaEmbed is not on the page"
    assert re.search(r"Fig\. 1.{0,40}The slider multiplies the scores", page, re.DOTALL), "no numbered caption"
    # without scripts, each figure is its first frame: the stored PNG, copied beside the page, inside <noscript> at
    # the end of the figure's wrapper, with the cell's alt text
    frames = re.findall(r'<noscript><img alt="([^"]+)" class="sdpa-first-frame" src="([^"]+)" />\s*</noscript></div>'
                        r"</div>", page)
    wrappers = re.findall(r'<div class="output text_html"><div class="sdpa-interactive"', page)
    assert len(wrappers) == FIGURES, "the figure is not the first thing in its output box"
    assert len(frames) == FIGURES, f"{len(frames)} first frames for {FIGURES} figures"
    assert frames[0][0] == "Bars of four softmax weights and a four by four Jacobian heatmap."
    assert all((demo_book / src).read_bytes().startswith(b"\x89PNG") for _, src in frames)
    bytes_gained = len(page.encode()) + (demo_book / scripts[0].split("?")[0]).stat().st_size
    print(f"demo page: {len(page.encode())} bytes of HTML, bundle {bytes_gained - len(page.encode())} bytes")


@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium (apt-get install chromium-headless-shell)")
def test_demo_figures_move_from_the_keyboard_offline(demo_book):
    from playwright.sync_api import sync_playwright

    outside, errors = [], []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        folder = demo_book.as_uri()

        def guard(route):
            if route.request.url.startswith(folder + "/"):
                route.continue_()
            else:
                outside.append(route.request.url)
                route.abort()

        context.route(re.compile(".*"), guard)
        tab = context.new_page()
        tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        tab.on("pageerror", lambda e: errors.append(str(e)))
        tab.goto((demo_book / "demo.html").as_uri(), wait_until="load")
        figures = tab.locator(".sdpa-interactive")
        assert figures.count() == FIGURES
        svg = [figures.nth(n).locator("svg").first for n in range(FIGURES)]
        for picture in svg:
            picture.wait_for(timeout=20_000)
        for n in range(FIGURES):
            inputs = figures.nth(n).locator(".vega-bind input")
            labelled = inputs.evaluate_all("(els) => els.map((el) => el.labels.length > 0 && !!el.labels[0].textContent.trim())")
            assert labelled and all(labelled), f"figure {n}: an input without a label"

        def press(control, key, n):
            before = svg[n].inner_html()
            control.focus()
            tab.keyboard.press(key)
            tab.wait_for_timeout(400)
            assert svg[n].inner_html() != before, f"figure {n} did not change on {key}"

        press(figures.nth(0).locator("input[type=range]").first, "ArrowRight", 0)  # the multiplier c: 1 -> 2
        # L = 3 queries, S = 4 keys: the radio buttons' next option, bottom-right, shifts the mask by S - L = 1
        press(figures.nth(1).locator("input[type=radio]").first, "ArrowRight", 1)
        assert figures.nth(1).locator("input[type=radio]:checked").get_attribute("value") == "bottom-right"
        press(figures.nth(1).locator("input[type=range]").first, "ArrowRight", 1)  # L: 3 -> 4
        for n in range(2, FIGURES):  # every other figure: its first control, from the keyboard
            control = figures.nth(n).locator(".vega-bind input").first
            kind = control.get_attribute("type")
            if kind == "radio":  # the arrow moves from the chosen option to the next
                control = figures.nth(n).locator(".vega-bind input[type=radio]:checked").first
            press(control, "Space" if kind == "checkbox" else "ArrowRight", n)
        width = tab.evaluate("() => document.documentElement.scrollWidth")
        browser.close()
    assert not outside, f"requests left the page's folder: {outside}"
    assert not errors, f"console errors: {errors}"
    assert width <= 1400, "the page scrolls sideways"
