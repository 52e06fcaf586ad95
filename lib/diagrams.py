"""Explanatory diagrams for the chapters, drawn in code from each chapter's own numbers (matplotlib)."""

from __future__ import annotations

# --------------------------------------------------------------------------------------------------------------
# chapter 8: the ledger per score, and where a forward tile lives on an H100
# --------------------------------------------------------------------------------------------------------------

_UNIT_COLORS = {"tensor cores": "#0072B2", "exponential unit": "#E69F00", "float32 lanes": "#009E73",
                "HBM": "#CC79A7"}


def score_ledger_bars(ledgers, measured=None, ax=None):
    """Picoseconds per score on each unit, for each head size: the units one after another (a stacked bar) against
    a kernel that overlaps them all (the longest unit alone), with SDPA's measured time per score as a tick.

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
        if measured and label in measured:
            ax.plot([measured[label] * 1e12] * 2, [i - 0.42, i + 0.42], color="#D55E00", lw=2.5,
                    label="SDPA measured (cuDNN)" if i == 0 else None)
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
