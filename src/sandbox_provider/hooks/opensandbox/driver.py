"""
Plain functions behind :class:`~sandbox_provider.hooks.opensandbox.OpenSandboxHook`: the ``opensandbox``
SDK's configuration, the sandbox's access token, the stamps as server metadata, the egress policy and its
readback, the daemon's output events and files, error and exit-status translation. The SDK is imported
inside the functions that use it.
"""

from __future__ import annotations

import base64
import ipaddress
import posixpath
import re
import secrets
import signal
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError
from sandbox_provider.sandbox.spec import SandboxSpec

INSTALL_HINT = "pip install -c requirements.lock '.[opensandbox]' in a clone of airflow-provider-sandbox"
#: The port of the in-sandbox daemon (execd) and of the egress sidecar's API.
EXECD_PORT, EGRESS_PORT = 44772, 18080
#: The only enforcement mode in which the egress sidecar drops what its policy does not allow.
ENFORCING_MODE = "dns+nft"
#: Metadata key holding the sandbox's provider name (``airflow-sandbox-<hex>``), a valid label value.
NAME_KEY = "airflow_sandbox"
#: A label value holds at most 63 characters.
_LABEL_CHARS = 63
#: execd takes its access token from this variable of its environment and wants it back in this header
#: on every request; the hook keeps each sandbox's token in its metadata under ``TOKEN_KEY``.
TOKEN_ENV, TOKEN_HEADER, TOKEN_KEY = "EXECD_ACCESS_TOKEN", "X-EXECD-ACCESS-TOKEN", "airflow_execd_token"
#: Where execd spools a command's output (``/tmp/<execution id>.stdout`` and ``.stderr``).
SPOOL_DIR = "/tmp"
#: Seconds by which execd's clock may put a timeout's error before the deadline (the command starts a
#: little after the ``init`` event's stamp is taken, or before).
TIMER_SLACK = 0.25
_EXECUTION_ID = re.compile(r"[A-Za-z0-9-]{1,64}")


def import_sdk() -> Any:
    """Return the ``opensandbox`` module, or raise Airflow's optional-feature error with the install command."""
    try:
        import opensandbox
        import opensandbox.exceptions
    except ImportError as err:
        from airflow.exceptions import AirflowOptionalProviderFeatureException

        raise AirflowOptionalProviderFeatureException(
            f"The OpenSandbox backend needs the opensandbox SDK. Install it with: {INSTALL_HINT}"
        ) from err
    return opensandbox


def connection_config(
    settings: Mapping[str, Any], transport: Any = None, token: str | None = None, *, deadline: float | None = None
) -> Any:
    """
    A new ``ConnectionConfigSync`` from resolved settings (``domain`` None: the SDK reads
    ``OPEN_SANDBOX_DOMAIN`` and ``OPEN_SANDBOX_API_KEY``). A new one per sandbox object, since the SDK
    closes the transport it made when that sandbox is closed. ``token``, a sandbox's access token,
    rides in execd's header on every request: the SDK adds the config's headers to each one.
    ``deadline``: seconds each request may take, its retries included (a connection test's patience);
    None leaves the SDK's own retries as they are.
    """
    import_sdk()
    from opensandbox.config import ConnectionConfigSync

    options: dict[str, Any] = {
        "request_timeout": timedelta(seconds=float(settings["request_timeout"])),
        "use_server_proxy": bool(settings["use_server_proxy"]),
    }
    if deadline is not None:
        from opensandbox.transport.retry import RetryPolicy

        options["request_timeout"] = min(options["request_timeout"], timedelta(seconds=deadline))
        options["retry_policy"] = RetryPolicy(overall_deadline=timedelta(seconds=deadline))
    for name in ("domain", "api_key", "protocol"):
        if settings.get(name):
            options[name] = settings[name]
    if transport is not None:
        options["transport"] = transport
    if token:
        options["headers"] = {TOKEN_HEADER: token}
    return ConnectionConfigSync(**options)


def new_token() -> str:
    """A fresh access token for one sandbox: 48 hex digits, a valid label value."""
    return secrets.token_hex(24)


def token_of(metadata: Mapping[str, str] | None) -> str | None:
    """The access token kept in a sandbox's metadata, or None for a sandbox made without one."""
    token = (metadata or {}).get(TOKEN_KEY)
    return token if isinstance(token, str) and token else None


# -- stamps as metadata ----------------------------------------------------------------------------------
# Server metadata follows Kubernetes label rules (values of at most 63 characters from [A-Za-z0-9-_.]), so
# each stamp is base32 (letters and digits only) cut into 63-character pieces: "<stamp>.0", "<stamp>.1"...


def encode_stamps(stamps: Mapping[str, str]) -> dict[str, str]:
    """The metadata that carries ``stamps``; every key and value is a valid label."""
    metadata: dict[str, str] = {}
    for key, value in stamps.items():
        text = base64.b32encode(value.encode()).decode().rstrip("=")
        pieces = [text[i : i + _LABEL_CHARS] for i in range(0, len(text), _LABEL_CHARS)] or [""]
        for index, piece in enumerate(pieces):
            metadata[f"{key}.{index}"] = piece
    return metadata


