"""Chapter 8's hidden tests (tools/hidden_tests/ch08.py), proven both ways on the real chapter: the official
solutions and answers written apart from them score every exercise, typical mistakes and cheats score none."""

import sys

import pytest
from grading_helpers import (
    ROOT,
    proven_both_ways,
)

sys.path.insert(0, str(ROOT / "tools"))
import grade

pytestmark = pytest.mark.grader  # whole chapters in the sandbox: make test-grader


CH8 = "chapters/08_gpu_cost.ipynb"

CORRECT = {  # from the statements: other formulas, a list, an array, tiles keyed as the ledger sees them
    1: '''def traffic_mb(n, d, block_rows, elt):
    query_blocks = -(-n // block_rows)
    standard = 4 * n * (n + d) * elt  # Q, K, S, P, V loaded; S, P, O stored
    tiled = 2 * n * d * (query_blocks + 1) * elt + 4 * n
    return [standard / 10**6, tiled / 10**6]


standard_mb, tiled_mb = traffic_mb(8192, 128, 128, 2)
standard_us, tiled_us = (mb / 3.35e12 * 1e12 for mb in (standard_mb, tiled_mb))''',
    2: '''def sweep(q, k, v, blocks):
    runs = []
    for b in blocks:
        memory = HBM()
        out = flash_attention_model(memory, q, k, v, b, min(b, len(q[0])))[0]
        runs.append((memory.loaded + memory.stored, out))
    return np.array([r[0] for r in runs]), np.stack([r[1] for r in runs])


q, k, v = rng.standard_normal((3, 512, 32))
counts, outputs = sweep(q, k, v, [16, 32, 64, 128, 256])''',
    3: '''def tile_ledger(rates, d, n, tiles, tflops):
    rows = {tuple(t): cost.score_ledger(rates, d, n=n, tiles=tuple(t)) for t in tiles}
    smem_ps = {t: r.seconds["shared memory"] / 1e-12 for t, r in rows.items()}
    l2_tbs = {t: r.l2_bytes_per_s(tflops) * 1e-12 for t, r in rows.items()}
    not_above = [t for t, r in rows.items() if r.seconds["shared memory"] <= r.seconds["tensor cores"]]
    best = sorted(smem_ps.items(), key=lambda item: item[1])[0][0]
    return smem_ps, l2_tbs, not_above, best


grid = [(m, c) for m in (64, 128, 256) for c in (64, 128)]
smem_ps, l2_tbs, not_above, best = tile_ledger(h100_rates, 128, 8192, grid, 603)''',
}
MISTAKES = {  # the last, shorter query block dropped; one counter for every run; the notebook's H100 for any GPU
    1: ("official", "math.ceil(n / block_rows)", "n // block_rows"),
    2: ("official", "    for block in blocks:\n        hbm = HBM()\n", "    hbm = HBM()\n    for block in blocks:\n"),
    3: ("official", "cost.score_ledger(rates, d", "cost.score_ledger(h100_rates, d"),
}
CHEATS = {  # the printed numbers typed in; the library's attention and the formula instead of the model; the
    # printed table typed in
    1: "def traffic_mb(n, d, block_rows, elt):\n    return 545.259520, 272.662528\n\n\n"
       "standard_mb, tiled_mb = traffic_mb(8192, 128, 128, 2)\nstandard_us, tiled_us = 162.77, 81.39",
    2: '''def sweep(q, k, v, blocks):
    n, d = q.shape
    counts = [2 * n * d + 2 * n * d * math.ceil(n / b) + n for b in blocks]
    return counts, [attn.attention(q, k, v) for _ in blocks]


q, k, v = (rng.standard_normal((512, 32)) for _ in range(3))
counts, outputs = sweep(q, k, v, (16, 32, 64, 128, 256))''',
    3: '''def tile_ledger(rates, d, n, tiles, tflops):
    smem = {(64, 64): 0.647, (64, 128): 0.582, (128, 64): 0.517, (128, 128): 0.453, (256, 64): 0.453,
            (256, 128): 0.388}
    l2 = {t: 9.42 * 64 / t[0] for t in smem}
    return smem, l2, [(128, 64), (128, 128), (256, 64), (256, 128)], (256, 128)


smem_ps, l2_tbs, not_above, best = tile_ledger(h100_rates, 128, 8192, [], 603)''',
}


def test_chapter_8_full_marks_for_correct_work_none_for_mistakes_or_cheats(tmp_path):
    proven_both_ways(tmp_path, CH8, CORRECT, {"mistakes": MISTAKES, "cheats": CHEATS}, {
        ("cheats", 1): "`standard_h`: expected traffic_mb's standard MB",
        ("cheats", 2): "asks you to write what lib.attention.attention does",
        ("mistakes", 2): "`counts_h`: expected the numbers each run of sweep moved",
    }, grade.Limits(timeout=300, cell_timeout=120))
