"""Explanatory diagrams that the chapters draw from their own numbers.

A data plot shows a measurement; a diagram here shows how a computation is put together (which vector meets
which, the shapes of the blocks), labelled with the very arrays a chapter has just computed, so that strict nbval
keeps the picture as true as the printed numbers. Each function takes those arrays, draws one figure in the book's
look (:func:`lib.notebook.use_book_style`: white face, viridis/cividis, the colour-blind-safe cycle) and returns it.
Chapters call them in one line, in a cell whose metadata numbers and captions the figure.
"""

from __future__ import annotations

import numpy as np

# ----------------------------------------------------------------------------------------------------------------
# chapters 4-6: the score matrix and its masks (chapter 5), the module's data flow (chapter 6)

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
