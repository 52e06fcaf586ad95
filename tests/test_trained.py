"""The stored models of chapter 11 and the recipes that make them (lib.trained); chapter 13's are in
test_trained_variants.py.

The chapters load weights trained once, so that every machine prints the same figures. These tests train the same
recipes afresh on whatever CPU runs them and check what the chapters claim of the result, with the chapters' own
margins; then they check that the stored weights meet the same claims. A recipe whose fresh models stopped meeting
them, or stored weights that no longer came from a recipe that does, fail here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lib import trained
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
