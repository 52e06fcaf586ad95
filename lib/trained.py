"""The small models chapters 11 and 13 train, their recipes, and their weights stored with the course.

Training on a CPU repeats exactly on one machine (one thread, deterministic algorithms), but not across machines:
the vector width and the matrix kernels torch picks for a CPU (AVX2, AVX-512, Arm's NEON) change the order of
floating-point sums, and a few hundred steps of Adam turn a last-bit difference into another model, whose figures
differ from the first one's in the second decimal. So the models whose figures a chapter prints are trained once by
the recipes below (``python tools/train_models.py``, on any machine), their weights are stored in ``lib/weights/``
(a few hundred kilobytes in all), and the chapters load them: every reader, and every CI machine, then sees the same
numbers. The library tests run the same recipes afresh and check what the chapters say of the result, with
tolerances, so a stored file stands for what its recipe does on any machine, not for one lucky run.

A reader who retrains in a chapter (``RETRAIN = True``) gets a model of the same kind whose printed digits may
differ; the chapters' checks hold for it too.
"""

from __future__ import annotations

import pathlib

import torch
from torch.nn import functional as F

from lib.model import TinyLM
from lib.variants import RecallNet, lookup_batch, masked_forward, recall_batch

__all__ = [
    "INDUCTION", "LOOKUP", "PROSE", "RECALL", "RECALL_MODELS", "WEIGHTS", "encode", "load", "prose_alphabet",
    "prose_batch", "prose_model", "prose_split", "prose_text", "recall_accuracy", "recall_model", "recall_test",
    "repeat_batch", "save", "train_induction", "train_lookup", "train_prose", "train_recall",
]

WEIGHTS = pathlib.Path(__file__).resolve().parent / "weights"


def _path(name):
    if not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ValueError(f"a stored model's name is letters, digits, '-' and '_'; got {name!r}")
    return WEIGHTS / f"{name}.pt"


def _check_model(model):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (e.g. trained.lookup_model()), got {type(model).__name__}")


def save(name, model, **extra):
    """Store ``model``'s weights (and tensors in ``extra``, such as learned sink logits) as lib/weights/NAME.pt."""
    _check_model(model)
    path = _path(name)
    for key, value in extra.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"extra must be tensors, got {key}={type(value).__name__}")
    WEIGHTS.mkdir(exist_ok=True)
    state = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    state.update({k: v.detach().clone() for k, v in extra.items()})
    torch.save(state, path)


def load(name, model):
    """``model`` with the weights stored as NAME, in eval mode, and a dict of the extra tensors stored beside them.

    ``model`` must be built with the shapes it was trained with: a mismatch raises torch's own error, which names
    the parameter."""
    _check_model(model)
    path = _path(name)
    if not path.is_file():
        raise FileNotFoundError(f"no stored model {name!r} at {path}: run `python tools/train_models.py` to train it")
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state.pop("model"))
    return model.eval(), state


# --------------------------------------------------------------------------------------------------------------
# Chapter 11: induction heads. A segment of m distinct tokens (3 <= m <= 8) out of 20, the same segment again, then
# filler, 16 tokens in all; the model is scored inside the repeat, where the next token is determined.
# --------------------------------------------------------------------------------------------------------------

INDUCTION = {"vocab": 20, "n_tokens": 16, "d_model": 32, "n_layers": 2, "n_heads": 2, "steps": 300, "seeds": 5}


def repeat_batch(gen, size):
    """Tokens (size, 16): a segment of m distinct tokens, the segment again, then
    filler; the positions (size, 15) whose next token the repeat determines; and m."""
    V, N = INDUCTION["vocab"], INDUCTION["n_tokens"]
    m = torch.randint(3, 9, (size, 1), generator=gen)  # segment length, 3 to 8
    segment = torch.rand(size, V, generator=gen).argsort(-1)[:, :8]  # distinct
    filler = torch.randint(0, V, (size, N), generator=gen)
    pos = torch.arange(N)
    from_segment = segment.gather(1, torch.where(pos < m, pos, (pos - m).clamp(max=7)))
    tokens = torch.where(pos < 2 * m, from_segment, filler)
    scored = (pos >= m) & (pos < 2 * m - 1)  # in the repeat: the next token is known
    return tokens, scored[:, :-1], m


