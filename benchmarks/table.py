"""
The whole performance table of issue 14, one row per comparison (interleaved, n >= 5, median, min
and max of the per-round ratio): the local backend's rows (``bench_local_perf.rows``), then the
Docker backend's (``bench_docker_perf.rows``: ``@task.sandbox`` against ``@task.docker`` and
``docker run``, transfers against ``docker cp``; it needs a running Engine and the ``bench`` extra).

    .venv/bin/python benchmarks/table.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import print_table  # noqa: E402

#: The modules whose ``rows(rounds=...)`` make the table, in order; a missing one is named and skipped.
PARTS = ("bench_local_perf", "bench_docker_perf")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    rows = []
    for name in PARTS:
        try:
            part = importlib.import_module(name)
        except ImportError:
            print(f"({name} is not there: its rows are left out)", flush=True)
            continue
        rows += part.rows(rounds=args.rounds)
    print_table(rows)


if __name__ == "__main__":
    main()
