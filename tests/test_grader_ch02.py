"""Chapter 2's hidden tests (tools/hidden_tests/ch02.py), proven both ways on the real chapter: the official
solutions and answers written independently of them get full marks; typical mistakes, the chapter's printed
numbers, variables the notebook holds and the library function the exercise asks for score 0."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import grade
from grading_helpers import proven_both_ways

pytestmark = pytest.mark.grader  # whole chapters in the sandbox: make test-grader


CH2 = "chapters/02_matrix_form.ipynb"

# Answers keyed by exercise number, as in tests/test_grader.py.
CORRECT = {  # written from the statements: torch in float32, a search by whole steps, lists and loops
    1: "def shuffled_outputs(Q, K, V, order):\n"
       "    q, k, v = (torch.tensor(x, dtype=torch.float32) for x in (Q, K, V))\n"
       "    idx = torch.as_tensor(order)\n"
       "    together = torch.softmax(q @ k[idx].T / k.shape[1] ** 0.5, dim=-1) @ v[idx]\n"
       "    alone = torch.softmax(q @ k.T / k.shape[1] ** 0.5, dim=-1) @ v[idx]\n"
       "    return together, alone\n\n\n"
       "same, broken = shuffled_outputs(Q, K, V, np.arange(n)[::-1].copy())",
    2: "def longest_sequence(budget_bytes, bytes_per_number):\n"
       "    n = int((budget_bytes / bytes_per_number) ** 0.5)\n"
       "    while (n + 1) ** 2 * bytes_per_number <= budget_bytes:\n        n += 1\n"
       "    while n**2 * bytes_per_number > budget_bytes:\n        n -= 1\n    return n\n\n\n"
       "longest = longest_sequence(2**30, 4)",
    3: "def stretch_key(Q, K, j, c):\n    keys = [list(row) for row in K]\n"
       "    keys[j] = [c * x for x in keys[j]]\n"
       "    scores = [[sum(a * b for a, b in zip(q, key)) / math.sqrt(len(key)) for key in keys] for q in Q]\n"
       "    weights = []\n    for row in scores:\n        e = [math.exp(x - max(row)) for x in row]\n"
       "        weights.append([x / sum(e) for x in e])\n    return scores, weights\n\n\n"
       "S2, A2 = (np.array(x) for x in stretch_key(Q, K, 3, 2))\npositive = S[:, 3] > 0",
    4: "def einsum_attention(q, k, v):\n"
       "    q, k, v = (torch.as_tensor(x, dtype=torch.float32) for x in (q, k, v))\n"
       "    s = torch.einsum('ble,bse->bls', q, k) / q.shape[-1] ** 0.5\n"
       "    return torch.einsum('bls,bsv->blv', torch.softmax(s, dim=-1), v)\n\n\n"
       "qb, kb, vb = np.random.default_rng(1).normal(size=(3, 2, 5, d_k))\n"
       "out_e = einsum_attention(qb, kb, vb).numpy()",
}
MISTAKES = {  # the queries shuffled too; a rounded square root; the chapter's d_k for the keys' size; the softmax
    # over the queries
    1: ("official", "same = attn.attention(Q, K[order], V[order])", "same = attn.attention(Q[order], K[order], V[order])"),
    2: ("official", "math.isqrt(budget_bytes // bytes_per_number)", "round(math.sqrt(budget_bytes / bytes_per_number))"),
    3: ("official", "math.sqrt(K.shape[1])", "math.sqrt(d_k)"),
    4: ("official", "attn.softmax(scores)", "attn.softmax(scores, axis=1)"),
}
CHEATS = {  # the notebook's own output; the chapter's printed n; the notebook's own S2 and A2; the library's attention
    1: "official\n\n\ndef shuffled_outputs(Q, K, V, order):\n    return out, attn.attention(Q, K, V[order])",
    2: "def longest_sequence(budget_bytes, bytes_per_number):\n    return 16384\n\n\nlongest = 16384",
    3: "official\n\n\ndef stretch_key(Q, K, j, c):\n    return S2, A2",
    4: "official\n\n\ndef einsum_attention(q, k, v):\n    return attn.attention(q, k, v)",
}


REASONS = {  # how the grader says why, for a few of them
    ("mistakes", 2): "`longest_h`: expected the longest n",
    ("mistakes", 3): "`S2_h`: expected the scaled scores after the stretch",
    ("cheats", 4): "PermissionError: this exercise asks you to write what lib.attention.attention does",
}


def test_chapter_2_full_marks_for_correct_work_none_for_mistakes_or_cheats(tmp_path):
    proven_both_ways(tmp_path, CH2, CORRECT, {"mistakes": MISTAKES, "cheats": CHEATS}, REASONS,
                     grade.Limits(timeout=300, cell_timeout=60))
