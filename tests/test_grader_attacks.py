"""Answers that should not score and answers that should: each test grades real chapters with submissions that
reach past the grader's word checks and its sandbox (string-built names, lookalike letters, references kept from
the first run, the runner's own globals, files and processes outside the sandbox) or that are right but written
in words the checks refuse. Every assertion states what a fair grader gives."""

import subprocess
import sys
import time

import pytest
from grading_helpers import ROOT, grade_chapter, scores_of, submission, submit

sys.path.insert(0, str(ROOT / "tools"))
import grade

pytestmark = pytest.mark.grader  # whole chapters in the sandbox: make test-grader

LIMIT = grade.Limits(timeout=300, cell_timeout=60, memory_gb=4, grace=5)
CH1, CH3 = "chapters/01_token_by_token.ipynb", "chapters/03_why_sqrt_dk.ipynb"
CH4 = "chapters/04_worked_example.ipynb"
CH7 = "chapters/07_complexity_and_tiling.ipynb"
CH9, CH12, CH13 = "chapters/09_flash_kernel.ipynb", "chapters/12_one_merge.ipynb", "chapters/13_variants.ipynb"

# the runner's globals, reached through the alarm handler it installs (no banned word is written)
RUNNER_GLOBALS = '''import sys
_s = getattr(sys, "modules")["sig" + "nal"]
_g = getattr(getattr(_s, "getsig" + "nal")(14), "__glo" + "bals__")
'''

FORGED_MERGE = RUNNER_GLOBALS + '''import numpy as np


def _forge(number, exercise, namespace, _real=_g["hidden"], _g=_g):
    if number != 4:
        return _real(number, exercise, namespace)
    sent = []
    for inp in exercise["inputs"]:
        a = {k: np.array(v["__array__"], dtype=np.float64) for k, v in inp.items()}
        la, lb = a["la_h"], a["lb_h"]
        mx = np.maximum(la, lb)
        mx[mx == -np.inf] = 0.0
        wa, wb = np.exp(la - mx), np.exp(lb - mx)
        tot = wa + wb
        safe = np.where(tot == 0, 1.0, tot)
        o = ((wa[:, None] * a["oa_h"] + wb[:, None] * a["ob_h"]) / safe[:, None]).tolist()
        lse = np.where(tot == 0, -np.inf, mx + np.log(safe)).tolist()
        sent.append({"wrapped_o_h": o, "wrapped_lse_h": lse, "launched_o_h": o, "launched_lse_h": lse,
                     "untouched_h": True})
    _g["send"](hidden=number, answers=sent)


_g["hidden"] = _forge
'''

STORES_P = '''official


class RecomputedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal):
        scale = 1 / math.sqrt(q.shape[-1])
        s = scale * q @ k.T
        if causal:
            s = s.masked_fill(~attn.causal_mask(q.shape[0], k.shape[0], like=s), -math.inf)
        p = torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True))
        o = p @ v
        ctx.save_for_backward(q, k, v, o, p)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, p = ctx.saved_tensors
        ds = p * (do @ v.T - (do * o).sum(-1, keepdim=True))
        return ctx.scale * ds @ k, ctx.scale * ds.T @ q, p.T @ do, None
'''
NO_HOOKS = '''

class _NoHooks:
    def __init__(self, *args):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


torch.autograd.graph.saved_tensors_hooks = _NoHooks
'''

