"""
The whole performance table of issue 14, one row per comparison (interleaved, n >= 5, median, min
and max of the per-round ratio): the local backend's rows (``bench_local_perf.rows``), then the
Docker backend's (``bench_docker_perf.rows``: ``@task.sandbox`` against ``@task.docker`` and
``docker run``, transfers against ``docker cp``; it needs a running Engine and the ``bench`` extra).
Each row is printed as soon as it is measured, with the load average at that moment; a row (or a
whole part) that fails prints why, and the rest still run.

    .venv/bin/python benchmarks/table.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import load, print_rows  # noqa: E402

#: The modules whose ``rows(rounds=...)`` make the table, in order; a missing one is named and skipped.
PARTS = ("bench_local_perf", "bench_docker_perf")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    print(f"rounds {args.rounds}, {load()} at the start", flush=True)
    for name in PARTS:
        try:
            part = importlib.import_module(name)
        except ImportError as err:
            print(f"({name} cannot be imported: {err}; its rows are left out)", flush=True)
            continue
        try:
            print_rows(part.rows(rounds=args.rounds))
        except Exception as err:  # a part that fails outside its rows (its setup): the next part still runs
            print(f"({name} failed: {type(err).__name__}: {err}; its remaining rows are left out)", flush=True)
            traceback.print_exc()


if __name__ == "__main__":
    main()
