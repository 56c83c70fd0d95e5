"""
Plain functions behind :class:`~sandbox_provider.hooks.islo.IsloSandboxHook`: the SDK import, which
failures may be retried and how, and the translation of SDK errors into sandbox errors.

Every call here passes ``max_retries=0`` to the SDK and retries, if at all, itself: the SDK would
otherwise resend any request after a 5xx, 408, 409 or 429 answer or a dropped connection, a command
included (so a command whose response was lost would run twice).
"""

from __future__ import annotations

from typing import Any

from sandbox_provider.hooks.hosted.service import retry_after_seconds, status_error
from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError

__all__ = [
    "INSTALL_HINT",
    "NO_RETRIES",
    "error_message",
    "import_islo",
    "is_not_found",
    "retry_after",
    "status_of",
    "transient",
    "translate",
    "unsent",
]

INSTALL_HINT = "pip install -c requirements.lock '.[islo]' in a clone of airflow-provider-sandbox"
#: Request options that stop the SDK from resending anything.
NO_RETRIES: dict[str, Any] = {"max_retries": 0}


def import_islo() -> Any:
    """Return the ``islo`` module, or raise Airflow's optional-feature error with the install command."""
    try:
        import islo
        import islo.core.api_error  # noqa: F401
    except ImportError as err:
        from airflow.exceptions import AirflowOptionalProviderFeatureException

        raise AirflowOptionalProviderFeatureException(
            f"The Islo sandbox backend needs the islo SDK. Install it with: {INSTALL_HINT}"
        ) from err
    return islo


def status_of(err: BaseException) -> int | None:
    """The HTTP status an SDK error carries, or None for a failure without an answer."""
    status = getattr(err, "status_code", None)
    if status is None:
        response = getattr(err, "response", None)
        status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def is_not_found(err: BaseException) -> bool:
    return status_of(err) == 404


def unsent(err: BaseException) -> bool:
    """
    Whether ``err`` shows the request had no effect, so resending it cannot do anything twice: no
    connection was made, or the service refused it for the rate limit (429).
    """
    import httpx

    if isinstance(err, (httpx.ConnectError, httpx.ConnectTimeout)):
        return True
    return status_of(err) == 429


def transient(err: BaseException) -> bool:
    """Whether an idempotent request that failed with ``err`` is worth trying again."""
    import httpx

    if isinstance(err, httpx.TransportError):
        return True
    status = status_of(err)
    return status is not None and (status == 429 or status >= 500)


def retry_after(err: BaseException) -> float | None:
    """The pause, in seconds, the ``Retry-After`` header of an error's answer asks for; None without one."""
    return retry_after_seconds(getattr(err, "headers", None))


def error_message(err: BaseException) -> str:
    """What the service said, in one line: the ``message`` of its error body, else the error itself."""
    body = getattr(err, "body", None)
    message = body.get("message") if isinstance(body, dict) else getattr(body, "message", None)
    if message:
        return str(message)
    status = status_of(err)
    if status is not None:
        return f"HTTP {status}" + (f": {body}" if isinstance(body, str) and body.strip() else "")
    return f"{type(err).__name__}: {err}".rstrip(": ")


def translate(err: BaseException, doing: str, handle: str | None = None, *, maybe_ran: bool = False) -> SandboxError:
    """
    The sandbox error for an SDK failure while ``doing`` something (``"creating the sandbox"``).

    401/403 and a failed API-key exchange: the credentials. 402: billing. 404: the sandbox is gone.
    409: it is not running. 400/422: a request the caller can change. Anything else (no answer, 5xx,
    429 past the retries): the service failed; with ``maybe_ran``, the message says the request may
    have taken effect and was not sent again.
    """
    import httpx

    what = f"sandbox {handle}" if handle else "the sandbox"
    status = status_of(err)
    detail = error_message(err)
    exchange_failed = isinstance(err, httpx.HTTPStatusError) or (
        isinstance(err, KeyError) and "session_token" in str(err)
    )
    common = status_error("Islo", 401 if exchange_failed else status, doing=doing, what=what, detail=detail)
    if common is not None:
        return common
    if status == 409:
        return SandboxTerminalError(f"Islo cannot use {what} now ({detail}): it is not running.")
    if status in (400, 422):
        return SandboxError(f"Islo rejected {doing} ({detail}).")
    tail = " It may have run: it was not sent again, so check before repeating it." if maybe_ran else ""
    return SandboxTerminalError(f"Islo failed while {doing} ({detail}).{tail}")
