"""
Sum a pytest run's durations per test module, longest first, to keep ``LONG_MODULES`` in
tests/conftest.py in order:

    bash scripts/test.sh -n 2 --durations=0 | tee run.log
    python scripts/module_durations.py run.log [TOP]

Reads the ``--durations`` lines (``12.34s call     tests/x.py::test_y``: setup, call and teardown
all count) and prints the TOP modules (default 15) with their total seconds and test count.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict

LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s+(?:setup|call|teardown)\s+(\S+?\.py)(?:::\S.*)?$")


def main(argv: list[str]) -> int:
    if not 2 <= len(argv) <= 3:
        print(__doc__, file=sys.stderr)
        return 2
    top = int(argv[2]) if len(argv) == 3 else 15
    seconds: dict[str, float] = defaultdict(float)
    tests: dict[str, set[str]] = defaultdict(set)
    with open(argv[1], encoding="utf-8", errors="replace") as log:
        for line in log:
            match = LINE.match(line)
            if match:
                seconds[match[2]] += float(match[1])
                tests[match[2]].add(line.split(None, 2)[2].strip())
    if not seconds:
        print(f"{argv[1]}: no --durations lines (run pytest with --durations=0)", file=sys.stderr)
        return 1
    for module, total in sorted(seconds.items(), key=lambda item: -item[1])[:top]:
        print(f"{total:8.1f} s  {len(tests[module]):4d} tests  {module}")
    print(f"{sum(seconds.values()):8.1f} s in all, {len(seconds)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
