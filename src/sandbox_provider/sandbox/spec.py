"""The value types of the sandbox contract: what a sandbox must be, and what a command gave back."""

from __future__ import annotations

import ipaddress
import json
import math
import posixpath
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "DEFAULT_WORKDIR",
    "EXPIRES_AT_TAG",
    "HOLDER_TAG",
    "NETWORK_TAG",
    "OWNER_TAG",
    "SANDBOX_NAME_PREFIX",
    "WORKDIR_TAG",
    "AttachedSandbox",
    "SandboxExecResult",
    "SandboxSpec",
    "StreamTotals",
    "check_byte_count",
    "check_handle",
    "check_path",
    "check_positive",
    "check_workdir",
    "dag_run_owner",
    "trace_stamps",
    "decode_network_policy",
    "encode_network_policy",
    "hostname_allowlist",
    "is_sandbox_handle",
    "new_sandbox_name",
]

#: Stamp keys an attachable backend keeps with each sandbox. The ``airflow_`` prefix keeps them
#: apart from a user's own tags, and they win over a user tag of the same name.
OWNER_TAG = "airflow_owner"
HOLDER_TAG = "airflow_holder"
EXPIRES_AT_TAG = "airflow_expires_at"
NETWORK_TAG = "airflow_network"
WORKDIR_TAG = "airflow_workdir"
#: Stamps naming the task instance that provisioned a sandbox, to trace and clean up leftovers.
DAG_ID_TAG = "airflow_dag_id"
RUN_ID_TAG = "airflow_run_id"
TASK_ID_TAG = "airflow_task_id"
MAP_INDEX_TAG = "airflow_map_index"
TRY_NUMBER_TAG = "airflow_try_number"
TRACE_TAGS = (DAG_ID_TAG, RUN_ID_TAG, TASK_ID_TAG, MAP_INDEX_TAG, TRY_NUMBER_TAG)

SANDBOX_NAME_PREFIX = "airflow-sandbox-"
DEFAULT_WORKDIR = "/workspace"


def new_sandbox_name() -> str:
    """Return a fresh sandbox name, ``airflow-sandbox-`` and 12 hex digits."""
    return SANDBOX_NAME_PREFIX + secrets.token_hex(6)


def _string_list(value: Sequence[str] | None, name: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)):
        raise ValueError(f"SandboxSpec.{name} must be a list of strings, not a single string; wrap it: [{value!r}].")
    items = tuple(value)
    bad = [item for item in items if not isinstance(item, str) or not item.strip()]
    if bad:
        raise ValueError(f"SandboxSpec.{name} must hold non-empty strings; these entries are not: {bad!r}.")
    return items


@dataclass(frozen=True)
class SandboxSpec:
    """
    What a sandbox must be. A backend that cannot enforce a field it is given refuses to provision.

    :param env: environment variables inside the sandbox, strings to strings. Nothing else from
        the worker's environment reaches the sandbox. Code in the sandbox can read every value.
    :param block_network: ``True`` (default) denies all outbound traffic, DNS included.
        ``False`` opens outbound access as far as the backend allows it.
    :param allow_egress_to: hostnames the sandbox may reach; narrows ``block_network=True``.
    :param allow_egress_to_cidrs: IPv4 ranges the sandbox may reach on any port; narrows
        ``block_network=True``.
    :param owner: who provisioned the sandbox for later tasks to attach to, usually
        :func:`dag_run_owner`. A backend that cannot record an owner refuses it.
    :raises ValueError: on a value of the wrong type (an env value that is not a string, say),
        when the spec is built, so a Dag file fails at parse time rather than at run time.
    """

    env: Mapping[str, str] | None = None
    block_network: bool = True
    allow_egress_to: Sequence[str] | None = None
    allow_egress_to_cidrs: Sequence[str] | None = None
    owner: str | None = None

    def __post_init__(self) -> None:
        if self.env is not None:
            if not isinstance(self.env, Mapping):
                raise ValueError(
                    f"SandboxSpec.env must be a mapping of strings to strings, got {type(self.env).__name__}."
                )
            bad = sorted(str(k) for k, v in self.env.items() if not isinstance(k, str) or not isinstance(v, str))
            if bad:
                raise ValueError(
                    "SandboxSpec.env must map strings to strings; these entries do not: "
                    f"{bad!r}. Convert each value in the Dag, e.g. str(port), so the sandbox sees what you meant."
                )
            bad_names = sorted(k for k in self.env if not k or "=" in k or "\0" in k)
            bad_values = sorted(k for k, v in self.env.items() if "\0" in v)
            if bad_names or bad_values:
                raise ValueError(
                    "SandboxSpec.env names must be non-empty and hold no '=' or NUL, and values no NUL; "
                    f"fix these entries: {sorted(set(bad_names + bad_values))!r}."
                )
            object.__setattr__(self, "env", MappingProxyType(dict(self.env)))
        if not isinstance(self.block_network, bool):
            raise ValueError(f"SandboxSpec.block_network must be True or False, got {self.block_network!r}.")
        object.__setattr__(self, "allow_egress_to", _string_list(self.allow_egress_to, "allow_egress_to"))
        object.__setattr__(
            self, "allow_egress_to_cidrs", _string_list(self.allow_egress_to_cidrs, "allow_egress_to_cidrs")
        )
        if not self.block_network and (self.allow_egress_to or self.allow_egress_to_cidrs):
            raise ValueError(
                "SandboxSpec allow lists narrow block_network=True; with block_network=False outbound access "
                "is already open. Drop block_network=False to allow only the listed destinations."
            )
        if self.owner is not None and (not isinstance(self.owner, str) or not self.owner.strip()):
            raise ValueError(f"SandboxSpec.owner must be a non-empty string or None, got {self.owner!r}.")

    @property
    def has_allowlist(self) -> bool:
        """Whether the spec names hosts or address ranges to allow."""
        return bool(self.allow_egress_to or self.allow_egress_to_cidrs)


