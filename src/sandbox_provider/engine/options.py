"""
``SessionOptions``: what a consumer asks of a sandbox session, checked in one place.

The operator, the decorator and the toolset build one when the Dag is parsed (template strings may
stand where values will be), and :meth:`SessionOptions.rendered` checks it again once Airflow has
rendered the templates, before anything is provisioned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sandbox_provider.engine.storage import duplicate_paths
from sandbox_provider.engine.transfer import DEFAULT_MAX_EXPORT_BYTES, check_transfer_map
from sandbox_provider.sandbox.spec import SandboxSpec, check_byte_count, dag_run_owner, is_sandbox_handle

__all__ = ["SessionOptions", "check_attachable", "is_reference", "is_template"]


def is_reference(value: Any) -> bool:
    """True for a value Airflow resolves when the task runs, such as an ``XComArg``."""
    from airflow.sdk.definitions._internal.mixins import ResolveMixin

    return isinstance(value, ResolveMixin)


def is_template(value: Any) -> bool:
    """True for a string Airflow will render (it holds ``{{`` or ``{%``), or a reference it resolves."""
    if isinstance(value, str):
        return "{{" in value or "{%" in value
    return is_reference(value)


def _check_conn_id(value: Any, name: str) -> str | None:
    if value is None or (isinstance(value, str) and value.strip()):
        return value
    raise ValueError(f"{name} must be the id of an Airflow connection, or None; got {value!r}.")


def check_attachable(hook: Any) -> None:
    """:raises ValueError: unless another task's sandbox can be attached on ``hook``'s backend (for ``attach_to``)."""
    if not hook.attachable:
        raise ValueError(
            f"attach_to needs a backend that can find a sandbox from another task, and {hook.name!r} is not one. "
            "Drop attach_to to provision a sandbox here, or use an attachable backend such as LocalSandboxHook or "
            "ModalSandboxHook."
        )


@dataclass(frozen=True)
class SessionOptions:
    """
    What a session is asked to do with its sandbox.

    :param spec: the spec to provision with; None means ``SandboxSpec()``. Not allowed with ``attach_to``.
    :param attach_to: the handle of a sandbox another task provisioned (or a template for it).
    :param sandbox_owner: with ``attach_to``, the owner the sandbox must carry; with ``keep=True``, the
        owner stamped on the new sandbox. Default for both: the current Dag run.
    :param files: ``{sandbox path: text or bytes}`` written in after provisioning.
    :param inputs: ``{sandbox path: storage URL}`` streamed in after provisioning.
    :param exports: ``{sandbox path: storage URL}`` copied out after success.
    :param input_conn_id: the Airflow connection for ``inputs``.
    :param export_conn_id: the Airflow connection for ``exports``.
    :param max_export_bytes: the largest file an export copies, in bytes (default 1 GiB).
    :param keep: None destroys a provisioned sandbox and releases an attached one; True leaves the
        sandbox standing; False destroys it even when attached.
    :param templated: whether template strings may still stand for values (at parse time).
    :raises ValueError: for any value that cannot work, saying what to change.
    """

    spec: SandboxSpec | None = None
    attach_to: Any = None
    sandbox_owner: str | None = None
    files: Mapping[str, str | bytes] = field(default_factory=dict)
    inputs: Mapping[str, Any] = field(default_factory=dict)
    exports: Mapping[str, Any] = field(default_factory=dict)
    input_conn_id: str | None = None
    export_conn_id: str | None = None
    max_export_bytes: int = DEFAULT_MAX_EXPORT_BYTES
    keep: bool | None = None
    templated: bool = False

    def __post_init__(self) -> None:
        spec, attach_to, owner, keep = self.spec, self.attach_to, self.sandbox_owner, self.keep
        if spec is not None and not isinstance(spec, SandboxSpec):
            raise ValueError(f"spec must be a SandboxSpec, got {type(spec).__name__}.")
        if keep not in (None, True, False):
            raise ValueError(f"keep_sandbox must be None, True or False, got {keep!r}.")
        if attach_to is not None:
            if not (self.templated and is_template(attach_to)) and not is_sandbox_handle(attach_to):
                raise ValueError(
                    f"attach_to is {attach_to!r}, which is not a sandbox handle. Pass the handle the provisioning "
                    "task returned, e.g. \"{{ ti.xcom_pull(task_ids='provision') }}\", or drop attach_to."
                )
            if spec is not None:
                raise ValueError(
                    "spec cannot be combined with attach_to: the sandbox already exists with its own spec. Set the "
                    "spec on the task that provisions it."
                )
        if owner is not None:
            if not isinstance(owner, str) or not owner.strip():
                raise ValueError(f"sandbox_owner must be a non-empty string or None, got {owner!r}.")
            if attach_to is None and keep is not True:
                raise ValueError(
                    "sandbox_owner applies to a sandbox shared between tasks: pass it with attach_to (the owner to "
                    "check) or with keep_sandbox=True (the owner to stamp)."
                )
            if spec is not None and spec.owner is not None and spec.owner != owner:
                raise ValueError(f"sandbox_owner={owner!r} contradicts spec.owner={spec.owner!r}; give one of them.")
        templated = self.templated
        object.__setattr__(self, "files", check_transfer_map(self.files, "files", urls=False))
        object.__setattr__(self, "inputs", check_transfer_map(self.inputs, "inputs", urls=True, templated=templated))
        object.__setattr__(self, "exports", check_transfer_map(self.exports, "exports", urls=True, templated=templated))
        clash = duplicate_paths((("files", self.files), ("inputs", self.inputs)))
        if clash:
            raise ValueError(clash)
        object.__setattr__(self, "input_conn_id", _check_conn_id(self.input_conn_id, "input_conn_id"))
        object.__setattr__(self, "export_conn_id", _check_conn_id(self.export_conn_id, "export_conn_id"))
        object.__setattr__(self, "max_export_bytes", int(check_byte_count(self.max_export_bytes, "max_export_bytes")))

    @property
    def attach_mode(self) -> bool:
        return self.attach_to is not None

    def rendered(self, **values: Any) -> SessionOptions:
        """
        The options with rendered values put in (``attach_to``, ``inputs``, ``exports``, ``files``), checked
        again with no template allowed.

        :raises ValueError: for a rendered value that cannot work (an export that is not a URL, say).
        :raises SandboxTerminalError: for an ``attach_to`` that rendered to no handle (the upstream task
            returned nothing): no retry of this task can fix that.
        """
        attach_to = values.get("attach_to", self.attach_to)
        if attach_to is not None:
            if not isinstance(attach_to, str):
                attach_to = str(attach_to)
            if not is_sandbox_handle(attach_to):
                from sandbox_provider.sandbox.errors import SandboxTerminalError

                raise SandboxTerminalError(
                    f"attach_to is {attach_to!r}, which is not a sandbox handle. The task that provisions the "
                    "sandbox returned nothing, or this task ran before it; check the upstream task and its XCom."
                )
            values["attach_to"] = attach_to.strip()
        return dataclasses.replace(self, templated=False, **values)

    def provision_spec(self, hook: Any, context: Mapping[str, Any] | None) -> SandboxSpec | None:
        """
        The spec to provision with (None in attach mode). With ``keep=True`` on an attachable backend, a
        spec without an owner is stamped with ``sandbox_owner``, or the Dag run of ``context``, so a later
        task of the run can attach.
        """
        if self.attach_mode:
            return None
        spec = self.spec or SandboxSpec()
        if self.keep is True and hook.attachable and spec.owner is None:
            owner = self.sandbox_owner or (dag_run_owner(context) if context else None)
            if owner:
                spec = dataclasses.replace(spec, owner=owner)
        return spec

    def check_backend(self, hook: Any) -> None:
        """
        Check what needs the backend but not a sandbox: attaching needs an attachable backend, the spec
        must be one it can enforce (network, the size and number of its env entries), and no two of
        ``files`` and ``inputs`` may write one path once relative paths start at the backend's workdir.

        :raises ValueError: for attach_to on a backend that cannot attach, or two entries for one path.
        :raises SandboxTerminalError: for a spec the backend cannot enforce.
        """
        # An attached sandbox may have another workdir (its stamps say); compare by name only then.
        workdir = None if self.attach_mode else getattr(hook, "workdir", None)
        clash = duplicate_paths((("files", self.files), ("inputs", self.inputs)), workdir)
        if clash:
            raise ValueError(clash)
        if self.attach_mode:
            check_attachable(hook)
        elif self.keep is True and not hook.attachable:
            raise ValueError(
                f"keep_sandbox=True leaves the sandbox standing for a later task to attach to, and no task can attach "
                f"to a sandbox of the {hook.name!r} backend: it would run, unused, until its lifetime ends. Do the "
                "work in this task, or provision on an attachable backend."
            )
        else:
            hook.check_spec(self.provision_spec(hook, None))
