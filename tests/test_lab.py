"""The kernel lab's grade (lib.lab): right kernels pass with their byte ratios, each mistake fails its step."""

import pathlib

import lab_kernels as handed_in
import pytest
import torch

from lib import flash, lab

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEED = 20261128
interpreted = pytest.mark.skipif(not flash.INTERPRETED, reason="counts bytes in Triton's interpreter")


def _scores(kernel, steps=lab.STEPS, seed=SEED, **mistake):
    return {step.name: step for step in lab.grade(kernel, seed, steps, constants=mistake)}


@interpreted
@pytest.mark.parametrize("kernel", [handed_in.official, handed_in.another_way], ids=["official", "another way"])
def test_right_kernels_pass_every_step(kernel):
    steps = _scores(kernel)
    assert {name: s.score for name, s in steps.items()} == dict.fromkeys(lab.STEPS, 1), steps
    assert steps["bytes"].ratio == pytest.approx(1.0)


@interpreted
def test_two_passes_over_k_are_right_but_fail_the_bytes():
    steps = _scores(handed_in.two_passes)
    assert steps["output"].score == steps["causal"].score == steps["logsumexp"].score == 1
    assert steps["bytes"].score == 0 and steps["bytes"].ratio > lab.BYTES_FACTOR
    assert "reads K 2.00x and V 1.00x as often" in steps["bytes"].why


@interpreted
def test_mistakes_fail_the_step_they_touch():
    no_skip = _scores(handed_in.official, SKIP=False)
    assert no_skip["causal"].score == 1 and no_skip["tile skip"].score == 0
    assert "future" in no_skip["tile skip"].why
    wrong_mask = _scores(handed_in.official, ("output", "causal"), DIAGONAL=False)
    assert wrong_mask["output"].score == 1 and wrong_mask["causal"].score == 0
    no_rescale = _scores(handed_in.official, ("output",), RESCALE=False)
    assert no_rescale["output"].score == 0 and "O differs" in no_rescale["output"].why


@interpreted
def test_work_done_outside_triton_scores_nothing():
    empty = _scores(handed_in.does_nothing)
    assert all(s.score == 0 for s in empty.values())
    assert "read no Q" in empty["output"].why
    wrapper = _scores(handed_in.torch_wrapper)
    assert all(s.score == 0 for s in wrapper.values()) and "not a Triton kernel" in wrapper["output"].why


def test_hidden_cases_follow_the_seed_and_cover_the_lab():
    assert lab.hidden_cases(1, "output") == lab.hidden_cases(1, "output")
    assert lab.hidden_cases(1, "output") != lab.hidden_cases(2, "output")
    cases = [c for seed in range(20) for step in lab.STEPS for c in lab.hidden_cases(seed, step)]
    assert {c.dtype for c in cases} == {torch.float32, torch.float16}
    assert any(c.L != c.S for c in cases) and any(c.causal for c in cases) and any(not c.causal for c in cases)
    assert min(c.E for c in cases) == 16 and max(c.E for c in cases) == 128
    assert all(c.causal for s in range(20) for c in lab.hidden_cases(s, "tile skip"))


@interpreted
def test_no_message_gives_the_answer_away():
    for step in _scores(handed_in.official, RESCALE=False).values():
        assert "tensor(" not in step.why and "expected" not in step.why


def test_refusals():
    with pytest.raises(ValueError, match="unknown steps"):
        lab.grade(handed_in.official, 1, ("speed",))
    with pytest.raises(TypeError, match="seed must be an int"):
        lab.grade(handed_in.official, "1")
    with pytest.raises(TypeError, match="Triton kernel"):
        lab.launch(handed_in.torch_wrapper, *(torch.zeros(1, 4, 16) for _ in range(3)))
    with pytest.raises(ValueError, match="shapes do not fit"):
        lab.launch(handed_in.official, torch.zeros(1, 4, 16), torch.zeros(1, 5, 16), torch.zeros(1, 4, 16))


@pytest.mark.gpu
@pytest.mark.skipif(flash.INTERPRETED or not torch.cuda.is_available(), reason="compiles the kernel for a GPU")
def test_on_a_gpu_the_kernel_is_graded_compiled_and_timed_against_sdpa():
    steps = {s.name: s for s in lab.grade(handed_in.official, SEED)}
    assert all(steps[name].score == 1 for name in ("output", "logsumexp", "causal")), steps
    assert steps["bytes"].score is None and "interpreter" in steps["bytes"].why
    ours, sdpa = lab.time_against_sdpa(handed_in.official, L=1024, Z=8)
    assert ours > 0 and sdpa > 0


@interpreted
def test_the_books_solution_passes_on_other_seeds(tmp_path, monkeypatch):
    import importlib

    import nbformat

    book = nbformat.read(ROOT / "chapters" / "09_flash_kernel.ipynb", as_version=4)
    (source,) = [c.source for c in book.cells if c.cell_type == "code" and "def flash_forward_kernel(" in c.source]
    # Triton reads a kernel's source from its file: the solution goes into a module of its own
    (tmp_path / "book_lab.py").write_text("import triton\nimport triton.language as tl\n\n\n" + source)
    monkeypatch.syspath_prepend(str(tmp_path))
    solution = importlib.import_module("book_lab").flash_forward_kernel
    for seed in (SEED, SEED + 1):
        assert [s.score for s in lab.grade(solution, seed)] == [1] * len(lab.STEPS)


@interpreted
def test_the_verdict_on_one_run_agrees_with_the_grade():
    case = lab.Case(Z=2, L=64, S=64, E=32, EV=24, causal=True, dtype=torch.float32)  # four query tiles
    for kernel, mistake, fails in ((handed_in.official, {}, None), (handed_in.official, {"RESCALE": False}, "O differs"),
                                   (handed_in.official, {"SKIP": False}, "future"),
                                   (handed_in.two_passes, {}, "future"), (handed_in.does_nothing, {}, "read no Q")):
        (q, k, v), o, lse, moved = lab._run(kernel, case, 3, mistake)
        by_name = {name: moved.bytes(name, "both") for name in ("Q", "K", "V", "O", "LSE")}
        message = lab.verdict(case, q, k, v, o, lse, by_name)
        assert (message is None) if fails is None else (fails in message), (kernel, mistake, message)
