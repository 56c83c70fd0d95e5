"""
The agent's tool-call latency: ``SandboxToolset``'s tools as a pydantic-ai agent calls them,
against the hook's own calls on the same sandbox, run by hand:

    .venv/bin/python benchmarks/bench_toolset.py [--rounds 30] [--calls 3] [--backend local docker]
    .venv/bin/python benchmarks/bench_toolset.py --against /work/wt-ref/src   # this tree vs another

A real ``pydantic_ai.Agent`` runs the toolset in a thread of its own with a ``FunctionModel``
that asks for one tool call each time the benchmark tells it to, so a timed call is one whole
agent step without the model's thinking: the model's tool call goes through pydantic-ai's
argument validation and the toolset (session, masking, output shaping) into the sandbox, and the
result comes back to the model as the next request. The agent's run provisions its sandbox on
the first (untimed) call and destroys it when the run ends, as in a task; the history the model
gets is held at the last exchange (see ``last_exchange``).

Rows per backend, each round ``--calls`` calls of one side, the sides interleaved
(``harness.compare``), printed per call; many short rounds follow the machine's load closely:

- ``run_command("echo ok")`` against ``hook.run_command`` on the same sandbox (the floor), and
  against the raw tool: ``bwrap ... echo ok`` with the backend's mounts on local
  (``floors.raw_bwrap``), ``exec`` of ``echo ok`` as the sandbox user in the same container through
  the Docker SDK on Docker;
- ``write_file`` of 1 KiB against ``hook.write_file``; ``read_file`` of it against ``hook.read_file``.

Issue 14's goal for these figures: the ratios within 10% of the reference tree's. ``--against
SRC`` measures that directly: each tool through the agent on this tree against the same on the
tree whose ``src`` directory is given, each tree in a worker process of its own
(``floors.TreeWorker``), interleaved; goal: median ratio at most 1.10. Another tree can also be
measured against the floors with ``PYTHONPATH=<tree>/src`` in front of the command; the first
line printed names the tree measured.
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import shutil
import sys
import threading
from collections.abc import Callable
from typing import Any

import floors
from harness import Comparison, compare, print_table

NOTE = ("tool call latency, measured\n" * 37)[:1020] + "end\n"  # 1 KiB of text
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
        check(self.stepper.call("run_command", {"command": "mkdir -p bench && echo ok"}), "ok")
        self.handle = self.handles[-1]

    def close(self) -> None:
        self.stepper.finish()
        self.thread.join(timeout=300)
        if self.error is not None:
            raise self.error


def check(text: str, expected: str) -> None:
    if expected not in text:
        raise RuntimeError(f"expected {expected!r} in {text[:200]!r}")


def docker_exec(client, container: str, user: str) -> Callable[[], None]:
    """``echo ok`` run in ``container`` as ``user`` with the fewest Engine calls: create, start (read), inspect."""
    api = client.api

    def run() -> None:
        exec_id = api.exec_create(container, ["echo", "ok"], stdout=True, stderr=True, user=user)["Id"]
        out = api.exec_start(exec_id)
        if api.exec_inspect(exec_id)["ExitCode"] != 0:
            raise RuntimeError(f"docker exec echo failed: {out!r}")
        check(out.decode(), "ok")

    return run


class ToolSide:
    """
    One backend's agent run and what its calls are measured against. ``agent`` maps a tool to one
    agent call of it; ``floors`` maps a tool to ``(name, call)`` pairs on the same sandbox.
    """

    def __init__(self, backend: str) -> None:
        from sandbox_provider.engine.output import MASK_MARGIN_BYTES

        self.backend = backend
        self.root: str | None = None
        if backend == "local":
            self.root, self.parent = floors.local_root(), f"airflow-sandbox-{floors.run_tag()}"
            hook = floors.local_hook(self.root, self.parent)
            bwrap = floors.raw_bwrap(self.root)
            raw = ("raw bwrap echo", lambda: check(bwrap(["echo", "ok"]).stdout.decode(), "ok"))
        else:
            self.client, self.uid, self.tag = floors.docker_client(), floors.bench_uid(), floors.run_tag()
            hook = floors.docker_hook(self.uid)
        self.run = AgentRun(hook)
        handle, step = self.run.handle, self.run.stepper
        if backend == "docker":
            raw = ("docker exec (SDK)", docker_exec(self.client, handle, f"{self.uid}:{self.uid}"))
        output_cap = 50 * 1024 + MASK_MARGIN_BYTES  # the toolset's default shown bytes and its masking margin
        data = NOTE.encode()
        self.agent: dict[str, Callable[[], None]] = {
            "run_command": lambda: check(step.call("run_command", {"command": "echo ok"}), "ok"),
            "write_file": lambda: check(step.call("write_file", {"path": NOTE_PATH, "content": NOTE}), "Wrote"),
            "read_file": lambda: check(step.call("read_file", {"path": NOTE_PATH}), "end"),
        }

        def run_floor() -> None:
            check(hook.run_command(handle, "echo ok", timeout=60, max_output_bytes=output_cap).stdout, "ok")

        def read_floor() -> None:
            check(hook.read_file(handle, NOTE_PATH, max_bytes=5 << 20).decode(), "end")

        self.floors: dict[str, list[tuple[str, Callable[[], object]]]] = {
            "run_command": [("hook.run_command", run_floor), raw],
            "write_file": [("hook.write_file", lambda: hook.write_file(handle, NOTE_PATH, data))],
            "read_file": [("hook.read_file", read_floor)],
        }
        self.agent["write_file"]()  # the file read_file reads

    def close(self) -> str:
        """End the agent run (it destroys its sandbox); return what is left behind."""
        try:
            self.run.close()
            if self.root is not None:
                return f"  left behind, local: {floors.local_leftovers(self.root, self.parent)}"
            return f"  left behind, docker: {floors.docker_leftovers(self.client, self.uid, self.tag)}"
        finally:
            if self.root is not None:
                shutil.rmtree(self.root, ignore_errors=True)


def repeat(calls: int, fn: Callable[[], object]) -> Callable[[], None]:
    def many() -> None:
        for _ in range(calls):
            fn()

    return many


def timed(name: str, ours: Callable[[], object], base_name: str, base: Callable[[], object], args, goal: str) -> None:
    """Compare the sides, each round ``ours()`` and ``base()`` making ``args.calls`` calls; print the row per call."""
    n = args.calls
    c = compare(name, ours, base_name, base, rounds=args.rounds)
    per_call = Comparison(f"{name} /call", base_name, [t / n for t in c.ours], [t / n for t in c.baseline])
    print_table([(per_call, goal)])


def against_floors(args) -> None:
    """Each tool through the agent against the hook's call on the same sandbox (and the raw tool), in this process."""
    for backend in args.backend:
        side = ToolSide(backend)
        try:
            for tool, call in side.agent.items():
                for base_name, base in side.floors[tool]:
                    timed(
                        f"{backend}: agent {tool}",
                        repeat(args.calls, call),
                        base_name,
                        repeat(args.calls, base),
                        args,
                        GOAL,
                    )
        finally:
            print(side.close(), flush=True)


