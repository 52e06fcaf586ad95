"""Explanatory diagrams that the chapters draw from their own numbers.

A data plot shows a measurement; a diagram here shows how a computation is put together (which vector meets
which, the shapes of the blocks), labelled with the very arrays a chapter has just computed, so that strict nbval
keeps the picture as true as the printed numbers. Each function takes those arrays, draws one figure in the book's
look (:func:`lib.notebook.use_book_style`: white face, viridis/cividis, the colour-blind-safe cycle) and returns it.
Chapters call them in one line, in a cell whose metadata numbers and captions the figure.
"""

from __future__ import annotations

import numpy as np

INK = "#222222"
BLUE, ORANGE, GREEN = "#0072B2", "#E69F00", "#009E73"


# ----------------------------------------------------------------------------------------------------------------
# shared primitives


def _canvas(width, height):
    """A figure with one axis-free panel whose data units are inches, origin at the bottom left."""
    import matplotlib.pyplot as plt

    from lib.notebook import use_book_style

    use_book_style()
    fig, ax = plt.subplots(figsize=(width, height))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.set_axis_off()
    fig.subplots_adjust(left=0, right=1, bottom=0, top=1)
    return fig, ax


def _box(ax, x, y, w, h, text="", face="white", edge=INK, size=9, weight="normal", colour=INK):
    """A rectangle with its lower-left corner at (x, y) and ``text`` centred in it."""
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), w, h, facecolor=face, edgecolor=edge, linewidth=1))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, color=colour,
                fontweight=weight, family="monospace")


def _arrow(ax, start, end, colour=INK, width=1.0):
    """A straight arrow from ``start`` to ``end``."""
    ax.annotate("", xy=end, xytext=start,
                arrowprops={"arrowstyle": "-|>", "color": colour, "lw": width, "shrinkA": 0, "shrinkB": 0})


def _numbers(vector, digits=2):
    """A short vector as text, ``[ 0.22 -0.17 -0.02]``."""
    return "[" + " ".join(f"{float(x):+.{digits}f}" for x in vector) + "]"


def _two_digits(value):
    """A matrix entry as it is printed inside its cell."""
    return f"{value:.2f}"


def _grid(ax, x, y, values, cell, cmap, label, low=None, high=None, text=None):
    """A matrix drawn as coloured cells, top-left entry at the top left, ``label`` above it.

    ``values`` decides the colours (scaled to ``low``..``high``); ``text`` formats each entry inside its cell.
    Returns the box (x, y, width, height) the grid occupies.
    """
    import matplotlib as mpl

    values = np.asarray(values, dtype=float)
    rows, cols = values.shape
    low = values.min() if low is None else low
    high = values.max() if high is None else high
    colours = mpl.colormaps[cmap]((values - low) / max(high - low, 1e-12))
    for r in range(rows):
        for c in range(cols):
            cx, cy = x + c * cell, y + (rows - 1 - r) * cell
            _box(ax, cx, cy, cell, cell, face=colours[r, c], edge="white")
            if text is not None:
                luminance = 0.299 * colours[r, c, 0] + 0.587 * colours[r, c, 1] + 0.114 * colours[r, c, 2]
                ax.text(cx + cell / 2, cy + cell / 2, text(values[r, c]), ha="center", va="center",
                        fontsize=6.5, color="black" if luminance > 0.5 else "white")
    width, height = cols * cell, rows * cell
    ax.add_patch(mpl.patches.Rectangle((x, y), width, height, fill=False, edgecolor=INK, linewidth=1))
    ax.text(x + width / 2, y + height + 0.08, label, ha="center", va="bottom", fontsize=9.5)
    return x, y, width, height


# ----------------------------------------------------------------------------------------------------------------
# chapters 1-3


def one_query_dataflow(query, keys, values, weights, output, t=1):
    """Chapter 1: one query against every key, its scores, the division by sqrt(d_k), the weights, the mix.

    ``query`` is q_t (d_k,), ``keys`` and ``values`` are (n, d_k) and (n, d_v), ``weights`` the softmax weights
    (n,) and ``output`` the weighted mix (d_v,); ``t`` is the 1-based position of the query, as in chapter 1.
    """
    query, keys, values = np.asarray(query), np.asarray(keys), np.asarray(values)
    weights, output = np.asarray(weights), np.asarray(output)
    n, d_k = keys.shape
    scores = keys @ query
    scaled = scores / np.sqrt(d_k)
    row_h, box_h, top = 0.66, 0.48, 0.75 + 0.66 * n
    fig, ax = _canvas(10.4, top + 0.5)
    size = 9.5  # the numbers: the figure is shown about 0.75 times its size in the book's column
    # column: (left edge, width)
    columns = {"key": (1.95, 2.05), "score": (4.3, 0.85), "scaled": (5.4, 0.85), "weight": (6.5, 0.95),
               "value": (7.8, 1.65)}
    heads = {"key": "key $k_j$", "score": f"$q_{t} \\cdot k_j$", "scaled": f"$\\div\\sqrt{{{d_k}}}$",
             "weight": f"weight $\\alpha_{{{t}j}}$", "value": "value $v_j$"}
    for name, (x, w) in columns.items():
        ax.text(x + w / 2, top + 0.12, heads[name], ha="center", fontsize=11)
    centre = 0.75 + row_h * n / 2
    _box(ax, 0.05, centre - 0.3, 1.68, 0.6, _numbers(query), face="#E8F1F8", size=size)
    ax.text(0.89, centre + 0.42, f"query $q_{t}$", ha="center", fontsize=11, color=BLUE)
    right = {name: x + w for name, (x, w) in columns.items()}
    out_x, out_w = 9.7, 0.68
    for j in range(n):
        y = top - (j + 1) * row_h
        mid = y + box_h / 2
        _arrow(ax, (1.73, centre), (columns["key"][0] - 0.02, mid), colour=BLUE, width=0.8)
        _box(ax, columns["key"][0], y, columns["key"][1], box_h, f"{j + 1}: " + _numbers(keys[j]), size=size)
        _arrow(ax, (right["key"], mid), (columns["score"][0], mid))
        _box(ax, columns["score"][0], y, columns["score"][1], box_h, f"{scores[j]:+.3f}", size=size)
        _arrow(ax, (right["score"], mid), (columns["scaled"][0], mid))
        _box(ax, columns["scaled"][0], y, columns["scaled"][1], box_h, f"{scaled[j]:+.3f}", size=size)
        _arrow(ax, (right["scaled"], mid), (columns["weight"][0], mid))
        x_w, w_w = columns["weight"]
        _box(ax, x_w, y, w_w, box_h)
        _box(ax, x_w, y, w_w * weights[j], box_h, face=ORANGE, edge=ORANGE)
        ax.text(x_w + w_w - 0.05, mid, f"{weights[j]:.3f}", ha="right", va="center", fontsize=size,
                family="monospace")
        ax.text(columns["value"][0] - 0.15, mid, "×", ha="center", va="center", fontsize=12)
        _box(ax, columns["value"][0], y, columns["value"][1], box_h, _numbers(values[j]), size=size)
        _arrow(ax, (right["value"], mid), (out_x, centre), colour=GREEN, width=0.8)
    ax.text(x_w + w_w / 2, 0.42, "softmax: each $e^{s_j}$ over their sum; the bars add to 1",
            ha="center", fontsize=9.5, color="0.3")
    ax.text(out_x + out_w / 2, centre + 0.72, f"output$_{t}$", ha="center", fontsize=11, color=GREEN)
    ax.text(out_x + out_w / 2, top + 0.12, f"$\\sum_j \\alpha_{{{t}j}} v_j$", ha="center", fontsize=11)
    _box(ax, out_x, centre - 0.6, out_w, 1.2, "\n".join(f"{x:+.3f}" for x in output), face="#E6F4EF",
         size=size)
    ax.text(0.05, 0.08, f"n = {n} keys, d_k = {d_k}; the numbers are chapter 1's, rounded for the picture",
            fontsize=9, color="0.35")
    return fig