def induction_model():
    """The untrained model of the induction task: :class:`TinyLM`, 2 layers of 2 heads, RoPE, no MLP."""
    c = INDUCTION
    return TinyLM(c["vocab"], c["d_model"], n_layers=c["n_layers"], n_heads=c["n_heads"], d_ff=0)


def train_induction(seed, steps=INDUCTION["steps"]):
    """Train :func:`induction_model` from seed ``seed``: Adam at 1e-2, fresh batches
    of 64, next-token loss inside the repeat only. Returns the model in eval mode."""
    torch.manual_seed(seed)
    model = induction_model()
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(100 + seed)
    for _ in range(steps):
        tokens, scored, _ = repeat_batch(data, 64)
        logits = model(tokens)[:, :-1]  # position p predicts token p + 1
        loss = F.cross_entropy(logits[scored], tokens[:, 1:][scored])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return model.eval()


# --------------------------------------------------------------------------------------------------------------
# Chapter 11: a character model of English. The text is the course's own prose (the Markdown of chapters 1 to 9,
# with code, formulas, markup and links' targets removed, lower case), stored as lib/weights/prose.txt so that the
# recipe reads the same characters on every machine; the first 90 % trains, the last 10 % is held out.
# --------------------------------------------------------------------------------------------------------------

PROSE = {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 256, "context": 64, "batch": 32, "steps": 800}


def prose_text():
    """The stored English text (lower-case letters, space and . , ; : ' ( ) -) as one string."""
    return (WEIGHTS / "prose.txt").read_text(encoding="utf-8").strip()


def prose_alphabet():
    """The characters of :func:`prose_text`, sorted: token i is ``prose_alphabet()[i]``."""
    return "".join(sorted(set(prose_text())))


def encode(text):
    """A string of the alphabet's characters as token ids (len(text),); any other character is a ValueError."""
    alphabet = prose_alphabet()
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    unknown = sorted(set(text) - set(alphabet))
    if unknown:
        raise ValueError(f"characters outside the model's alphabet {alphabet!r}: {''.join(unknown)!r}")
    return torch.tensor([alphabet.index(c) for c in text])


def prose_split():
    """(train, held_out): the text's token ids, its first 90 % and the rest."""
    ids = encode(prose_text())
    cut = int(0.9 * len(ids))
    return ids[:cut], ids[cut:]


def prose_batch(ids, gen, size):
    """``size`` windows of ``context`` + 1 consecutive tokens of ``ids``, at random starts: (size, context + 1)."""
    T = PROSE["context"]
    starts = torch.randint(0, len(ids) - T - 1, (size,), generator=gen)
    return torch.stack([ids[s:s + T + 1] for s in starts.tolist()])


def prose_model():
    """The untrained character model: :class:`TinyLM`, 2 layers of 4 heads, RoPE, an MLP of 256."""
    c = PROSE
    return TinyLM(len(prose_alphabet()), c["d_model"], n_layers=c["n_layers"], n_heads=c["n_heads"],
                  d_ff=c["d_ff"])


def train_prose(seed=0, steps=PROSE["steps"]):
    """Train :func:`prose_model` from seed ``seed``: Adam at 3e-3, fresh windows of
    64 characters from the training text, batches of 32, next-character loss at
    every position. Returns the model in eval mode."""
    torch.manual_seed(seed)
    model = prose_model()
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(100 + seed)
    train_ids, _ = prose_split()
    for _ in range(steps):
        window = prose_batch(train_ids, data, PROSE["batch"])
        logits = model(window[:, :-1])  # position p predicts character p + 1
        loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return model.eval()


# --------------------------------------------------------------------------------------------------------------
# Chapter 13: the lookup task (lib.variants.lookup_batch), with and without a learned sink logit per head, trained
# until it answers the lookups: 4,000 steps, the learning rate decayed along a cosine, which brings every seed tried
# (0, 1, 2) above 0.9 of the answers that are symbols (after 500 steps, about 0.3; the answers "-" are right early).
# --------------------------------------------------------------------------------------------------------------

LOOKUP = {"n_symbols": 64, "d_model": 32, "n_layers": 2, "n_heads": 2, "steps": 4000}


