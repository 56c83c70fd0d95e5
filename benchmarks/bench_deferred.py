"""
Deferred sandbox commands on Docker: many long commands through one worker slot, run by hand:

    .venv/bin/python benchmarks/bench_deferred.py [--count 50] [--seconds 30] [--rounds 5] [--poll-interval 5]

A round has two sides, interleaved (``harness.compare``):

- **deferred**: ``--count`` ``SandboxOperator(deferrable=True)`` tasks through ONE worker slot (one
  thread runs every ``execute`` and, as the triggers fire, every ``execute_complete``, one at a
  time), their ``SandboxCommandTrigger`` s all at once in a trigger-runner process of their own (one
  asyncio loop and its default thread pool, as in ``airflow triggerer``). Each command prints a line
  a second for ``--seconds`` seconds. The round's time is until the last task finished.
- **blocking**: ONE plain ``SandboxOperator`` task of the same command in the slot.

The ratio is deferred / blocking: how much longer ``--count`` deferred jobs take through one slot
than one blocking job does; ``--count`` blocking jobs need ``--count`` times the blocking time
through that slot. Every deferred task must succeed with the command's exit status and last line.

Reported besides: the CPU seconds (user + system) the trigger-runner process spent per job, and the
worker-slot seconds per deferred job (its ``execute`` plus ``execute_complete``). The Docker
Engine's own CPU for the polls' execs is not in these figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any
from unittest import mock

from harness import compare, print_table

IMAGE = "airflow-sandbox-python:bookworm"

#: The trigger-runner process: reads serialized triggers, one JSON line each, until an empty line, and
#: runs each as soon as it comes, all at once; writes each event as a JSON line as it fires to the descriptor its argument names (its
#: standard output and error carry the triggers' logs), and at the end the CPU seconds it spent after
#: its imports (it says it is ready once they are done, as a triggerer that is already running).
RUNNER = r"""
import asyncio, importlib, json, os, resource, sys

import sandbox_provider.hooks.docker, sandbox_provider.triggers.sandbox  # what a running triggerer has loaded

events = os.fdopen(int(sys.argv[1]), "w")


def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


started = cpu()
print(json.dumps({"ready": True}), file=events, flush=True)

async def one(classpath, kwargs):
    module, _, name = classpath.rpartition(".")
    trigger = getattr(importlib.import_module(module), name)(**kwargs)
    async for event in trigger.run():
        print(json.dumps(event.payload), file=events, flush=True)
        return

async def main():
    loop, started = asyncio.get_running_loop(), []
    while (line := await loop.run_in_executor(None, sys.stdin.readline)).strip():
        started.append(asyncio.ensure_future(one(*json.loads(line))))  # each as soon as its task deferred
    await asyncio.gather(*started)

asyncio.run(main())
print(json.dumps({"cpu": cpu() - started}), file=events, flush=True)
"""


def context(task_id: str, run_id: str) -> dict:
    ti = mock.MagicMock(dag_id="bench_deferred", run_id=run_id, task_id=task_id, map_index=-1, try_number=1)
    return {"ti": ti, "run_id": run_id}


def operator(task_id: str, command: str, *, deferrable: bool, poll_interval: float):
    from sandbox_provider.hooks.docker import DockerSandboxHook
    from sandbox_provider.operators.sandbox import SandboxOperator

    return SandboxOperator(
        task_id=task_id,
        command=command,
        backend=DockerSandboxHook(image=IMAGE),
        deferrable=deferrable,
        poll_interval=poll_interval,
    )


class DeferredRound:
    """One deferred side: ``count`` tasks through one slot, their triggers in one runner process."""

    def __init__(self, count: int, command: str, poll_interval: float, last_line: str) -> None:
        self.count, self.command, self.poll_interval, self.last_line = count, command, poll_interval, last_line
        self.cpu_per_job: list[float] = []
        self.slot_per_job: list[float] = []
        self.runner: subprocess.Popen | None = None
        self.events: Any = None

    def prepare(self) -> None:
        """Untimed, before a round: start the trigger runner and wait until it is ready."""
        if self.runner is not None:
            return
        read, write = os.pipe()
        self.runner = subprocess.Popen(
            [sys.executable, "-c", RUNNER, str(write)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(write,),
            text=True,
        )
        os.close(write)
        self.events = os.fdopen(read)
        if "ready" not in json.loads(self.events.readline() or "{}"):
            raise AssertionError("the trigger runner did not start")

    def __call__(self) -> None:
        from airflow.sdk.exceptions import TaskDeferred

        self.prepare()
        runner, events = self.runner, self.events
        assert runner is not None and runner.stdin is not None and events is not None
        self.runner = self.events = None
        run_id = f"r{time.time_ns()}"
        ops, slot = {}, 0.0
        for index in range(self.count):
            task_id = f"t{index}"
            op = operator(task_id, self.command, deferrable=True, poll_interval=self.poll_interval)
            began = time.perf_counter()
            try:
                op.execute(context(task_id, run_id))
            except TaskDeferred as deferred:
                path, kwargs = deferred.trigger.serialize()
                runner.stdin.write(json.dumps([path, kwargs]) + "\n")
                runner.stdin.flush()
            slot += time.perf_counter() - began
            ops[kwargs["job"]] = (task_id, op)
        runner.stdin.write("\n")
        runner.stdin.close()
        done = 0
        for line in events:
            payload = json.loads(line)
            if "cpu" in payload:
                self.cpu_per_job.append(payload["cpu"] / self.count)
                continue
            task_id, op = ops[payload["job"]]
            began = time.perf_counter()
            result = op.execute_complete(context(task_id, run_id), payload)
            slot += time.perf_counter() - began
            if result["exit_code"] != 0 or not result["stdout"].endswith(self.last_line):
                raise AssertionError(f"{task_id} gave {result!r}")
            done += 1
        runner.wait()
        events.close()
        if done != self.count:
            raise AssertionError(f"only {done} of {self.count} deferred tasks finished")
        self.slot_per_job.append(slot / self.count)


def blocking(command: str, last_line: str) -> None:
    op = operator("blocking", command, deferrable=False, poll_interval=5)
    result = op.execute(context("blocking", f"b{time.time_ns()}"))
    if result["exit_code"] != 0 or not result["stdout"].endswith(last_line):
        raise AssertionError(f"the blocking task gave {result!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--seconds", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--poll-interval", type=float, default=5.0)
    args = parser.parse_args()
    os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "True")
    command = f'for i in $(seq 1 {args.seconds}); do echo "line $i"; sleep 1; done'
    last = f"line {args.seconds}\n"
    deferred = DeferredRound(args.count, command, args.poll_interval, last)
    print(f"{args.count} deferred {args.seconds}s commands on Docker through one worker slot", flush=True)
    result = compare(
        f"{args.count} deferred, 1 slot",
        deferred,
        "1 blocking, 1 slot",
        lambda: blocking(command, last),
        rounds=args.rounds,
        warmup=0,
        setup=deferred.prepare,
    )
    print_table([(result, f"(goal: near 1; {args.count} blocking jobs would take {args.count}x)")])
    cpu, slot = deferred.cpu_per_job, deferred.slot_per_job
    print(
        f"trigger-runner CPU per job: median {statistics.median(cpu):.3f}s (min {min(cpu):.3f}, max {max(cpu):.3f}) "
        f"for {args.seconds}s of command polled every {args.poll_interval:g}s; worker-slot time per deferred job: "
        f"median {statistics.median(slot):.2f}s",
        flush=True,
    )


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()
