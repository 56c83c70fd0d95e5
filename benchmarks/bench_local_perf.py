"""
The local backend's rows of the performance table (issue 14), each measured interleaved against
what a user would pick instead (``harness.compare``: A, B, A, B ..., median, min and max of the
per-round ratio):

- staging 1 GiB from ``file://`` into a sandbox, against ``cp`` onto the same disk (goal: at least
  0.8x cp's throughput, i.e. a time ratio of at most 1.25), and the worker's peak memory growth
  meanwhile (goal: at most 64 MiB);
- 10,000 files of 1 KiB staged as one directory, against ``tar -c | tar -x`` (goal: within 2x);
- the same 10,000 files exported as one directory to ``file://``, against ``tar -c | tar -x`` of
  the sandbox's workspace (goal: within 2x);
- ``@task.sandbox`` returning ``a + b``, in-task time (create, stage, run, read, destroy) with a new
  hook per task (as every task process builds its own), against a raw ``bwrap ... python3 -c`` with
  the same namespaces and mounts (goal: within 2x) and against ``@task.external_python`` on the
  same interpreter (goal: at most 0.6x).

Each row is printed as soon as it is measured, with the load average at that moment; a row that
fails prints why and the others still run.

    .venv/bin/python benchmarks/bench_local_perf.py [--rounds 15] [--files 10000] [--stage-mib 1024]
        [--part all|staging|task]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import floors  # noqa: E402
from harness import Row, attempt, compare, print_rows  # noqa: E402

from sandbox_provider.engine.transfer import export_files, stage_inputs  # noqa: E402
from sandbox_provider.hooks.local import LocalSandboxHook  # noqa: E402

PARTS = ("staging", "task")


def _peak_rss() -> int:
    """The process's peak resident memory since the last reset, in KiB (VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _reset_peak_rss() -> int:
    """Reset VmHWM to the current resident size (Linux: ``5`` into clear_refs); return it, in KiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _peak_rss()


def _tar_copy(source: str, dest: str) -> None:
    os.makedirs(dest)
    subprocess.run(f"tar -c -C '{source}' . | tar -x -C '{dest}'", shell=True, check=True)


def _big_staging_row(hook, handle: str, root: str, workspace: str, *, rounds: int, stage_mib: int) -> Row:
    """
    Each call writes a new file (as a job staging into its sandbox does); before each, untimed, the
    last call's file is removed and the disk synced, so neither side pays the other's writeback.
    """
    counter = itertools.count()
    big = os.path.join(root, "big.bin")
    with open(big, "wb") as f:
        for _ in range(stage_mib):
            f.write(os.urandom(1024 * 1024))

    def clear() -> None:
        for name in os.listdir(workspace):
            if name.startswith(("big", "cp")):
                os.unlink(os.path.join(workspace, name))
        os.sync()

    before = _reset_peak_rss()
    row = (
        compare(
            f"stage {stage_mib} MiB (file://)",
            lambda: stage_inputs(hook, handle, {f"big{next(counter)}.bin": f"file://{big}"}),
            "cp",
            lambda: subprocess.run(["cp", big, os.path.join(workspace, f"cp{next(counter)}.bin")], check=True),
            rounds=rounds,
            setup=clear,
        ),
        "(goal: time ratio <= 1.25, i.e. >= 0.8x cp's throughput)",
    )
    grown = (_peak_rss() - before) / 1024
    print(f"memory: the worker's peak RSS grew {grown:.1f} MiB while staging (goal <= 64 MiB)", flush=True)
    os.unlink(big)
    clear()
    return row


def _make_tree(tree: str, files: int) -> None:
    for i in range(files):
        sub = os.path.join(tree, f"d{i % 100:02d}")
        os.makedirs(sub, exist_ok=True)
        with open(os.path.join(sub, f"f{i:05d}.txt"), "wb") as f:
            f.write(os.urandom(1024))


def staging_rows(hook: LocalSandboxHook, root: str, *, rounds: int, files: int, stage_mib: int) -> Iterator[Row]:
    """The staging and export rows, in one sandbox, each yielded as soon as it is measured."""
    handle = hook.create()
    workspace = os.path.join(hook.state_root, handle, "workspace")
    counter = itertools.count()
    try:
        yield from attempt(
            f"stage {stage_mib} MiB (file://)",
            lambda: _big_staging_row(hook, handle, root, workspace, rounds=rounds, stage_mib=stage_mib),
        )
        tree = os.path.join(root, "tree")
        _make_tree(tree, files)
        yield from attempt(
            f"stage {files} x 1 KiB as a directory",
            lambda: (
                compare(
                    f"stage {files} x 1 KiB as a directory",
                    lambda: stage_inputs(hook, handle, {f"in{next(counter)}": f"file://{tree}/"}),
                    "tar -c | tar -x",
                    lambda: _tar_copy(tree, os.path.join(workspace, f"tar{next(counter)}")),
                    rounds=rounds,
                ),
                "(goal <= 2x)",
            ),
        )
        out = os.path.join(root, "out")
        stage_inputs(hook, handle, {"exported": f"file://{tree}/"})
        yield from attempt(
            f"export {files} x 1 KiB as a directory",
            lambda: (
                compare(
                    f"export {files} x 1 KiB as a directory",
                    lambda: export_files(hook, handle, {"exported": f"file://{out}/e{next(counter)}/"}),
                    "tar -c | tar -x",
                    lambda: _tar_copy(os.path.join(workspace, "exported"), os.path.join(out, f"t{next(counter)}")),
                    rounds=rounds,
                ),
                "(goal <= 2x)",
            ),
        )
    finally:
        hook.destroy(handle)


@contextlib.contextmanager
def _stderr_to_devnull() -> Iterator[None]:
    """Descriptor 2 (what child processes inherit) points at /dev/null meanwhile."""
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def task_rows(state_root: str, root: str, *, rounds: int) -> Iterator[Row]:
    """``@task.sandbox`` with a new hook per task, against the raw floor and ``@task.external_python``."""
    from airflow.sdk import DAG, task

    def add(a, b):
        return a + b

    with DAG("bench", schedule=None) as dag:
        task.sandbox(python="/usr/bin/python3", backend=LocalSandboxHook(state_root=state_root))(add)(2, 3)
        task.external_python(python="/usr/bin/python3", task_id="ext")(add)(2, 3)
    sandboxed, external = dag.tasks
    ti = mock.MagicMock(dag_id="bench", run_id="r", task_id="add", map_index=-1)
    context = {"ti": ti, "run_id": "r"}
    raw = floors.raw_bwrap(root)

    def ours() -> None:
        sandboxed.backend = LocalSandboxHook(state_root=state_root)  # each task process builds its own
        assert sandboxed.execute(context) == 5

    def floor() -> None:
        raw(["/usr/bin/python3", "-c", "print(2 + 3)"]).check_returncode()

    def theirs() -> None:
        # Its probes of an interpreter without Airflow print tracebacks; they go to /dev/null, not the table.
        with _stderr_to_devnull():
            assert external.execute(context) == 5

    # The removal a task's destroy leaves to a thread (after the result is sent) finishes before either
    # side's next call, untimed, so it never lands on the other side's time.
    settle = floors.join_local_removals
    name = "@task.sandbox a+b (new hook)"
    yield from attempt(
        f"{name} vs raw",
        lambda: (compare(name, ours, "raw bwrap python3 -c", floor, rounds=rounds, setup=settle), "(goal <= 2x)"),
    )
    yield from attempt(
        f"{name} vs external_python",
        lambda: (compare(name, ours, "@task.external_python", theirs, rounds=rounds, setup=settle), "(goal <= 0.6x)"),
    )


def rows(*, rounds: int = 15, files: int = 10_000, stage_mib: int = 1024, parts=PARTS) -> Iterator[Row]:
    """
    Every local row of the table (``parts``: ``"staging"``, ``"task"``), each yielded as soon as it is
    measured; the worker process's first-use work (imports, the bwrap probe) is out of the measurement.
    """
    root = tempfile.mkdtemp(prefix="sandbox-bench-")
    os.chmod(root, 0o711)  # a root worker runs sandboxes as an unprivileged user, who must pass through
    state_root = os.path.join(root, "state")
    hook = LocalSandboxHook(state_root=state_root)
    try:
        hook.destroy(hook.create())
        if "staging" in parts:
            yield from staging_rows(hook, root, rounds=rounds, files=files, stage_mib=stage_mib)
        if "task" in parts:
            yield from task_rows(state_root, root, rounds=rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--stage-mib", type=int, default=1024)
    parser.add_argument("--part", choices=("all", *PARTS), default="all")
    args = parser.parse_args()
    import logging

    logging.disable(logging.INFO)
    parts = PARTS if args.part == "all" else (args.part,)
    print_rows(rows(rounds=args.rounds, files=args.files, stage_mib=args.stage_mib, parts=parts))


if __name__ == "__main__":
    main()
