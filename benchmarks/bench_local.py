"""
Benchmark the local (bubblewrap) backend against the raw tools, measured in the same run.

    .venv/bin/python benchmarks/bench_local.py [--runs 30] [--export-mib 1024]

Prints:
- the median of create + run ``true`` + destroy, against a raw ``bwrap ... true`` with the same
  namespaces, mounts, limits and user, and their ratio (goal: at most 2x);
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

from sandbox_provider.hooks.local import LocalSandboxHook
from sandbox_provider.sandbox import SandboxSpec
from sandbox_provider.sandbox.transfer import export_files


def median_seconds(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--export-mib", type=int, default=1024)
    args = parser.parse_args()

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

        # The raw tool with the same namespaces and mounts this backend uses, on a plain directory.
        raw_dir = os.path.join(root, "raw")
        os.makedirs(raw_dir, mode=0o711)
        for sub in ("workspace", "tmp"):
            os.makedirs(os.path.join(raw_dir, sub))
            if os.geteuid() == 0:
                os.chown(os.path.join(raw_dir, sub), hook.sandbox_uid, hook.sandbox_uid)
        raw_argv = hook._argv(raw_dir, False, {}, 1) + ["--", "true"]
        fd_index = raw_argv.index("--json-status-fd")
        del raw_argv[fd_index : fd_index + 2]

        def raw():
            subprocess.run(raw_argv, check=True, stdin=subprocess.DEVNULL, **hook._identity())

        raw_s = median_seconds(raw, args.runs)
        ours_s = median_seconds(lifecycle, args.runs)
        print(
            f"lifecycle  raw bwrap true: {raw_s * 1000:8.2f} ms   create+true+destroy: {ours_s * 1000:8.2f} ms"
            f"   ratio {ours_s / raw_s:.2f}x (goal <= 2x)"
        )

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
