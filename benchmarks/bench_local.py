"""
Benchmark the local (bubblewrap) backend against the raw tools, measured in the same run.

    .venv/bin/python benchmarks/bench_local.py [--runs 21] [--export-mib 1024] [--reuse-hook]

Prints:
- create + run ``true`` + destroy (not waiting for the removal, as a task's session does) with a new
  hook per sandbox (as every task process builds its own;
  ``--reuse-hook``: one hook for every round), against a raw ``bwrap ... true`` with the same
  namespaces and mounts, as the same kind of user, its output captured as the backend captures a
  command's (``floors.raw_bwrap``, the floor every benchmark shares), interleaved
  (``harness.compare``: A, B, A, B ...): the median, min and max of each side and of the per-round
  ratio (goal: median at most 1.3x), with the load average. The backend's
  part is everything else: a user id lease, a cgroup, the system-call filter, a fresh keyring, the
  crash-safe directory and its stamps;
- exporting one file of ``--export-mib`` MiB through the session engine to ``file://`` storage,
  against ``cp`` of the same file, as throughput and ratio (goal: at least 0.5x of cp);
- how much the worker's peak resident memory grew during the export (goal: at most 64 MiB).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import floors  # noqa: E402
from harness import Comparison, compare, load  # noqa: E402

from sandbox_provider.engine.transfer import export_files  # noqa: E402
from sandbox_provider.hooks.local import LocalSandboxHook  # noqa: E402
from sandbox_provider.sandbox import SandboxSpec  # noqa: E402


def _summary(times: list[float]) -> str:
    ms = [t * 1000 for t in times]
    return f"median {statistics.median(ms):7.2f} ms (min {min(ms):6.2f}, max {max(ms):7.2f})"


def _cpu_seconds() -> float:
    """CPU time of this process and of its waited-for children so far, user and system, in seconds."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def _counting_cpu(fn, spent: list[float]):
    def timed() -> None:
        start = _cpu_seconds()
        fn()
        spent.append(_cpu_seconds() - start)

    return timed


def lifecycle_row(hook: LocalSandboxHook, root: str, *, rounds: int, reuse_hook: bool = False) -> Comparison:
    """
    create + ``true`` + destroy against the raw tool with the same mounts, interleaved, each round
    with a new hook on ``hook``'s state root (``reuse_hook``: ``hook`` itself); printed too, with the
    CPU time each side spent per round (worker and the programs it ran), which the load of other
    work on the machine moves far less than the wall-clock time.
    """
    raw = floors.raw_bwrap(root)

    def ours() -> None:
        task_hook = hook if reuse_hook else LocalSandboxHook(state_root=hook.state_root)
        handle = task_hook.create(spec=SandboxSpec())
        result = task_hook.run_command(handle, "true", timeout=30, max_output_bytes=1024)
        assert result.ok, result.stderr
        floors.destroy_as_a_task_does(task_hook, handle)  # the removal goes on in a thread

    def floor() -> None:
        raw(["true"]).check_returncode()

    cpu_ours: list[float] = []
    cpu_raw: list[float] = []

    def settle() -> None:
        # The removal a destroy left to a thread (as a task's does: after the result is sent) finishes
        # before either side's next call, untimed, so it never lands on the raw side's time; its CPU
        # is counted as ours.
        start = _cpu_seconds()
        floors.join_local_removals()
        if cpu_ours:
            cpu_ours[-1] += _cpu_seconds() - start

    row = compare(
        "create + true + destroy",
        _counting_cpu(ours, cpu_ours),
        "raw bwrap true",
        _counting_cpu(floor, cpu_raw),
        rounds=rounds,
        setup=settle,
    )
    ratios = row.ratios
    cpu_ratios = [a / b for a, b in zip(cpu_ours[-rounds:], cpu_raw[-rounds:], strict=True) if b > 0]
    mode = "one hook for every sandbox" if reuse_hook else "a new hook per sandbox"
    print(f"lifecycle  ({mode}, {load()} at the end)")
    print(f"           raw bwrap true:      {_summary(row.baseline)}")
    print(f"           create+true+destroy: {_summary(row.ours)}")
    print(
        f"           per-round ratio: median {statistics.median(ratios):.2f}x (min {min(ratios):.2f}, "
        f"max {max(ratios):.2f}, n={len(ratios)}) (goal: median <= 1.3x)"
    )
    print(
        f"           CPU per round: raw {statistics.median(cpu_raw[-rounds:]) * 1000:.2f} ms, ours "
        f"{statistics.median(cpu_ours[-rounds:]) * 1000:.2f} ms, per-round ratio median "
        f"{statistics.median(cpu_ratios):.2f}x",
        flush=True,
    )
    return row


def export_rows(hook: LocalSandboxHook, root: str, *, export_mib: int) -> None:
    """Export one big file to ``file://`` against ``cp``, and the worker's peak memory growth meanwhile."""
    size = export_mib * 1024 * 1024
    handle = hook.create()
    try:
        r = hook.run_command(handle, f"head -c {size} /dev/urandom > big.bin", timeout=600, max_output_bytes=4096)
        assert r.ok, r.stderr
        source = os.path.join(hook.state_root, handle, "workspace", "big.bin")
        dest_cp = os.path.join(root, "cp.bin")
        start = time.perf_counter()
        subprocess.run(["cp", source, dest_cp], check=True)
        cp_s = time.perf_counter() - start
        os.unlink(dest_cp)

        dest = os.path.join(root, "out", "exported.bin")
        # Warm up the storage layer (fsspec imports, first connection) so the figure is the export's own.
        hook.run_command(handle, "echo warm > warm.txt", timeout=30, max_output_bytes=100)
        export_files(hook, handle, {"warm.txt": f"file://{root}/out/warm.txt"}, max_bytes=size)
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        records = export_files(hook, handle, {"big.bin": f"file://{dest}"}, max_bytes=size)
        ours = time.perf_counter() - start
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert records[0].size_bytes == size == os.path.getsize(dest)
        mib = size / 1024 / 1024
        print(
            f"export     cp: {mib / cp_s:8.1f} MiB/s   export: {mib / ours:8.1f} MiB/s"
            f"   ratio {cp_s / ours:.2f}x of cp (goal >= 0.5x)"
        )
        print(
            f"memory     worker peak RSS grew {(rss_after - rss_before) / 1024:.1f} MiB during a {mib:.0f} MiB"
            " export (goal <= 64 MiB)"
        )
    finally:
        hook.destroy(handle)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=21, help="rounds of each, interleaved (at least 5)")
    parser.add_argument("--export-mib", type=int, default=1024)
    parser.add_argument("--reuse-hook", action="store_true", help="one hook for every sandbox, not one each")
    parser.add_argument("--no-export", action="store_true", help="the lifecycle row only")
    args = parser.parse_args()
    if args.runs < 5:
        parser.error("--runs must be at least 5")

    root = tempfile.mkdtemp(prefix="sandbox-bench-")
    os.chmod(root, 0o711)  # a root worker runs sandboxes as an unprivileged user, who must pass through
    hook = LocalSandboxHook(state_root=os.path.join(root, "state"))
    try:
        hook.destroy(hook.create())  # first-use probe and directory setup out of the measurement
        lifecycle_row(hook, root, rounds=args.runs, reuse_hook=args.reuse_hook)
        if not args.no_export:
            export_rows(hook, root, export_mib=args.export_mib)
    finally:
        floors.join_local_removals()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