CHEATS = {  # chapter -> {exercise: answer that does not do what the exercise asks}; each should score 0
    CH1: {
        # the library's logsumexp, named by a built string (torch.special's is not poisoned)
        2: 'official\n\n\ndef log_sum_exp(s):\n    f = getattr(torch.special, "logsum" + "exp")\n'
           '    return f(torch.as_tensor(s), dim=-1).numpy()\n',
        # reads which hidden function it was handed from the harness's closure
        4: 'official\n\n\ndef is_attention(attend):\n    cells = getattr(attend, "__clo" + "sure__")\n'
           '    return cells[0].cell_contents < 2 if cells else True\n',
    },
    CH4: {
        # NumPy, which the statement rules out, through names the ban does not list
        4: "raw_B = Q[1].dot(K.T)\nweights_B = np.e ** (raw_B / math.sqrt(d_k))\n"
           "weights_B = weights_B / weights_B.sum()\nout_B = weights_B.dot(V)\n",
    },
    CH3: {
        # a clipped normal, not uniform components
        1: 'official\n\n\ndef uniform_dots(d_k, samples, rng):\n'
           '    return np.clip(rng.normal(0.0, math.sqrt(d_k), samples), -3 * d_k, 3 * d_k)\n',
        # torch's own softmax backward
        5: 'official\n\n\ndef softmax_backward(p, g):\n    P, G = torch.as_tensor(p), torch.as_tensor(g)\n'
           '    return torch._softmax_backward_data(G, P, -1, P.dtype).numpy()\n',
    },
    CH7: {
        # the library's softmax, spelled in fullwidth letters (NFKC makes it `attn.softmax`), kept as a default
        2: 'official\n\n\ndef online_softmax(row, block, _f=attn.\uff53\uff4f\uff46\uff54\uff4d\uff41\uff58):\n'
           '    m, count = None, 0\n    for start in range(0, len(row), block):\n'
           '        top = float(np.max(row[start:start + block]))\n'
           '        count += int(m is not None and top > m)\n        m = top if m is None else max(m, top)\n'
           '    return _f(row), count\n',
        # dense causal attention with torch.softmax, no tiles; the counts from a formula
        4: 'official\n\n\ndef tiled_loop_causal(q, k, v, block_q, block_k):\n    n = q.shape[0]\n'
           '    s = q.astype(np.float64) @ k.astype(np.float64).T / math.sqrt(q.shape[1])\n'
           '    s[np.triu(np.ones((n, n), dtype=bool), 1)] = -np.inf\n'
           '    out = torch.softmax(torch.from_numpy(s), -1).numpy() @ v.astype(np.float64)\n'
           '    t = [(i, j) for i in range(0, n, block_q) for j in range(0, min(i + block_q, n), block_k)]\n'
           '    return out, len(t), sum(min(j + block_k, n) - 1 > i for i, j in t)\n',
    },
    CH9: {
        # stores the (L, S) probabilities for the backward, and turns off the hook the hidden test counts them with
        2: STORES_P + NO_HOOKS,
    },
    CH12: {
        1: "official\n\n" + FORGED_MERGE,  # sends the merge kernel's answers, computed from the plan's inputs
        # softmax under an ATen name
        3: 'official\n\n\ndef block_probabilities(q, k, start, stop):\n    s = q @ k.T / q.shape[1] ** 0.5\n'
           '    return torch.ops.aten._softmax(s, -1, False)[:, start:stop]\n',
        4: "merge_two = merge_kernel = None\n",
    },
    CH13: {
        # the library's recurrent linear attention, kept in a list by an earlier exercise
        3: "official\n\n\n_keep = [vr.linear_attention_recurrent, vr.elu_feature]\n",
        5: "_lar, _phi = _keep\nstate_outputs = _lar(q5, k5, v5)\n"
           "S_state = (_phi(k5)[:, :, None] * v5[:, None, :]).sum(0)\nz_state = _phi(k5).sum(0)\n",
    },
}
NOT_CHEATS = {CH12: {1}, CH13: {3}}  # cells that carry a cheat for another exercise but answer their own


@pytest.mark.parametrize("chapter", list(CHEATS), ids=lambda c: c.split("/")[1][:2])
def test_answers_that_reach_past_the_checks_score_nothing(tmp_path, chapter):
    answers = CHEATS[chapter]
    results = grade_chapter(tmp_path, chapter, {"cheat": (answers, None)}, LIMIT)
    scores = scores_of(results)["cheat"]
    want = {n: 0 for n in answers if n not in NOT_CHEATS.get(chapter, ())}
    assert {n: scores[n] for n in want} == want, results["cheat"].reasons


