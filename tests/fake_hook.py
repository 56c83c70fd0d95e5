"""
``FakeSandboxHook``: a backend for tests of the session, operator, decorator and toolset that do not
need isolation. Each sandbox is a temporary directory; commands run under plain ``sh`` there, with
the same deadline and output rules as a real backend, and files move with ShellFiles. It isolates
nothing: use it only for code the test wrote.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping

from sandbox_provider.sandbox.attach import Attachable
from sandbox_provider.sandbox.errors import SandboxTerminalError
from sandbox_provider.sandbox.files import ShellFiles
from sandbox_provider.sandbox.hook import Capabilities, OutputSink, ProvisionRequest, RunOutcome, SandboxHook


class FakeSandboxHook(ShellFiles, Attachable, SandboxHook):
    """
    :param root: where sandbox directories go (default: a new temporary directory).
    :param sandbox_timeout: lifetime in seconds.
    :param capabilities: what it claims to enforce (default: no network, open network).
    """

    name = "fake"
    display_name = "fake"

    def __init__(
        self,
        root: str | None = None,
        *,
        sandbox_timeout: float = 3600.0,
        capabilities: Capabilities | None = None,
    ) -> None:
        super().__init__()
        self.root = root or tempfile.mkdtemp(prefix="fake-sandboxes-")
        self.sandbox_timeout = sandbox_timeout
        if capabilities is not None:
            self.capabilities = capabilities
        self.stamps: dict[str, dict[str, str]] = {}
        self.env: dict[str, dict[str, str]] = {}
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        #: The process group of the command running in each sandbox, which a destroy ends (as a real backend's does).
        self._running: dict[str, int] = {}

    def _lifetime_seconds(self) -> float:
        return self.sandbox_timeout

    def _dir(self, handle: str) -> str:
        path = os.path.join(self.root, handle)
        if handle not in self.stamps or not os.path.isdir(path):
            raise SandboxTerminalError(f"Sandbox {handle!r} does not exist.")
        return path

    def _provision(self, request: ProvisionRequest) -> str:
        self.calls.append(("provision", request.name))
        os.makedirs(os.path.join(self.root, request.name))
        self.stamps[request.name] = dict(request.stamps)
        self.env[request.name] = dict(request.spec.env or {})
        return request.name

    def _run(self, handle: str, command: str, *, timeout: float, output: OutputSink) -> RunOutcome:
        path = self._dir(handle)
        self.calls.append(("run", command))
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": path, "LANG": "C.UTF-8", **self.env[handle]}
        proc = subprocess.Popen(
            ["/bin/sh", "-c", command],
            cwd=path,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        readers = [
            threading.Thread(target=_drain, args=(proc.stdout, output.stdout), daemon=True),
            threading.Thread(target=_drain, args=(proc.stderr, output.stderr), daemon=True),
        ]
        for reader in readers:
            reader.start()
        self._running[handle] = proc.pid
        timed_out = False
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        self._running.pop(handle, None)
        _kill(proc.pid)
        proc.wait()
        for reader in readers:
            reader.join(5)
        terminated = not os.path.isdir(path)
        return RunOutcome(exit_code=proc.returncode, timed_out=timed_out, sandbox_terminated=terminated)

    def _destroy(self, handle: str) -> None:
        self.calls.append(("destroy", handle))
        self.stamps.pop(handle, None)
        shutil.rmtree(os.path.join(self.root, handle), ignore_errors=True)
        running = self._running.pop(handle, None)
        if running is not None:
            _kill(running)

    def read_tags(self, handle: str) -> Mapping[str, str]:
        self._dir(handle)
        return dict(self.stamps[handle])

    def write_tags(self, handle: str, tags: Mapping[str, str]) -> None:
        self._dir(handle)
        with self._lock:
            self.stamps[handle] = dict(tags)

    def find_sandboxes(self, stamps: Mapping[str, str]) -> dict[str, dict[str, str]]:
        return {h: dict(t) for h, t in self.stamps.items() if all(t.get(k) == v for k, v in stamps.items())}

    def _remaining_lifetime(self, handle: str) -> float | None:
        return float(self.read_tags(handle)["airflow_expires_at"]) - time.time()


def _drain(pipe, write) -> None:
    for chunk in iter(lambda: pipe.read1(65536), b""):
        write(chunk)
    pipe.close()


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