@dataclass(frozen=True)
class StreamTotals:
    """
    How much a command wrote to one output stream in all, counted as the output arrived; the
    result's text is only the tail of it.

    :param bytes: bytes written to the stream.
    :param lines: lines written: newline characters, plus one for a last line without one.
    :param tail_at_line_start: the kept tail begins at the start of a line (always, when nothing
        was dropped); False when its first line lost its start.
    """

    bytes: int
    lines: int
    tail_at_line_start: bool = True


@dataclass(frozen=True)
class SandboxExecResult:
    """
    What one command gave back.

    :param exit_code: the command's exit status; meaningless when ``timed_out``.
    :param stdout: the tail of standard output, decoded as UTF-8 with replacement.
    :param stderr: the tail of standard error, decoded the same way.
    :param timed_out: the command ran past its deadline and was killed.
    :param stdout_truncated: bytes were dropped from the head of ``stdout`` to keep within the cap.
    :param stderr_truncated: the same for ``stderr``.
    :param sandbox_terminated: the backend ended the sandbox (to stop the command, or it died);
        its files are gone.
    :param applied_timeout: the deadline actually applied, in seconds, when the backend shortened
        the one asked for (to the sandbox's remaining lifetime, say).
    :param stdout_totals: how much the command wrote to standard output in all, so a reader can say
        exactly what the tail leaves out; None when the producer did not count.
    :param stderr_totals: the same for standard error.
    :param ended_because: with ``sandbox_terminated``, why the sandbox ended when the hook knows: this
        worker destroyed it (the reason it gave, e.g. the task was stopped), or its lifetime ran out.
    """

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    sandbox_terminated: bool = False
    applied_timeout: float | None = None
    stdout_totals: StreamTotals | None = None
    stderr_totals: StreamTotals | None = None
    ended_because: str | None = None

    @property
    def ok(self) -> bool:
        """True when the command finished in time with exit status 0."""
        return not self.timed_out and not self.sandbox_terminated and self.exit_code == 0


@dataclass(frozen=True)
class AttachedSandbox:
    """
    What a task learns when it attaches to a sandbox another task provisioned.

    :param handle: the sandbox's handle.
    :param remaining_lifetime: seconds left before the backend ends the sandbox, or None if unknown.
    :param network: the network part of the spec it was provisioned with, or None if unknown.
    :param workdir: its working directory, or None if the provisioner did not record one.
    """

    handle: str
    remaining_lifetime: float | None
    network: SandboxSpec | None
    workdir: str | None
    tags: Mapping[str, str] = field(default_factory=dict)


def is_sandbox_handle(value: object) -> bool:
    """True for a non-empty string that is not what a missing XCom renders to (``"None"``)."""
    return isinstance(value, str) and bool(value.strip()) and value.strip() != "None"


def check_handle(handle: object) -> str:
    """
    Return ``handle`` if it can name a sandbox.

    :raises SandboxHandleError: (a ``ValueError``) for an empty string, ``None`` or ``"None"`` (a
        missing XCom), or a non-string.
    """
    from sandbox_provider.sandbox.errors import SandboxHandleError

    if not is_sandbox_handle(handle):
        raise SandboxHandleError(
            f"{handle!r} is not a sandbox handle. Pass the string that create() returned; when it comes "
            "from XCom, check that the provisioning task ran first and returned it."
        )
    return handle  # type: ignore[return-value]


def check_positive(value: Any, name: str, *, allow_none: bool = False) -> Any:
    """
    Return ``value`` if it is a positive finite number (bools refused).

    :raises ValueError: naming ``name`` otherwise.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}.")
    return value


def check_byte_count(value: Any, name: str, *, unit: str = "bytes") -> int:
    """
    Return ``value`` if it is a whole, positive number of ``unit`` (bools refused).

    :raises ValueError: naming ``name`` otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a whole, positive number of {unit}, got {value!r}.")
    return value