def against_tree(args) -> None:
    """Each tool through the agent on this tree against the same on another tree, each in a worker process."""
    argv = ["--calls", str(args.calls), "--backend", *args.backend]
    trees = (floors.TreeWorker(__file__, None, argv), floors.TreeWorker(__file__, args.against, argv))
    print(f"this tree: {trees[0].tree}\nagainst:   {trees[1].tree}", flush=True)
    try:
        for backend in args.backend:
            for tool in ("run_command", "write_file", "read_file"):
                action = f"{backend}:{tool}"
                timed(
                    f"{backend}: {tool}, this tree",
                    lambda a=action: trees[0].do(a),
                    "the same on the other tree",
                    lambda a=action: trees[1].do(a),
                    args,
                    "(goal: median ratio <= 1.10)",
                )
    finally:
        for name, tree in zip(("this tree", "the other tree"), trees, strict=True):
            print(f"{name}:\n{tree.close()}", flush=True)


def serve(args) -> int:
    """A worker of ``--against``: each action is ``--calls`` agent calls of one tool on one backend."""

    def setup():
        sides = [ToolSide(backend) for backend in args.backend]
        actions = {f"{s.backend}:{tool}": repeat(args.calls, call) for s in sides for tool, call in s.agent.items()}
        return actions, lambda: "\n".join(s.close() for s in sides)

    return floors.serve(setup)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds, at least 5 (default 30)")
    parser.add_argument("--calls", type=int, default=3, help="calls of one side per round (default 3)")
    parser.add_argument("--backend", nargs="+", choices=floors.BACKENDS, default=list(floors.BACKENDS))
    parser.add_argument(
        "--against",
        metavar="SRC",
        help="compare this tree's agent calls with those of the provider tree whose src directory this is",
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 5:
        parser.error("--rounds must be at least 5")
    if args.calls < 1:
        parser.error("--calls must be at least 1")
    return floors.dispatch(args, serve=serve, against_tree=against_tree, against_floors=against_floors)


if __name__ == "__main__":
    sys.exit(main())