def matrix_form(Q, K, A, V, out, scale=None):
    """Chapter 2: softmax(Q Kᵀ · scale) V as blocks, each drawn from its own entries and labelled with its shape.

    The sizes follow the library's vocabulary: L queries and S keys of size E, values of size Ev.
    """
    import matplotlib as mpl

    Q, K, A, V, out = (np.asarray(x, dtype=float) for x in (Q, K, A, V, out))
    L, E = Q.shape
    S, Ev = V.shape
    scale = 1 / np.sqrt(E) if scale is None else scale
    scores = Q @ K.T * scale
    cell = 0.4  # inches: the figure is shown about 0.8 times its size in the book's column
    y_low, y_top = 0.75, 0.75 + L * cell + 1.25
    x_s = 0.3 + E * cell + 0.7 + S * cell + 1.25  # where the score block starts
    x_o = 0.3 + S * cell + 0.7 + Ev * cell + 0.7  # where the output block starts
    width = max(x_s + S * cell, x_o + Ev * cell + 2.6) + 0.15
    fig, ax = _canvas(width, y_top + L * cell + 0.45)

    def block(x, y, values, label, cmap="cividis", low=None, high=None, numbers=False):
        bound = np.abs(values).max()  # signed entries: 0 sits mid-scale
        low, high = (-bound, bound) if low is None else (low, high)
        box = _grid(ax, x, y, values, cell, cmap, label, low, high)
        if numbers:  # each entry inside its cell, dark on light colours and light on dark ones
            colours = mpl.colormaps[cmap]((values - low) / max(high - low, 1e-12))
            rows, cols = values.shape
            for r in range(rows):
                for c in range(cols):
                    luminance = colours[r, c, :3] @ [0.299, 0.587, 0.114]
                    ax.text(x + (c + 0.5) * cell, y + (rows - 0.5 - r) * cell, _two_digits(values[r, c]),
                            ha="center", va="center", fontsize=8.5,
                            color="black" if luminance > 0.5 else "white")
        return box

    def operator(x, y, symbol, size=16):
        ax.text(x, y, symbol, ha="center", va="center", fontsize=size, color=INK)

    _, _, wq, hq = block(0.3, y_top, Q, f"$Q$  (L, E) = ({L}, {E})")
    operator(0.3 + wq + 0.35, y_top + hq / 2, "@")
    block(0.3 + wq + 0.7, y_top + (hq - E * cell) / 2, K.T, f"$K^\\top$  (E, S) = ({E}, {S})")
    operator(x_s - 0.6, y_top + hq / 2 + 0.1, f"$\\times\\frac{{1}}{{\\sqrt{{{E}}}}}$", 13)
    operator(x_s - 0.6, y_top + hq / 2 - 0.4, "=", 14)
    block(x_s, y_top, scores, f"scores $S$  (L, S) = ({L}, {S})", numbers=True)
    start, end = (x_s - 0.1, y_top + 0.1), (0.3 + S * cell + 0.25, y_low + L * cell + 0.05)
    _arrow(ax, start, end)
    angle = np.degrees(np.arctan2(start[1] - end[1], start[0] - end[0]))  # 1 unit = 1 inch both ways
    ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.06, "softmax of each row", fontsize=10,
            ha="center", va="bottom", rotation=angle, rotation_mode="anchor")
    block(0.3, y_low, A, f"weights $A$  (L, S) = ({L}, {S})", "viridis", 0.0, A.max(), numbers=True)
    x_v = 0.3 + S * cell + 0.7
    operator(x_v - 0.35, y_low + L * cell / 2, "@")
    block(x_v, y_low + (L - S) * cell / 2, V, f"$V$  (S, Ev) = ({S}, {Ev})")
    operator(x_o - 0.35, y_low + L * cell / 2, "=")
    block(x_o, y_low, out, f"output  (L, Ev) = ({L}, {Ev})")
    ax.text(x_o + Ev * cell + 0.3, y_low + L * cell / 2,
            "row i of $S$: query i against\nevery key (one dot product each)\n\n"
            "row i of $A$: how query i shares\nits attention among the S keys\n\n"
            "row i of the output: those\nshares of the values, mixed",
            va="center", fontsize=9.5, color="0.3")
    ax.text(0.3, 0.1, f"L = S = {L} tokens, E = Ev = {E}: chapter 2's sentence. Colour shows each entry's value"
            "\n(cividis for signed numbers, viridis for weights).", fontsize=9, color="0.35")
    return fig


def saturation(score_rows, labels):
    """Chapter 3: for each score vector, its softmax weights and the softmax Jacobian diag(p) - p pᵀ.

    A spread-out row passes gradient through every entry of the Jacobian; a saturated one closes it.
    """
    import matplotlib.pyplot as plt

    from lib.attention import softmax
    from lib.notebook import use_book_style

    use_book_style()
    rows = len(score_rows)
    fig, axes = plt.subplots(rows, 3, figsize=(10, 2.9 * rows), gridspec_kw={"width_ratios": [1, 1, 1.1]})
    axes = np.atleast_2d(axes)
    for r, (scores, label) in enumerate(zip(score_rows, labels)):
        scores = np.asarray(scores, dtype=float)
        p = softmax(scores)
        jac = np.diag(p) - np.outer(p, p)
        keys = np.arange(len(scores))
        ax_s, ax_p, ax_j = axes[r]
        ax_s.bar(keys, scores, color=BLUE)
        ax_s.set(title=f"scores: {label}", xticks=keys, xlabel="key")
        ax_p.bar(keys, p, color=ORANGE)
        ax_p.set(title=f"weights, largest {p.max():.3f}", xticks=keys, ylim=(0, 1.05), xlabel="key")
        bound = 0.25
        ax_j.imshow(jac, cmap="cividis", vmin=-bound, vmax=bound)
        ax_j.grid(False)
        colours = plt.get_cmap("cividis")((jac + bound) / (2 * bound))
        for i in keys:
            for j in keys:
                entry = "0" if abs(jac[i, j]) < 5e-4 else f"{jac[i, j]:+.3f}"
                light = colours[i, j, :3] @ [0.299, 0.587, 0.114] > 0.5  # dark text on light cells
                ax_j.text(j, i, entry, ha="center", va="center", fontsize=8,
                          color="black" if light else "white")
        norm = np.linalg.norm(jac)
        ax_j.set(title=f"Jacobian $\\partial p_i/\\partial s_j$, norm {norm:.3g}", xticks=keys, yticks=keys,
                 xlabel="score j", ylabel="weight i")
    fig.suptitle("Large score gaps saturate the weights and close the Jacobian the gradient passes through")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------------------------
# chapter 12: two states merging, split-KV waves on the SMs, the ring step by step and its schedule, the all-to-all,
# a paged cache's block table


def ring_schedule(counts, titles, *, tile=64):
    """Draw ring steps (columns) by ranks (rows), one panel per layout, each cell the tiles that rank computes.

    ``counts`` is a list of tables as :func:`lib.ring.causal_tile_counts` returns them (a row per step, a count
    per rank), ``titles`` one title per table. Each cell names the key block the rank holds at that step (the
    block of rank (r - step) mod P) and its tile count, coloured on one shared scale; under each column the
    step's largest count (its slowest rank, which the step waits for). Returns the figure.
    """
    import matplotlib.pyplot as plt

    from lib.notebook import use_book_style

    use_book_style()
    tables = [np.asarray(c, dtype=int).T for c in counts]  # (ranks, steps)
    if len(titles) != len(tables):
        raise ValueError(f"{len(tables)} tables but {len(titles)} titles")
    top = max(int(t.max()) for t in tables)
    P = tables[0].shape[0]
    fig, axes = plt.subplots(1, len(tables), figsize=(4.4 * len(tables) + 1.2, 0.8 * P + 2.0), squeeze=False,
                             sharey=True, layout="constrained")
    for ax, table, title in zip(axes[0], tables, titles):
        image = ax.imshow(table, cmap="viridis", vmin=0, vmax=top, aspect="auto")
        for r in range(P):
            for s in range(P):
                light = table[r, s] < 0.6 * top
                ax.text(s, r, f"K{(r - s) % P}\n{table[r, s]}", ha="center", va="center", fontsize=9,
                        color="white" if light else "black")
        slowest = table.max(axis=0)
        ax.set_xticks(range(P), [f"step {s}\nmax {m}" for s, m in enumerate(slowest)], fontsize=9)
        ax.set_yticks(range(P), [f"rank {r}" for r in range(P)])
        ax.tick_params(length=0)
        ax.grid(False)
        ideal = table.sum() / P
        ax.set_title(f"{title}: {slowest.sum()} tiles on the critical path\n"
                     f"against {ideal:g} ideal ({slowest.sum() / ideal:.2f}x)", fontsize=10)
    fig.colorbar(image, ax=axes[0].tolist(), label=f"{tile}x{tile} tiles computed", shrink=0.9)
    return fig


