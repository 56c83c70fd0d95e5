"""
Plumbing the backends with a connection of their own share: checking the connection id, reading the
connection and resolving settings over its extras; and what the hosted-service backends (Islo, Boat)
share: a retry loop that never outlasts its deadline (tenacity's), ``Retry-After`` parsing, the errors an answer's
status means, and the check of a service URL before an API key is sent to it.
"""

from __future__ import annotations

import email.utils
import ipaddress
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import tenacity

from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError

__all__ = [
    "FIRST_PAUSE",
    "LONGEST_PAUSE",
    "ServiceConnection",
    "abandon_runaway",
    "call",
    "check_conn_id",
    "check_service_url",
    "discard",
    "load_connection",
    "resolve_settings",
    "retry_after_seconds",
    "status_error",
]

T = TypeVar("T")

#: First and longest pause between two attempts of a call, in seconds.
FIRST_PAUSE, LONGEST_PAUSE = 0.5, 8.0


def retry_after_seconds(headers: Mapping[str, Any] | None) -> float | None:
    """The pause, in seconds, a ``Retry-After`` header (seconds or an HTTP date) asks for; None without one."""
    value = next((v for k, v in dict(headers or {}).items() if str(k).lower() == "retry-after"), None)
    if value is None:
        return None
    text = str(value).strip()
    if text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def call(
    fn: Callable[[], T],
    *,
    until: float,
    retry: Callable[[BaseException], bool],
    retry_after: Callable[[BaseException], float | None],
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    attempts: int | None = None,
) -> T:
    """
    Call ``fn`` until it returns, retrying the failures ``retry`` accepts while ``clock()`` stays
    before ``until`` (and at most ``attempts`` calls in all, when given). Pauses grow from 0.5 s to
    8 s, or last what ``retry_after(err)`` asks, and a pause that would end past ``until`` is not taken.

    The loop is tenacity's; the deadline and ``Retry-After`` are its stop and wait.

    :raises: the last failure, when it may not be retried or time or attempts ran out.
    """

    def pause(state: tenacity.RetryCallState) -> float:
        backoff = min(FIRST_PAUSE * 2 ** (state.attempt_number - 1), LONGEST_PAUSE)
        failure = state.outcome.exception() if state.outcome is not None else None
        return max(backoff, (retry_after(failure) if failure is not None else None) or 0.0)

    def stop(state: tenacity.RetryCallState) -> bool:
        spent = attempts is not None and state.attempt_number >= attempts
        return spent or clock() + pause(state) >= until

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(lambda err: isinstance(err, Exception) and retry(err)),
        stop=stop,
        wait=pause,
        sleep=sleep,
        reraise=True,
    )
    return retrying(fn)


def check_service_url(url: str, what: str) -> str:
    """
    Return ``url`` without a trailing slash if an API key may be sent to it: ``https://``, or
    ``http://`` to a loopback address (a local test server).

    :raises ValueError: naming ``what`` (the setting) and what to give instead.
    """
    parts = urlsplit(str(url).strip())
    host = parts.hostname or ""
    loopback = host == "localhost"
    try:
        loopback = loopback or ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not host or parts.scheme not in ("https", "http") or (parts.scheme == "http" and not loopback):
        raise ValueError(
            f"{what} must be an https:// URL such as 'https://api.example.com' (plain http:// only to a loopback "
            f"address), got {url!r}: the API key would travel unencrypted or to nowhere."
        )
    return str(url).strip().rstrip("/")


def check_conn_id(conn_id: Any, name: str) -> str:
    """:raises ValueError: unless ``conn_id`` (the hook argument ``name``) is a connection id."""
    if not isinstance(conn_id, str) or not conn_id.strip():
        raise ValueError(f"{name} must be a connection id, got {conn_id!r}.")
    return conn_id


