"""
The agent's tool-call latency: ``SandboxToolset``'s tools as a pydantic-ai agent calls them,
against the hook's own calls on the same sandbox, run by hand:

    .venv/bin/python benchmarks/bench_toolset.py [--rounds 9] [--calls 15] [--backend local docker]

A real ``pydantic_ai.Agent`` runs the toolset in a thread of its own with a ``FunctionModel``
that asks for one tool call each time the benchmark tells it to, so a timed call is one whole
agent step without the model's thinking: the model's tool call goes through pydantic-ai's
argument validation and the toolset (session, masking, output shaping) into the sandbox, and the
result comes back to the model as the next request. The agent's run provisions its sandbox on
the first (untimed) call and destroys it when the run ends, as in a task.

Rows per backend, each round ``--calls`` calls of one side, the sides interleaved
(``harness.compare``):

- ``run_command("echo ok")`` against ``hook.run_command`` on the same sandbox (the floor), and
  against the raw tool: ``bwrap ... echo ok`` with the backend's mounts on local
  (``floors.raw_bwrap``), ``exec`` of ``echo ok`` as the sandbox user in the same container through
  the Docker SDK on Docker;
- ``write_file`` of 1 KiB against ``hook.write_file``; ``read_file`` of it against ``hook.read_file``.

Issue 14's goal for these figures: the ratios within 10% of the reference tree's (run this script
on both and compare the medians).

To measure another tree of the provider (the reference commit, say) with these same scripts, put
its ``src`` first: ``PYTHONPATH=<tree>/src .venv/bin/python benchmarks/<script>``; the first line
printed names the tree measured.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import queue
import shutil
import sys
import threading
from collections.abc import Callable
from typing import Any

import floors
from harness import Comparison, compare, print_table

NOTE = "tool call latency, measured\n" * 37 + "end\n"  # 1 KiB of text
NOTE_PATH = "bench/note.txt"
GOAL = "(goal: within 10% of the reference tree's ratio)"


class Stepper:
    """
    The body of a ``FunctionModel``: each model request hands back the result of the previous
    tool call and asks for the next one the benchmark queued, or ends the run when it queues None.
    """

    def __init__(self) -> None:
        self._asks: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue()
        self._results: queue.Queue[Any] = queue.Queue()
        self._calls = 0

    def __call__(self, messages, info):
        from pydantic_ai.messages import ModelResponse, RetryPromptPart, TextPart, ToolCallPart, ToolReturnPart

        returned = [p for p in messages[-1].parts if isinstance(p, (ToolReturnPart, RetryPromptPart))]
        if returned:
            self._results.put(returned[-1])
        ask = self._asks.get()
        if ask is None:
            return ModelResponse(parts=[TextPart("done")])
        self._calls += 1
        return ModelResponse(parts=[ToolCallPart(ask[0], ask[1], tool_call_id=f"call-{self._calls}")])

    def call(self, tool: str, args: dict[str, Any]) -> str:
        """Have the agent call ``tool``; return what the model got back. :raises RuntimeError: on a retry prompt."""
        from pydantic_ai.messages import RetryPromptPart

        self._asks.put((tool, args))
        part = self._results.get(timeout=300)
        if isinstance(part, BaseException):
            raise RuntimeError(f"the agent run ended with {type(part).__name__}: {part}") from part
        if isinstance(part, RetryPromptPart):
            raise RuntimeError(f"{tool} came back as a retry prompt: {part.model_response()}")
        return str(part.content)

    def finish(self) -> None:
        self._asks.put(None)

    def ended(self, err: BaseException) -> None:
        """The run ended with ``err``: a call waiting for a result gets it instead."""
        self._results.put(err)


async def last_exchange(messages: list) -> list:
    """
    Keep the prompt and the last tool call with its result: pydantic-ai's own cost per step grows
    with the history (about 18 ms to 48 ms per call after 400 calls here), which is not the
    toolset's, and would make a figure depend on how many calls came before it. (Async, so
    pydantic-ai runs it on the event loop rather than in a thread.)
    """
    return messages if len(messages) <= 3 else [messages[0], *messages[-2:]]


class AgentRun:
    """A pydantic-ai agent run with a ``SandboxToolset`` on ``hook``, in a thread, driven call by call."""

    def __init__(self, hook) -> None:
        from pydantic_ai import Agent
        from pydantic_ai.capabilities import ProcessHistory
        from pydantic_ai.models.function import FunctionModel
        from pydantic_ai.usage import UsageLimits

        from sandbox_provider.toolsets import SandboxToolset

        self.handles: list[str] = []
        create = hook.create

        def recording_create(**kwargs):  # learn the handle the run provisions, to call the hook on it
            handle = create(**kwargs)
            self.handles.append(handle)
            return handle

        hook.create = recording_create
        self.stepper = Stepper()
        agent = Agent(
            FunctionModel(self.stepper), toolsets=[SandboxToolset(hook)], capabilities=[ProcessHistory(last_exchange)]
        )
        self.error: BaseException | None = None

        def run() -> None:
            try:
                asyncio.run(agent.run("benchmark", usage_limits=UsageLimits(request_limit=None)))
            except BaseException as err:  # reported by the waiting call and by close()
                self.error = err
                self.stepper.ended(err)

        self.thread = threading.Thread(target=run, name="agent-run", daemon=True)
        self.thread.start()
        out = self.stepper.call("run_command", {"command": "mkdir -p bench && echo ok"})
        assert out.strip().endswith("ok"), out
        self.handle = self.handles[-1]

    def close(self) -> None:
        self.stepper.finish()
        self.thread.join(timeout=300)
        if self.error is not None:
            raise self.error


def repeat(calls: int, fn: Callable[[], object]) -> Callable[[], None]:
    def many() -> None:
        for _ in range(calls):
            fn()

    return many


def check(text: str, expected: str) -> None:
    assert expected in text, f"expected {expected!r} in {text[:200]!r}"


def tool_rows(run: AgentRun, hook, raw: tuple[str, Callable[[], object]], args) -> list[tuple[Comparison, str]]:
    """The rows of one backend: each tool through the agent against the hook's call (and the raw tool)."""
    from sandbox_provider.sandbox.output import MASK_MARGIN_BYTES

    step, handle, n = run.stepper, run.handle, args.calls
    output_cap = 50 * 1024 + MASK_MARGIN_BYTES  # the toolset's default shown bytes and its masking margin
    data = NOTE.encode()

    def agent_run() -> None:
        check(step.call("run_command", {"command": "echo ok"}), "ok")

    def hook_run() -> None:
        result = hook.run_command(handle, "echo ok", timeout=60, max_output_bytes=output_cap)
        check(result.stdout, "ok")

    def agent_write() -> None:
        check(step.call("write_file", {"path": NOTE_PATH, "content": NOTE}), "Wrote")

    def agent_read() -> None:
        check(step.call("read_file", {"path": NOTE_PATH}), "end")

    def hook_read() -> None:
        check(hook.read_file(handle, NOTE_PATH, max_bytes=5 * 1024 * 1024).decode(), "end")

    name = hook.name
    pairs = [
        (f"{name}: agent run_command", agent_run, "hook.run_command", hook_run),
        (f"{name}: agent run_command", agent_run, raw[0], raw[1]),
        (
            f"{name}: agent write_file 1 KiB",
            agent_write,
            "hook.write_file",
            lambda: hook.write_file(handle, NOTE_PATH, data),
        ),
        (f"{name}: agent read_file 1 KiB", agent_read, "hook.read_file", hook_read),
    ]
    rows = []
    for title, ours, base_name, base in pairs:
        comparison = compare(f"{title} x{n}", repeat(n, ours), f"{base_name} x{n}", repeat(n, base), rounds=args.rounds)
        print_table([(comparison, GOAL)])
        rows.append((comparison, GOAL))
    return rows