def state_merge(out_a, lse_a, out_b, lse_b, out, lse, *, keys_a="keys 0-3", keys_b="keys 4-9"):
    """Draw the merge of two attention states, one query row a line (chapter 12).

    ``out_a`` (L, Ev) and ``lse_a`` (L,) are part A's state, ``out_b`` and ``lse_b`` part B's, ``out`` and ``lse``
    the merged state. Each row shows the two parts' outputs and logsumexps, a bar cut into the parts' weights
    e^(lse_A - lse) and e^(lse_B - lse), which add to 1, and the merged output, their weighted average.
    Returns the figure.
    """
    out_a, out_b, out = (np.asarray(x, dtype=float) for x in (out_a, out_b, out))
    lse_a, lse_b, lse = (np.asarray(x, dtype=float).reshape(-1) for x in (lse_a, lse_b, lse))
    L = out.shape[0]
    row_h, top = 0.95, 0.95 * L + 0.9
    fig, ax = _canvas(10.4, top + 0.35)
    cols = {"a": (0.75, 2.25), "b": (3.2, 2.25), "bar": (5.75, 2.3), "out": (8.45, 1.85)}
    heads = {"a": f"part A ({keys_a})", "b": f"part B ({keys_b})",
             "bar": "weights $e^{\\mathrm{lse}_A-\\mathrm{lse}}$ + $e^{\\mathrm{lse}_B-\\mathrm{lse}}$ = 1",
             "out": "merged state"}
    for name, (x, w) in cols.items():
        ax.text(x + w / 2, top + 0.05, heads[name], ha="center", fontsize=10.5)
    for i in range(L):
        y = top - (i + 1) * row_h
        ax.text(0.05, y + 0.4, f"row {i}", va="center", fontsize=10)
        for name, o, s, colour in (("a", out_a, lse_a, "#E8F1F8"), ("b", out_b, lse_b, "#FDF1DC")):
            x, w = cols[name]
            _box(ax, x, y + 0.05, w, 0.7, f"o = {_numbers(o[i], 3)}\nlse = {s[i]:+.3f}", face=colour, size=8.5)
        x, w = cols["bar"]
        wa = float(np.exp(lse_a[i] - lse[i]))
        _box(ax, x, y + 0.2, w * wa, 0.4, face=BLUE, edge=BLUE)
        _box(ax, x + w * wa, y + 0.2, w * (1 - wa), 0.4, face=ORANGE, edge=ORANGE)
        ax.text(x + 0.05, y + 0.4, f"{wa:.3f}", va="center", fontsize=9, color="white", family="monospace")
        ax.text(x + w - 0.05, y + 0.4, f"{1 - wa:.3f}", va="center", ha="right", fontsize=9, family="monospace")
        _arrow(ax, (cols["b"][0] + cols["b"][1] + 0.05, y + 0.4), (x - 0.05, y + 0.4))
        _arrow(ax, (x + w + 0.05, y + 0.4), (cols["out"][0] - 0.05, y + 0.4), colour=GREEN)
        x, w = cols["out"]
        _box(ax, x, y + 0.05, w, 0.7, f"o = {_numbers(out[i], 3)}\nlse = {lse[i]:+.3f}", face="#E6F4EF", size=8.5)
    ax.text(0.05, 0.12, "lse = log(e^lse_A + e^lse_B); o = (weight of A) o_A + (weight of B) o_B: "
            "an average of the parts' outputs, weighted by their shares of the row's total", fontsize=8.5,
            color="0.3")
    return fig


