"""
A stand-in for the ``modal`` SDK, enough for ModalSandboxHook, with no network and no account.

``build()`` returns a module object to put in ``sys.modules["modal"]``. Its ``exception`` module
mirrors the class names and parents of the real ``modal.exception`` (checked against the installed
SDK by ``test_modal_sdk_signatures.py``). Sandboxes record every call; a command either takes the
next :class:`FakeProcess` queued on the sandbox, or, with ``run_on_host`` set, runs through the
host's ``sh`` so the hook's guest scripts are exercised for real against a temporary directory
(:class:`HostProcess`). Such a command keeps to what Modal does: it sees the sandbox's ``env`` over a
bare environment (the worker's ``PATH`` and nothing else of it), its output streams as it arrives,
it is killed with its whole process group at its ``timeout`` (whole seconds) and then reports -1, a
signal ``N`` reports ``128 + N``, and a terminated sandbox refuses to run anything.
"""

from __future__ import annotations

import enum
import itertools
import os
import subprocess
import threading
import types
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fake_service import kill_group


def _exception_module() -> types.ModuleType:
    mod = types.ModuleType("modal.exception")

    class Error(Exception):
        pass

    class _GRPCErrorWrapper(Exception):
        pass

    def grpc(name: str, *parents: type) -> type:
        return type(name, parents or (Error, _GRPCErrorWrapper), {})

    classes: dict[str, type] = {"Error": Error, "_GRPCErrorWrapper": _GRPCErrorWrapper}
    for name in (
        "AlreadyExistsError",
        "AuthError",
        "InternalError",
        "InvalidError",
        "NotFoundError",
        "PermissionDeniedError",
        "ResourceExhaustedError",
        "ServiceError",
    ):
        classes[name] = grpc(name)
    classes["ConflictError"] = type("ConflictError", (classes["InvalidError"],), {})
    timeout = type("TimeoutError", (Error,), {})
    classes["TimeoutError"] = timeout
    for name in ("ExecTimeoutError", "SandboxTimeoutError", "FunctionTimeoutError"):
        classes[name] = type(name, (timeout,), {})
    for name in ("ConnectionError", "InternalFailure", "SandboxTerminatedError", "SandboxFilesystemError"):
        classes[name] = type(name, (Error,), {})
    fs_error = classes["SandboxFilesystemError"]
    for name in (
        "SandboxFilesystemNotFoundError",
        "SandboxFilesystemIsADirectoryError",
        "SandboxFilesystemNotADirectoryError",
        "SandboxFilesystemPermissionError",
        "SandboxFilesystemFileTooLargeError",
    ):
        classes[name] = type(name, (fs_error,), {})
    for name, cls in classes.items():
        cls.__module__ = "modal.exception"
        setattr(mod, name, cls)
    return mod


class FileType(enum.Enum):
    FILE = "file"
    DIRECTORY = "directory"
    SYMLINK = "symlink"


@dataclass
class FileInfo:
    name: str
    type: FileType


class FakeStream:
    """An output stream: yields byte chunks, then raises ``error`` if one is set."""

    def __init__(self, chunks: list[bytes], error: BaseException | None = None) -> None:
        self.chunks = list(chunks)
        self.error = error
        self.chunks_read = 0

    def __iter__(self):
        for chunk in self.chunks:
            self.chunks_read += 1
            yield chunk
        if self.error is not None:
            raise self.error


class FakeProcess:
    """A scripted command: its exit status, its output chunks, and errors raised while waiting or reading."""

    def __init__(
        self,
        returncode: int = 0,
        stdout: list[bytes] | bytes = (),
        stderr: list[bytes] | bytes = (),
        *,
        wait_error: BaseException | None = None,
        stdout_error: BaseException | None = None,
    ) -> None:
        self.returncode = returncode
        self.stdout = FakeStream([stdout] if isinstance(stdout, bytes) else list(stdout), stdout_error)
        self.stderr = FakeStream([stderr] if isinstance(stderr, bytes) else list(stderr))
        self.wait_error = wait_error

    def wait(self) -> int:
        if self.wait_error is not None:
            raise self.wait_error
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode


