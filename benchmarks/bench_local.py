"""
Benchmark the local (bubblewrap) backend against the raw tools, measured in the same run.

    .venv/bin/python benchmarks/bench_local.py [--runs 30] [--export-mib 1024]

Prints:
- create + run ``true`` + destroy, against a raw ``bwrap ... true`` with the same namespaces and
  mounts, as the same kind of user, the two run alternately in one loop: median, min and max of
  each, and the ratio of the medians (goal: at most 1.5x). The backend's part is everything else:
  a user id lease, a cgroup, the system-call filter, a fresh keyring, the crash-safe directory;
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

from sandbox_provider.hooks import _local_driver as driver
from sandbox_provider.hooks._local_ids import DEFAULT_UID_RANGE, parse_uid_range
from sandbox_provider.hooks.local import LocalSandboxHook
from sandbox_provider.sandbox import SandboxSpec
from sandbox_provider.sandbox.transfer import export_files


def interleaved(first, second, runs: int) -> tuple[list[float], list[float]]:
    """Time ``first`` and ``second`` alternately, ``runs`` times each, swapping which goes first."""
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(runs):
        order = ((first, times[0]), (second, times[1]))
        for fn, out in order if i % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return times


def summary(times: list[float]) -> str:
    ms = [t * 1000 for t in times]
    return f"median {statistics.median(ms):7.2f} ms (min {min(ms):6.2f}, max {max(ms):7.2f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30, help="rounds of each, interleaved (at least 5)")
    parser.add_argument("--export-mib", type=int, default=1024)
    args = parser.parse_args()
    if args.runs < 5:
        parser.error("--runs must be at least 5")

    root = tempfile.mkdtemp(prefix="sandbox-bench-")
    os.chmod(root, 0o711)  # a root worker runs sandboxes as an unprivileged user, who must pass through
    hook = LocalSandboxHook(state_root=os.path.join(root, "state"))
    try:
        hook.destroy(hook.create())  # first-use probe and directory setup out of the measurement

        def lifecycle():
            handle = hook.create(spec=SandboxSpec())
            result = hook.run_command(handle, "true", timeout=30, max_output_bytes=1024)
            assert result.ok, result.stderr
            hook.destroy(handle)

        # The raw tool with the same namespaces and mounts this backend uses, on a plain directory,
        # as an unprivileged user of the same kind (a root worker's sandboxes get ids of the range).
        raw_uid = parse_uid_range(DEFAULT_UID_RANGE)[1] if os.geteuid() == 0 else os.getuid()
        raw_box = os.path.join(root, "raw", "box")
        for sub in ("", "workspace", "tmp"):
            os.makedirs(os.path.join(raw_box, sub), mode=0o700, exist_ok=True)
            os.chown(os.path.join(raw_box, sub), raw_uid, raw_uid)
        os.chmod(os.path.join(root, "raw"), 0o711)
        raw_argv = driver.bwrap_argv(
            shutil.which("bwrap"),
            box=raw_box,
            workdir="/workspace",
            binds=driver.system_binds(None, "/workspace", False),
            network=False,
            shm_bytes=64 << 20,
        )
        # Dropped to that user the way the backend does (setpriv), so both spawn alike from Python.
        drop = ["setpriv", f"--reuid={raw_uid}", f"--regid={raw_uid}", "--clear-groups"] if os.geteuid() == 0 else []

        def raw():
            subprocess.run([*drop, *raw_argv, "--", "true"], check=True, stdin=subprocess.DEVNULL, env=driver.BWRAP_ENV)

        raw_t, ours_t = interleaved(raw, lifecycle, args.runs)
        ratio = statistics.median(ours_t) / statistics.median(raw_t)
        print(f"lifecycle  raw bwrap true:      {summary(raw_t)}")
        print(f"           create+true+destroy: {summary(ours_t)}   ratio {ratio:.2f}x (goal <= 1.5x)")

        size = args.export_mib * 1024 * 1024
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
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