def split_kv_waves(programs, splits, sms, *, columns=12):
    """Draw the SMs of a GPU, wave by wave, as split-KV decoding fills them (chapter 12).

    ``programs`` is the number of programs for one slice (one per key/value head), ``splits`` a list of slice
    counts, one row of panels each, ``sms`` the GPU's SM count. Each panel is one wave: an SM is coloured by the
    key/value head whose program it runs, or left white when idle; the row's title gives programs, waves and the
    share of SMs kept busy. Returns the figure.
    """
    import matplotlib as mpl
    import matplotlib.pyplot as plt

    from lib.notebook import use_book_style

    use_book_style()
    splits = [int(s) for s in splits]
    waves = [-(-programs * s // sms) for s in splits]
    rows = -(-sms // columns)
    fig, axes = plt.subplots(len(splits), max(waves), figsize=(3.1 * max(waves) + 0.6, 2.35 * len(splits)),
                             squeeze=False, layout="constrained")
    colours = mpl.colormaps["viridis"](np.linspace(0, 0.9, programs))
    for row, (s, w) in enumerate(zip(splits, waves)):
        p = programs * s
        busy = p / (w * sms)
        for wave in range(max(waves)):
            ax = axes[row, wave]
            ax.set_xlim(0, columns)
            ax.set_ylim(rows, 0)
            ax.set_aspect("equal")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.grid(False)
            if wave >= w:
                ax.set_axis_off()
                continue
            for sm in range(sms):
                job = wave * sms + sm  # programs go to the SMs in order: head h's slices are h*s ... h*s+s-1
                face = colours[job // s] if job < p else "white"
                ax.add_patch(mpl.patches.Rectangle((sm % columns, sm // columns), 1, 1, facecolor=face,
                                                   edgecolor="0.6", linewidth=0.4))
            used = min(sms, p - wave * sms)
            ax.set_title(f"wave {wave + 1}: {used} of {sms} SMs busy", fontsize=9)
        axes[row, 0].set_ylabel(f"{s} slice{'s' if s > 1 else ''}\n{p} programs\n{busy:.2f} busy", fontsize=9.5,
                                rotation=0, ha="right", va="center")
    fig.suptitle(f"{sms} SMs, one program each; colour = the key/value head of its program, white = idle",
                 fontsize=9.5)
    return fig


def ring_step_tiles(N, world_size, layout="contiguous", *, tile=64):
    """The causal ring's work step by step: an int array (P, T, T), T = N/tile, for :func:`ring_steps` (chapter 12).

    Entry [t, i, j] is the rank that computes (query tile i, key tile j) of the whole attention matrix at ring step
    t, or -1 if no rank computes it then. Query tile i belongs to the rank holding its tokens
    (:func:`lib.ring.positions`); that rank meets key tile j's block at step (rank(i) - rank(j)) mod P, and computes
    the pair only if some key is at or before some query (j <= i), as :func:`lib.ring.causal_tile_counts` counts.
    """
    from lib import ring

    P = world_size
    if N % tile:
        raise ValueError(f"N={N} does not cut into tiles of {tile}")
    owner = np.empty(N, dtype=int)
    for r in range(P):
        owner[ring.positions(N, r, P, layout).numpy()] = r
    T = N // tile
    tiles = owner.reshape(T, tile)
    if (tiles != tiles[:, :1]).any():
        raise ValueError(f"tiles of {tile} tokens straddle two ranks in the {layout} layout")
    rank = tiles[:, 0]  # (T,) the rank that holds each tile
    step = (rank[:, None] - rank[None, :]) % P  # (T, T): when query tile i meets key tile j
    causal = np.tril(np.ones((T, T), dtype=bool))
    return np.stack([np.where(causal & (step == t), rank[:, None], -1) for t in range(P)])  # (P, T, T)


def ring_steps(schedules, titles):
    """Draw the causal ring step by step (chapter 12): one row per layout, one panel per step.

    ``schedules`` are arrays from :func:`ring_step_tiles`. Each panel is the whole attention matrix (query tiles
    down, key tiles across); the tiles computed at that step are coloured by the rank that computes them, the
    tiles of other steps are pale grey and the masked future is white. Under each panel, each rank's tile count at
    that step. Returns the figure.
    """
    import matplotlib as mpl
    import matplotlib.pyplot as plt

    from lib.notebook import use_book_style

    use_book_style()
    if len(titles) != len(schedules):
        raise ValueError(f"{len(schedules)} schedules but {len(titles)} titles")
    P, T, _ = np.asarray(schedules[0]).shape
    palette = mpl.colormaps["viridis"](np.linspace(0, 0.92, P))
    fig, axes = plt.subplots(len(schedules), P, figsize=(2.45 * P + 0.4, 2.75 * len(schedules)), squeeze=False,
                             layout="constrained")
    for row, (schedule, title) in enumerate(zip(schedules, titles)):
        schedule = np.asarray(schedule)
        done = (schedule >= 0).any(axis=0)  # (T, T) every computed tile, at any step
        for t in range(P):
            image = np.ones((T, T, 4))
            image[done] = (0.88, 0.88, 0.88, 1.0)
            now = schedule[t] >= 0
            image[now] = palette[schedule[t][now]]
            ax = axes[row, t]
            ax.imshow(image, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.grid(False)
            counts = [int((schedule[t] == r).sum()) for r in range(P)]
            ax.set_title(f"{title}, step {t}", fontsize=9.5)
            ax.set_xlabel("tiles per rank: " + " ".join(map(str, counts)), fontsize=8.5)
    handles = [mpl.patches.Patch(color=palette[r], label=f"rank {r}") for r in range(P)]
    handles.append(mpl.patches.Patch(color=(0.88, 0.88, 0.88), label="another step"))
    fig.legend(handles=handles, loc="outside lower center", ncol=P + 1, fontsize=9, frameon=False)
    return fig


def ulysses_all_to_all(world_size, n_heads, n_kv_heads, *, model=""):
    """Draw the all-to-all that turns sequence shards into head shards (chapter 12).

    Before: rank r holds its N/P tokens of every head, q and the output with ``n_heads`` heads, k and v with
    ``n_kv_heads``. After: it holds all N tokens of H/P query heads and Hkv/P key/value heads. Each cell (heads of one
    rank's share, sequence shard) is coloured by the rank that holds it; the hatched cells stay home, every other
    one crosses a link. Returns the figure.
    """
    import matplotlib as mpl

    P = int(world_size)
    if n_heads % P or n_kv_heads % P:
        raise ValueError(f"{P} ranks cannot share {n_heads} query and {n_kv_heads} key/value heads evenly")
    palette = mpl.colormaps["viridis"](np.linspace(0, 0.92, P))
    unit = 0.42  # inches per sequence shard
    per_head = min(0.06, 2.3 / n_heads)  # inches per head
    fig, ax = _canvas(10.4, n_heads * per_head + 1.55)
    base = 0.55
    spots = {"before": 0.55, "after": 5.75}
    for when, x0 in spots.items():
        x = x0
        for name, heads in (("q (and output)", n_heads), ("k, v (each)", n_kv_heads)):
            share = heads // P
            for shard in range(P):  # columns: sequence shards (token blocks)
                for part in range(P):  # rows: groups of heads, the share of each rank after the all-to-all
                    holder = shard if when == "before" else part
                    y = base + (heads - (part + 1) * share) * per_head
                    _box(ax, x + shard * unit, y, unit, share * per_head, face=palette[holder], edge="white")
                    if shard == part:  # the slice that stays on its rank
                        ax.add_patch(mpl.patches.Rectangle((x + shard * unit, y), unit, share * per_head,
                                                           fill=False, hatch="////", edgecolor="white",
                                                           linewidth=0))
            ax.add_patch(mpl.patches.Rectangle((x, base), P * unit, heads * per_head, fill=False, edgecolor=INK))
            ax.text(x + P * unit / 2, base + heads * per_head + 0.08, f"{name}: {heads} heads", ha="center",
                    fontsize=9)
            ax.text(x + P * unit / 2, base - 0.18, "token shards 0 to " + str(P - 1), ha="center", fontsize=8)
            x += P * unit + 0.35
    top = base + n_heads * per_head
    ax.text(spots["before"], top + 0.45, "before: rank r holds its N/P tokens of every head", fontsize=10)
    ax.text(spots["after"], top + 0.45, f"after: rank r holds all N tokens of 1/{P} of the heads", fontsize=10)
    _arrow(ax, (4.75, base + n_heads * per_head / 2), (5.55, base + n_heads * per_head / 2), width=1.6)
    ax.text(5.15, base + n_heads * per_head / 2 + 0.12, "all-to-all", ha="center", fontsize=9)
    label = f"{model}: " if model else ""
    ax.text(0.05, 0.06, f"{label}{P} ranks, colour = the rank holding the slice; hatched slices stay home, the "
            f"other {P - 1}/{P} of each cross a link", fontsize=8.5, color="0.3")
    return fig


def block_table(tables, lengths, page_size, num_pages):
    """Draw each sequence's block table, from its logical pages to the pool's physical pages (chapter 12).

    ``tables`` holds one block table per sequence (physical page numbers in logical order), ``lengths`` their token
    counts, ``page_size`` the rows of a page, ``num_pages`` the pool's size. Top: each sequence's logical pages,
    filled to the rows they hold; bottom: the pool, each page coloured by the sequence that owns it (free pages
    white); an arrow for each entry of each table. Returns the figure.
    """
    from matplotlib.colors import to_rgba

    colours = [BLUE, ORANGE, GREEN, "#CC79A7"]
    tint = [to_rgba(c, 0.45) for c in colours]
    w, h = 0.95, 0.55
    pool_y = 0.45
    fig, ax = _canvas(10.4, pool_y + h + 0.75 + 1.05 * len(tables))
    pool_x = (10.4 - num_pages * (w + 0.12)) / 2
    owner = {page: s for s, table in enumerate(tables) for page in table}
    for page in range(num_pages):
        x = pool_x + page * (w + 0.12)
        s = owner.get(page)
        _box(ax, x, pool_y, w, h, f"page {page}" if s is not None else f"page {page}\nfree",
             face=tint[s % 4] if s is not None else "white", size=8.5)
    ax.text(pool_x - 0.1, pool_y + h / 2, "pool", ha="right", va="center", fontsize=10)
    for s, (table, n) in enumerate(zip(tables, lengths)):
        y = pool_y + h + 0.7 + (len(tables) - 1 - s) * 1.05
        ax.text(0.1, y + h / 2, f"sequence {s}\n{n} tokens", va="center", fontsize=9.5)
        for i, page in enumerate(table):
            x = 1.55 + i * (w + 0.25)
            rows = min(page_size, n - i * page_size)
            _box(ax, x, y, w * rows / page_size, h, face=tint[s % 4], edge=tint[s % 4])
            _box(ax, x, y, w, h, f"[{i}] -> {page}", face="none", size=8.5)
            ax.text(x + w / 2, y + h + 0.05, f"tokens {i * page_size}-{i * page_size + rows - 1}", ha="center",
                    fontsize=7.5)
            _arrow(ax, (x + w / 2, y), (pool_x + page * (w + 0.12) + w / 2, pool_y + h), colour=colours[s % 4],
                   width=0.7)
    ax.text(10.3, 0.1, f"{page_size} rows a page, filled as shaded; token j of a sequence is row j mod {page_size} "
            f"of page table[j // {page_size}]", ha="right", fontsize=8.5, color="0.3")
    return fig



# --------------------------------------------------------------------------------------------------------------
# chapters 8 and 9: the memories, the ledger per score, where a forward tile lives on an H100, causal tiles, and
# schedules of the key loop
# --------------------------------------------------------------------------------------------------------------

_UNIT_COLORS = {"tensor cores": "#0072B2", "exponential unit": "#E69F00", "float32 lanes": "#009E73",
                "HBM": "#CC79A7"}


def score_ledger_bars(ledgers, measured=None, ax=None):
    """Picoseconds per score on each unit, for each head size: the units one after another (a stacked bar), a
    kernel that overlaps its softmax's two units (dashed) and one that overlaps them all (the longest unit alone,
    dotted), with SDPA's measured time per score as a tick.

    ``ledgers`` maps a label (e.g. "d = 64") to a :class:`lib.cost.ScoreLedger`; ``measured`` maps the same labels
    to measured seconds per score."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 3.8))
    rows = list(ledgers.items())
    for i, (label, ledger) in enumerate(rows):
        left = 0.0
        for unit in ("tensor cores", "exponential unit", "float32 lanes"):
            ps = ledger.seconds[unit] * 1e12
            ax.barh(i, ps, left=left, color=_UNIT_COLORS[unit], edgecolor="white",
                    label=unit if i == 0 else None)
            left += ps
        ax.plot([ledger.bound("full") * 1e12] * 2, [i - 0.42, i + 0.42], color="black", lw=1.5, ls=":",
                label="all units overlapped" if i == 0 else None)
        # the prediction's other end: float32 work hidden under the exponentials, products still in turn
        ax.plot([ledger.bound("softmax") * 1e12] * 2, [i - 0.42, i + 0.42], color="black", lw=1.5, ls="--",
                label="softmax overlapped" if i == 0 else None)
        if measured and label in measured:
            ax.plot([measured[label] * 1e12] * 2, [i - 0.42, i + 0.42], color="#D55E00", lw=2.5,
                    label="SDPA measured (cuDNN, by match)" if i == 0 else None)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.set_xlabel("picoseconds per score (one query-key pair), whole GPU")
    ax.set_title("At d = 64 the exponentials cost as much as the products")
    ax.invert_yaxis()
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize=9, frameon=False)
    ax.grid(axis="y", visible=False)
    return ax


def forward_tile_budget(tiles_kib, capacities_kib, ax=None):
    """One SM's two on-chip memories, registers and shared memory, as bars of their capacity, filled by what one
    program of the forward kernel keeps in each (KiB): the chapter's count for its tile choice."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 2.6))
    colors = ["#0072B2", "#56B4E9", "#E69F00", "#009E73", "#CC79A7", "#F0E442"]
    for i, (memory, parts) in enumerate(tiles_kib.items()):
        ax.barh(i, capacities_kib[memory], color="none", edgecolor="black", lw=1)
        left = 0.0
        for j, (what, kib) in enumerate(parts.items()):
            ax.barh(i, kib, left=left, color=colors[(3 * i + j) % len(colors)], edgecolor="white")
            if kib >= 12:
                ax.text(left + kib / 2, i, f"{what}\n{kib:.0f}", ha="center", va="center", fontsize=8)
            left += kib
        ax.text(capacities_kib[memory] + 3, i, f"of {capacities_kib[memory]:.0f} KiB", va="center", fontsize=9)
    ax.set_yticks(range(len(tiles_kib)), list(tiles_kib))
    ax.set_xlabel("KiB on one SM")
    ax.set_title("One program of the forward kernel fills most of an SM")
    ax.set_xlim(0, max(capacities_kib.values()) * 1.18)
    ax.invert_yaxis()
    ax.grid(axis="y", visible=False)
    return ax


def memory_hierarchy(levels, ax=None):
    """A GPU's memories as a ladder of boxes, largest at the bottom, each labelled with its size and, between two,
    the bandwidth that joins them (chapter 8). ``levels`` is a list of ``(name, size_text, link_text)`` from the
    largest memory to the smallest; ``link_text`` labels the arrow up to the next level (None for the last)."""
    if ax is None:
        fig, ax = _canvas(7.5, 0.95 * len(levels) - 0.15)
    else:
        fig = ax.figure
    colours = ["#CC79A7", "#56B4E9", "#009E73", "#E69F00", "#0072B2"]
    height, gap = 0.5, 0.45
    for i, (name, size, link) in enumerate(levels):
        width = 6.6 - 1.1 * i
        x, y = (7.5 - width) / 2, 0.15 + i * (height + gap)
        _box(ax, x, y, width, height, f"{name}: {size}", face=colours[i % len(colours)] + "55", size=9)
        if link:
            _arrow(ax, (3.75, y + height), (3.75, y + height + gap))
            ax.text(3.85, y + height + gap / 2, link, va="center", fontsize=8, color=INK)
    return fig


def causal_tile_walk(n, block_m, block_n, ax=None):
    """The key tiles each query block of a causal forward pass visits (chapter 9): whole tiles below the diagonal,
    tiles the diagonal crosses (visited and masked inside), and tiles wholly in the future (never read)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    rows, cols = -(-n // block_m), -(-n // block_n)
    kind = np.zeros((rows, cols))  # 0 skipped, 1 whole, 2 masked inside
    for i in range(rows):
        first, last = i * block_m, min(n, (i + 1) * block_m) - 1  # query rows of this block
        for j in range(cols):
            lo, hi = j * block_n, min(n, (j + 1) * block_n) - 1  # keys of this tile
            if lo > last:
                continue  # every key is in every row's future
            kind[i, j] = 1 if hi <= first else 2
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.6))
    cmap = ListedColormap(["#F2F2F2", BLUE, ORANGE])
    ax.imshow(kind, cmap=cmap, vmin=0, vmax=2, aspect=block_m / block_n * 0 + 1, interpolation="nearest")
    ax.set_xticks(np.arange(-0.5, cols, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, rows, 1), minor=True)
    ax.grid(which="minor", color="white", lw=1)
    ax.grid(which="major", visible=False)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel(f"key tile ({block_n} keys each)")
    ax.set_ylabel(f"query block\n({block_m} rows, one program)")
    visited = int((kind > 0).sum())
    ax.set_title(f"n = {n}: {visited} of {rows * cols} tiles visited")
    from matplotlib.patches import Patch

    handles = [Patch(color=BLUE, label="visited, no mask"), Patch(color=ORANGE, label="visited, masked inside"),
               Patch(facecolor="#F2F2F2", edgecolor="#999999", label="skipped: never read")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, fontsize=8, frameon=False)
    return ax


def _schedule(groups, tasks):
    """Greedy list scheduling: each group runs its tasks in order; tasks on "tensor" share one unit, one at a time;
    a group's "softmax" runs on its own warps. ``tasks`` is a list of (unit, name, width). Returns the bars
    (group, start, name, width) and the finishing time."""
    nxt, ready, core_free, bars = [0] * groups, [0.0] * groups, 0.0, []
    while any(i < len(tasks) for i in nxt):
        def start(g, core_free=core_free):  # this round's state
            unit = tasks[nxt[g]][0]
            return max(ready[g], core_free) if unit == "tensor" else ready[g]

        g = min((g for g in range(groups) if nxt[g] < len(tasks)), key=start)
        unit, name, width = tasks[nxt[g]]
        t0 = start(g)
        bars.append((g, t0, name, width))
        ready[g] = t0 + width
        if unit == "tensor":
            core_free = t0 + width
        nxt[g] += 1
    return bars, max(ready)


def warpgroup_schedules(ledger, tiles=3, ax=None):
    """Three schedules of the key loop (chapter 9), drawn to the ledger's times for one block of query rows. Top: this
    library's kernel, 8 warps in two warp groups of 64 rows each, kept in step by the loop's barriers, so their
    products and their softmax take turns. Middle: the same two groups in ping-pong, as FlashAttention-3 schedules
    them, one group's softmax under the other's products. A warp group's 4 warps span the SM's 4 sub-partitions, so
    a group's softmax over half the rows has the exponential and float32 units to itself and takes half the block's
    softmax time, as its products take half the tensor time. Bottom: one group that issues the next tile's QKᵀ
    before this tile's softmax. ``ledger`` is a :class:`lib.cost.ScoreLedger`; widths are its picoseconds per
    score. Returns each schedule's finishing time."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t = ledger.seconds
    mma = t["tensor cores"] * 1e12 / 2  # one of the two products
    soft = max(t["exponential unit"], t["float32 lanes"]) * 1e12  # its two units overlapping each other
    colour = {"QKᵀ": BLUE, "softmax": ORANGE, "PV": "#56B4E9"}
    turn = [("tensor", "QKᵀ", mma), ("own", "softmax", soft), ("tensor", "PV", mma)] * tiles
    half = [("tensor", "QKᵀ", mma / 2), ("own", "softmax", soft / 2), ("tensor", "PV", mma / 2)] * tiles
    lanes = []  # (row, start, name, width)
    bars, end_turn = _schedule(1, turn)
    lanes += [(0.0, s0, n_, w) for _, s0, n_, w in bars]
    bars, end_pp = _schedule(2, half)
    lanes += [(0.8 + 0.45 * g, s0, n_, w) for g, s0, n_, w in bars]
    # one group, pipelined: QKᵀ of tile j + 1 runs on the tensor cores during the softmax of tile j
    clock, row = mma, 2.5
    lanes.append((row - 0.2, 0.0, "QKᵀ", mma))
    for j in range(tiles):
        lanes.append((row + 0.2, clock, "softmax", soft))
        if j < tiles - 1:
            lanes.append((row - 0.2, clock, "QKᵀ", mma))
        clock += max(soft, mma if j < tiles - 1 else 0.0)
        lanes.append((row - 0.2, clock, "PV", mma))
        clock += mma
    end_pipe = clock
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 3.4))
    for y, s0, name, width in lanes:
        ax.barh(y, width, left=s0, height=0.36, color=colour[name], edgecolor="white")
    for y, end in ((0.0, end_turn), (1.025, end_pp), (2.5, end_pipe)):
        ax.text(end + 0.03, y, f"{end:.2f}", va="center", fontsize=8)
    ax.set_yticks([0.0, 0.8, 1.25, 2.5],
                  ["two groups in step,\nin turn (this kernel)", "ping-pong, group 1", "group 2", "one group,\nnext QKᵀ early"])
    ax.invert_yaxis()
    ax.set_xlim(0, end_turn * 1.12)
    ax.set_xlabel(f"picoseconds per score, {tiles} key tiles (the ledger's times at d = {ledger.d}, H100)")
    ax.set_title("The same work, three schedules: overlap hides the softmax")
    ax.legend(handles=[Patch(color=c, label=w) for w, c in colour.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.25), ncol=3, fontsize=8, frameon=False)
    ax.grid(axis="y", visible=False)
    return {"in turn": end_turn, "ping-pong": end_pp, "pipelined": end_pipe}


# ----------------------------------------------------------------------------------------------------------------
# chapters 4-6: the score matrix and its masks (chapter 5), the module's data flow and its head split (chapter 6)

_MAY = "#0072B2"  # the book's blue: a pair that may attend
_MASKED = "#D9D9D9"  # light grey: a masked pair, whose score becomes -inf
_EMPTY = "#D55E00"  # vermilion: a query row with nothing to attend


def mask_grids(masks, titles, *, suptitle=None, xlabel="key position j", ylabel="query position i"):
    """Draw boolean masks (True = may attend, as SDPA and lib.attention) as grids of cells, side by side.

    Each mask is a 2-D boolean array, queries on rows and keys on columns. Allowed cells are blue, masked cells
    grey with a cross; a row with no allowed cell (an empty row, chapter 5) is marked on its right. Returns the
    figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    from lib.notebook import use_book_style

    use_book_style()
    masks = [np.asarray(m, dtype=bool) for m in masks]
    if any(m.ndim != 2 for m in masks):
        raise ValueError(f"each mask must be 2-D (queries, keys), got shapes {[m.shape for m in masks]}")
    if len(titles) != len(masks):
        raise ValueError(f"{len(masks)} masks but {len(titles)} titles")
    widths = [m.shape[1] + 1.5 for m in masks]  # room on the right for the empty-row marks
    height = max(m.shape[0] for m in masks)
    fig, axes = plt.subplots(
        1, len(masks), figsize=(0.42 * sum(widths) + 0.6, 0.42 * height + 1.9),
        gridspec_kw={"width_ratios": widths}, squeeze=False, layout="constrained",
    )
    any_empty = False
    for ax, mask, title in zip(axes[0], masks, titles):
        L, S = mask.shape
        for i in range(L):
            for j in range(S):
                colour = _MAY if mask[i, j] else _MASKED
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=colour, edgecolor="white", lw=1.5))
                if not mask[i, j]:
                    ax.plot([j - 0.2, j + 0.2], [i - 0.2, i + 0.2], color="#8C8C8C", lw=1)
                    ax.plot([j - 0.2, j + 0.2], [i + 0.2, i - 0.2], color="#8C8C8C", lw=1)
            if not mask[i].any():
                any_empty = True
                ax.annotate("", xy=(S - 0.45, i), xytext=(S + 0.6, i),
                            arrowprops={"arrowstyle": "-|>", "color": _EMPTY, "lw": 1.5})
        ax.set_xlim(-0.5, S + 1.0)
        ax.set_ylim(L - 0.5, -0.5)
        ax.set_aspect("equal")
        ax.set_xticks(range(S))
        ax.set_yticks(range(L))
        ax.tick_params(length=0)
        ax.grid(False)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(title, fontsize=11)
        ax.set_xlabel(xlabel)
    axes[0][0].set_ylabel(ylabel)
    handles = [Patch(facecolor=_MAY, label="may attend (True): score kept"),
               Patch(facecolor=_MASKED, edgecolor="#8C8C8C", label="masked (False): score set to $-\\infty$")]
    if any_empty:
        handles.append(Patch(facecolor=_EMPTY, label="empty row: no key to attend"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False, fontsize=9.5)
    if suptitle:
        fig.suptitle(suptitle)
    return fig


def _shape(x):
    return tuple(x) if isinstance(x, tuple) else tuple(np.shape(x))


def module_dataflow(*, X, w_q, w_k, w_v, Q, K, V, A, out, w_o=None, unit=0.035):
    """Draw a self-attention module's data flow, x -> W_Q, W_K, W_V -> attention -> W_O, to scale.

    Each argument is an array (drawn as a small heatmap of its values, cividis) or a shape tuple (drawn empty,
    hatched). Every block is a rectangle of ``unit`` inches per row and per column, labelled with its name and
    shape, so the figure shows the chapter's own sizes (chapter 6). Returns the figure.
    """
    import matplotlib.pyplot as plt

    from lib.notebook import use_book_style

    use_book_style()
    n, d_model = _shape(X)
    for name, w, rows in (("W_Q", w_q, d_model), ("W_K", w_k, d_model), ("W_V", w_v, d_model)):
        if _shape(w)[0] != rows:
            raise ValueError(f"{name} has shape {_shape(w)}, but X has {d_model} columns")
    if _shape(A) != (n, n) or _shape(out)[0] != n:
        raise ValueError(f"weights {_shape(A)} and output {_shape(out)} do not fit {n} tokens")

    gap, space = 0.9, 0.5  # inches between columns of blocks, and between blocks
    columns = [[("X", X)], [("$W_Q$", w_q), ("$W_K$", w_k), ("$W_V$", w_v)],
               [("$Q$", Q), ("$K$", K), ("$V$", V)], [("$A$", A)], [("$AV$", out)]]
    if w_o is not None:
        columns += [[("$W_O$", w_o)], [("output", (n, _shape(w_o)[1]))]]
    col_w = [max(_shape(a)[1] for _, a in col) * unit for col in columns]
    col_h = [sum(_shape(a)[0] * unit for _, a in col) + space * (len(col) - 1) for col in columns]
    width, height = sum(col_w) + gap * (len(columns) - 1) + 0.4, max(col_h) + 1.1
    fig, ax = plt.subplots(figsize=(width, height))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    boxes = {}  # name -> (x0, y0, w, h)
    x = 0.2
    for col, cw, ch in zip(columns, col_w, col_h):
        y = (height + ch) / 2 - 0.05  # top of the column, centred
        for name, a in col:
            rows, cols = _shape(a)
            w, h = cols * unit, rows * unit
            y0 = y - h
            if isinstance(a, tuple):
                ax.add_patch(plt.Rectangle((x, y0), w, h, facecolor="white", edgecolor="#444444",
                                           hatch="///", lw=1, linestyle="--"))
            else:
                ax.imshow(np.asarray(a, dtype=float), cmap="cividis", aspect="auto",
                          extent=(x, x + w, y0, y), interpolation="nearest")
                ax.add_patch(plt.Rectangle((x, y0), w, h, fill=False, edgecolor="#444444", lw=1))
            ax.text(x + w / 2, y0 - 0.06, f"{name}  {rows}×{cols}", ha="center", va="top", fontsize=13)
            boxes[name] = (x, y0, w, h)
            y = y0 - space
        x += cw + gap

    def arrow(src, dst, label=None, dashed=False, low=False, below=False):
        x0, y0, w0, h0 = boxes[src]
        x1, y1, _, h1 = boxes[dst]
        ax.annotate("", xy=(x1 - 0.04, y1 + (0.15 if low else 0.5) * h1), xytext=(x0 + w0 + 0.04, y0 + h0 / 2),
                    arrowprops={"arrowstyle": "-|>", "color": "#444444", "lw": 1.1,
                                "linestyle": "--" if dashed else "-"})
        if label:
            middle = (y0 + h0 / 2 + y1 + h1 / 2) / 2
            ax.text((x0 + w0 + x1) / 2, middle - 0.08 if below else middle + 0.08, label,
                    ha="center", va="top" if below else "bottom", fontsize=10)

    for w_name, target in (("$W_Q$", "$Q$"), ("$W_K$", "$K$"), ("$W_V$", "$V$")):
        arrow("X", w_name)
        arrow(w_name, target)
    arrow("$Q$", "$A$")
    arrow("$K$", "$A$")
    xa, ya, wa, ha = boxes["$A$"]
    ax.text(xa + wa / 2, ya + ha + 0.08, "softmax", ha="center", va="bottom", fontsize=13)
    arrow("$A$", "$AV$")
    arrow("$V$", "$AV$", low=True)
    if w_o is not None:
        arrow("$AV$", "$W_O$", dashed=True)
        arrow("$W_O$", "output", dashed=True)
    formula = "$Q, K, V = XW_Q, XW_K, XW_V$     $A = $softmax$(QK^\\top/\\sqrt{d_k})$ by rows     output $= AV$"
    if w_o is not None:
        formula += "$\\,W_O$"
    ax.text(width / 2, height - 0.05, formula, ha="center", va="top", fontsize=13, color="#444444")
    return fig


def head_split(q, heads, merged, *, unit=0.09):
    """Draw one sequence's split into heads and back (chapter 6): q (n, d_model) cut into h column groups,
    the h heads' (n, d_k) blocks that attention works on, and their outputs side by side again.

    ``q`` is (n, d_model), ``heads`` the attention outputs of that sequence, (h, n, d_k), and ``merged`` their
    (n, d_model) concatenation. Each head has its own colour frame. Returns the figure.
    """
    import matplotlib.pyplot as plt

    from lib.notebook import use_book_style

    use_book_style()
    q, heads, merged = (np.asarray(a, dtype=float) for a in (q, heads, merged))
    h, n, d_k = heads.shape
    if q.shape != (n, h * d_k) or merged.shape != (n, h * d_k):
        raise ValueError(f"q {q.shape} and merged {merged.shape} must be (n, h*d_k) = {(n, h * d_k)}")
    colours = [BLUE, ORANGE, GREEN, "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", INK]
    wide, tall = h * d_k * unit, n * unit
    space = 0.25
    stack = h * tall + (h - 1) * space
    gap = 1.3
    width = 2 * wide + 2 * d_k * unit + 3 * gap + 0.4
    height = stack + 1.4
    fig, ax = plt.subplots(figsize=(width, height))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")

    def block(x, y, values, edge, label=None):
        w, t = values.shape[1] * unit, values.shape[0] * unit
        ax.imshow(values, cmap="cividis", aspect="auto", extent=(x, x + w, y, y + t), interpolation="nearest",
                  zorder=2)
        ax.add_patch(plt.Rectangle((x, y), w, t, fill=False, edgecolor=edge, lw=2, zorder=3))
        if label:
            ax.text(x + w / 2, y - 0.05, label, ha="center", va="top", fontsize=10)

    def wide_block(x, values, name):
        y = (height - tall) / 2
        block(x, y, values, INK, f"{name}  {n}×{h * d_k}")
        for i in range(h):  # each head's columns framed in its colour
            ax.add_patch(plt.Rectangle((x + i * d_k * unit, y), d_k * unit, tall, fill=False,
                                       edgecolor=colours[i % len(colours)], lw=2, zorder=3))
            ax.text(x + (i + 0.5) * d_k * unit, y + tall + 0.05, f"head {i}", ha="center", va="bottom",
                    fontsize=9, color=colours[i % len(colours)])
        return y

    x0 = 0.2
    y_mid = wide_block(x0, q, "$Q$") + tall / 2
    x1 = x0 + wide + gap
    x2 = x1 + d_k * unit + gap
    top = (height + stack) / 2 - 0.1
    for i in range(h):
        y = top - (i + 1) * tall - i * space
        colour = colours[i % len(colours)]
        block(x1, y, q[:, i * d_k:(i + 1) * d_k], colour)
        block(x2, y, heads[i], colour)
        fan = y_mid + (h / 2 - i - 0.5) * tall / h  # head i's arrows leave and enter at their own height
        ax.annotate("", xy=(x1 - 0.05, y + tall / 2), xytext=(x0 + wide + 0.05, fan),
                    arrowprops={"arrowstyle": "-|>", "color": colour, "lw": 1}, zorder=1)
        ax.annotate("", xy=(x2 - 0.05, y + tall / 2), xytext=(x1 + d_k * unit + 0.05, y + tall / 2),
                    arrowprops={"arrowstyle": "-|>", "color": colour, "lw": 1})
        ax.annotate("", xy=(x2 + d_k * unit + gap - 0.05, fan), xytext=(x2 + d_k * unit + 0.05, y + tall / 2),
                    arrowprops={"arrowstyle": "-|>", "color": colour, "lw": 1}, zorder=1)
    ax.text(x1 + d_k * unit / 2, 0.02, f"{h} heads of $Q$,\n{n}×{d_k} each", ha="center", va="bottom", fontsize=10)
    ax.text(x2 + d_k * unit / 2, 0.02, f"attention per\nhead, {n}×{d_k}", ha="center", va="bottom", fontsize=10)
    ax.text((x0 + wide + x1) / 2, height - 0.05, "reshape,\ntranspose(1, 2)", ha="center", va="top", fontsize=9)
    x3 = x2 + d_k * unit + gap
    ax.text((x2 + d_k * unit + x3) / 2, height - 0.05, "transpose(1, 2),\nreshape", ha="center", va="top",
            fontsize=9)
    wide_block(x3, merged, "merged")
    return fig


# --------------------------------------------------------------------------------------------------------------
# Chapters 10 and 11: heads, and a model
# --------------------------------------------------------------------------------------------------------------

_HEAD_COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")


def _cells(ax, x0, y0, rows, cols, colour_of, cell=1.0, label=None):
    """Draw a rows × cols grid of cells at (x0, y0) (top-left), each cell filled by colour_of(r, c)."""
    from matplotlib.patches import Rectangle

    for r in range(rows):
        for c in range(cols):
            ax.add_patch(Rectangle((x0 + c * cell, y0 - (r + 1) * cell), cell, cell, facecolor=colour_of(r, c),
                                   edgecolor="white", linewidth=0.8))
    if label:
        ax.text(x0 + cols * cell / 2, y0 + 0.4, label, ha="center", va="bottom", fontsize=10)


def split_merge_heads(n, d_model, n_heads):
    """Chapter 10: one sequence's queries (n, d_model) cut into heads by a reshape and a transpose, then merged.

    Columns are coloured by the head that owns them; the middle panel shows the (h, n, d_head) stack that
    attention sees, one (n, d_head) matrix per head; the right panel the merge, every token's heads side by side.
    """
    import matplotlib.pyplot as plt

    if d_model % n_heads:
        raise ValueError(f"d_model={d_model} is not a multiple of n_heads={n_heads}")
    d_head = d_model // n_heads

    def by_column(r, c):
        return _HEAD_COLOURS[(c // d_head) % len(_HEAD_COLOURS)]

    gap = 3.0
    width = d_model + gap + n_heads * (d_head + 1) + gap + d_model
    fig, ax = plt.subplots(figsize=(min(10.0, 0.32 * width + 1), 0.32 * (n + 4) + 1.2))
    _cells(ax, 0, 0, n, d_model, by_column, label=f"q: ({n}, {d_model})")
    x = d_model + gap
    for h in range(n_heads):
        _cells(ax, x, 0, n, d_head, lambda r, c, h=h: _HEAD_COLOURS[h % len(_HEAD_COLOURS)],
              label=f"head {h}")
        x += d_head + 1
    ax.text(d_model + gap + (n_heads * (d_head + 1) - 1) / 2, -n - 1.2,
            f"reshape to ({n}, {n_heads}, {d_head}),\ntranspose to ({n_heads}, {n}, {d_head})",
            ha="center", va="top", fontsize=9)
    x += gap - 1
    _cells(ax, x, 0, n, d_model, by_column, label=f"merged: ({n}, {d_model})")
    ax.text(x + d_model / 2, -n - 1.2, "transpose back, reshape;\nthen @ W_O mixes the heads",
            ha="center", va="top", fontsize=9)
    for x_arrow in (d_model + 0.4, x - gap + 0.6):
        ax.annotate("", xy=(x_arrow + gap - 1, -n / 2), xytext=(x_arrow, -n / 2),
                    arrowprops={"arrowstyle": "->", "color": "0.3"})
    for r in range(n):
        ax.text(-0.4, -r - 0.5, f"token {r}", ha="right", va="center", fontsize=8)
    ax.set_xlim(-3.5, x + d_model + 0.5)
    ax.set_ylim(-n - 3.4, 1.6)
    ax.set_aspect("equal")
    ax.axis("off")
    return fig


def decoder_block(d_model, n_heads, n_kv_heads, d_ff, n_layers):
    """Chapter 11: the pre-norm residual block, the residual stream down the middle and two branches that add to it."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    fig, ax = plt.subplots(figsize=(8.0, 6.4))
    stream_x = 2.0

    def box(x, y, text, colour):
        ax.add_patch(FancyBboxPatch((x - 2.1, y - 0.38), 4.2, 0.76, boxstyle="round,pad=0.05",
                                    facecolor=colour, edgecolor="0.3"))
        ax.text(x, y, text, ha="center", va="center", fontsize=9)

    def arrow(x0, y0, x1, y1):
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops={"arrowstyle": "->", "color": "0.3"})

    ax.plot([stream_x, stream_x], [0.2, 9.4], color="0.3", linewidth=2.5, zorder=0)
    ax.text(stream_x - 0.25, 0.4, f"x: (B, L, {d_model})", ha="right", va="center", fontsize=9)
    ax.text(stream_x - 0.25, 9.3, "to the next block", ha="right", va="center", fontsize=9)
    group = n_heads // n_kv_heads
    kv = f"{n_kv_heads} key/value heads" + (f", groups of {group}" if group > 1 else "")
    branches = [
        (2.3, "LayerNorm", f"attention: {n_heads} heads of {d_model // n_heads}\nRoPE on q, k; {kv}",
         "#56B4E9", "KV cache: keys and values\nof every earlier token"),
        (6.0, "LayerNorm", f"MLP: {d_model} → {d_ff} → {d_model}\nGELU, token by token", "#E69F00", None),
    ]
    for y, norm, body, colour, side in branches:
        ax.plot([stream_x, 4.2], [y - 0.9, y - 0.9], color="0.3")
        box(5.8, y - 0.9, norm, "white")
        arrow(5.8, y - 0.5, 5.8, y + 0.1)
        box(5.8, y + 0.6, body, colour)
        arrow(5.8, y + 1.0, 5.8, y + 1.6)
        ax.plot([5.8, stream_x + 0.25], [y + 1.7, y + 1.7], color="0.3")
        ax.add_patch(plt.Circle((stream_x, y + 1.7), 0.25, facecolor="white", edgecolor="0.3", zorder=3))
        ax.text(stream_x, y + 1.7, "+", ha="center", va="center", fontsize=12, zorder=4)
        if side:
            ax.text(8.9, y + 0.6, side, ha="left", va="center", fontsize=8, color="0.25")
            ax.annotate("", xy=(7.95, y + 0.6), xytext=(8.85, y + 0.6),
                        arrowprops={"arrowstyle": "<->", "color": "0.5"})
    ax.text(stream_x + 0.4, 10.0, f"× {n_layers} blocks, then LayerNorm and the read-out to the vocabulary",
            ha="left", va="center", fontsize=9)
    ax.set_xlim(-1.2, 11.6)
    ax.set_ylim(0, 10.3)
    ax.axis("off")
    return fig


def ablation_heatmaps(panels, *, title=None, chance=None):
    """Chapter 11: ablation results as annotated heatmaps, one panel per metric or kind of ablation.

    ``panels`` is a list of (panel title, row labels, column labels, scores), ``scores`` a (rows, columns) array of
    accuracies in [0, 1]: one row per seed, one column per ablated head or layer. ``chance``, if given, is a level
    named in the colour bar (what guessing would score).
    """
    import matplotlib.pyplot as plt
    import numpy as np

    if not panels:
        raise ValueError("panels must hold at least one (title, rows, columns, scores)")
    widths = [len(cols) for _, _, cols, _ in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(min(12.0, 1.5 + 0.85 * sum(widths) + 1.2 * len(panels)),
                                                      0.5 * len(panels[0][1]) + 2.3),
                             gridspec_kw={"width_ratios": widths}, squeeze=False)
    for ax, (name, rows, cols, scores) in zip(axes[0], panels):
        scores = np.asarray(scores, dtype=float)
        if scores.shape != (len(rows), len(cols)):
            raise ValueError(f"scores of panel {name!r} must have shape {(len(rows), len(cols))}, got {scores.shape}")
        image = ax.imshow(scores, cmap="cividis", vmin=0, vmax=1, aspect="auto")
        for (r, c), value in np.ndenumerate(scores):
            ax.text(c, r, f"{value:.2f}", ha="center", va="center", fontsize=8,
                    color="black" if value > 0.55 else "white")
        ax.set_xticks(range(len(cols)), cols, rotation=30, ha="right", fontsize=8)
        ax.set_yticks(range(len(rows)), rows, fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.grid(False)
    bar = fig.colorbar(image, ax=list(axes[0]), shrink=0.8, label="held-out accuracy")
    if chance is not None:  # a tick of its own, so its label never sits on another
        bar.ax.axhline(chance, color="white", linewidth=1.5)
        ticks = [t for t in (0.0, 0.5, 1.0) if abs(t - chance) > 0.12] + [chance]
        bar.set_ticks(ticks, labels=[f"{t:.1f}" for t in ticks[:-1]] + [f"guessing, {chance:.2f}"])
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


# --------------------------------------------------------------------------------------------------------------
# Chapter 7: what attention costs, and the way out
# --------------------------------------------------------------------------------------------------------------


def running_state(row, block):
    """Chapter 7: one row's running maximum m and total ℓ = Σ exp(s - m) after each block of its scores."""
    import math

    m, total, states = -math.inf, 0.0, []
    for start in range(0, len(row), block):
        part = [float(x) for x in row[start:start + block]]
        m_new = max(m, max(part))
        total = total * math.exp(m - m_new) + sum(math.exp(x - m_new) for x in part)
        m = m_new
        states.append((m, total))
    return states


def tile_grid(scores, block_q, block_k):
    """Chapter 7: a score matrix cut into tiles, and each row's running (m, ℓ) after each key tile.

    The grid shows the scores (L, S) coloured and printed, tile boundaries drawn thick; beside each row, one column
    per key tile gives the running maximum m and total ℓ that the online softmax holds after that tile.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    scores = np.asarray(scores, dtype=float)
    L, S = scores.shape
    n_tiles = -(-S // block_k)
    fig, ax = plt.subplots(figsize=(min(11.0, 0.55 * S + 1.9 * n_tiles + 1.5), 0.55 * L + 1.6))
    ax.imshow(scores, cmap="viridis", extent=(0, S, L, 0), aspect="equal")
    for r in range(L):
        for c in range(S):
            ax.text(c + 0.5, r + 0.5, f"{scores[r, c]:.1f}", ha="center", va="center", fontsize=8,
                    color="white" if scores[r, c] < scores.mean() else "black")
    for x in range(0, S + 1, block_k):
        ax.axvline(min(x, S), color="white", linewidth=3)
    for y in range(0, L + 1, block_q):
        ax.axhline(min(y, L), color="white", linewidth=3)
    for r in range(L):
        for t, (m, total) in enumerate(running_state(scores[r], block_k)):
            ax.text(S + 0.4 + 2.0 * t, r + 0.5, f"m={m:.1f}\nℓ={total:.2f}", ha="left", va="center",
                    fontsize=8, linespacing=1.0)
    for t in range(n_tiles):
        ax.text(S + 0.4 + 2.0 * t, -0.3, f"after key\ntile {t + 1}", ha="left", va="bottom", fontsize=8)
    for qb in range(0, L, block_q):
        ax.text(-0.3, qb + min(block_q, L - qb) / 2, f"query\nblock {qb // block_q + 1}", ha="right",
                va="center", fontsize=8)
    ax.set_xlim(-2.2, S + 0.4 + 2.0 * n_tiles)
    ax.set_ylim(L + 0.2, -1.6)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)
    for spine in ax.spines.values():
        spine.set_visible(False)
    return fig


# --------------------------------------------------------------------------------------------------------------
# Chapter 13: the formula as models changed it
# --------------------------------------------------------------------------------------------------------------


def window_tiles(masks, titles, block):
    """Chapter 13: boolean masks (True = may attend) over a grid of (block × block) tiles, side by side.

    Allowed cells are blue; a tile with no allowed cell is hatched grey, a tile the kernel never visits. Each
    title gets the count of tiles visited. Returns the figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    from lib.notebook import use_book_style

    use_book_style()
    masks = [np.asarray(m, dtype=bool) for m in masks]
    fig, axes = plt.subplots(1, len(masks), figsize=(3.6 * len(masks), 4.1), squeeze=False, layout="constrained")
    for ax, mask, title in zip(axes[0], masks, titles):
        L, S = mask.shape
        ax.imshow(np.where(mask, 1.0, 0.0), cmap="Blues", vmin=-0.15, vmax=1.3, extent=(0, S, L, 0))
        visited = 0
        for i0 in range(0, L, block):
            for j0 in range(0, S, block):
                h, w = min(block, L - i0), min(block, S - j0)
                if mask[i0:i0 + h, j0:j0 + w].any():
                    visited += 1
                else:
                    ax.add_patch(Rectangle((j0, i0), w, h, facecolor="#D9D9D9", edgecolor="#8C8C8C",
                                           hatch="///", lw=0))
        for x in range(0, S + 1, block):
            ax.axvline(x, color=INK, lw=1.2)
        for y in range(0, L + 1, block):
            ax.axhline(y, color=INK, lw=1.2)
        ax.set(xlim=(0, S), ylim=(L, 0), xlabel="key position j", xticks=[], yticks=[])
        ax.set_title(f"{title}\n{visited} of {-(-L // block) * -(-S // block)} tiles visited", fontsize=11)
        ax.grid(False)
    axes[0][0].set_ylabel("query position i")
    fig.legend(handles=[Patch(facecolor="#3A7DC0", label="may attend"),
                        Patch(facecolor="#D9D9D9", edgecolor="#8C8C8C", hatch="///", label="tile skipped")],
               loc="outside lower center", ncol=2, frameon=False, fontsize=9.5)
    return fig


def sink_and_eviction(weights, accuracy, *, first_label="BOS", share=None, head=None):
    """Chapter 13: one head's attention (L, L) with its first column marked, beside the accuracy of each cache.

    ``accuracy`` maps a cache's name to the held-out accuracy with it, a number or a dict (kind of answer ->
    accuracy on those answers), drawn as one bar per kind. ``share``, if given, is the head's average
    weight on key 0 as the text measures it (the title then quotes it instead of this map's own mean over rows),
    and ``head`` a (layer, head) pair, counted from 1, for the title. Returns the figure.
    """
    import matplotlib.pyplot as plt

    from lib.notebook import use_book_style

    use_book_style()
    weights = np.asarray(weights, dtype=float)
    fig, (ax_map, ax_bar) = plt.subplots(1, 2, figsize=(11, 4.2), width_ratios=[1, 1.25], layout="constrained")
    image = ax_map.imshow(weights, cmap="viridis", vmin=0, vmax=1)
    ax_map.add_patch(plt.Rectangle((-0.5, -0.5), 1, weights.shape[0], fill=False, edgecolor=ORANGE, lw=2.5))
    if share is None:
        title = f"{weights[1:, 0].mean():.2f} of the weight, on average, on key 0"
    else:
        title = f"{float(share):.2f} of the weight on key 0, held-out average"
    if head is not None:
        title = f"Layer {head[0]}, head {head[1]}: {title}"
    ax_map.set(xlabel=f"key position j (0 = {first_label})", ylabel="query position i", title=title)
    ax_map.grid(False)
    fig.colorbar(image, ax=ax_map, shrink=0.8, label="attention weight")
    names = list(accuracy)
    split = {n: accuracy[n] if isinstance(accuracy[n], dict) else {"all answers": accuracy[n]} for n in names}
    kinds = list(split[names[0]])
    height = 0.8 / len(kinds)
    for i, (kind, color) in enumerate(zip(kinds, [BLUE, ORANGE, GREEN, "#CC79A7"])):
        values = [split[n][kind] for n in names]
        rows = [r - 0.4 + height * (i + 0.5) for r in range(len(names))]
        bars = ax_bar.barh(rows, values, height=height * 0.9, color=color, label=kind)
        for bar, value in zip(bars, values):
            ax_bar.text(value + 0.01, bar.get_y() + bar.get_height() / 2, f"{value:.2f}", va="center")
    ax_bar.set_yticks(range(len(names)), names)
    ax_bar.set(xlim=(0, 1.6 if len(kinds) > 1 else 1.1), xlabel="held-out accuracy",
               title="The same model under three caches")
    ax_bar.set_xticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    if len(kinds) > 1:
        ax_bar.legend(loc="center right")
    ax_bar.invert_yaxis()
    return fig


def cache_per_token(per_token):
    """Chapter 13: cache bytes one token adds, per model (a dict name -> bytes), as bars on a log scale."""
    import matplotlib.pyplot as plt

    from lib.notebook import use_book_style

    use_book_style()
    names = list(per_token)
    values = [per_token[n] for n in names]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(names) + 1.4), layout="constrained")
    bars = ax.barh(names, values, color=[ORANGE if "MLA" in n else BLUE for n in names])
    for bar, value in zip(bars, values):
        ax.text(value * 1.1, bar.get_y() + bar.get_height() / 2, f"{value / 1024:,.0f} KiB", va="center")
    ax.set_xscale("log")
    ax.set_xlim(min(values) / 2, max(values) * 8)
    ax.set(xlabel="cache bytes per token, all layers, 16-bit numbers (log scale)",
           title="What one token adds to the cache, per model")
    ax.invert_yaxis()
    return fig


def recall_curves(n_pairs, accuracy, *, d, training=None):
    """Chapter 13: held-out recall against the number of stored pairs, one line per attention (name -> list).

    ``training``, if given, is (steps, curve, name): one model's held-out recall at each checkpoint, curve
    (checkpoints, len(n_pairs)), drawn in a second panel, one line per pair count, to show where it levels off.
    """
    import matplotlib.pyplot as plt

    from lib.notebook import use_book_style

    use_book_style()
    if training is None:
        fig, ax = plt.subplots(figsize=(7.5, 4.0), layout="constrained")
    else:
        fig, (ax, ax_t) = plt.subplots(1, 2, figsize=(12, 4.2), width_ratios=[1, 1], layout="constrained")
        steps, curve, name = training
        curve = np.asarray(curve, dtype=float)
        for column, n in enumerate(n_pairs):
            ax_t.plot(steps, curve[:, column], marker=".", label=f"{n} pairs")
        ax_t.axvspan(steps[len(steps) // 2 - 1], steps[-1], color="#DDDDDD", zorder=0)
        ax_t.set(ylim=(0, 1.05), xlabel="training step", ylabel="held-out recall accuracy",
                 title=f"{name}: recall during training (grey: the last half)")
        ax_t.legend(fontsize="small", loc="lower right")
    for (name, acc), marker in zip(accuracy.items(), "os^"):
        ax.plot(n_pairs, acc, marker=marker, label=name)
    ax.axvline(d, color="#8C8C8C", ls="--", lw=1)
    ax.text(d * 1.05, 0.05, f"d = {d}", color="#555555")
    ax.set_xscale("log", base=2)
    ax.set_xticks(n_pairs, [str(n) for n in n_pairs])
    ax.set(ylim=(0, 1.05), xlabel="key-value pairs in the context", ylabel="held-out recall accuracy",
           title="Softmax keeps recalling; the fixed linear state does not")
    ax.legend()
    return fig
