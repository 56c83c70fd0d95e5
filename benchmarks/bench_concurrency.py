"""
Many sandboxes at once, against the raw tool at the same concurrency, run by hand:

    .venv/bin/python benchmarks/bench_concurrency.py [--count 50] [--rounds 5] [--backend local docker]

A round starts ``--count`` threads at once; each builds its own hook (as each task of a Dag does),
creates a sandbox, runs ``echo ok`` in it (checking the output) and destroys it. The round's time
is until the last thread ends. Against it, interleaved (``harness.compare``), the same number of
raw runs at once:

- local: ``bwrap ... echo ok`` with the backend's namespaces and read-only mounts
  (``floors.raw_bwrap``);
- Docker: ``docker run --rm --network none <image> echo ok``.

After the rounds it prints, per backend, the errors seen (exceptions, wrong output) and what is
left behind, counted on the machine: on local the entries of the run's state root, the uid
leases pointing into it and the cgroups under the run's own cgroup parent; on Docker the
containers, in any state, carrying this run's labels (the hook's by their sandbox user label,
the raw ones by a run label), so other people's containers on the same Engine are not counted.
Issue 14's goal for this figure: no errors, no leftovers, and the ratio within 10% of the
reference tree's (run this script on both and compare the medians).

To measure another tree of the provider (the reference commit, say) with these same scripts, put
its ``src`` first: ``PYTHONPATH=<tree>/src .venv/bin/python benchmarks/<script>``; the first line
printed names the tree measured.

One warm-up sandbox per side runs alone before the rounds (imports, probes, first connection);
the rounds themselves have no warm-up, so the default run stays near three minutes.
"""

from __future__ import annotations

import argparse
import collections
import logging
import shutil
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import floors
from harness import compare, print_table

EXPECTED = "ok"


class Errors:
    """The errors of one side of a benchmark, counted by their first line."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.runs = 0
        self._lock = threading.Lock()

    def add(self, what: str) -> None:
        with self._lock:
            self.counts[what.splitlines()[0][:160] if what else "(no message)"] += 1

    def report(self, name: str) -> str:
        total = sum(self.counts.values())
        lines = [f"  {name}: {total} errors in {self.runs} sandboxes"]
        lines += [f"    {n} x {what}" for what, n in self.counts.most_common(5)]
        return "\n".join(lines)


def burst(count: int, one: Callable[[], None], errors: Errors) -> None:
    """Run ``one`` in ``count`` threads at once; an exception is an error, never an early end."""

    def guarded(_index: int) -> None:
        try:
            one()
        except Exception as err:  # every failure is counted and reported, not raised
            errors.add(f"{type(err).__name__}: {err}")

    with ThreadPoolExecutor(max_workers=count) as pool:
        list(pool.map(guarded, range(count)))
    errors.runs += count


def hook_life(make_hook: Callable[[], object], errors: Errors) -> Callable[[], None]:
    """One task's sandbox: a hook of its own, create, ``echo ok``, destroy (destroy also after a failed command)."""

    def one() -> None:
        hook = make_hook()
        handle = hook.create()
        try:
            result = hook.run_command(handle, f"echo {EXPECTED}", timeout=120, max_output_bytes=4096)
            if not result.ok or result.stdout.strip() != EXPECTED:
                errors.add(
                    f"command: exit {result.exit_code}, stdout {result.stdout[:80]!r}, stderr {result.stderr[:80]!r}"
                )
        finally:
            hook.destroy(handle)

    return one


def raw_life(run: Callable[[], object], errors: Errors) -> Callable[[], None]:
    def one() -> None:
        proc = run()
        out = proc.stdout.decode(errors="replace").strip()
        if proc.returncode != 0 or out != EXPECTED:
            errors.add(
                f"raw: exit {proc.returncode}, stdout {out[:80]!r}, stderr {proc.stderr.decode(errors='replace')[:120]!r}"
            )

    return one


def measure(
    backend: str, ours: Callable[[], None], raw: Callable[[], None], args, errors: tuple[Errors, Errors], raw_name: str
):
    ours_errors, raw_errors = errors
    ours()
    raw()  # warm-up: one of each, alone
    ours_errors.runs = raw_errors.runs = 0
    ours_errors.counts.clear()
    raw_errors.counts.clear()
    comparison = compare(
        f"{backend}: {args.count} hook lifecycles at once",
        lambda: burst(args.count, ours, ours_errors),
        f"{args.count} x {raw_name}",
        lambda: burst(args.count, raw, raw_errors),
        rounds=args.rounds,
        warmup=0,
    )
    print_table([(comparison, "(goal: within 10% of the reference tree's ratio)")])
    return comparison


def counter_control(backend: str, what: str, standing: dict[str, int]) -> None:
    """Print what the leftover count saw while ``what`` stood on purpose: a count of 0 there is blind."""
    blind = [name for name, n in standing.items() if n < 1]
    verdict = f"; BLIND to {', '.join(blind)}" if blind else ""
    print(f"  counter control, {backend}: with {what} standing it counts {standing}{verdict}", flush=True)


def run_local(args) -> None:
    root = floors.local_root()
    parent = f"airflow-sandbox-{floors.run_tag()}"
    errors = (Errors(), Errors())
    try:
        raw = floors.raw_bwrap(root)
        hook = floors.local_hook(root, parent)
        handle = hook.create()
        counter_control("local", "one hook sandbox", floors.local_leftovers(root, parent))
        hook.destroy(handle)
        measure(
            "local",
            hook_life(lambda: floors.local_hook(root, parent), errors[0]),
            raw_life(lambda: raw(["echo", EXPECTED]), errors[1]),
            args,
            errors,
            "raw bwrap echo",
        )
        print(errors[0].report("local hook"))
        print(errors[1].report("raw bwrap"))
        print(f"  left behind, local: {floors.local_leftovers(root, parent)}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_docker(args) -> None:
    import subprocess

    client = floors.docker_client()
    uid, tag = floors.bench_uid(), floors.run_tag()
    argv = floors.docker_run_argv(tag, ["echo", EXPECTED])
    errors = (Errors(), Errors())
    hook = floors.docker_hook(uid)
    handle = hook.create()
    standing = client.containers.create(floors.IMAGE, ["true"], labels={floors.RAW_LABEL: tag}, network_mode="none")
    counter_control("docker", "one hook sandbox and one raw container", floors.docker_leftovers(client, uid, tag))
    hook.destroy(handle)
    standing.remove(force=True)
    measure(
        "docker",
        hook_life(lambda: floors.docker_hook(uid), errors[0]),
        raw_life(lambda: subprocess.run(argv, capture_output=True, stdin=subprocess.DEVNULL), errors[1]),
        args,
        errors,
        "docker run --rm",
    )
    print(errors[0].report("docker hook"))
    print(errors[1].report("docker run --rm"))
    left = floors.docker_leftovers(client, uid, tag)
    print(f"  left behind, docker: {left}", flush=True)
    if any(left.values()):
        time.sleep(5)
        print(f"  left behind, docker, 5 s later: {floors.docker_leftovers(client, uid, tag)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=50, help="sandboxes at once (default 50)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds, at least 5 (default 5)")
    parser.add_argument("--backend", nargs="+", choices=floors.BACKENDS, default=list(floors.BACKENDS))
    args = parser.parse_args()
    if args.rounds < 5:
        parser.error("--rounds must be at least 5")
    if args.count < 1:
        parser.error("--count must be at least 1")
    logging.disable(logging.WARNING)
    print(floors.provenance(), flush=True)
    for backend in args.backend:
        {"local": run_local, "docker": run_docker}[backend](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