def check_workdir(workdir: Any) -> str:
    """
    Return ``workdir`` normalised, if it is an absolute POSIX path without NUL.

    :raises ValueError: otherwise.
    """
    if not isinstance(workdir, str) or not workdir.startswith("/") or "\0" in workdir:
        raise ValueError(f"workdir must be an absolute path such as '/workspace', got {workdir!r}.")
    return posixpath.normpath(workdir)


_HOSTNAME_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")


def hostname_allowlist(entries: Sequence[str], *, hint: str = "") -> list[str]:
    """
    The hostnames of an ``allow_egress_to`` list in canonical form: lowercased, without a trailing
    dot, each once, in the order given. ``*.example.com`` (any subdomain) is a hostname too.

    :param hint: words added to the error, such as where addresses go on this backend.
    :raises ValueError: naming the first entry that is not a hostname (an address, a URL, a port, a
        single label).
    """
    allowed: list[str] = []
    for entry in entries:
        host = entry.strip().lower().rstrip(".")
        labels = host[2:].split(".") if host.startswith("*.") else host.split(".")
        try:
            ipaddress.ip_address(host)
            is_address = True
        except ValueError:
            is_address = False
        if is_address or len(labels) < 2 or not all(_HOSTNAME_LABEL.fullmatch(label) for label in labels):
            raise ValueError(
                f"allow_egress_to entry {entry!r} is not a hostname. Give a bare name such as 'pypi.org' or "
                f"'*.example.com': no scheme, port, path or IP address{hint}."
            )
        if host not in allowed:
            allowed.append(host)
    return allowed


def check_path(path: Any) -> str:
    """
    Return ``path`` if it can name a file in a sandbox: a non-empty string without NUL.

    :raises SandboxError: otherwise, saying what to pass instead.
    """
    if not isinstance(path, str) or not path.strip() or "\0" in path:
        from sandbox_provider.sandbox.errors import SandboxError

        raise SandboxError(f"{path!r} is not a usable path: give a non-empty string without NUL characters.")
    return path


def trace_stamps(context: Mapping[str, Any] | None = None) -> dict[str, str]:
    """
    The stamps naming the running task instance: Dag, run, task, map index and try number.

    :param context: the task context; None looks up the current one, and outside a task (a hook
        used from a script) there is none, and the result is empty.
    """
    if context is None:
        try:
            from airflow.sdk import get_current_context

            context = get_current_context()
        except Exception:
            return {}
    ti = context.get("ti") if isinstance(context, Mapping) else None
    if ti is None:
        return {}
    values = {
        DAG_ID_TAG: getattr(ti, "dag_id", None),
        RUN_ID_TAG: getattr(ti, "run_id", None),
        TASK_ID_TAG: getattr(ti, "task_id", None),
        MAP_INDEX_TAG: getattr(ti, "map_index", None),
        TRY_NUMBER_TAG: getattr(ti, "try_number", None),
    }
    return {key: str(value) for key, value in values.items() if value is not None}


def dag_run_owner(context: Mapping[str, Any]) -> str:
    """
    Return the owner token for the Dag run in ``context``: ``"<dag_id>/<run_id>"``.

    Pass it as ``SandboxSpec(owner=...)`` when provisioning a sandbox that a later task of the same
    run attaches to. A bare run id is not enough: two Dags can share one.
    """
    ti = context["ti"]
    return f"{ti.dag_id}/{ti.run_id}"


def encode_network_policy(spec: SandboxSpec) -> str:
    """Encode the network fields of ``spec`` as compact JSON with sorted keys, for a stamp."""
    return json.dumps(
        {
            "allow_egress_to": list(spec.allow_egress_to or []),
            "allow_egress_to_cidrs": list(spec.allow_egress_to_cidrs or []),
            "block_network": spec.block_network,
        },
        sort_keys=True,
        separators=(",", ":"),
    )


def decode_network_policy(value: str) -> SandboxSpec:
    """
    Decode a stamp written by :func:`encode_network_policy` into a spec with only network fields.

    :raises ValueError: if ``value`` is not such a stamp.
    """
    try:
        data = json.loads(value)
        block = data["block_network"]
        hosts = data["allow_egress_to"]
        cidrs = data["allow_egress_to_cidrs"]
        if not isinstance(block, bool) or not isinstance(hosts, list) or not isinstance(cidrs, list):
            raise TypeError
        return SandboxSpec(block_network=block, allow_egress_to=hosts or None, allow_egress_to_cidrs=cidrs or None)
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"{value!r} is not a network policy stamp") from err


_HANDLE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def handle_is_plain_name(handle: str) -> bool:
    """True when ``handle`` is safe to use as one file or container name component."""
    return bool(_HANDLE_RE.fullmatch(handle)) and handle not in {".", ".."}


def is_named_sandbox(handle: str) -> bool:
    """True for a name :func:`new_sandbox_name` could have made: the prefix, then one plain name."""
    return isinstance(handle, str) and handle.startswith(SANDBOX_NAME_PREFIX) and handle_is_plain_name(handle)
