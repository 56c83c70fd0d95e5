"""
Benchmarks for the Docker sandbox backend, run by hand against a real Engine:

    bash scripts/docker/prepare.sh
    .venv/bin/python benchmarks/bench_docker.py [--rounds 20]

1. Lifecycle: ``create`` + ``run_command("true")`` + ``destroy`` through the hook, against the raw
   ``docker`` SDK calls for a container with the same settings (create and start it, exec ``true``
   as the same user, remove it), rounds interleaved. What the hook adds on top is its own work: the
   sweep of leftovers before each create, waiting for the keeper, the runner around the command and
   the keeper's sweep after it. Rounds alternate (``harness.compare``); goal: the median of the
   per-round ratios at most 1.10.
(Transfers against ``docker cp``, and ``@task.sandbox`` against ``@task.docker``, are in
``bench_docker_perf.py``.)

Prints one JSON object with the figures and whether each goal was met. Exits 0 either way: it
reports, it does not judge.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import floors  # noqa: E402  (it sets the connection and Airflow's test mode up)

IMAGE, CONN_ID = floors.IMAGE, floors.DOCKER_CONN_ID


def raw_lifecycle(client, index: int) -> None:
    """
    The Engine calls a sandbox's life needs, straight through the SDK, for a container with the
    same settings as the hook's: the same keeper as PID 1, user, capabilities, limits and network,
    and the command run as the same unprivileged user.
    """
    from sandbox_provider.hooks.docker import driver

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()

    import docker

    from sandbox_provider.hooks.docker import DockerSandboxHook

    client = docker.from_env(version="auto")
    hook = DockerSandboxHook(CONN_ID, pull="never")
    report = {"engine": client.version().get("Version"), "image": IMAGE}
    report["lifecycle"] = bench_lifecycle(hook, client, args.rounds)
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
