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
# chapter 10: the ring's schedule, which key block each rank holds at each step and the causal work it does


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