def run_local(args) -> None:
    root = floors.local_root()
    parent = f"airflow-sandbox-{floors.run_tag()}"
    try:
        hook = floors.local_hook(root, parent)
        raw = floors.raw_bwrap(root)
        run = AgentRun(hook)
        try:
            tool_rows(run, hook, ("raw bwrap echo", lambda: check(raw(["echo", "ok"]).stdout.decode(), "ok")), args)
        finally:
            run.close()
        print(f"  left behind, local: {floors.local_leftovers(root, parent)}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def docker_exec(client, container: str, user: str) -> Callable[[], None]:
    """``echo ok`` run in ``container`` as ``user`` with the fewest Engine calls: create, start (read), inspect."""
    api = client.api

    def run() -> None:
        exec_id = api.exec_create(container, ["echo", "ok"], stdout=True, stderr=True, user=user)["Id"]
        out = api.exec_start(exec_id)
        assert api.exec_inspect(exec_id)["ExitCode"] == 0
        check(out.decode(), "ok")

    return run


def run_docker(args) -> None:
    client = floors.docker_client()
    uid, tag = floors.bench_uid(), floors.run_tag()
    hook = floors.docker_hook(uid)
    run = AgentRun(hook)
    try:
        raw = docker_exec(client, run.handle, f"{uid}:{uid}")
        tool_rows(run, hook, ("docker exec (SDK)", raw), args)
    finally:
        run.close()
    print(f"  left behind, docker: {floors.docker_leftovers(client, uid, tag)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds, at least 5 (default 9)")
    parser.add_argument("--calls", type=int, default=15, help="calls of one side per round (default 15)")
    parser.add_argument("--backend", nargs="+", choices=floors.BACKENDS, default=list(floors.BACKENDS))
    args = parser.parse_args()
    if args.rounds < 5:
        parser.error("--rounds must be at least 5")
    if args.calls < 1:
        parser.error("--calls must be at least 1")
    logging.disable(logging.WARNING)
    print(floors.provenance(), flush=True)
    for backend in args.backend:
        {"local": run_local, "docker": run_docker}[backend](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