class HostProcess:
    """A command running through the host's ``sh`` as Modal runs one in a sandbox (see the module docstring)."""

    #: Bytes one read of an output pipe takes at most: Modal streams output in chunks.
    chunk_bytes = 7000

    def __init__(self, args: tuple[str, ...], *, cwd: str | None, env: dict[str, str], timeout: int | None) -> None:
        self._proc = subprocess.Popen(
            list(args),
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.timed_out = False
        self._timer = threading.Timer(timeout or 60, self._kill_at_deadline)
        self._timer.daemon = True
        self._timer.start()
        self.stdout = self._chunks(self._proc.stdout)
        self.stderr = self._chunks(self._proc.stderr)

    def _kill_at_deadline(self) -> None:
        self.timed_out = True
        kill_group(self._proc.pid)

    def _chunks(self, pipe: Any):
        while chunk := os.read(pipe.fileno(), self.chunk_bytes):
            yield chunk
        pipe.close()

    def _status(self, code: int) -> int:
        self._timer.cancel()
        if self.timed_out:
            return -1
        return 128 - code if code < 0 else code

    def wait(self) -> int:
        return self._status(self._proc.wait())

    def poll(self) -> int | None:
        code = self._proc.poll()
        return None if code is None else self._status(code)


class FakeFilesystem:
    def __init__(self, sandbox: FakeSandbox) -> None:
        self._sandbox = sandbox

    def _record(self, name: str, *args: Any) -> None:
        self._sandbox.calls.append((f"filesystem.{name}", args, {}))
        error = self._sandbox.fs_errors.pop(name, None)
        if error is not None:
            raise error

    def write_bytes(self, data: bytes, remote_path: str) -> None:
        self._record("write_bytes", data, remote_path)
        self._sandbox.put(remote_path, bytes(data))

    def copy_from_local(self, local_path: str, remote_path: str) -> None:
        self._record("copy_from_local", local_path, remote_path)
        with open(local_path, "rb") as handle:
            self._sandbox.put(remote_path, handle.read())

    def list_files(self, remote_path: str) -> list[FileInfo]:
        self._record("list_files", remote_path)
        exc = self._sandbox.modal.exception
        if not os.path.exists(remote_path):
            raise exc.SandboxFilesystemNotFoundError(f"{remote_path} not found")
        if not os.path.isdir(remote_path):
            raise exc.SandboxFilesystemNotADirectoryError(f"{remote_path} is not a directory")
        listed = []
        for entry in os.scandir(remote_path):
            if entry.is_symlink():
                kind = FileType.SYMLINK
            elif entry.is_dir():
                kind = FileType.DIRECTORY
            else:
                kind = FileType.FILE
            listed.append(FileInfo(name=entry.name, type=kind))
        return listed


class FakeSandbox:
    """One sandbox: what it was created with, its tags, every call made on it, and queued processes."""

    def __init__(self, modal: Any, object_id: str, kwargs: dict[str, Any]) -> None:
        self.modal = modal
        self.object_id = object_id
        self.create_kwargs = kwargs
        self.tags: dict[str, str] = dict(kwargs.get("tags") or {})
        self.calls: list[tuple[str, tuple, dict]] = []
        self.processes: deque[FakeProcess | BaseException] = deque()
        self.exec_errors: deque[BaseException] = deque()
        self.fs_errors: dict[str, BaseException] = {}
        self.tag_errors: deque[BaseException] = deque()
        self.poll_result: int | None = None
        self.terminate_error: BaseException | None = None
        self.terminated = False
        self.run_on_host = False
        self._filesystem = FakeFilesystem(self)

    @property
    def filesystem(self) -> FakeFilesystem:
        return self._filesystem

    def put(self, remote_path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(remote_path), exist_ok=True)
        if os.path.islink(remote_path):
            os.unlink(remote_path)
        with open(remote_path, "wb") as handle:
            handle.write(data)

    def exec(self, *args: str, timeout: int | None = None, workdir: str | None = None, text: bool = True, **kw):
        self.calls.append(("exec", args, {"timeout": timeout, "workdir": workdir, "text": text, **kw}))
        if self.terminated:
            raise self.modal.exception.SandboxTerminatedError(f"{self.object_id} was terminated")
        if self.exec_errors:
            raise self.exec_errors.popleft()
        if self.processes:
            item = self.processes.popleft()
            if isinstance(item, BaseException):
                raise item
            return item
        if self.run_on_host:
            env = {"PATH": os.environ.get("PATH", os.defpath), **(self.create_kwargs.get("env") or {})}
            return HostProcess(args, cwd=workdir, env=env, timeout=timeout)
        return FakeProcess(0)

    def get_tags(self) -> dict[str, str]:
        self.calls.append(("get_tags", (), {}))
        if self.tag_errors:
            raise self.tag_errors.popleft()
        return dict(self.tags)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.calls.append(("set_tags", (dict(tags),), {}))
        if self.tag_errors:
            raise self.tag_errors.popleft()
        self.tags = dict(tags)

    def poll(self) -> int | None:
        self.calls.append(("poll", (), {}))
        return self.poll_result

    def terminate(self, *, wait: bool = False) -> None:
        self.calls.append(("terminate", (), {"wait": wait}))
        if self.terminate_error is not None:
            raise self.terminate_error
        self.terminated = True
        self.poll_result = 137


@dataclass
class FakeApp:
    name: str
    app_id: str
    lookups: list[dict[str, Any]] = field(default_factory=list)


class FakeSandboxFactory:
    """Stands in for the ``modal.Sandbox`` class: ``create``, ``from_id``, ``from_name`` and ``list``."""

    def __init__(self, modal: Any) -> None:
        self.modal = modal
        self.by_id: dict[str, FakeSandbox] = {}
        self.create_calls: list[dict[str, Any]] = []
        self.create_errors: deque[BaseException] = deque()
        self.from_id_calls: list[str] = []
        self.from_id_errors: deque[BaseException] = deque()
        self.list_calls: list[dict[str, Any]] = []
        self.run_on_host = False
        self._ids = itertools.count(1)

    def create(self, *args: str, **kwargs: Any) -> FakeSandbox:
        self.create_calls.append(kwargs)
        sandbox_id = f"sb-fake{next(self._ids):04d}"
        if self.create_errors:
            error = self.create_errors.popleft()
            if getattr(error, "after_create", False):  # reached Modal, then the reply was lost
                self._make(sandbox_id, kwargs)
            raise error
        return self._make(sandbox_id, kwargs)

    def _make(self, sandbox_id: str, kwargs: dict[str, Any]) -> FakeSandbox:
        sandbox = FakeSandbox(self.modal, sandbox_id, kwargs)
        sandbox.run_on_host = self.run_on_host
        self.by_id[sandbox_id] = sandbox
        return sandbox

    def from_id(self, sandbox_id: str, client: Any = None) -> FakeSandbox:
        self.from_id_calls.append(sandbox_id)
        if self.from_id_errors:
            raise self.from_id_errors.popleft()
        if sandbox_id not in self.by_id:
            raise self.modal.exception.NotFoundError(f"Sandbox {sandbox_id} not found")
        return self.by_id[sandbox_id]

    def from_name(self, app_name: str, name: str, *, environment_name: str | None = None, client: Any = None):
        for sandbox in self.by_id.values():
            if sandbox.create_kwargs.get("name") == name:
                return sandbox
        raise self.modal.exception.NotFoundError(f"no sandbox named {name}")

    def list(self, *, app_id: str | None = None, tags: dict[str, str] | None = None, client: Any = None):
        self.list_calls.append({"app_id": app_id, "tags": tags, "client": client})
        for sandbox in self.by_id.values():
            if not sandbox.terminated and all(sandbox.tags.get(k) == v for k, v in (tags or {}).items()):
                yield sandbox


class FakeImage:
    def __init__(self, tag: str) -> None:
        self.tag = tag

    @classmethod
    def from_registry(cls, tag: str, **kwargs: Any) -> FakeImage:
        return cls(tag)


class FakeClient:
    def __init__(self, credentials: tuple[str, str] | None) -> None:
        self.credentials = credentials


def build() -> types.ModuleType:
    """Return a fresh fake ``modal`` module; its ``Sandbox``, ``App`` and ``Client`` keep their own records."""
    modal = types.ModuleType("modal")
    modal.__version__ = "fake"
    modal.exception = _exception_module()
    modal.Image = FakeImage
    modal.FileType = FileType
    modal.Sandbox = FakeSandboxFactory(modal)

    apps: dict[str, FakeApp] = {}
    app_errors: deque[BaseException] = deque()
    client_errors: deque[BaseException] = deque()

    class App:
        errors = app_errors
        registry = apps

        @staticmethod
        def lookup(name, *, client=None, environment_name=None, create_if_missing=False):
            if app_errors:
                raise app_errors.popleft()
            app = apps.get(name)
            if app is None:
                if not create_if_missing:
                    raise modal.exception.NotFoundError(f"App {name!r} not found")
                app = apps[name] = FakeApp(name=name, app_id=f"ap-{len(apps) + 1:022d}")
            app.lookups.append({"client": client, "environment_name": environment_name})
            return app

    class Client:
        errors = client_errors
        built: list[FakeClient] = []

        @staticmethod
        def from_env():
            if client_errors:
                raise client_errors.popleft()
            client = FakeClient(None)
            Client.built.append(client)
            return client

        @staticmethod
        def from_credentials(token_id, token_secret):
            if client_errors:
                raise client_errors.popleft()
            client = FakeClient((token_id, token_secret))
            Client.built.append(client)
            return client

    modal.App = App
    modal.Client = Client
    return modal
