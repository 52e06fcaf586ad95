"""Run chapter notebooks top to bottom, several at once, each in a fresh kernel, and say how each ended.

    python tools/run_chapters.py colab/chapters/*.ipynb                 # every Colab edition, 4 at a time
    python tools/run_chapters.py --jobs 6 --out /tmp/run chapters/09_flash_kernel.ipynb

Each notebook runs in its own folder (the one it lies in, so its setup cell finds lib/ above it) with the
machine's own Python (the kernel is "python3"). A line per notebook gives its seconds and either "ok" or the first
error, with the cell it came from; cells tagged `raises-exception` may raise, as they do in the book. With --out,
the executed notebooks are written there. The exit status is 1 if any notebook stopped on an error, else 0.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import pathlib
import sys
import time


def run_one(path: str, out: str | None, timeout: int) -> tuple[str, float, str]:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    nb_path = pathlib.Path(path).resolve()
    nb = nbformat.read(nb_path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(nb_path.parent)}})
    start = time.perf_counter()
    try:
        client.execute()
        status = "ok"
    except (CellExecutionError, CellTimeoutError) as err:
        index = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                      and "raises-exception" not in c.metadata.get("tags", [])  # errors the book shows
                      and any(o.get("output_type") == "error" for o in c.get("outputs", []))), None)
        lines = [line for line in str(err).splitlines() if line.strip()]
        status = f"error in cell {index}: {lines[-1][:300] if lines else type(err).__name__}"
    except Exception as err:  # noqa: BLE001  (a kernel that died: say so, go on with the others)
        status = f"error: {type(err).__name__}: {str(err)[:300]}"
    seconds = time.perf_counter() - start
    if out:
        pathlib.Path(out).mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, pathlib.Path(out) / nb_path.name)
    return nb_path.name, seconds, status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="+")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--out", help="write the executed notebooks into this folder")
    parser.add_argument("--timeout", type=int, default=900, help="seconds a cell may take")
    args = parser.parse_args()
    failed = 0
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_one, path, args.out, args.timeout) for path in args.notebooks]
        for future in concurrent.futures.as_completed(futures):
            name, seconds, status = future.result()
            failed += status != "ok"
            print(f"{name}: {seconds:.1f} s, {status}", flush=True)
    print(f"{len(args.notebooks) - failed} of {len(args.notebooks)} notebooks ran to the end")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
