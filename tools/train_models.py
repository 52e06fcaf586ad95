"""Train the models chapters 11 and 13 load, with lib.trained's recipes, and store their weights in lib/weights/.

    python tools/train_models.py              # every model
    python tools/train_models.py induction    # those whose name starts so

Run it after changing a recipe, then refresh the chapters that load the models (make notebooks) and commit the
weights with them. One thread and deterministic algorithms, as in the chapters: on one machine a second run writes
the same weights; on another CPU the weights, and the chapters' last digits, may differ (lib/trained.py says why).
"""

from __future__ import annotations

import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch

from lib import trained


def recipes():
    """name -> a zero-argument call returning (model, extra tensors to store beside it)."""
    found = {f"induction-seed{seed}": (lambda seed=seed: (trained.train_induction(seed), {}))
             for seed in range(trained.INDUCTION["seeds"])}
    found["prose"] = lambda: (trained.train_prose(), {})
    found["lookup-plain"] = lambda: (trained.train_lookup(learned_sink=False)[0], {})

    def with_sink():
        model, sinks = trained.train_lookup(learned_sink=True)
        return model, {"sinks": sinks}

    found["lookup-sink"] = with_sink

    def recall(kind, d):
        def recipe():
            model, curve = trained.train_recall(kind, d)
            return model, {"curve": curve}
        return recipe

    for name, (kind, d) in trained.RECALL_MODELS.items():
        found[name] = recall(kind, d)
    return found


def main():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    wanted = sys.argv[1:]
    for name, recipe in recipes().items():
        if wanted and not any(name.startswith(w) for w in wanted):
            continue
        start = time.perf_counter()
        model, extra = recipe()
        trained.save(name, model, **extra)
        size = trained.WEIGHTS.joinpath(f"{name}.pt").stat().st_size
        print(f"{name}: trained in {time.perf_counter() - start:.1f} s, {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