def decode_stamps(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """The stamps held in ``metadata``; keys that are not stamp pieces are ignored, unreadable ones dropped."""
    groups: dict[str, dict[int, str]] = {}
    for key, value in (metadata or {}).items():
        stamp, dot, index = key.rpartition(".")
        if dot and stamp.startswith("airflow_") and index.isdigit():
            groups.setdefault(stamp, {})[int(index)] = value or ""
    stamps: dict[str, str] = {}
    for stamp, pieces in groups.items():
        if sorted(pieces) != list(range(len(pieces))):
            continue
        text = "".join(pieces[i] for i in range(len(pieces)))
        try:
            stamps[stamp] = base64.b32decode(text + "=" * (-len(text) % 8)).decode()
        except (ValueError, UnicodeDecodeError):
            continue
    return stamps


def stamps_patch(current: Mapping[str, str] | None, stamps: Mapping[str, str]) -> dict[str, str | None]:
    """A JSON merge patch turning the stamp pieces in ``current`` into those of ``stamps``."""
    wanted = encode_stamps(stamps)
    patch: dict[str, str | None] = {k: v for k, v in wanted.items() if (current or {}).get(k) != v}
    for key in current or {}:
        stamp, dot, index = key.rpartition(".")
        if dot and stamp.startswith("airflow_") and index.isdigit() and key not in wanted:
            patch[key] = None
    return patch


# -- network ---------------------------------------------------------------------------------------------


def network_policy(spec: SandboxSpec) -> Any:
    """The egress policy for ``spec``: None for an open network, else deny by default plus allow rules."""
    if not spec.block_network:
        return None
    from opensandbox.models.sandboxes import NetworkPolicy, NetworkRule

    targets = [*(spec.allow_egress_to or ()), *(spec.allow_egress_to_cidrs or ())]
    return NetworkPolicy.model_validate(
        {"defaultAction": "deny", "egress": [NetworkRule(action="allow", target=t) for t in targets]}
    )


_HOST_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")


def is_hostname(text: str) -> bool:
    """A bare DNS name (``pypi.org``) or a wildcard one (``*.example.com``), no address, port or scheme."""
    host = text.strip().lower().rstrip(".")
    labels = host[2:].split(".") if host.startswith("*.") else host.split(".")
    if is_network(host) or len(labels) < 2:
        return False
    return all(_HOST_LABEL.fullmatch(label) for label in labels)


def is_network(text: str) -> bool:
    """An IPv4 or IPv6 address or range without host bits set (``203.0.113.0/24``)."""
    try:
        ipaddress.ip_network(text.strip(), strict=True)
    except ValueError:
        return False
    return True


def policy_readback(sandbox: Any, config: Any) -> tuple[str | None, str | None, set[str]]:
    """
    Ask the sandbox's egress sidecar what it enforces: ``(enforcement mode, default action, allowed
    targets)``. The SDK's own ``get_egress_policy`` drops the mode, so this reads ``GET /policy`` with
    the SDK's generated egress client, at the endpoint the server publishes for the sidecar.
    """
    import httpx
    from opensandbox.api.egress import Client
    from opensandbox.api.egress.api.policy import get_policy
    from opensandbox.api.egress.types import Unset

    endpoint = sandbox.get_endpoint(EGRESS_PORT)
    client = Client(
        base_url=f"{config.protocol}://{endpoint.endpoint}",
        headers=endpoint.build_request_headers(config),
        timeout=httpx.Timeout(config.request_timeout.total_seconds()),
        httpx_args={"transport": config.transport} if config.transport is not None else {},
    )
    with client:
        response = get_policy.sync_detailed(client=client)
    parsed = response.parsed
    if response.status_code != 200 or parsed is None or isinstance(parsed, str):
        return None, None, set()

    def value(item: Any) -> str | None:
        if item is None or isinstance(item, Unset):
            return None
        return str(getattr(item, "value", item))

    policy = None if isinstance(parsed.policy, Unset) else parsed.policy
    default = value(getattr(policy, "default_action", None)) if policy is not None else None
    rules = getattr(policy, "egress", None) if policy is not None else None
    allowed = {str(rule.target) for rule in rules or [] if value(rule.action) == "allow"}
    return value(parsed.enforcement_mode), default, allowed


def network_refusal(mode: str | None, default: str | None, allowed: set[str], spec: SandboxSpec) -> str | None:
    """What the server's operator must change when the readback does not prove ``spec``; None when it does."""
    wanted = set(spec.allow_egress_to or ()) | set(spec.allow_egress_to_cidrs or ())
    if mode == ENFORCING_MODE and default == "deny" and allowed == wanted:
        return None
    found = f"enforcement mode {mode!r}" if mode else "no enforcement mode"
    if mode == ENFORCING_MODE:
        found = f"default action {default!r} and allow rules {sorted(allowed)!r}"
    return (
        f"The OpenSandbox server's egress sidecar reports {found}, so it cannot be shown to block what this "
        f"SandboxSpec blocks (in 'dns' mode, traffic to IP addresses bypasses the policy); the sandbox was "
        f'destroyed. The server\'s operator must set [egress] mode = "{ENFORCING_MODE}" in its configuration, '
        "or pass SandboxSpec(block_network=False) to accept an open network."
    )


# -- output ------------------------------------------------------------------------------------------------


def line_text(text: str) -> str:
    """
    The output one execd line event stands for. execd sends each line without what ended it (a
    ``\\n``, ``\\r`` or ``\\r\\n``, or nothing for a last line) and an empty line as ``"\\n"``; a line
    is passed on ended by a newline.
    """
    return text if text == "\n" else text + "\n"


def spool_paths(execution_id: str | None) -> dict[str, str]:
    """``{"stdout": path, "stderr": path}`` of the files execd spooled a command's output to; empty for an odd id."""
    if not execution_id or not _EXECUTION_ID.fullmatch(execution_id):
        return {}
    return {stream: f"{SPOOL_DIR}/{execution_id}.{stream}" for stream in ("stdout", "stderr")}


def tail_range(size: int, keep: int) -> tuple[int, str]:
    """
    ``(bytes, Range header)`` for the end of a ``size``-byte file when ``keep`` bytes are kept: one byte
    more than that when the file is longer, so the byte before the kept tail says whether it starts a line.
    """
    take = min(size, keep + 1)
    return take, f"bytes={size - take}-{size - 1}"


# -- errors and exit statuses ----------------------------------------------------------------------------


def status_of(err: BaseException) -> int | None:
    return getattr(err, "status_code", None)


def api_error(err: BaseException, doing: str, where: str, handle: str | None = None) -> SandboxError:
    """The contract's error for an SDK exception raised while ``doing`` something at ``where``."""
    from opensandbox.exceptions import SandboxApiException, SandboxConnectionException, SandboxException

    status = status_of(err)
    detail = str(err).split(" | ")[0]
    if status == 404 and handle:
        return SandboxTerminalError(
            f"Sandbox {handle!r} does not exist on {where}: it was destroyed, or reached the end of its lifetime."
        )
    if status in (401, 403):
        return SandboxTerminalError(
            f"{where} refused the API key while {doing} (HTTP {status}). Put the server's API key in the "
            "connection's password, or in OPEN_SANDBOX_API_KEY when no connection is used."
        )
    if isinstance(err, SandboxConnectionException) or not isinstance(err, SandboxException):
        return SandboxTerminalError(
            f"Cannot reach {where} while {doing}: {detail}. Check the connection's host and port."
        )
    if isinstance(err, SandboxApiException) and status is not None and status < 500:
        return SandboxError(f"{where} refused {doing} (HTTP {status}): {detail}")
    return SandboxTerminalError(f"{where} failed while {doing}: {detail}")


def signal_status(traceback: list[str]) -> int | None:
    """``128 + n`` for execd's ``signal: <name>`` traceback of a process killed by signal n, else None."""
    text = " ".join(traceback or []).lower()
    if "signal:" not in text:
        return None
    name = text.split("signal:", 1)[1].strip()
    for sig in signal.Signals:
        try:
            described = (signal.strsignal(sig) or "").lower()
        except ValueError:
            continue
        if described and name.startswith(described):
            return 128 + int(sig)
    return None


def exit_status(
    execution: Any, elapsed: float, applied: float, began_ms: int | None = None
) -> tuple[int | None, bool, str]:
    """
    ``(exit code, timed out, note)`` for a finished execution. execd reports both a timeout and a death
    by signal as ``-1``: a -1 at or past the applied deadline is the timeout, any earlier one a signal,
    given as ``128 + signal`` as a shell would. None means the stream ended without an outcome.

    :param elapsed: seconds the call took on the worker, execd's wait after the command included.
    :param began_ms: the ``init`` event's timestamp. With it, a -1 is the timeout only if execd's own
        clock also puts the error at the deadline (within ``TIMER_SLACK``): the wait after a command
        (about a second on the vendor's daemon) makes an earlier death by signal look late on the worker.
    """
    error = execution.error
    if error is None:
        return (0, False, "") if execution.complete is not None else (None, False, "")
    try:
        code = int(error.value)
    except (TypeError, ValueError):
        return 1, False, "; ".join(error.traceback or [str(error.value)])
    if code != -1:
        return code, False, ""
    inside = None
    if began_ms is not None and getattr(error, "timestamp", None):
        inside = (int(error.timestamp) - int(began_ms)) / 1000
    if elapsed >= applied and (inside is None or inside >= applied - TIMER_SLACK):
        return -1, True, ""
    status = signal_status(error.traceback)
    return (status if status is not None else -1), False, "; ".join(error.traceback or [])


def sandbox_path(workdir: str, path: str) -> str:
    """``path`` as an absolute path in the sandbox: relative ones resolve in ``workdir``."""
    return posixpath.normpath(path if path.startswith("/") else posixpath.join(workdir, path))
