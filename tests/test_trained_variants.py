"""The stored models of chapter 13 and the recipes that make them (lib.trained); chapter 11's are in test_trained.py.

The chapters load weights trained once, so that every machine prints the same figures. These tests train the same
recipes afresh on whatever CPU runs them and check what the chapters claim of the result, with the chapters' own
margins; then they check that the stored weights meet the same claims. A recipe whose fresh models stopped meeting
them, or stored weights that no longer came from a recipe that does, fail here.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from lib import trained
from lib import variants as vr

# --------------------------------------------------------------------------------------------------------------
# Chapter 13: the lookup task, with and without learned sinks
# --------------------------------------------------------------------------------------------------------------

W = 8  # the window chapter 13 keeps


NONE = trained.LOOKUP["n_symbols"] + 1  # the answer "-"


def lookup_figures(model, sinks=None):
    """Accuracy past the window, split into the answers that are symbols and the answers "-", with the whole context,
    the last W tokens, and the last W and token 0; each layer's mean weight per head on token 0, and the heaviest
    head's mean weight on it where the answer is "-" and where it is a symbol; the split accuracy with token 0's
    value zeroed."""
    tokens, targets = vr.lookup_batch(torch.Generator().manual_seed(7), 1000)
    n = tokens.shape[1]
    found = targets[:, W:] != NONE

    def run(mask, **kwargs):
        with torch.no_grad():
            return vr.masked_forward(model, tokens, mask, sinks=sinks, **kwargs)

    def right(logits):
        correct = (logits.argmax(-1) == targets)[:, W:]
        return correct[found].float().mean().item(), correct[~found].float().mean().item()

    masks = (None, vr.streaming_mask(n, W), vr.streaming_mask(n, W, n_sink=1))
    accuracy = [right(run(mask)) for mask in masks]
    _, maps = run(None, return_weights=True)
    on_first = torch.stack([m[:, :, W:, 0].mean((0, 2)) for m in maps])  # (layer, head)
    layer, head = divmod(int(on_first.argmax()), on_first.shape[1])
    to_first = maps[layer][:, head, W:, 0]
    nothing_found = (to_first[~found].mean().item(), to_first[found].mean().item())

    def zero_first_value(q, k, v, allowed):
        v = torch.cat([torch.zeros_like(v[..., :1, :]), v[..., 1:, :]], dim=-2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

    no_value = right(run(None, attend=zero_first_value))
    return accuracy, on_first, nothing_found, no_value


def lookup_claims(plain, sink_model, sinks):
    """The failures of chapter 13's claims on a plain and a learned-sink lookup model; accuracies are (symbol
    answers, '-' answers)."""
    (whole, window, with_sink), on_first, (on_nothing, on_found), no_value = lookup_figures(plain)
    failed = []
    if not (whole[0] > 0.85 and whole[1] > 0.95):
        failed.append(f"the model does not solve the lookups: {whole}")
    if not window[1] < 0.1:
        failed.append(f"evicting token 0 leaves {window} of {whole}")
    if not all(abs(a - b) < 0.01 for a, b in zip(with_sink, whole)):
        failed.append(f"keeping token 0 gives {with_sink}, not {whole}")
    if not on_first.max().item() > 0.3:
        failed.append("no head parks on token 0")
    if not on_nothing > on_found + 0.2:
        failed.append(f"the heaviest head's weight on token 0 is {on_nothing:.2f} with nothing found, {on_found:.2f} else")
    if not no_value[1] < 0.3:
        failed.append(f"token 0's value zeroed leaves {no_value}")
    sink_accuracy, sink_first, _, _ = lookup_figures(sink_model, sinks)
    if not sink_accuracy[0][0] > 0.85:
        failed.append(f"the sink model does not solve the lookups: {sink_accuracy[0]}")
    if not sink_first[1].max().item() < on_first[1].max().item() / 3:
        failed.append("with sinks, layer 2 still leans on token 0")
    if not sink_first[0].max().item() > 0.3:
        failed.append("with sinks, layer 1 no longer leans on token 0")
    if not sink_accuracy[1][1] < sink_accuracy[0][1] - 0.4:
        failed.append("with sinks, eviction no longer hurts")
    return failed


def test_the_lookup_recipe_meets_chapter_13s_claims_on_this_machine():
    torch.use_deterministic_algorithms(True)
    try:
        plain, _ = trained.train_lookup(learned_sink=False)
        sink_model, sinks = trained.train_lookup(learned_sink=True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert sinks.shape == (2, 2) and not sinks.requires_grad
    assert lookup_claims(plain, sink_model, sinks) == []


def test_a_lookup_model_trained_too_briefly_fails_the_claims():
    """The claims can fail: 500 steps leave most lookups unsolved (about 0.3 of the symbol answers right)."""
    torch.use_deterministic_algorithms(True)
    try:
        plain, _ = trained.train_lookup(learned_sink=False, steps=500)
    finally:
        torch.use_deterministic_algorithms(False)
    (whole, _, _), _, _, _ = lookup_figures(plain)
    assert whole[0] < 0.85


def test_the_stored_lookup_models_meet_the_same_claims():
    plain, extra = trained.load("lookup-plain", trained.lookup_model())
    assert extra == {}
    sink_model, stored = trained.load("lookup-sink", trained.lookup_model())
    assert set(stored) == {"sinks"}
    assert lookup_claims(plain, sink_model, stored["sinks"]) == []


# --------------------------------------------------------------------------------------------------------------
# Chapter 13: associative recall, trained to a plateau
# --------------------------------------------------------------------------------------------------------------

PLATEAU = 0.03  # chapter 13: over the last half of training, no recall moved by this much


def plateau_moves(curve):
    """For each pair count, how far recall moved (max - min) over the checkpoints of the last half of training."""
    last_half = curve[curve.shape[0] // 2 - 1:]  # from the checkpoint at half the steps to the end
    return (last_half.amax(0) - last_half.amin(0)).tolist()


def recall_claims(nets, curves):
    """The failures of chapter 13's claims on the three recall models (name -> model, name -> curve)."""
    tests = trained.recall_test(99)
    recall = {name: trained.recall_accuracy(net, tests) for name, net in nets.items()}
    soft, linear, wide = recall["recall-softmax"], recall["recall-linear"], recall["recall-linear-d32"]
    failed = []
    for name, curve in curves.items():
        if curve.shape != (trained.RECALL["steps"] // trained.RECALL["every"], len(trained.RECALL["pair_counts"])):
            failed.append(f"{name}: curve of shape {tuple(curve.shape)}")
        elif not max(plateau_moves(curve)) < PLATEAU:
            failed.append(f"{name} still moves over the last half: {plateau_moves(curve)}")
    if not min(soft) > 0.97:
        failed.append(f"softmax recall {soft}")
    if not all(a > b for a, b in itertools.pairwise(linear)):
        failed.append(f"linear recall does not fall with the pairs: {linear}")
    if not (linear[-1] < 0.5 and linear[2] < 0.85):
        failed.append(f"linear recall too high at 16 and 64 pairs: {linear}")
    if not all(s > li + 0.05 for s, li in zip(soft[1:], linear[1:])):
        failed.append("linear attention does not stay below softmax from 8 pairs on")
    if not all(w > n + 0.03 for w, n in zip(wide[1:], linear[1:])):
        failed.append(f"d = 32 does not recall more than d = 16 from 8 pairs on: {wide} against {linear}")
    return failed


def fresh_recall(steps=trained.RECALL["steps"]):
    torch.use_deterministic_algorithms(True)
    try:
        nets, curves = {}, {}
        for name, (kind, d) in trained.RECALL_MODELS.items():
            nets[name], curves[name] = trained.train_recall(kind, d, steps=steps)
        return nets, curves
    finally:
        torch.use_deterministic_algorithms(False)


def test_the_recall_recipe_meets_chapter_13s_claims_on_this_machine():
    assert recall_claims(*fresh_recall()) == []


def test_the_stored_recall_models_meet_the_same_claims():
    nets, curves = {}, {}
    for name, (kind, d) in trained.RECALL_MODELS.items():
        nets[name], extra = trained.load(name, trained.recall_model(kind, d))
        assert set(extra) == {"curve"}
        curves[name] = extra["curve"]
    assert recall_claims(nets, curves) == []


def test_recall_trained_a_quarter_as_long_has_not_plateaued():
    """The plateau check can fail: 1,000 steps leave the linear model still learning."""
    _, curve = trained.train_recall("linear", steps=1000)
    assert max(plateau_moves(curve)) > PLATEAU


# --------------------------------------------------------------------------------------------------------------
# Storing and loading
# --------------------------------------------------------------------------------------------------------------