def lookup_model():
    """The untrained model of the lookup task: :class:`TinyLM`, 2 layers of 2 heads, RoPE, no MLP; its vocabulary
    is the 64 symbols, the BOS token and the answer "none"."""
    c = LOOKUP
    return TinyLM(c["n_symbols"] + 2, c["d_model"], n_layers=c["n_layers"], n_heads=c["n_heads"], d_ff=0)


def train_lookup(learned_sink, seed=0, steps=LOOKUP["steps"]):
    """Train :func:`lookup_model` on fresh batches of 64, the whole causal context
    visible, with Adam at 1e-2 decayed to 0 along a cosine; with ``learned_sink`` also
    one sink logit per head (zeros at first, its own learning rate 0.1, decayed too).
    Returns (model, sinks): sinks (layers, heads) or None."""
    torch.manual_seed(seed)
    model = lookup_model()
    sinks = None
    if learned_sink:
        sinks = torch.nn.Parameter(torch.zeros(LOOKUP["n_layers"], LOOKUP["n_heads"]))
    groups = [{"params": model.parameters()}]
    if learned_sink:
        groups.append({"params": [sinks], "lr": 0.1})
    optimiser = torch.optim.Adam(groups, lr=1e-2)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, steps)  # to 0
    data = torch.Generator().manual_seed(100 + seed)
    for _ in range(steps):
        tokens, targets = lookup_batch(data, 64)
        logits = masked_forward(model, tokens, sinks=sinks)
        loss = F.cross_entropy(logits[:, 1:].flatten(0, 1), targets[:, 1:].flatten())
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        schedule.step()
    return model.eval(), (None if sinks is None else sinks.detach())


# --------------------------------------------------------------------------------------------------------------
# Chapter 13: associative recall (lib.variants.recall_batch), one layer of softmax or linear attention, trained
# until its held-out recall stops moving. Each checkpoint's recall is stored with the weights as the curve.
# --------------------------------------------------------------------------------------------------------------

RECALL = {"pair_counts": (4, 8, 16, 32, 64), "n_keys": 128, "n_values": 16, "n_queries": 8, "d": 16,
          "steps": 4000, "every": 250}
# The stored recall models: name -> (kind, d).
RECALL_MODELS = {"recall-softmax": ("softmax", 16), "recall-linear": ("linear", 16), "recall-linear-d32": ("linear", 32)}


def recall_model(kind, d=RECALL["d"]):
    """The untrained model of the recall task: :class:`lib.variants.RecallNet` with ``kind`` and state size d."""
    return RecallNet(RECALL["n_keys"], RECALL["n_values"], d, kind)


def recall_test(seed, size=1000):
    """Held-out recall data: for each of RECALL's pair counts, ``size`` contexts (keys, values, asked, answers)."""
    c, data = RECALL, torch.Generator().manual_seed(seed)
    return [recall_batch(data, size, n, c["n_keys"], c["n_values"], c["n_queries"]) for n in c["pair_counts"]]


def recall_accuracy(net, tests):
    """The share of queries ``net`` answers right, one per entry of ``tests`` (as :func:`recall_test` makes)."""
    right = []
    with torch.no_grad():
        for keys, values, asked, answers in tests:
            right.append((net(keys, values, asked).argmax(-1) == answers).float().mean().item())
    return right


def train_recall(kind, d=RECALL["d"],
                 steps=RECALL["steps"]):
    """Train :func:`recall_model`: Adam at 1e-2, fresh batches of 64 contexts, the
    pair counts in turn. Every 250 steps, recall on 2,000 held-out contexts per count.
    Returns (model, curve): curve (checkpoints, pair counts), model in eval mode."""
    c = RECALL
    torch.manual_seed(0)
    net = recall_model(kind, d)
    optimiser = torch.optim.Adam(net.parameters(), lr=1e-2)
    data, curve = torch.Generator().manual_seed(10), []
    held_out = recall_test(98, size=2000)
    for step in range(steps):
        n_pairs = c["pair_counts"][step % len(c["pair_counts"])]
        keys, values, asked, answers = recall_batch(data, 64, n_pairs, c["n_keys"],
                                                    c["n_values"], c["n_queries"])
        logits = net(keys, values, asked)  # (64, n_queries, n_values)
        loss = F.cross_entropy(logits.flatten(0, 1), answers.flatten())
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        if (step + 1) % c["every"] == 0:
            curve.append(recall_accuracy(net.eval(), held_out))
            net.train()
    return net.eval(), torch.tensor(curve)
