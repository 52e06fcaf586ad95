"""The stored models of chapters 11 and 13 and the recipes that make them (lib.trained).

The chapters load weights trained once, so that every machine prints the same figures. These tests train the same
recipes afresh on whatever CPU runs them and check what the chapters claim of the result, with the chapters' own
margins; then they check that the stored weights meet the same claims. A recipe whose fresh models stopped meeting
them, or stored weights that no longer came from a recipe that does, fail here.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from lib import trained
from lib import variants as vr
from lib.model import head_ablations

SEEDS = range(trained.INDUCTION["seeds"])


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------------------------
# Chapter 11: induction heads
# --------------------------------------------------------------------------------------------------------------


def induction_claims(model):
    """The failures of chapter 11's claims on one induction model: an empty list when it meets them all."""
    tokens, scored, m = trained.repeat_batch(torch.Generator().manual_seed(7), 1000)
    N = tokens.shape[1]

    def accuracy(model_):
        with torch.no_grad():
            predicted = model_(tokens)[:, :-1].argmax(-1)
        return (predicted == tokens[:, 1:])[scored].float().mean().item()

    with torch.no_grad():
        _, maps = model(tokens, return_weights=True)
    target = (torch.arange(N) - m + 1).clamp(min=0)  # p - m + 1: the key after A's first occurrence
    induction = [maps[1][:, h].gather(2, target[..., None])[..., 0][:, :-1][scored].mean().item() for h in range(2)]
    model.fit_head_means(trained.repeat_batch(torch.Generator().manual_seed(8), 1000)[0])
    mean = head_ablations(model, accuracy)
    resample = head_ablations(model, accuracy, source=tokens.roll(1, dims=0))
    guess = (1 / m.float()).expand(-1, N - 1)[scored].mean().item()
    failed = []
    if mean.intact < 0.95:
        failed.append(f"accuracy {mean.intact:.3f} < 0.95 inside the repeat")
    if min(induction) < 0.8:
        failed.append(f"layer 2's induction shares {induction}: one below 0.8")
    for result in (mean, resample):
        l1, l2 = result.layers
        if not (l1 < 0.3 and l2 < 0.1):
            failed.append(f"{result.kind}: whole layers off leave {l1:.2f}, {l2:.2f}")
        if not 0.8 * guess < l1:
            failed.append(f"{result.kind}: layer 1 off falls below guessing ({l1:.2f})")
    if not min(resample.heads[1]) < min(mean.heads[1]) - 0.2:
        failed.append("resampling a layer-2 head should cost more than mean-ablating it")
    return failed


@pytest.fixture(scope="module")
def fresh_inductors():
    torch.use_deterministic_algorithms(True)
    try:
        return {seed: trained.train_induction(seed) for seed in SEEDS}
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_induction_recipe_meets_chapter_11s_claims_on_this_machine(fresh_inductors, seed):
    assert induction_claims(fresh_inductors[seed]) == []


@pytest.mark.parametrize("seed", SEEDS)
def test_the_stored_induction_models_meet_the_same_claims(seed):
    model, extra = trained.load(f"induction-seed{seed}", trained.induction_model())
    assert extra == {}
    assert not model.training
    assert induction_claims(model) == []


def test_a_model_trained_too_briefly_fails_the_claims():
    """The claims can fail: 20 steps of the recipe do not make an induction head."""
    torch.use_deterministic_algorithms(True)
    try:
        assert induction_claims(trained.train_induction(0, steps=20)) != []
    finally:
        torch.use_deterministic_algorithms(False)


# --------------------------------------------------------------------------------------------------------------
# Chapter 11: a character model of the course's prose, and its previous-character head
# --------------------------------------------------------------------------------------------------------------

SENTENCE = "every query asks which of the earlier letters matter."  # the chapter's sentence


