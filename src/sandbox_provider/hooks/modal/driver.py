"""
Plain functions behind ``ModalSandboxHook``: importing the SDK, checking arguments, mapping the
spec's egress fields to Modal's allowlists, whole-second deadlines, sorting out how a command or a
file copy ended, and mapping SDK errors to the contract's errors.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, TypeVar

from sandbox_provider.sandbox import guest
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError
from sandbox_provider.sandbox.files import file_status_error, reported_size
from sandbox_provider.sandbox.network import NetworkReach
from sandbox_provider.sandbox.spec import SandboxSpec, hostname_allowlist

INSTALL_HINT = "pip install -c requirements.lock '.[modal]' in a clone of airflow-provider-sandbox"
#: Longest pause between two attempts of a call that hit a transient API error, in seconds.
MAX_BACKOFF = 8.0
EGRESS_ENFORCEMENTS = ("strict", "sni")

log = logging.getLogger(__name__)
T = TypeVar("T")


def import_modal() -> Any:
    """Return the ``modal`` module, or raise Airflow's optional-feature error with the install command."""
    try:
        import modal
        import modal.exception
    except ImportError as err:
        from airflow.exceptions import AirflowOptionalProviderFeatureException

        raise AirflowOptionalProviderFeatureException(
            f"The Modal sandbox backend needs the modal SDK and the Modal provider. Install them with: {INSTALL_HINT}"
        ) from err
    return modal


def modal_hook_class() -> type:
    """The ``ModalHook`` of apache-airflow-providers-modal, which holds the credentials."""
    import_modal()
    try:
        from airflow.providers.modal.hooks.modal import ModalHook
    except ImportError as err:
        from airflow.exceptions import AirflowOptionalProviderFeatureException

        raise AirflowOptionalProviderFeatureException(
            f"The Modal sandbox backend reads credentials through apache-airflow-providers-modal, which is not "
            f"installed. Install it with: {INSTALL_HINT}"
        ) from err
    return ModalHook


#: What each network mode lets through on Modal, for an agent's tool description.
NETWORK_REACH = NetworkReach(
    blocked="has no network access at all, not even DNS",
    open=(
        "has outbound network access on any port, DNS included, except to Modal's metadata endpoint and "
        "private address ranges"
    ),
    hosts=(
        "only HTTPS (TLS) on port 443 reaches them, matched by the server name in the TLS handshake, so plain "
        "HTTP and every other port fail or hang; DNS answers for every name, and a site served from the same "
        "TLS endpoint as a listed host can be reached too"
    ),
    cidrs=(
        "any port and protocol reaches addresses in them; DNS answers for every name, but only addresses in "
        "these ranges can be reached"
    ),
    both="Port 443 also reaches any address whose TLS server name is one of the listed hosts.",
)

# Address ranges a sandbox can never reach through Modal's address allowlist, or must not try to:
# private networks, loopback, link-local (cloud metadata), shared address space, multicast, reserved.
_UNREACHABLE_V4 = tuple(
    ipaddress.IPv4Network(net)
    for net in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.168.0.0/16",
        "198.18.0.0/15",
        "224.0.0.0/4",
        "240.0.0.0/4",
    )
)


# -- validation ------------------------------------------------------------------------------------


