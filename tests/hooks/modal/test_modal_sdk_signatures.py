"""
Checks against the ``modal`` SDK actually installed: every class, method and keyword the Modal hook
uses must exist there under that name, so a rename in a new SDK release fails this suite rather
than a Dag run. The calls checked are the ones the hook really makes (recorded through the fake),
bound to the real signatures with ``inspect.signature``.
"""

from __future__ import annotations

import importlib
import inspect
import io
import sys

import pytest

modal = pytest.importorskip("modal")
if getattr(modal, "__version__", "") == "fake":  # pragma: no cover - the fake leaked from another test
    pytest.skip("the real modal SDK is shadowed", allow_module_level=True)

import fake_modal
import modal.exception as real_exception
from modal.container_process import ContainerProcess
from modal.io_streams import StreamReader
from modal.sandbox.sandbox import SandboxFilesystem
from modal.types import FileInfo, FileType

from sandbox_provider.sandbox.spec import SandboxSpec

modal_hook_module = importlib.import_module("sandbox_provider.hooks.modal.hook")
provider_module = importlib.import_module("airflow.providers.modal.hooks.modal")
ModalHook = provider_module.ModalHook

REAL_SANDBOX = modal.Sandbox
REAL_IMAGE = modal.Image


def _bind(func, *args, **kwargs) -> None:
    """Fail, naming the call, if ``func``'s real signature does not take these arguments."""
    try:
        inspect.signature(func).bind(*args, **kwargs)
    except TypeError as err:
        pytest.fail(f"{getattr(func, '__qualname__', func)} no longer takes {sorted(kwargs)}: {err}")


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """Drive the hook through the fake SDK once over every path, and return the fake with its records."""
    fake = fake_modal.build()
    monkeypatch.setitem(sys.modules, "modal", fake)
    monkeypatch.setitem(sys.modules, "modal.exception", fake.exception)
    monkeypatch.setattr(provider_module, "modal", fake)
    fake.Sandbox.run_on_host = True
    hook = modal_hook_module.ModalSandboxHook(
        modal_conn_id=None,
        workdir=str(tmp_path),
        idle_timeout=60,
        cpu=1.0,
        memory=1024,
        gpu="T4",
        region="us-east",
        cloud="aws",
        tags={"dag_id": "d"},
        egress_enforcement="sni",
    )
    spec = SandboxSpec(env={"A": "1"}, allow_egress_to=["pypi.org"], allow_egress_to_cidrs=["203.0.113.0/24"])
    handle = hook.create(spec=spec)
    blocked = hook.create(spec=SandboxSpec())
    hook.write_file(handle, "a.txt", b"data")
    hook.import_file(handle, "b.txt", io.BytesIO(b"more"))
    hook.read_file(handle, "a.txt", max_bytes=10)
    hook.export_file(handle, "a.txt", io.BytesIO(), max_bytes=10)
    hook.list_directory(handle)
    hook.run_command(handle, "true", timeout=5, max_output_bytes=10)
    hook.write_tags(handle, {**hook.read_tags(handle), "k": "v"})
    hook.list_sandboxes({"dag_id": "d"})
    modal_hook_module.ModalSandboxHook(modal_conn_id=None).destroy(handle)
    hook.destroy(blocked)
    return fake


def test_sandbox_create_takes_every_keyword_the_hook_passes(recorded):
    assert len(recorded.Sandbox.create_calls) == 2
    for kwargs in recorded.Sandbox.create_calls:
        _bind(REAL_SANDBOX.create, **kwargs)
    used = set().union(*recorded.Sandbox.create_calls)
    assert {"block_network", "outbound_domain_allowlist", "outbound_cidr_allowlist", "idle_timeout"} <= used