def prose_claims(model, threshold=0.5):
    """The failures of chapter 11's claims on a prose model: it has learned the held-out text, and its head with
    the largest previous-character share puts its largest weight one character back in at least ``threshold`` of
    the rows, on held-out text and on the chapter's sentence."""
    _, held_ids = trained.prose_split()
    held = trained.prose_batch(held_ids, torch.Generator().manual_seed(3), 256)
    with torch.no_grad():
        logits, maps = model(held[:, :-1], return_weights=True)
        _, sentence_maps = model(trained.encode(SENTENCE)[None], return_weights=True)
    failed = []
    loss = F.cross_entropy(logits.flatten(0, 1), held[:, 1:].flatten()).item()
    if loss > 0.5 * torch.log(torch.tensor(float(len(trained.prose_alphabet())))).item():
        failed.append(f"held-out loss {loss:.2f}: not below half of uniform guessing")
    p = torch.arange(1, held.shape[1] - 1)
    shares = torch.stack([m[:, :, p, p - 1].mean(dim=(0, 2)) for m in maps])  # (layers, heads)
    layer, head = divmod(shares.argmax().item(), shares.shape[1])
    held_back = (maps[layer][:, head, p].argmax(-1) == p - 1).float().mean().item()
    q = torch.arange(1, len(SENTENCE))
    sentence_back = (sentence_maps[layer][0, head, q].argmax(-1) == q - 1).float().mean().item()
    for where, share in (("held-out text", held_back), ("the sentence", sentence_back)):
        if share < threshold:
            failed.append(f"layer {layer + 1} head {head} peaks one back in {share:.2f} of the rows of {where}")
    return failed


def test_the_prose_text_is_the_chapters_alphabet_and_the_sentence_is_not_in_it():
    text = trained.prose_text()
    assert len(text) > 100_000 and set(text) == set(trained.prose_alphabet())
    assert SENTENCE not in text
    assert trained.encode("ab").tolist() == [trained.prose_alphabet().index(c) for c in "ab"]
    with pytest.raises(ValueError, match="outside the model's alphabet"):
        trained.encode("Attention")
    with pytest.raises(TypeError, match="must be a str"):
        trained.encode(b"abc")


def test_the_prose_recipe_meets_chapter_11s_claims_on_this_machine():
    torch.use_deterministic_algorithms(True)
    try:
        assert prose_claims(trained.train_prose()) == []
    finally:
        torch.use_deterministic_algorithms(False)


def test_the_stored_prose_model_meets_the_same_claims():
    model, extra = trained.load("prose", trained.prose_model())
    assert extra == {} and not model.training
    assert prose_claims(model) == []


def test_a_prose_model_trained_too_briefly_fails_the_claims():
    torch.use_deterministic_algorithms(True)
    try:
        assert prose_claims(trained.train_prose(steps=30)) != []
    finally:
        torch.use_deterministic_algorithms(False)


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


def test_the_recall_recipe_meets_chapter_12s_claims_on_this_machine():
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


def test_save_then_load_gives_the_same_model_and_extras(tmp_path, monkeypatch):
    monkeypatch.setattr(trained, "WEIGHTS", tmp_path)
    torch.manual_seed(1)
    model = trained.lookup_model()
    trained.save("a-model_1", model, sinks=torch.tensor([[0.5, -1.0], [2.0, 0.0]]))
    torch.manual_seed(2)
    loaded, extra = trained.load("a-model_1", trained.lookup_model())
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(extra["sinks"], torch.tensor([[0.5, -1.0], [2.0, 0.0]]))


def test_every_model_tools_train_models_writes_is_stored():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "tools" / "train_models.py"
    spec = importlib.util.spec_from_file_location("train_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    names = set(module.recipes())
    assert names == {f"induction-seed{s}" for s in SEEDS} | {"lookup-plain", "lookup-sink", "prose"} | set(
        trained.RECALL_MODELS)
    assert {p.stem for p in trained.WEIGHTS.glob("*.pt")} == names


@pytest.mark.parametrize("name", ["", "../x", "a b", "x.pt"])
def test_a_bad_name_is_refused(name):
    with pytest.raises(ValueError, match="name"):
        trained.load(name, trained.lookup_model())


def test_a_missing_model_names_the_command_that_trains_it(tmp_path, monkeypatch):
    monkeypatch.setattr(trained, "WEIGHTS", tmp_path)
    with pytest.raises(FileNotFoundError, match="tools/train_models.py"):
        trained.load("nothing-here", trained.lookup_model())


def test_weights_of_another_shape_are_refused():
    with pytest.raises(RuntimeError, match="size mismatch"):
        trained.load("lookup-plain", trained.induction_model())


def test_a_model_that_is_not_a_module_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(trained, "WEIGHTS", tmp_path)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        trained.load("lookup-plain", {"embed.weight": torch.zeros(1)})
    with pytest.raises(TypeError, match="torch.nn.Module"):
        trained.save("x", "a model")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("extra", [{"sinks": [0.5, 1.0]}, {"sinks": None}])
def test_extras_must_be_tensors(tmp_path, monkeypatch, extra):
    monkeypatch.setattr(trained, "WEIGHTS", tmp_path)
    with pytest.raises(TypeError, match="extra must be tensors"):
        trained.save("x", trained.lookup_model(), **extra)
    assert not list(tmp_path.iterdir())