def whole_seconds(value: Any, name: str, *, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a whole number of seconds, got {value!r}.")
    if value != int(value) or not low <= value <= high:
        raise ValueError(f"{name} must be a whole number of seconds from {low} to {high}, got {value!r}.")
    return int(value)


def check_image(image: Any) -> Any:
    if isinstance(image, str):
        if not image.strip() or any(ch.isspace() for ch in image):
            raise ValueError(f"image must be a registry tag such as 'python:3.12-slim', got {image!r}.")
        return image
    modal = sys.modules.get("modal")
    image_type = getattr(modal, "Image", None) if modal is not None else None
    if isinstance(image_type, type) and isinstance(image, image_type):
        return image
    raise ValueError(
        f"image must be a registry tag (a string) or a modal.Image, got {type(image).__name__}. Build one with "
        "modal.Image.from_registry('python:3.12-slim').pip_install(...)."
    )


def check_optional_text(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a non-empty string or None, got {value!r}.")
    return value


def check_region(region: Any) -> str | tuple[str, ...] | None:
    if region is None or isinstance(region, str):
        return check_optional_text(region, "region")
    if isinstance(region, Sequence) and region and all(isinstance(r, str) and r.strip() for r in region):
        return tuple(region)
    raise ValueError(f"region must be a region name, a non-empty list of them, or None, got {region!r}.")


def check_user_tags(tags: Any) -> dict[str, str]:
    if tags is None:
        return {}
    if not isinstance(tags, Mapping):
        raise ValueError(f"tags must map strings to strings, got {type(tags).__name__}.")
    bad = sorted(str(k) for k, v in tags.items() if not isinstance(k, str) or not k or not isinstance(v, str))
    if bad:
        raise ValueError(f"tags must map non-empty strings to strings; these entries do not: {bad!r}.")
    reserved = sorted(k for k in tags if k.startswith("airflow_"))
    if reserved:
        raise ValueError(
            f"tags may not use the airflow_ prefix, which this backend keeps for its own stamps: {reserved!r}. "
            "Rename them, e.g. 'dag_id' instead of 'airflow_dag_id'."
        )
    return dict(tags)


def check_conn_id(conn_id: Any) -> str | None:
    if conn_id is not None and (not isinstance(conn_id, str) or not conn_id.strip()):
        raise ValueError(f"modal_conn_id must be a connection id or None, got {conn_id!r}.")
    return conn_id


def check_app_name(app_name: Any) -> str:
    if not isinstance(app_name, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", app_name):
        raise ValueError(f"app_name must be 1 to 64 letters, digits, '.', '_' or '-', got {app_name!r}.")
    return app_name


def check_flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}.")
    return value


def check_memory(memory: Any) -> int | None:
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0):
        raise ValueError(f"memory must be a positive whole number of MiB, got {memory!r}.")
    return memory


def check_egress_enforcement(value: Any) -> str:
    if value not in EGRESS_ENFORCEMENTS:
        raise ValueError(
            f"egress_enforcement must be 'strict' or 'sni', got {value!r}. 'sni' accepts "
            "hostname allowlists that Modal checks only against the TLS server name."
        )
    return value


def network_kwargs(spec: SandboxSpec, egress_enforcement: str) -> dict[str, Any]:
    """Return the network keywords for ``Sandbox.create``, or refuse what Modal cannot enforce."""
    if not spec.block_network:
        return {}
    if not spec.has_allowlist:
        return {"block_network": True}
    kwargs: dict[str, Any] = {}
    if spec.allow_egress_to:
        if egress_enforcement != "sni":
            raise SandboxTerminalError(
                "SandboxSpec.allow_egress_to names hostnames, and Modal can enforce a hostname list only by "
                "matching the server name in the TLS handshake: TLS on port 443 reaches the listed hosts, but "
                "DNS stays open for every name and any host behind the same TLS endpoint as a listed one is "
                "reachable too. To accept that, pass ModalSandboxHook(egress_enforcement='sni'). Otherwise use "
                "allow_egress_to_cidrs for destinations with fixed addresses (enforced per address), or a "
                "bare SandboxSpec() with no allowlist, which blocks everything including DNS."
            )
        kwargs["outbound_domain_allowlist"] = domain_allowlist(spec.allow_egress_to)
    if spec.allow_egress_to_cidrs:
        kwargs["outbound_cidr_allowlist"] = cidr_allowlist(spec.allow_egress_to_cidrs)
    if "outbound_domain_allowlist" in kwargs and "outbound_cidr_allowlist" in kwargs:
        log.warning(
            "Both allowlists are set: port 443 is open to any address whose TLS server name is on the "
            "hostname list, in addition to the listed address ranges."
        )
    return kwargs


def present(**options: Any) -> dict[str, Any]:
    """The ``options`` that are set (not None), for SDK keywords that must be left out when unset."""
    return {key: value for key, value in options.items() if value is not None}


def deadline_seconds(timeout: float, remaining: float | None, handle: str) -> tuple[int, bool]:
    """
    Return the whole seconds to give a command (Modal reads 0 as "no deadline") and whether they were
    cut to the ``remaining`` lifetime (None: unknown).

    :raises SandboxTerminalError: when less than a second of the lifetime is left.
    """
    seconds = max(1, math.ceil(timeout))
    if remaining is None:
        return seconds, False
    if remaining < 1:
        raise SandboxTerminalError(
            f"Sandbox {handle!r} has reached the end of its lifetime (sandbox_timeout); Modal has ended it "
            "or is about to. Provision a new sandbox, with a longer sandbox_timeout if the work needs it."
        )
    if seconds >= math.floor(remaining):  # the deadline reaches the end of the sandbox's life
        return max(1, math.floor(remaining)), True
    return seconds, False


def classify_run(
    died: BaseException | None,
    exit_code: int,
    *,
    elapsed: float,
    seconds: int,
    ended: Callable[[], bool],
    translate: Callable[[BaseException], SandboxError],
) -> tuple[bool, bool]:
    """
    How a command ended, as ``(timed_out, terminated)``, from the error that stopped waiting or
    reading (None if none did), its status and the seconds it ran. For an SDK error that says
    neither, ``ended()`` tells whether the sandbox ended; if not, ``translate(error)`` is raised.
    """
    exc = sys.modules["modal"].exception
    if died is None:
        # Modal reports a command killed at its deadline as -1, or as SIGKILL once the deadline passed.
        return exit_code == -1 or (exit_code == 137 and elapsed >= seconds), False
    if isinstance(died, exc.ExecTimeoutError):
        return True, False
    if isinstance(died, (exc.SandboxTerminatedError, exc.SandboxTimeoutError, exc.NotFoundError)):
        return False, True
    if isinstance(died, exc.Error):
        if ended():
            return False, True
        raise translate(died) from died
    raise died


def file_copy_error(
    code: int,
    stderr: str,
    *,
    handle: str,
    path: str,
    verb: str,
    seconds: int,
    max_bytes: int,
    ended: Callable[[], bool],
) -> SandboxError | None:
    """
    The error for a ``file.sh`` copy that ended with status ``code`` and ``stderr``, None for
    success; ``ended()`` tells whether a failure was the sandbox ending (then terminal).
    """
    size = reported_size(stderr)
    if code == guest.TOO_LARGE_STATUS:
        return SandboxFileTooLargeError(path, size or max_bytes + 1, max_bytes)
    known = file_status_error(code, path)
    if known is not None:
        return known
    if code == -1:
        return SandboxError(f"Timed out after {seconds}s while {verb} {path!r}.")
    if code != 0:
        if ended():
            return SandboxTerminalError(f"Sandbox {handle!r} ended while {verb} {path!r}.")
        detail = stderr.strip().splitlines()[-1:] or [f"exit status {code}"]
        return SandboxError(f"Could not finish {verb} {path!r}: {detail[0]}")
    if size is None:
        return SandboxError(f"The sandbox did not report the size of {path!r}.")
    return None


def spool(source: IO[bytes], target: IO[bytes], chunk_bytes: int) -> int:
    """Copy ``source`` into the local file ``target`` in pieces of ``chunk_bytes`` (text as UTF-8); return the bytes."""
    total = 0
    while chunk := source.read(chunk_bytes):
        if isinstance(chunk, str):
            chunk = chunk.encode()
        target.write(chunk)
        total += len(chunk)
    target.flush()
    return total


def listing(entries: Any) -> list[tuple[str, bool]]:
    """Modal's directory entries as sorted ``(name, is_directory)`` pairs; a symbolic link is not a directory."""
    return sorted((entry.name, getattr(entry.type, "value", entry.type) == "directory") for entry in entries)


def cidr_allowlist(entries: Sequence[str]) -> list[str]:
    """Return Modal's form of a CIDR allowlist, or refuse an entry it cannot or should not enforce."""
    allowed: list[str] = []
    for entry in entries:
        text = entry.strip()
        try:
            net = ipaddress.ip_network(text, strict=True)
        except ValueError:
            try:
                ipaddress.ip_network(text, strict=False)
            except ValueError:
                raise SandboxTerminalError(
                    f"allow_egress_to_cidrs entry {entry!r} is not an IPv4 address range. Write it as "
                    "'203.0.113.0/24' or a single address; put hostnames in allow_egress_to."
                ) from None
            raise SandboxTerminalError(
                f"allow_egress_to_cidrs entry {entry!r} has host bits set, so it is unclear which range is meant. "
                f"Write the network address, e.g. {str(ipaddress.ip_network(text, strict=False))!r}, or a "
                "single address with /32."
            ) from None
        if net.version != 4:
            raise SandboxTerminalError(
                f"allow_egress_to_cidrs entry {entry!r} is IPv6; Modal's address allowlist takes IPv4 ranges "
                "only. List the destination's IPv4 range instead."
            )
        if net.prefixlen == 0:
            raise SandboxTerminalError(
                f"allow_egress_to_cidrs entry {entry!r} matches every address, which is no allowlist at all. "
                "Pass SandboxSpec(block_network=False) to open outbound access, or list narrower ranges."
            )
        clash = next((blocked for blocked in _UNREACHABLE_V4 if net.overlaps(blocked)), None)
        if clash is not None:
            raise SandboxTerminalError(
                f"allow_egress_to_cidrs entry {entry!r} overlaps {clash}, a private, loopback, link-local or "
                "reserved range that a Modal sandbox cannot reach. List only public IPv4 ranges."
            )
        canonical = str(net)
        if canonical not in allowed:
            allowed.append(canonical)
    return allowed


def domain_allowlist(entries: Sequence[str]) -> list[str]:
    try:
        return hostname_allowlist(entries, hint=" (put addresses in allow_egress_to_cidrs)")
    except ValueError as err:
        raise SandboxTerminalError(str(err)) from None


def transient_errors(modal: Any) -> tuple[type[BaseException], ...]:
    """The SDK errors worth retrying a call for."""
    exc = modal.exception
    return (
        exc.ConnectionError,
        exc.InternalError,
        exc.InternalFailure,
        exc.ServiceError,
        exc.ResourceExhaustedError,
        ConnectionError,
    )


class Gone(SandboxTerminalError):
    """The sandbox named in the error no longer exists."""


#: What each of the SDK's filesystem errors means, by class name.
_FILESYSTEM_REASONS = {
    "SandboxFilesystemNotFoundError": "the path does not exist",
    "SandboxFilesystemNotADirectoryError": "a part of the path is not a directory",
    "SandboxFilesystemIsADirectoryError": "the path is a directory",
    "SandboxFilesystemPermissionError": "permission denied",
}


def _credential_error(err: BaseException, action: str, *, conn_id: str | None, source: str) -> SandboxError | None:
    """The error for a missing connection or refused credentials; None when ``err`` is neither."""
    from airflow.exceptions import AirflowNotFoundException

    if isinstance(err, AirflowNotFoundException):
        return SandboxTerminalError(
            f"The Airflow connection {conn_id!r} is not defined. Create a 'modal' connection with "
            "that id (token id as login, token secret as password), or pass modal_conn_id=None to use the "
            "worker's own Modal configuration."
        )
    if type(err).__name__ == "ModalConnectionError":
        return SandboxTerminalError(f"The Modal credentials cannot be used: {err}")
    exc = sys.modules["modal"].exception
    if isinstance(err, exc.AuthError):
        return SandboxTerminalError(
            f"Modal rejected the credentials from {source} while {action}: {err}. "
            "Check the token id and secret (modal token new makes a fresh pair) and the environment."
        )
    if isinstance(err, exc.PermissionDeniedError):
        return SandboxTerminalError(
            f"The credentials from {source} may not do this while {action}: {err}. "
            "Use a token of a workspace and environment that holds the app."
        )
    return None


def translate(
    err: BaseException,
    action: str,
    handle: str | None,
    *,
    conn_id: str | None,
    source: str,
    has_ended: Callable[[str], bool],
) -> SandboxError:
    """
    Map an error from the SDK or the Modal provider to this package's errors; :class:`Gone` says the
    sandbox ``handle`` no longer exists. ``has_ended`` polls the sandbox when the error alone cannot tell.
    """
    refused = _credential_error(err, action, conn_id=conn_id, source=source)
    if refused is not None:
        return refused
    exc = sys.modules["modal"].exception
    what = f"sandbox {handle!r}" if handle else "Modal"
    if isinstance(err, exc.ExecTimeoutError):
        return SandboxError(f"A command in {what} ran out of time while {action}: {err}")
    if isinstance(err, (exc.NotFoundError, exc.SandboxTerminatedError, exc.SandboxTimeoutError)):
        if handle is None:
            return SandboxTerminalError(f"Modal could not find what it needed while {action}: {err}")
        return Gone(
            f"Sandbox {handle!r} is gone (ended, past its lifetime, or never existed) while {action}: {err}. "
            "Its files went with it; provision a new sandbox."
        )
    if isinstance(err, exc.SandboxFilesystemError):
        reason = _FILESYSTEM_REASONS.get(type(err).__name__)
        if reason is None and handle is not None and has_ended(handle):
            # The SDK reports a file call on a sandbox that has finished as a bare filesystem error.
            return Gone(f"Sandbox {handle!r} has ended; {action} failed: {err}. Provision a new sandbox.")
        return SandboxError(f"{action.capitalize()} did not work in {what}: {reason or 'it failed'} ({err}).")
    if isinstance(err, exc.ConflictError):  # before InvalidError, its parent
        return SandboxTerminalError(f"Sandbox {handle!r} is shutting down; {action} was refused: {err}")
    if isinstance(err, exc.InvalidError):
        return SandboxTerminalError(f"Modal refused the request while {action}: {err}")
    if isinstance(err, exc.Error):
        if handle is not None and has_ended(handle):
            return Gone(f"Sandbox {handle!r} ended while {action}: {err}")
        return SandboxError(f"Modal reported an error while {action} in {what}: {err}")
    return SandboxTerminalError(f"Unexpected error while {action} on Modal: {type(err).__name__}: {err}")


def call(
    action: str,
    fn: Callable[[], T],
    *,
    handle: str | None,
    budget: float,
    on_error: Callable[[BaseException], T | None] | None,
    passthrough: tuple[type[BaseException], ...],
    translate: Callable[[BaseException, str, str | None], SandboxError],
    monotonic: Callable[[], float],
    sleep: Callable[[float], None],
) -> T:
    """
    Run one SDK call, retrying transient API errors until ``budget`` seconds have passed (0: no retry).

    Other errors become :class:`SandboxError` or :class:`SandboxTerminalError` through ``translate``,
    except those in ``passthrough``, which are raised as they are. ``on_error`` may turn any other
    error into a result: a create whose reply was lost finds its own sandbox on the next attempt,
    whether that attempt is ours or one the SDK makes by itself before answering.
    """
    modal = import_modal()
    transient = transient_errors(modal)
    deadline = monotonic() + budget
    delay = 0.5
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except transient as err:
            now = monotonic()
            if now + delay > deadline:
                raise SandboxTerminalError(
                    f"Modal kept failing while {action}"
                    + (f" for sandbox {handle!r}" if handle else "")
                    + f" ({type(err).__name__}: {err}); gave up after {attempt} attempt(s). "
                    "Airflow's task retries can try again later."
                ) from err
            log.warning("Transient Modal error while %s (attempt %d): %s; retrying", action, attempt, err)
            sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF)
        except SandboxError:
            raise
        except passthrough:
            raise
        except Exception as err:
            if on_error is not None:
                recovered = on_error(err)
                if recovered is not None:
                    return recovered
            raise translate(err, action, handle) from err