def test_sandbox_methods_take_what_the_hook_passes(recorded):
    methods = {
        "exec": REAL_SANDBOX.exec,
        "get_tags": REAL_SANDBOX.get_tags,
        "set_tags": REAL_SANDBOX.set_tags,
        "poll": REAL_SANDBOX.poll,
        "terminate": REAL_SANDBOX.terminate,
        "filesystem.write_bytes": SandboxFilesystem.write_bytes,
        "filesystem.copy_from_local": SandboxFilesystem.copy_from_local,
        "filesystem.list_files": SandboxFilesystem.list_files,
    }
    seen = set()
    for sandbox in recorded.Sandbox.by_id.values():
        for name, args, kwargs in sandbox.calls:
            _bind(methods[name], None, *args, **kwargs)  # None stands for self
            seen.add(name)
    assert seen == set(methods)


def test_lookup_and_listing_signatures(recorded):
    assert recorded.Sandbox.list_calls
    for kwargs in recorded.Sandbox.list_calls:
        _bind(REAL_SANDBOX.list, **kwargs)
    _bind(REAL_SANDBOX.from_id, "sb-x", client=None)
    _bind(REAL_SANDBOX.from_name, "app", "name", environment_name=None, client=None)
    _bind(REAL_IMAGE.from_registry, "python:3.12-slim")
    assert isinstance(REAL_IMAGE, type)


def test_sandbox_exposes_the_attributes_the_hook_reads():
    for name in ("object_id", "filesystem"):
        assert hasattr(REAL_SANDBOX, name), name
    assert isinstance(inspect.getattr_static(REAL_SANDBOX, "filesystem"), property)


def test_process_and_streams():
    _bind(ContainerProcess.wait, None)
    _bind(ContainerProcess.poll, None)
    for name in ("stdout", "stderr"):
        assert isinstance(inspect.getattr_static(ContainerProcess, name), property)
    assert hasattr(StreamReader, "__iter__")


def test_file_listing_types():
    assert {"name", "type"} <= set(inspect.signature(FileInfo).parameters)
    assert FileType.DIRECTORY.value == "directory"


def test_modal_provider_hook_api():
    assert "modal_conn_id" in inspect.signature(ModalHook.__init__).parameters
    _bind(ModalHook.lookup_app, None, "app", create_if_missing=True)
    _bind(ModalHook.get_sandbox, None, "sb-x")
    for name in ("client", "environment_name"):
        assert hasattr(ModalHook, name), name
    assert ModalHook.conn_type == "modal"
    assert ModalHook.default_conn_name == modal_hook_module.ModalSandboxHook.default_conn_name


USED_ERRORS = (
    "Error",
    "AlreadyExistsError",
    "AuthError",
    "ConflictError",
    "ConnectionError",
    "ExecTimeoutError",
    "InternalError",
    "InternalFailure",
    "InvalidError",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "SandboxFilesystemError",
    "SandboxFilesystemIsADirectoryError",
    "SandboxFilesystemNotADirectoryError",
    "SandboxFilesystemNotFoundError",
    "SandboxFilesystemPermissionError",
    "SandboxTerminatedError",
    "SandboxTimeoutError",
    "ServiceError",
)


@pytest.mark.parametrize("name", USED_ERRORS)
def test_error_classes_the_hook_catches_exist(name):
    assert isinstance(getattr(real_exception, name, None), type), f"modal.exception.{name} is gone"


def test_fake_exception_hierarchy_mirrors_the_sdk():
    fake = fake_modal.build().exception
    for name in dir(fake):
        fake_cls = getattr(fake, name)
        if not isinstance(fake_cls, type):
            continue
        real_cls = getattr(real_exception, name, None)
        assert isinstance(real_cls, type), f"the fake has modal.exception.{name}, the SDK does not"
        real_parents = {base.__name__ for base in real_cls.__mro__}
        fake_parents = {base.__name__ for base in fake_cls.__mro__} - {"object", "BaseException", "Exception"}
        assert fake_parents <= real_parents, f"{name}: fake parents {fake_parents} vs real {real_parents}"
    # The order the hook checks in depends on this.
    assert issubclass(real_exception.ConflictError, real_exception.InvalidError)
    assert issubclass(real_exception.SandboxFilesystemNotFoundError, real_exception.SandboxFilesystemError)
