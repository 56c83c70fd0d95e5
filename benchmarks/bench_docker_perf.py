"""
The Docker backend's rows of the performance table (issue 14), run by hand against a real Engine,
each measured interleaved against what a user would pick instead (``harness.compare``: A, B, A, B
..., median, min and max of the per-round time ratio, ours / theirs):

    bash scripts/docker/prepare.sh
    .venv/bin/python benchmarks/bench_docker_perf.py [--rounds 5] [--part all|task|transfer]
        [--export-mib 1024] [--files 10000]

``task`` (the same function, ``return a + b``, timed in-task: the operator's ``execute``):

1. ``@task.sandbox`` with a new ``DockerSandboxHook`` per task (as every task process builds its
   own) against ``@task.docker`` (the ``apache-airflow-providers-docker`` of the ``bench`` extra) on
   the same image, with no network. Goal: median ratio at most 0.8. The row also gives the Engine requests one ``@task.sandbox``
   call makes (counted at the SDK's ``APIClient.send``).
2. ``@task.sandbox`` against the floor: ``docker run --rm --network none <image> python3 -c ...``.
   Reported, no goal.

``transfer`` (in one sandbox with 2 GiB of memory):

3. Export of one big file: ``export_file`` of ``--export-mib`` MiB into a local file, against
   ``docker cp`` of the same file. Goal: at least 0.8x ``docker cp``'s throughput (a time ratio of at
   most 1.25), and the worker's peak memory (max RSS) growing by at most 64 MiB over all rounds.
4. ``--files`` files of 1 KiB as one directory: staged with ``import_batch`` against ``docker cp``
   of the directory into the container, and exported with ``export_batch`` (one ``tree`` request,
   into local files) against ``docker cp`` out of the container. Goal: at most 0.8x each.

``benchmarks/table.py`` prints these rows (``rows()``) after the local backend's. Each row is printed
as soon as it is measured, with the load average; a row that fails prints why and the others still
run. Exits 0 either way: it reports, it does not judge.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import floors  # noqa: E402  (first: it sets the connection and Airflow's test mode up)

IMAGE, CONN_ID = floors.IMAGE, floors.DOCKER_CONN_ID

from airflow.sdk import DAG, task  # noqa: E402
from harness import Row, attempt, compare, print_rows  # noqa: E402

PARTS = ("task", "transfer")


# -- @task.sandbox against @task.docker ---------------------------------------------------------------


@task.sandbox
def add_in_sandbox(a, b):
    return a + b


@task.docker(image=IMAGE, network_mode="none", auto_remove="success")
def add_in_docker(a, b):
    return a + b


def run_task(decorated, **overrides) -> None:
    """Build the task in a throwaway Dag and run its operator's execute() with a minimal context."""
    with DAG("bench_docker_perf", schedule=None) as dag:
        decorated(1, 2)
    operator = dag.tasks[0]
    for name, value in overrides.items():
        setattr(operator, name, value)
    ti = mock.MagicMock(dag_id="bench_docker_perf", run_id="r", task_id=operator.task_id, map_index=-1, try_number=1)
    assert operator.execute({"ti": ti, "run_id": "r"}) == 3


def count_requests(fn) -> list[tuple[str, str]]:
    """The Engine requests ``fn()`` sends, as ``(method, path)``."""
    import docker.api.client

    sent: list[tuple[str, str]] = []
    original = docker.api.client.APIClient.send

    def send(client, request, **kwargs):
        sent.append((request.method, request.path_url.split("?")[0]))
        return original(client, request, **kwargs)

    docker.api.client.APIClient.send = send
    try:
        fn()
    finally:
        docker.api.client.APIClient.send = original
    return sent


def task_rows(*, rounds: int) -> Iterator[Row]:
    """``@task.sandbox`` against ``@task.docker`` and against ``docker run --rm``."""
    from sandbox_provider.hooks.docker import DockerSandboxHook

    def ours() -> None:
        # A new hook per task, as each task process builds its own.
        run_task(add_in_sandbox, backend=DockerSandboxHook(CONN_ID, pull="never"))

    floor_argv = floors.docker_run_argv(floors.run_tag(), ["python3", "-c", "print(1 + 2)"])

    def floor() -> None:
        subprocess.run(floor_argv, check=True, capture_output=True)

    ours()  # the API version is negotiated once per process, not per task
    requests = len(count_requests(ours))
    name = "@task.sandbox a+b (Docker)"
    yield from attempt(
        f"{name} vs @task.docker",
        lambda: (
            compare(name, ours, "@task.docker", lambda: run_task(add_in_docker), rounds=rounds),
            f"(goal <= 0.8x; {requests} Engine requests per task)",
        ),
    )
    yield from attempt(
        f"{name} vs docker run",
        lambda: (compare(name, ours, "docker run --rm python3 -c", floor, rounds=rounds), "(floor)"),
    )


