"""
Benchmarks for the Docker sandbox backend, run by hand against a real Engine:

    bash scripts/docker/prepare.sh
    .venv/bin/python benchmarks/bench_docker.py [--rounds 20] [--export-mib 1024]

1. Lifecycle: ``create`` + ``run_command("true")`` + ``destroy`` through the hook, against the raw
   ``docker`` SDK calls for a container with the same settings (create and start it, exec ``true``
   as the same user, remove it), rounds interleaved. What the hook adds on top is its own work: the
   sweep of leftovers before each create, waiting for the keeper, the runner around the command and
   the keeper's sweep after it. Rounds alternate (``harness.compare``); goal: the median of the
   per-round ratios at most 1.10.
2. Export: ``export_file`` of a file of ``--export-mib`` MiB to a local file, against ``docker cp``
   of the same file. Goal: at least half of ``docker cp``'s throughput, and the worker's peak
   memory (max RSS) growing by at most 64 MiB for 1 GiB.

Prints one JSON object with the figures and whether each goal was met. Exits 0 either way: it
reports, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

IMAGE = os.environ.get("SANDBOX_DOCKER_IMAGE", "airflow-sandbox-python:bookworm")
CONN_ID = "sandbox_docker_bench"
os.environ.setdefault(
    f"AIRFLOW_CONN_{CONN_ID.upper()}", json.dumps({"conn_type": "sandbox_docker", "extra": {"image": IMAGE}})
)
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "True")


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def raw_lifecycle(client, index: int) -> None:
    """
    The Engine calls a sandbox's life needs, straight through the SDK, for a container with the
    same settings as the hook's: the same keeper as PID 1, user, capabilities, limits and network,
    and the command run as the same unprivileged user.
    """
    from sandbox_provider.hooks import _docker_driver as driver

    api = client.api
    settings = {"memory_bytes": 1024**3, "cpus": 1.0, "pids_limit": 512, "network": "bridge"}
    host_config = driver.host_config(api, settings, block_network=True, run_as_root=False)
    user = driver.command_user(driver.DEFAULT_SANDBOX_UID, False)
    container = api.create_container(
        IMAGE,
        name=f"bench-raw-{os.getpid()}-{index}",
        entrypoint=driver.keeper_entrypoint(3600, user),
        command=[],
        user="0:0",
        working_dir="/workspace",
        labels={"bench": "raw"},
        host_config=host_config,
    )["Id"]
    api.start(container)
    exec_id = api.exec_create(container, ["true"], stdout=True, stderr=True, user=user)["Id"]
    for _ in api.exec_start(exec_id, stream=True, demux=True):
        pass
    assert api.exec_inspect(exec_id)["ExitCode"] == 0
    api.remove_container(container, force=True)


def hook_lifecycle(hook) -> None:
    handle = hook.create()
    result = hook.run_command(handle, "true", timeout=60, max_output_bytes=4096)
    assert result.ok, result
    hook.destroy(handle)


def bench_lifecycle(hook, client, rounds: int) -> dict:
    from harness import compare

    index = iter(range(10**6))
    comparison = compare(
        "hook create+run+destroy",
        lambda: hook_lifecycle(hook),
        "raw SDK, same settings",
        lambda: raw_lifecycle(client, next(index)),
        rounds=rounds,
    )
    ratios = comparison.ratios
    return {
        "rounds": rounds,
        "hook_median_s": round(statistics.median(comparison.ours), 4),
        "raw_sdk_median_s": round(statistics.median(comparison.baseline), 4),
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "goal_within_10pct": statistics.median(ratios) <= 1.10,
    }


def bench_export(hook, mib: int) -> dict:
    handle = hook.create()
    workdir = tempfile.mkdtemp(prefix="bench-docker-", dir="/var/tmp")
    try:
        made = hook.run_command(
            handle, f"head -c {mib}M /dev/urandom > big.bin && sync", timeout=600, max_output_bytes=4096
        )
        assert made.ok, made
        size = mib * 1024 * 1024
        cp_target = os.path.join(workdir, "cp.bin")
        began = time.perf_counter()
        subprocess.run(["docker", "cp", f"{handle}:/workspace/big.bin", cp_target], check=True)
        cp_seconds = time.perf_counter() - began
        os.unlink(cp_target)
        rss_before = _max_rss_bytes()
        target = os.path.join(workdir, "export.bin")
        began = time.perf_counter()
        with open(target, "wb") as stream:
            copied = hook.export_file(handle, "big.bin", stream, max_bytes=size)
        export_seconds = time.perf_counter() - began
        rss_growth = _max_rss_bytes() - rss_before
        assert copied == size == os.path.getsize(target)
        export_rate, cp_rate = size / export_seconds / 2**20, size / cp_seconds / 2**20
        return {
            "size_mib": mib,
            "export_s": round(export_seconds, 2),
            "export_mib_per_s": round(export_rate, 1),
            "docker_cp_s": round(cp_seconds, 2),
            "docker_cp_mib_per_s": round(cp_rate, 1),
            "ratio_to_docker_cp": round(export_rate / cp_rate, 2),
            "goal_half_of_docker_cp": export_rate >= cp_rate / 2,
            "peak_rss_growth_mib": round(rss_growth / 2**20, 1),
            "goal_rss_growth_le_64mib": rss_growth <= 64 * 2**20,
        }
    finally:
        hook.destroy(handle)
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--export-mib", type=int, default=1024)
    parser.add_argument("--skip-export", action="store_true")
    args = parser.parse_args()

    import docker

    from sandbox_provider.hooks.docker import DockerSandboxHook

    client = docker.from_env(version="auto")
    hook = DockerSandboxHook(CONN_ID, pull="never")
    report = {"engine": client.version().get("Version"), "image": IMAGE}
    # Export first, so the RSS figure is not lifted by anything the lifecycle rounds allocated.
    if not args.skip_export:
        report["export"] = bench_export(hook, args.export_mib)
    report["lifecycle"] = bench_lifecycle(hook, client, args.rounds)
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