def resolve_settings(table: Any, args: Mapping[str, Any], extra: Mapping[str, Any], conn_id: str) -> dict[str, Any]:
    """``table.resolve`` of hook ``args`` over the connection's ``extra``; a bad extra is a terminal error naming it."""
    try:
        return table.resolve(args, extra, conn_id=conn_id)
    except ValueError as err:
        raise SandboxTerminalError(f"{err} Fix the extra or pass the setting to the hook.") from None


@dataclass(frozen=True)
class ServiceConnection:
    """
    What a hosted backend reads from its Airflow connection.

    :param conn_id: the connection's id.
    :param host: the service URL it names (``https://`` added when it has no scheme), or None.
    :param password: the API key, or None.
    :param extra: its extras.
    """

    conn_id: str
    host: str | None = None
    password: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def resolve(self, table: Any, args: Mapping[str, Any]) -> dict[str, Any]:
        """``table.resolve`` over this connection's extras; a bad extra is a terminal error naming it."""
        return resolve_settings(table, args, self.extra, self.conn_id)


def load_connection(hook: Any, conn_id: str, *, fallback: str) -> ServiceConnection:
    """
    Read ``hook``'s connection ``conn_id``. The hook's default connection may be missing (then the
    result is empty and the SDK's environment variables apply); another missing one is an error.

    :param fallback: what applies without a connection, for the message (``"ISLO_API_KEY"``).
    :raises SandboxTerminalError: for a named connection that does not exist.
    """
    conn = hook.connection_or_none(otherwise=f"{fallback} on the worker")
    if conn is None:
        return ServiceConnection(conn_id)
    host = (conn.host or "").strip() or None
    if host and "://" not in host:
        host = "https://" + host
    return ServiceConnection(conn_id, host, conn.password or None, dict(conn.extra_dejson or {}))


def status_error(service: str, status: int | None, *, doing: str, what: str, detail: str) -> SandboxError | None:
    """
    The error a hosted service's answer ``status`` means for every such backend, or None for one
    whose meaning is the backend's own: 401/403 the credentials (the connection's password, or
    ``<SERVICE>_API_KEY``), 402 billing, 404 the sandbox (``what``) is gone.
    """
    if status in (401, 403):
        return SandboxTerminalError(
            f"{service} refused the credentials while {doing} ({detail}). Check the API key: the password of the "
            f"connection, or {service.upper()}_API_KEY."
        )
    if status == 402:
        return SandboxTerminalError(f"{service} refused {doing} for billing reasons ({detail}); check the account.")
    if status == 404:
        return SandboxTerminalError(
            f"{service} has no {what} any more ({detail}): it was deleted, or its lifetime (sandbox_timeout) ended. "
            "Provision a new sandbox."
        )
    return None


def abandon_runaway(destroy: Callable[[str], None], handle: str, output: Any, timeout: float, *, ends: str) -> Any:
    """
    A command outlived its deadline and the kill inside the sandbox: delete the sandbox to stop it,
    tell the command's stderr (``output``, an ``OutputSink``), and return the outcome that says so.

    :param ends: how the service ends the sandbox by itself, for the message when the delete fails
        (``"Islo deletes it at the end of its lifetime"``).
    :raises SandboxTerminalError: when the sandbox could not be deleted.
    """
    from sandbox_provider.sandbox.hook import RunOutcome

    try:
        destroy(handle)
    except SandboxError as err:
        raise SandboxTerminalError(
            f"A command in sandbox {handle} outlived its {timeout:g} s deadline, and the sandbox could not be deleted "
            f"to stop it ({err}); {ends}."
        ) from err
    output.stderr(
        f"\nThe command outlived its {timeout:g} s deadline and the kill inside the sandbox, so sandbox {handle} was "
        "deleted to stop it.\n"
    )
    return RunOutcome(exit_code=-1, timed_out=True, sandbox_terminated=True)


def discard(destroy: Callable[[str], None], handle: str, logger: Any) -> None:
    """Delete a sandbox whose provisioning failed; a failure here is logged, since the first one is reported."""
    try:
        destroy(handle)
    except Exception:  # the failure being reported matters more
        logger.warning("Could not delete sandbox %s after a failed create", handle, exc_info=True)