# -- transfers against docker cp ----------------------------------------------------------------------


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class DirectorySink:
    """An export sink writing each file below ``root``, as the engine's partial copies would."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.stream = None

    def begin(self, index: int, name: str):
        path = os.path.join(self.root, str(index), name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.stream = open(path, "wb")  # noqa: SIM115 (closed in end)
        return self.stream

    def end(self, index: int, name: str, size: int) -> None:
        self.stream.close()


def _fresh_dir(parent: str, name: str) -> str:
    path = os.path.join(parent, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def export_row(hook, handle: str, work: str, *, mib: int, rounds: int) -> Row:
    """One big file out with ``export_file`` against ``docker cp``, and the worker's peak RSS growth."""
    made = hook.run_command(handle, f"head -c {mib}M /dev/urandom > big.bin", timeout=600, max_output_bytes=4096)
    assert made.ok, made
    size = mib * 1024 * 1024
    target = os.path.join(work, "export.bin")

    def ours() -> None:
        with open(target, "wb") as stream:
            assert hook.export_file(handle, "big.bin", stream, max_bytes=size) == size

    def docker_cp() -> None:
        subprocess.run(["docker", "cp", f"{handle}:/workspace/big.bin", target + ".cp"], check=True)
        os.unlink(target + ".cp")

    before = _max_rss_bytes()
    comparison = compare(f"export {mib} MiB (Docker)", ours, "docker cp", docker_cp, rounds=rounds)
    growth = (_max_rss_bytes() - before) / 2**20
    hook.run_command(handle, "rm big.bin", timeout=60, max_output_bytes=4096)
    return comparison, f"(goal <= 1.25x; worker peak RSS growth {growth:.1f} MiB, goal <= 64)"


def _make_tree(work: str, files: int) -> str:
    source = _fresh_dir(work, "tree")
    payload = os.urandom(1024)
    for i in range(files):
        folder = os.path.join(source, f"d{i % 100:02d}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"f{i:05d}.bin"), "wb") as out:
            out.write(payload)
    return source


def tree_rows(hook, handle: str, work: str, *, files: int, rounds: int) -> Iterator[Row]:
    """``files`` files of 1 KiB as one directory, in and out, against ``docker cp``."""
    from sandbox_provider.sandbox.batch import ExportLimits, ExportRequest, ImportEntry

    source = _make_tree(work, files)
    entries = []
    for folder, _, names in os.walk(source):
        for name in names:
            local = os.path.join(folder, name)
            relative = os.path.relpath(local, source)
            entries.append(
                ImportEntry(f"in/{relative}", os.path.getsize(local), lambda p=local: open(p, "rb"), local_path=local)
            )
    hook.run_command(handle, "mkdir -p cp-in", timeout=60, max_output_bytes=4096)
    yield from attempt(
        f"stage {files} x 1 KiB (Docker)",
        lambda: (
            compare(
                f"stage {files} x 1 KiB (Docker)",
                lambda: hook.import_batch(handle, entries),
                "docker cp into the container",
                lambda: subprocess.run(["docker", "cp", source, f"{handle}:/workspace/cp-in/"], check=True),
                rounds=rounds,
            ),
            "(goal <= 0.8x)",
        ),
    )
    limits = ExportLimits(max_file_bytes=1024**3, max_total_bytes=1024**3)

    def ours() -> None:
        sink = DirectorySink(_fresh_dir(work, "out"))
        hook.export_batch(handle, [ExportRequest("in", "tree")], sink, limits=limits)

    def docker_cp() -> None:
        subprocess.run(["docker", "cp", f"{handle}:/workspace/in", _fresh_dir(work, "cp-out")], check=True)

    def tree_export() -> Row:
        export = compare(
            f"export {files} x 1 KiB (Docker)", ours, "docker cp out of the container", docker_cp, rounds=rounds
        )
        exported = sum(len(names) for _, _, names in os.walk(os.path.join(work, "out")))
        assert exported == files, exported
        return export, "(goal <= 0.8x)"

    yield from attempt(f"export {files} x 1 KiB (Docker)", tree_export)


def transfer_rows(*, rounds: int, files: int, export_mib: int) -> Iterator[Row]:
    """The export of one big file and the directory of small files, both ways, in one sandbox."""
    from sandbox_provider.hooks.docker import DockerSandboxHook

    hook = DockerSandboxHook(CONN_ID, pull="never", memory_bytes=2 * 1024**3)
    handle = hook.create()
    work = tempfile.mkdtemp(prefix="bench-docker-transfer-", dir="/var/tmp")
    try:
        yield from attempt(
            f"export {export_mib} MiB (Docker)", lambda: export_row(hook, handle, work, mib=export_mib, rounds=rounds)
        )
        yield from tree_rows(hook, handle, work, files=files, rounds=rounds)
    finally:
        hook.destroy(handle)
        shutil.rmtree(work, ignore_errors=True)


def rows(*, rounds: int = 15, files: int = 10_000, export_mib: int = 1024, parts=PARTS) -> Iterator[Row]:
    """Every Docker row of the table (``parts``: ``"task"``, ``"transfer"``), each yielded as it is measured."""
    if "task" in parts:
        yield from task_rows(rounds=rounds)
    if "transfer" in parts:
        yield from transfer_rows(rounds=rounds, files=files, export_mib=export_mib)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--part", choices=("all", *PARTS), default="all")
    parser.add_argument("--export-mib", type=int, default=1024)
    parser.add_argument("--files", type=int, default=10_000)
    args = parser.parse_args()
    import logging

    logging.disable(logging.INFO)
    parts = PARTS if args.part == "all" else (args.part,)
    print_rows(rows(rounds=args.rounds, files=args.files, export_mib=args.export_mib, parts=parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
