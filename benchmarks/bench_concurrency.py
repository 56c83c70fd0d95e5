"""
Many sandboxes at once, against the raw tool at the same concurrency, run by hand:

    .venv/bin/python benchmarks/bench_concurrency.py [--count 50] [--rounds N] [--backend local docker]
    .venv/bin/python benchmarks/bench_concurrency.py --against /work/wt-ref/src   # this tree vs another

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
reference tree's. Before the rounds, one sandbox is left standing on purpose and counted, so a
count that cannot see leftovers says so (``BLIND``).

``--processes P`` (local) splits each burst over ``P`` worker processes of ``count / P`` threads
each, on both sides, as Airflow runs tasks: each in a process of its own. In one process, the
hook's Python work of 200 sandboxes at once queues for one interpreter lock, which a worker's
task processes do not share; the raw side's few lines of Python barely meet it. The errors of
every process are added up, the leftovers counted once for the run.

``--against SRC`` compares two trees of the provider directly instead: this tree's bursts
against those of the tree whose ``src`` directory is given, each tree in a worker process of its
own (``floors.TreeWorker``), the rounds interleaved; goal: median ratio at most 1.10. Each
worker reports its errors and leftovers at the end.

Another tree can also be measured against the raw tools with ``PYTHONPATH=<tree>/src`` in front
of the command; the first line printed names the tree measured. One warm-up sandbox per side
runs alone first (imports, probes, first connection); the rounds (default 15 on local, where a
burst takes under a second, and 5 on Docker, ~10 s a burst) have no warm-up, so the default run
stays near three minutes.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import floors
from harness import attempt, compare, print_rows, print_table

EXPECTED = "ok"
#: Issue 32's goal for 200 local sandboxes at once against as many raw bwraps.
GOAL_AT_ONCE = 1.4


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
    """
    One task's sandbox: a hook of its own, create, ``echo ok``, destroy (destroy also after a failed
    command) as a task's session does it, not waiting for the removal (``wait=False``).
    """

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
            floors.destroy_as_a_task_does(hook, handle)

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


class _Bursts:
    """Both sides of one backend as bursts of ``count`` at once: ``one_ours`` and ``one_raw`` each time."""

    count: int
    errors: tuple[Errors, Errors]
    one_ours: Callable[[], None]
    one_raw: Callable[[], None]

    def ours(self) -> None:
        burst(self.count, self.one_ours, self.errors[0])

    def raw(self) -> None:
        burst(self.count, self.one_raw, self.errors[1])


class LocalSide(_Bursts):
    """The local backend's two sides, each a burst of ``count`` at once, with their errors and leftovers."""

    name, raw_name = "local", "raw bwrap echo"

    def __init__(self, count: int) -> None:
        self.count, self.root = count, floors.local_root()
        self.parent = f"airflow-sandbox-{floors.run_tag()}"
        self.errors = (Errors(), Errors())
        raw = floors.raw_bwrap(self.root)
        hook = floors.local_hook(self.root, self.parent)
        handle = hook.create()
        self.notes = [counter_control("local", "one hook sandbox", floors.local_leftovers(self.root, self.parent))]
        hook.destroy(handle)
        self.one_ours = hook_life(lambda: floors.local_hook(self.root, self.parent), self.errors[0])
        self.one_raw = raw_life(lambda: raw(["echo", EXPECTED]), self.errors[1])
        warm_up(self)

    def leftovers(self) -> dict[str, int]:
        floors.join_local_removals()
        return floors.local_leftovers(self.root, self.parent)

    def close(self) -> str:
        """The errors of both sides and what is left behind; removes the run's directory."""
        try:
            return report(self, "local hook", "raw bwrap")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


class DockerSide(_Bursts):
    """The Docker backend's two sides, each a burst of ``count`` at once, with their errors and leftovers."""

    name, raw_name = "docker", "docker run --rm"

    def __init__(self, count: int) -> None:
        self.count, self.client = count, floors.docker_client()
        self.uid, self.tag = floors.bench_uid(), floors.run_tag()
        self.errors = (Errors(), Errors())
        hook = floors.docker_hook(self.uid)
        handle = hook.create()
        labels = {floors.RAW_LABEL: self.tag}
        standing = self.client.containers.create(floors.IMAGE, ["true"], labels=labels, network_mode="none")
        what = "one hook sandbox and one raw container"
        self.notes = [counter_control("docker", what, self.leftovers())]
        hook.destroy(handle)
        standing.remove(force=True)
        argv = floors.docker_run_argv(self.tag, ["echo", EXPECTED])
        self.one_ours = hook_life(lambda: floors.docker_hook(self.uid), self.errors[0])
        self.one_raw = raw_life(
            lambda: subprocess.run(argv, capture_output=True, stdin=subprocess.DEVNULL), self.errors[1]
        )
        warm_up(self)

    def leftovers(self) -> dict[str, int]:
        return floors.docker_leftovers(self.client, self.uid, self.tag)

    def close(self) -> str:
        text = report(self, "docker hook", "docker run --rm")
        if any(self.leftovers().values()):
            time.sleep(5)
            text += f"\n  left behind, docker, 5 s later: {self.leftovers()}"
        return text