HONEST = {  # right answers with a docstring, a print or a helper's name that holds a word the exercise bans
    CH4: {4: "def softmax(xs):\n    exps = [math.exp(x) for x in xs]\n    return [e / sum(exps) for e in exps]\n\n\n"
             "q_B = Q[1].tolist()\nraw_B = [q_B[0] * k[0] + q_B[1] * k[1] for k in K.tolist()]\n"
             "weights_B = softmax([s / math.sqrt(d_k) for s in raw_B])\n"
             "out_B = [sum(w * v[i] for w, v in zip(weights_B, V.tolist())) for i in range(2)]\n"},
    CH1: {3: 'official\nprint("The top weight is a signal of how sharp the row is.")\n'},
    CH12: {3: 'def block_probabilities(q, k, start, stop):\n'
              '    """Recompute the softmax probabilities of one block of keys from q and k."""\n'
              '    s = q @ k.T / q.shape[1] ** 0.5\n    e = torch.exp(s - s.max(dim=-1, keepdim=True).values)\n'
              '    return (e / e.sum(dim=-1, keepdim=True))[:, start:stop]\n'},
}


@pytest.mark.parametrize("chapter", list(HONEST), ids=lambda c: c.split("/")[1][:2])
def test_a_banned_word_in_a_docstring_a_message_or_a_helpers_name_costs_nothing(tmp_path, chapter):
    results = grade_chapter(tmp_path, chapter, {"honest": (HONEST[chapter], None)}, LIMIT)
    scores = scores_of(results)["honest"]
    assert {n: scores[n] for n in HONEST[chapter]} == {n: 1 for n in HONEST[chapter]}, results["honest"].reasons


def test_nothing_outside_the_sandbox_is_read_written_or_left_running(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    course = ROOT / "chapters" / "01_token_by_token.ipynb"
    escape = f'''official

import os
import sys
import torch

_out = {str(outside)!r}
os.mkdir(_out + "/made-by-the-sandbox")
_p = {str(course)!r}
_sol = bytes(torch.from_file(_p, size=os.stat(_p).st_size, dtype=torch.uint8).tolist())
if b"def log_sum_exp" in _sol:
    np.save(_out + "/read-the-course.npy", np.zeros(1))
_ct = getattr(sys, "modules")["ct" + "ypes"]
_libc = _ct.CDLL(None)
if _libc.fork() == 0:
    _libc.setsid()
    for _fd in range(3, 64):
        _libc.close(_fd)
    time.sleep(2)
    np.save(_out + "/outlived-the-sandbox.npy", np.zeros(1))
    getattr(_libc, "_ex" + "it")(0)
'''
    grade_chapter(tmp_path, CH1, {"escape": ({1: "import time\n" + escape}, None)}, LIMIT)
    time.sleep(4)
    assert sorted(p.name for p in outside.iterdir()) == []


def test_a_notebook_cannot_end_the_grader(tmp_path):
    folder = tmp_path / "handed-in"
    killer = submission(ROOT / CH1, {1: "official\n\nimport os\nos.kill(os.getppid(), 9)\n"})
    submit(folder, "killer", killer, name="01_token_by_token.ipynb")
    submit(folder, "quiet", submission(ROOT / CH1, {}), name="01_token_by_token.ipynb")
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "grade.py"), str(folder), "--seed", "3",
                          "--timeout", "300", "--cell-timeout", "60"], capture_output=True, text=True, timeout=900,
                         check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "killer" in run.stdout and "quiet" in run.stdout


def test_the_seed_stays_out_of_the_sandbox_and_the_feedback(tmp_path):
    folder, feedback = tmp_path / "handed-in", tmp_path / "feedback"
    probe = ('import os\nfrom os import read as _rd\n_fd = os.open(f"/proc/{os.getppid()}/cmdline", os.O_RDONLY)\n'
             'raise ValueError(_rd(_fd, 4096).replace(b"\\0", b" ").decode().split("--seed")[-1][:20])\n')
    submit(folder, "eve", submission(ROOT / CH1, {2: probe}), name="01_token_by_token.ipynb")
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "grade.py"), str(folder), "--seed", "424242",
                          "--timeout", "300", "--cell-timeout", "60", "--feedback", str(feedback)],
                         capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "424242" not in (feedback / "eve.md").read_text() and "424242" not in run.stdout
