"""Chapter 1's hidden tests (tools/hidden_tests/ch01.py), proven both ways on the real chapter: the official
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


CH1 = "chapters/01_token_by_token.ipynb"

# Answers keyed by exercise number, as in tests/test_grader.py.
CORRECT = {  # written from the statements: lists, a loop over rows in float32, torch, a reference of its own
    1: "def predict_shapes(n, d_model, d_k, d_v):\n    per_token = [n, d_v]\n"
       "    return [per_token, [n, n], list(per_token)]\n\n\n"
       "V5 = X @ np.ones((d_model, 5))\nout5 = attn.attention_loop(Q, K, V5)\nA5 = attn.attention_weights(Q, K)",
    2: "def log_sum_exp(s):\n    s = np.asarray(s, dtype=np.float32)\n    flat = s.reshape(-1, s.shape[-1])\n"
       "    out = []\n    for row in flat:\n        top = row.max()\n"
       "        out.append(top + math.log(sum(math.exp(x - top) for x in row)))\n"
       "    return np.array(out).reshape(s.shape[:-1])\n\n\n"
       "rows = np.array([[1000.0, 999.0, 998.0], [-1000.0, -1001.0, -1002.0]])\n"
       "as_written = np.array([np.inf, -np.inf])\nlse = log_sum_exp(rows)\n"
       "s16 = np.array([12.0, 11.0, 10.0], dtype=np.float16)\n"
       "w16 = np.exp(s16.astype(np.float32) - log_sum_exp(s16)).astype(np.float16)",
    3: "def largest_weights(s, factors):\n    t = torch.tensor(s, dtype=torch.float32)\n"
       "    return torch.stack([torch.softmax(c * t, dim=0).max() for c in factors])\n\n\n"
       "largest_weight = largest_weights(s1, [0, 1, 2, 4, 8, 16, 32, 64, 128]).tolist()",
    4: "def is_attention(attend):\n    gen = np.random.default_rng(0)\n"
       "    q, k, v = gen.normal(size=(3, 2)), gen.normal(size=(5, 2)), gen.normal(size=(5, 4))\n"
       "    try:\n        got = np.asarray(attend(q, k, v))\n    except Exception:\n        return False\n"
       "    e = np.exp(q @ k.T / np.sqrt(2))\n    want = e / e.sum(axis=1, keepdims=True) @ v\n"
       "    return got.shape == want.shape and np.allclose(got, want)\n\n\n"
       "wrong_S = (Q @ K.T).T / math.sqrt(d_k)\nwrong_A = attn.softmax(wrong_S)",
}
MISTAKES = {  # the outputs given the queries' size; one shift for the whole array; the scale applied twice; a test
    # that only checks what the bug keeps (shapes on square inputs, finite numbers)
    1: ("official", "return (n, d_v), (n, n), (n, d_v)", "return (n, d_v), (n, n), (n, d_k)"),
    2: ("official", "m = s.max(axis=-1, keepdims=True)", "m = s.max()"),
    3: ("official", "attn.softmax(c * s)", "attn.softmax(c * s / math.sqrt(d_k))"),
    4: "wrong_S = K @ Q.T / math.sqrt(d_k)\nwrong_A = attn.softmax(wrong_S)\n\n\n"
       "def is_attention(attend):\n    got = attend(Q, K, V)\n"
       "    return got.shape == V.shape and bool(np.isfinite(got).all())",
}
CHEATS = {  # the notebook's own arrays; the library's logsumexp; the chapter's printed weights; the name of the
    # chapter's buggy function
    1: "official\n\n\ndef predict_shapes(n, d_model, d_k, d_v):\n    return V5.shape, A5.shape, out5.shape",
    2: "official\n\n\ndef log_sum_exp(s):\n    return torch.logsumexp(torch.as_tensor(s), dim=-1)",
    3: "official\n\n\ndef largest_weights(s, factors):\n"
       "    return [0.25, 0.6656, 0.8498, 0.9712, 0.9991, 1.0, 1.0, 1.0, 1.0][: len(factors)]",
    4: "official\n\n\ndef is_attention(attend):\n    return attend.__name__ != 'colleague'",
}


REASONS = {  # how the grader says why, for a few of them
    ("mistakes", 1): "`shapes_h`: expected the shapes of V, of A and of the outputs",
    ("mistakes", 2): "`lse_batch_h`: expected log_sum_exp(s) of a (2, 3, m) array",
    ("mistakes", 4): "`is_attention` judged",
    ("cheats", 2): "your answer uses `logsumexp`",
}


def test_chapter_1_full_marks_for_correct_work_none_for_mistakes_or_cheats(tmp_path):
    proven_both_ways(tmp_path, CH1, CORRECT, {"mistakes": MISTAKES, "cheats": CHEATS}, REASONS,
                     grade.Limits(timeout=300, cell_timeout=60))