class LocalProcessesSide:
    """
    The local backend's two sides, each burst split over ``processes`` worker processes of
    ``count / processes`` threads (``--processes``), with the errors of all and the run's leftovers.
    """

    name, raw_name = "local", "raw bwrap echo"

    def __init__(self, count: int, processes: int) -> None:
        if count % processes:
            raise ValueError(f"--count {count} must be a multiple of --processes {processes}")
        self.count, self.root = count, floors.local_root()
        self.parent = f"airflow-sandbox-{floors.run_tag()}"
        hook = floors.local_hook(self.root, self.parent)
        handle = hook.create()
        self.notes = [counter_control("local", "one hook sandbox", floors.local_leftovers(self.root, self.parent))]
        hook.destroy(handle)
        argv = [sys.executable, __file__, "--child", self.root, self.parent, str(count // processes)]
        self.children = [
            subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(processes)
        ]
        for child in self.children:
            self._answer(child)  # "ready": warmed up

    @staticmethod
    def _answer(child: subprocess.Popen) -> str:
        assert child.stdout is not None
        for line in child.stdout:  # Airflow's configuration may print a line first
            if line.startswith("bench-child "):
                return line.split(" ", 1)[1].strip()
        raise RuntimeError(f"a worker process ended ({child.wait()})")

    def _burst(self, side: str) -> None:
        for child in self.children:
            assert child.stdin is not None
            child.stdin.write(side + "\n")
            child.stdin.flush()
        for child in self.children:
            self._answer(child)

    def ours(self) -> None:
        self._burst("ours")

    def raw(self) -> None:
        self._burst("raw")

    def close(self) -> str:
        totals = (Errors(), Errors())
        for child in self.children:
            self._ask_report(child)
            for errors, (runs, counts) in zip(totals, json.loads(self._answer(child)), strict=True):
                errors.runs += runs
                errors.counts.update(counts)
            assert child.stdin is not None
            child.stdin.close()
            child.wait()
        self.errors = totals
        try:
            return report(self, f"local hook, {len(self.children)} processes", "raw bwrap")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    @staticmethod
    def _ask_report(child: subprocess.Popen) -> None:
        assert child.stdin is not None
        child.stdin.write("report\n")
        child.stdin.flush()

    def leftovers(self) -> dict[str, int]:
        return floors.local_leftovers(self.root, self.parent)


def child(root: str, parent: str, threads: int) -> int:
    """A worker process of ``--processes``: a burst of ``threads`` of the side each line of stdin names."""
    logging.disable(logging.WARNING)
    errors = (Errors(), Errors())
    raw = floors.raw_bwrap(root)
    one = {
        "ours": hook_life(lambda: floors.local_hook(root, parent), errors[0]),
        "raw": raw_life(lambda: raw(["echo", EXPECTED]), errors[1]),
    }
    for side in one.values():  # warm-up, not counted
        side()
    for each in errors:
        each.counts.clear()
    floors.join_local_removals()
    print("bench-child ready", flush=True)
    for line in sys.stdin:
        side = line.strip()
        if side == "report":
            print("bench-child", json.dumps([[e.runs, dict(e.counts)] for e in errors]), flush=True)
            continue
        burst(threads, one[side], errors[0 if side == "ours" else 1])
        print("bench-child done", flush=True)
        floors.join_local_removals()  # untimed: the parent waits for every process's answer first
    return 0


SIDES = {"local": LocalSide, "docker": DockerSide}
#: Rounds per backend when --rounds is not given: a local burst takes well under a second, a Docker one ~10 s.
DEFAULT_ROUNDS = {"local": 15, "docker": 5}


def warm_up(side) -> None:
    """One sandbox of each side alone (imports, probes, first connection); its errors are not counted."""
    side.one_ours()
    side.one_raw()
    for errors in side.errors:
        errors.counts.clear()


def counter_control(backend: str, what: str, standing: dict[str, int]) -> str:
    """What the leftover count saw while ``what`` stood on purpose: a count of 0 there is blind."""
    blind = [name for name, n in standing.items() if n < 1]
    verdict = f"; BLIND to {', '.join(blind)}" if blind else ""
    return f"  counter control, {backend}: with {what} standing it counts {standing}{verdict}"


def report(side, ours_name: str, raw_name: str) -> str:
    ran = [errors.report(name) for errors, name in zip(side.errors, (ours_name, raw_name), strict=True) if errors.runs]
    lines = [*side.notes, *ran]
    return "\n".join([*lines, f"  left behind, {side.name}: {side.leftovers()}"])


def against_raw(args) -> None:
    """Each backend against its raw tool at the same concurrency, in this process."""
    for backend in args.backend:
        try:
            if args.processes and backend == "local":
                side = LocalProcessesSide(args.count, args.processes)
            else:
                side = SIDES[backend](args.count)
        except Exception as err:  # one backend that cannot start must not cost the other's row
            print(f"{backend}: FAILED to set up: {type(err).__name__}: {err}", flush=True)
            continue
        try:
            print_rows(
                attempt(
                    f"{backend}: {args.count} at once",
                    lambda side=side, backend=backend: (
                        compare(
                            f"{backend}: {args.count} hook lifecycles at once"
                            + (f" in {args.processes} processes" if args.processes and backend == "local" else ""),
                            side.ours,
                            f"{args.count} x {side.raw_name}",
                            side.raw,
                            rounds=args.rounds or DEFAULT_ROUNDS[backend],
                            warmup=0,
                            # What a burst's destroys left to threads finishes before the next burst, untimed.
                            setup=floors.join_local_removals,
                        ),
                        f"(goal: local <= {GOAL_AT_ONCE}x raw with 0 errors and 0 left behind)",
                    ),
                )
            )
        finally:
            print(side.close(), flush=True)


def against_tree(args) -> None:
    """This tree's bursts against another tree's, each in a worker process, interleaved."""
    argv = ["--count", str(args.count), "--backend", *args.backend]
    trees = (floors.TreeWorker(__file__, None, argv), floors.TreeWorker(__file__, args.against, argv))
    print(f"this tree: {trees[0].tree}\nagainst:   {trees[1].tree}", flush=True)
    try:
        for backend in args.backend:
            comparison = compare(
                f"{backend}: {args.count} at once, this tree",
                lambda b=backend: trees[0].do(b),
                "the same on the other tree",
                lambda b=backend: trees[1].do(b),
                rounds=args.rounds or DEFAULT_ROUNDS[backend],
                warmup=0,
            )
            print_table([(comparison, "(goal: median ratio <= 1.10)")])
    finally:
        for name, tree in zip(("this tree", "the other tree"), trees, strict=True):
            print(f"{name}:\n{tree.close()}", flush=True)


def serve(args) -> int:
    def setup():
        sides = {backend: SIDES[backend](args.count) for backend in args.backend}
        return {name: side.ours for name, side in sides.items()}, lambda: "\n".join(s.close() for s in sides.values())

    return floors.serve(setup)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=50, help="sandboxes at once (default 50)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds, at least 5 (default 15 on local, 5 on Docker)")
    parser.add_argument("--backend", nargs="+", choices=floors.BACKENDS, default=list(floors.BACKENDS))
    parser.add_argument(
        "--against",
        metavar="SRC",
        help="compare this tree's bursts with those of the provider tree whose src directory this is, instead of the raw tools",
    )
    parser.add_argument(
        "--processes",
        type=int,
        metavar="P",
        help="local: split each burst (both sides) over P worker processes, as tasks run (--count a multiple of P)",
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", nargs=3, metavar=("ROOT", "PARENT", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], int(args.child[2]))
    if args.processes is not None and (args.processes < 1 or args.count % args.processes):
        parser.error("--processes must be at least 1 and divide --count")
    if args.rounds is not None and args.rounds < 5:
        parser.error("--rounds must be at least 5")
    if args.count < 1:
        parser.error("--count must be at least 1")
    return floors.dispatch(args, serve=serve, against_tree=against_tree, against_floors=against_raw)


if __name__ == "__main__":
    sys.exit(main())
