"""
Transfers of the Docker sandbox backend against ``docker cp``, run by hand against a real Engine:

    bash scripts/docker/prepare.sh
    .venv/bin/python benchmarks/bench_docker_transfer.py [--rounds 5] [--export-mib 1024] [--files 10000]

1. Export of one big file: ``export_file`` of ``--export-mib`` MiB into a local file, against
   ``docker cp`` of the same file. Goal: at least 0.8x ``docker cp``'s throughput (a time ratio of at
   most 1.25), and the worker's peak memory (max RSS) growing by at most 64 MiB over all rounds.
2. ``--files`` files of 1 KiB as one directory: staged with ``import_batch`` against ``docker cp``
   of the directory into the container, and exported with ``export_batch`` (one ``tree`` request,
   into local files) against ``docker cp`` out of the container. Goal: within 2x each.

Each pair runs interleaved in one process (``harness.compare``: A, B, A, B, ...), and the line shows
the median, min and max of the per-round time ratio (ours / theirs). Exits 0 either way: it
reports, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

IMAGE = os.environ.get("SANDBOX_DOCKER_IMAGE", "airflow-sandbox-python:bookworm")
CONN_ID = "sandbox_docker_bench"
os.environ.setdefault(
    f"AIRFLOW_CONN_{CONN_ID.upper()}", json.dumps({"conn_type": "sandbox_docker", "extra": {"image": IMAGE}})
)
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "True")


def max_rss_bytes() -> int:
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


def fresh_dir(parent: str, name: str) -> str:
    path = os.path.join(parent, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def bench_export(hook, handle: str, work: str, mib: int, rounds: int):
    from harness import compare

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

    before = max_rss_bytes()
    comparison = compare(f"export {mib} MiB", ours, "docker cp", docker_cp, rounds=rounds)
    growth = max_rss_bytes() - before
    hook.run_command(handle, "rm big.bin", timeout=60, max_output_bytes=4096)
    return comparison, growth


def make_tree(work: str, files: int) -> str:
    source = fresh_dir(work, "tree")
    payload = os.urandom(1024)
    for i in range(files):
        folder = os.path.join(source, f"d{i % 100:02d}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"f{i:05d}.bin"), "wb") as out:
            out.write(payload)
    return source


def bench_tree(hook, handle: str, work: str, files: int, rounds: int):
    from harness import compare

    from sandbox_provider.sandbox.batch import ExportLimits, ExportRequest, ImportEntry

    source = make_tree(work, files)
    entries = []
    for folder, _, names in os.walk(source):
        for name in names:
            local = os.path.join(folder, name)
            relative = os.path.relpath(local, source)
            entries.append(
                ImportEntry(f"in/{relative}", os.path.getsize(local), lambda p=local: open(p, "rb"), local_path=local)
            )
    hook.run_command(handle, "mkdir -p cp-in", timeout=60, max_output_bytes=4096)
    stage = compare(
        f"stage {files} x 1 KiB (one batch)",
        lambda: hook.import_batch(handle, entries),
        "docker cp into the container",
        lambda: subprocess.run(["docker", "cp", source, f"{handle}:/workspace/cp-in/"], check=True),
        rounds=rounds,
    )
    limits = ExportLimits(max_file_bytes=1024**3, max_total_bytes=1024**3)

    def ours() -> None:
        sink = DirectorySink(fresh_dir(work, "out"))
        hook.export_batch(handle, [ExportRequest("in", "tree")], sink, limits=limits)

    def docker_cp() -> None:
        subprocess.run(["docker", "cp", f"{handle}:/workspace/in", fresh_dir(work, "cp-out")], check=True)

    export = compare(
        f"export {files} x 1 KiB (one batch)", ours, "docker cp out of the container", docker_cp, rounds=rounds
    )
    exported = sum(len(names) for _, _, names in os.walk(os.path.join(work, "out")))
    assert exported == files, exported
    return stage, export


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--export-mib", type=int, default=1024)
    parser.add_argument("--files", type=int, default=10_000)
    args = parser.parse_args()

    from harness import print_table

    from sandbox_provider.hooks.docker import DockerSandboxHook

    hook = DockerSandboxHook(CONN_ID, pull="never", memory_bytes=2 * 1024**3)
    handle = hook.create()
    work = tempfile.mkdtemp(prefix="bench-docker-transfer-", dir="/var/tmp")
    try:
        export, growth = bench_export(hook, handle, work, args.export_mib, args.rounds)
        stage, tree = bench_tree(hook, handle, work, args.files, args.rounds)
    finally:
        hook.destroy(handle)
        shutil.rmtree(work, ignore_errors=True)
    print_table(
        [
            (export, "goal: ratio <= 1.25 (>= 0.8x docker cp's throughput)"),
            (stage, "goal: ratio <= 2"),
            (tree, "goal: ratio <= 2"),
        ]
    )
    print(f"worker peak RSS growth over the export rounds: {growth / 2**20:.1f} MiB (goal <= 64 MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
