"""
Plain functions behind :class:`~sandbox_provider.hooks.boat.BoatSandboxHook`: the SDK import and
client, what a failure says about whether the request took effect, and the translation of SDK
errors into sandbox errors.

The client is built with urllib3's retries off (no connect, read, status or redirect retries, and
``Retry-After`` not obeyed), so one SDK call is one request: a command whose answer was lost is
never sent again by the transport, and no call sleeps past its own deadline.
"""

from __future__ import annotations

import json
from typing import Any

from sandbox_provider.hooks.hosted.service import retry_after_seconds, status_error
from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError

__all__ = [
    "DEFAULT_BASE_URL",
    "INSTALL_HINT",
    "error_code",
    "import_boat",
    "make_api",
    "retry_after",
    "status_of",
    "translate",
    "unsent",
]

INSTALL_HINT = "pip install -c requirements.lock '.[boat]' in a clone of airflow-provider-sandbox"
DEFAULT_BASE_URL = "https://boat.dev/api/v1"


def import_boat() -> Any:
    """Return the ``boat_sdk`` module, or raise Airflow's optional-feature error with the install command."""
    try:
        import boat_sdk
        import boat_sdk.exceptions  # noqa: F401
    except ImportError as err:
        from airflow.exceptions import AirflowOptionalProviderFeatureException

        raise AirflowOptionalProviderFeatureException(
            f"The Boat sandbox backend needs the boat-sdk package. Install it with: {INSTALL_HINT}"
        ) from err
    return boat_sdk


def make_api(base_url: str, api_key: str) -> Any:
    """A ``BoatApi`` for ``base_url`` sending ``api_key`` as a bearer token, one request per call."""
    boat_sdk = import_boat()
    import urllib3

    retries = urllib3.util.Retry(
        total=0, connect=0, read=0, redirect=0, status=0, other=0, respect_retry_after_header=False
    )
    config = boat_sdk.Configuration(host=base_url, access_token=api_key, retries=retries)
    return boat_sdk.BoatApi(boat_sdk.ApiClient(config))


def status_of(err: BaseException) -> int | None:
    """The HTTP status of an SDK error, or None for a failure without an answer."""
    from boat_sdk.exceptions import ApiException

    return err.status if isinstance(err, ApiException) and isinstance(err.status, int) else None


def error_code(err: BaseException) -> str | None:
    """The ``code`` of Boat's error envelope (``"invalid_path"``, ``"sandbox_not_ready"``), if any."""
    try:
        body = json.loads(getattr(err, "body", None) or "")
    except (TypeError, ValueError):
        return None
    if not isinstance(body, dict):
        return None
    code = body.get("code") or (body.get("error") or {}).get("code")
    return str(code) if code else None


def _message(err: BaseException) -> str:
    try:
        body = json.loads(getattr(err, "body", None) or "")
    except (TypeError, ValueError):
        body = None
    status = status_of(err)
    if isinstance(body, dict) and body.get("message"):
        return f"HTTP {status} {body.get('code') or ''}: {body['message']}".replace("  ", " ")
    if status is not None:
        return f"HTTP {status}"
    reason = getattr(err, "reason", None)
    return f"{type(err).__name__}: {reason or err}"


def retry_after(err: BaseException) -> float | None:
    """The pause, in seconds, the ``Retry-After`` header of an error's answer asks for."""
    return retry_after_seconds(getattr(err, "headers", None))


def unsent(err: BaseException) -> bool:
    """Whether ``err`` shows the request never reached Boat: the connection could not be made."""
    from urllib3.exceptions import ConnectTimeoutError, MaxRetryError

    reason = err.reason if isinstance(err, MaxRetryError) else err
    return isinstance(reason, ConnectTimeoutError)


def translate(err: BaseException, doing: str, handle: str | None = None, *, maybe_ran: bool = False) -> SandboxError:
    """
    The sandbox error for an SDK failure while ``doing`` something (``"running a command"``).

    401/403: the credentials. 402: billing. 404: the sandbox is gone. 400, 413 and 429: a request
    the caller can change or repeat later. 409: the sandbox is not running. No answer, or 5xx: the
    service failed; with ``maybe_ran``, the message says the request may have taken effect and was
    not sent again.
    """
    what = f"sandbox {handle}" if handle else "the sandbox"
    status = status_of(err)
    detail = _message(err)
    common = status_error("Boat", status, doing=doing, what=what, detail=detail)
    if common is not None:
        return common
    if status == 409:
        return SandboxTerminalError(
            f"Boat cannot use {what} now ({detail}): it is not running. Provision a new sandbox."
        )
    if status == 413:
        return SandboxError(f"Boat refused {doing} as too large ({detail}); send less at once.")
    if status == 429:
        wait = retry_after(err)
        when = f"after {wait:g} s" if wait is not None else "later"
        return SandboxError(f"Boat is rate limiting requests ({detail}) while {doing}; try again {when}.")
    if status == 400:
        return SandboxError(f"Boat rejected {doing} ({detail}).")
    if status is None and unsent(err):
        return SandboxTerminalError(f"Could not reach Boat while {doing} ({detail}); check the base URL.")
    tail = " It may have run: it was not sent again, so check before repeating it." if maybe_ran else ""
    return SandboxTerminalError(f"Boat failed while {doing} ({detail}).{tail}")
