"""Chapter 7's hidden tests (tools/hidden_tests/ch07.py), proven both ways on the real chapter: the official
solutions and answers written another way get full marks; numbers typed in, a variable the notebook holds, the
library called instead of the loop written and a typical slip score 0 on the exercise they touch (one submission, to
keep the test's time: the chapter's own measurements run in every sandbox)."""

import math

import numpy as np
import pytest
from grading_helpers import (
    ROOT,
    grade,
    mc,
    proven_both_ways,
    text,
)

pytestmark = pytest.mark.grader  # whole chapters in the sandbox: make test-grader

CH7 = "chapters/07_complexity_and_tiling.ipynb"

CORRECT = {  # other formulas; a pure-Python online softmax returning a list; a torch loop in float32
    1: '''def score_gib(heads, n, bytes_per_number):
    total_bytes = heads * n * n * bytes_per_number
    return total_bytes / (1024 * 1024 * 1024)


def causal_tflops(heads, n, d):
    return 0.5 * (4 * n * n * d) * heads * 1e-12''',
    2: '''def online_softmax(row, block=1):
    values = [float(x) for x in row]
    top, total, rescaled = None, 0.0, 0
    for start in range(0, len(values), block):
        chunk = values[start : start + block]
        if top is None:
            top = max(chunk)
        elif max(chunk) > top:
            total *= math.exp(top - max(chunk))
            top = max(chunk)
            rescaled += 1
        total += sum(math.exp(x - top) for x in chunk)
    return [math.exp(x - top) / total for x in values], rescaled''',
    3: '''def peak_growth(n, block_from, block_to, bytes_per_number):
    def tile(key_block):  # one n x (key block) tile of scores
        return n * key_block * bytes_per_number

    return tile(block_to) - tile(block_from)''',
    4: '''def tiled_loop_causal(q, k, v, block_q, block_k):
    q, k, v = (np.asarray(t, dtype=np.float32) for t in (q, k, v))
    n, scale = q.shape[0], q.shape[1] ** -0.5
    pieces, computed, masked = [], 0, 0
    for r0 in range(0, n, block_q):
        r1 = min(r0 + block_q, n)
        m = np.full((r1 - r0, 1), -np.inf, dtype=np.float32)
        total, acc = np.zeros((r1 - r0, 1), np.float32), np.zeros((r1 - r0, v.shape[1]), np.float32)
        for c0 in range(0, r1, block_k):  # no key after the block's last query
            c1 = min(c0 + block_k, n)
            s = (q[r0:r1] * scale) @ k[c0:c1].T
            computed += 1
            if c1 - 1 > r0:
                future = np.arange(c0, c1)[None, :] > np.arange(r0, r1)[:, None]
                s = np.where(future, -np.inf, s)
                masked += 1
            m_new = np.maximum(m, s.max(1, keepdims=True))
            p, shrink = np.exp(s - m_new), np.exp(m - m_new)
            total = total * shrink + p.sum(1, keepdims=True)
            acc = acc * shrink + p @ v[c0:c1]
            m = m_new
        pieces.append(acc / total)
    return list(np.concatenate(pieces)), computed, masked''',
}
WRONG = {  # the printed numbers typed in; the first block counted as a rescale; a variable the notebook holds (its
    # head size d) in place of n; the library's attention called instead of the loop
    1: "def score_gib(heads, n, bytes_per_number):\n    return 8.0\n\n\n"
       "def causal_tflops(heads, n, d):\n    return 0.55",
    2: ("official", "if m != -math.inf and m_new > m:", "if m_new > m:"),
    3: ("official", "return bytes_per_number * n * (block_to - block_from)",
        "return bytes_per_number * d * (block_to - block_from)"),
    4: "def tiled_loop_causal(q, k, v, block_q, block_k):\n"
       "    B = -(-len(q) // block_q)\n"
       "    return attn.attention(q, k, v, causal=True), B * (B + 1) // 2, B",
}


def test_chapter_7_tiling_full_marks_for_correct_work_none_for_mistakes_or_cheats(tmp_path):
    proven_both_ways(tmp_path, CH7, CORRECT, {"wrong": WRONG}, {
        ("wrong", 1): "`gib_h`: expected score_gib(heads, n, bytes_per_number)",
        ("wrong", 2): "`rescales_h`: not its number of rescales",
        ("wrong", 4): "your answer uses `attention`",
    }, grade.Limits(timeout=300, cell_timeout=120))


def test_chapter_7_hidden_inputs_catch_a_loop_that_skips_the_last_querys_own_key_block():
    """Half the hidden inputs of exercise 4 leave the last query alone at the start of its key block, so a loop that
    skips key blocks from the last query on (`j >= last row`) loses that query's own key and scores 0."""
    spec = next(s for s in grade.gs.SPECS if s.label == "complexity-and-tiling/causal-tiles")
    cell = next(c for c in mc.read_notebook(ROOT / CH7)["cells"] if "def tiled_loop_causal" in text(c))
    loops = {}
    for name, source in (("official", text(cell)), ("slipped", text(cell).replace("j > rows[-1, 0]", "j >= rows[-1, 0]"))):
        namespace = {"np": np, "math": math}
        exec(source.split("\n\n\nrng =")[0], namespace)  # noqa: S102 (the chapter's function, not its call)
        loops[name] = namespace["tiled_loop_causal"]
    caught = 0
    for student in ("ada", "bo", "cy", "di", "ed", "fay"):
        failures = {name: 0 for name in loops}
        for inputs, params in grade.draw(1, student, spec, None):
            want = spec.expect(inputs, params)
            for name, loop in loops.items():
                got = dict(zip(("out_h", "computed_h", "masked_h"), loop(*(inputs[k] for k in (
                    "q_h", "k_h", "v_h", "block_q_h", "block_k_h")))))
                failures[name] += any(grade.compare(k, c, got[k], want[k], got, inputs) for k, c in spec.compare.items()
                                      if k in got)
        assert failures["official"] == 0
        caught += failures["slipped"] > 0
    assert caught >= 4, caught
