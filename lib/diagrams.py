"""Explanatory diagrams the chapters draw from their own numbers, so that a figure can never disagree with the code.

Each function returns a matplotlib figure and draws only what its chapter's prose explains; the chapters call it in
one line. Plots of measurements stay in the chapters, in cells tagged ``plot``.
"""

from __future__ import annotations

# --------------------------------------------------------------------------------------------------------------
# Chapter 9: from one head to a model
# --------------------------------------------------------------------------------------------------------------

_HEAD_COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")


def _grid(ax, x0, y0, rows, cols, colour_of, cell=1.0, label=None):
    """Draw a rows × cols grid of cells at (x0, y0) (top-left), each cell filled by colour_of(r, c)."""
    from matplotlib.patches import Rectangle

    for r in range(rows):
        for c in range(cols):
            ax.add_patch(Rectangle((x0 + c * cell, y0 - (r + 1) * cell), cell, cell, facecolor=colour_of(r, c),
                                   edgecolor="white", linewidth=0.8))
    if label:
        ax.text(x0 + cols * cell / 2, y0 + 0.4, label, ha="center", va="bottom", fontsize=10)


def head_split(n, d_model, n_heads):
    """Chapter 9: one sequence's queries (n, d_model) cut into heads by a reshape and a transpose, then merged.

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
    _grid(ax, 0, 0, n, d_model, by_column, label=f"q: ({n}, {d_model})")
    x = d_model + gap
    for h in range(n_heads):
        _grid(ax, x, 0, n, d_head, lambda r, c, h=h: _HEAD_COLOURS[h % len(_HEAD_COLOURS)],
              label=f"head {h}")
        x += d_head + 1
    ax.text(d_model + gap + (n_heads * (d_head + 1) - 1) / 2, -n - 1.2,
            f"reshape to ({n}, {n_heads}, {d_head}),\ntranspose to ({n_heads}, {n}, {d_head})",
            ha="center", va="top", fontsize=9)
    x += gap - 1
    _grid(ax, x, 0, n, d_model, by_column, label=f"merged: ({n}, {d_model})")
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
    """Chapter 9: the pre-norm residual block, the residual stream down the middle and two branches that add to it."""
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
