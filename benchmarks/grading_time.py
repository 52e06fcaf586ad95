"""What grading a class costs: the grader (tools/grade.py) run on the official solutions of every chapter, handed in
by a few students, the way `make grade` runs it.

    .venv/bin/python benchmarks/grading_time.py                  # 2 students x 13 chapters, -j 2
    .venv/bin/python benchmarks/grading_time.py --students 4 --jobs 2 --class-size 60

Each student's notebooks are the student editions with the chapters' own solutions in place of the stubs, so every
hidden test runs. It prints, per chapter, the median wall-clock and processor seconds of one notebook, then the
whole run's wall-clock time and, from it, a projection for a class of --class-size students on this machine
(grading time grows with the number of notebooks; the projection is a prediction, not a measurement). It checks
that every exercise scored full marks and says so; nothing here passes or fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tools"), str(ROOT)]
import grading_helpers as gh


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--students", type=int, default=2, help="students handing in every chapter (2)")
    parser.add_argument("--jobs", "-j", type=int, default=2, help="notebooks graded at once (2)")
    parser.add_argument("--class-size", type=int, default=60, help="students to project the time for (60)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.students < 1 or args.jobs < 1 or args.class_size < 1:
        raise ValueError("--students, --jobs and --class-size must be at least 1")

    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp) / "handed-in"
        for path in gh.CHAPTERS:
            nb = gh.submission(path, gh.official_answers(path))
            for k in range(args.students):
                gh.submit(folder, f"student{k + 1:02d}", nb, name=path.name)
        notebooks = gh.grade.submissions(folder)
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda p: gh.grade.grade(p, folder, gh.OFFICIAL, args.seed), notebooks))
        wall = time.monotonic() - start

    print(f"{platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}; {len(notebooks)} notebooks, -j {args.jobs}")
    print(f"{'chapter':<40} {'wall s':>7} {'cpu s':>7} {'scored':>8}")
    for doc in sorted({r.chapter for r in results}):
        mine = [r for r in results if r.chapter == doc]
        scored = sum(sum(r.scores.values()) for r in mine) / len(mine)
        possible = sum(sum(r.points.values()) for r in mine) / len(mine)
        cpu = [r.cpu_seconds for r in mine if r.cpu_seconds is not None]
        print(f"{doc.rsplit('/', 1)[-1]:<40} {statistics.median(r.seconds for r in mine):>7.1f} "
              f"{statistics.median(cpu) if cpu else float('nan'):>7.1f} {scored:>4g}/{possible:g}")
    missing = [f"{c}.{n}" for c, n in sorted({(int(r.label), n) for r in results for n in r.ungraded})]
    short = [f"{r.student} {r.label}" for r in results if sum(r.scores.values()) < sum(r.points.values())]
    print(f"whole run: {wall:.0f} s wall for {len(notebooks)} notebooks ({wall / len(notebooks):.1f} s each)")
    per_student = wall / args.students
    print(f"prediction for {args.class_size} students x {len(gh.CHAPTERS)} chapters at -j {args.jobs} here: "
          f"{per_student * args.class_size / 60:.0f} min")
    print("official solutions: " + ("full marks on every notebook" if not short else f"short of full: {short}"))
    print("exercises without a hidden test: " + (", ".join(missing) if missing else "none"))


if __name__ == "__main__":
    main()
