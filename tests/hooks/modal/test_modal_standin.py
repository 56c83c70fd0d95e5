"""
The Modal stand-in's own launches: a command joins its sandbox's namespaces and must not die of
bubblewrap's parent-death signal when the machine is slow (the SIGKILL a loaded CI run saw).
"""

from __future__ import annotations

import asyncio
import subprocess

import modal_worker

from conftest import requires_bwrap

pytestmark = requires_bwrap

#: strace holds every exit_group 300 ms: bubblewrap's intermediate process, which should exit at once
#: after forking into the sandbox's PID namespace, is still there when the program starts.
_LINGERING_EXIT = ["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=exit_group"]
_LINGERING_EXIT += ["-e", "inject=exit_group:delay_enter=300000"]


def test_a_command_outlives_a_slow_intermediate_process_of_bubblewrap(tmp_path):
    record = modal_worker.SandboxRecord(
        sandbox_id="sb-standin",
        version=1,
        app_id="ap-standin",
        name="",
        definition=modal_worker.api_pb2.Sandbox(),
        image_tag="standin",
        env={},
        network=None,
        tags={},
        created_at=0.0,
        root=tmp_path / "sb-standin",
        task_id="ta-standin",
        router_jwt="",
        sandbox_token="",
    )
    modal_worker.provision(record)
    command = modal_worker.ExecRecord("ex-1", ["sh", "-c", "sleep 0.5; echo done"], record.workdir, {}, None)

    async def launch() -> list[tuple[int, bytes]]:
        namespaces = await modal_worker._hold(record)
        try:
            argv = modal_worker.bwrap_argv(record, command)
            # The positive control: the same launch with --die-with-parent, which the stand-in had.
            control = [argv[0], "--die-with-parent", *argv[1:]]
            ends = []
            for launched in (control, argv):
                process = await asyncio.create_subprocess_exec(
                    *_LINGERING_EXIT, *launched, stdout=subprocess.PIPE, pass_fds=namespaces
                )
                out, _ = await process.communicate()
                ends.append((process.returncode, out))
            return ends
        finally:
            await modal_worker._release(record)

    assert asyncio.run(launch()) == [(137, b""), (0, b"done\n")]
