"""The ``SandboxHook`` contract every backend implements, with shell-based file defaults."""

from __future__ import annotations

import base64
import binascii
import io
import logging
import re
import shlex
import time
from abc import abstractmethod
from collections.abc import Mapping
from typing import IO, Any, ClassVar

from airflow.sdk import BaseHook

from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError
from sandbox_provider.sandbox.spec import (
    DEFAULT_WORKDIR,
    EXPIRES_AT_TAG,
    HOLDER_TAG,
    NETWORK_TAG,
    OWNER_TAG,
    WORKDIR_TAG,
    AttachedSandbox,
    SandboxExecResult,
    SandboxSpec,
    check_byte_count,
    check_handle,
    check_path,
    decode_network_policy,
)

log = logging.getLogger(__name__)

__all__ = ["SandboxHook"]

#: Budget for one file operation run through the shell, in seconds.
FILE_OP_TIMEOUT = 120.0
#: Raw bytes moved per shell command when a backend has no file API.
SHELL_CHUNK_BYTES = 4 * 1024 * 1024
#: Raw bytes per write command: a command line holds at most 128 KiB in one argument on Linux.
SHELL_WRITE_CHUNK_BYTES = 48 * 1024
#: The most bytes of names one ``list_directory`` returns.
LIST_OUTPUT_BYTES = 16 * 1024 * 1024
#: Bytes read from a local or object-storage stream at a time.
STREAM_CHUNK_BYTES = 1024 * 1024

# Exit statuses the guest-side checks use; chosen outside what coreutils return.
_MISSING, _IS_DIR, _NOT_REGULAR, _TOO_LARGE = 66, 67, 68, 69
#: The status :meth:`SandboxHook._checks` exits with for a file over the budget.
TOO_LARGE_STATUS = _TOO_LARGE
_SIZE_MARK = "sandbox-size:"


def _b64_cap(raw: int) -> int:
    return raw * 2 + 4096


class SandboxHook(BaseHook):
    """
    A backend that provisions sandboxes and runs commands in them; one subclass per backend.

    A sandbox is named by a string **handle** that ``create`` returns. Every method takes it, so a
    handle pushed to XCom lets another task of an attachable backend pick the sandbox up.

    Rules every backend keeps:

    - The constructor is cheap: it runs when a Dag file is parsed, so it stores arguments and
      checks them, and resolves connections and clients lazily, on first use.
    - ``create`` refuses, with :class:`SandboxTerminalError`, any spec field it cannot enforce. It
      never provisions something weaker than asked.
    - ``destroy`` is idempotent.
    - :class:`SandboxTerminalError` for what no caller can fix (credentials, a sandbox that is
      gone); :class:`SandboxError` for what they can.

    The file methods here work over ``run_command`` with ``sh``, ``stat``, ``head``, ``tail``,
    ``find`` and ``base64`` in the guest. Backends with a native file API override them.
    """

    conn_name_attr = "sandbox_conn_id"
    default_conn_name = "sandbox_default"
    conn_type = "sandbox"
    hook_name = "Sandbox"

    #: Short backend name, used in messages and tool ids (``"local"``, ``"docker"``).
    name: ClassVar[str] = "sandbox"
    #: Whether another task can find this backend's sandboxes by handle (``attach``/``release``).
    attachable: ClassVar[bool] = False

    workdir: str = DEFAULT_WORKDIR

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    # -- the contract ----------------------------------------------------------------------------------

    @abstractmethod
    def create(self, *, spec: SandboxSpec | None = None) -> str:
        """
        Provision a sandbox and return its handle.

        :param spec: what the sandbox must be; None states no requirement beyond the backend's defaults.
        :raises SandboxTerminalError: if the spec asks for something this backend cannot enforce,
            or provisioning fails.
        """

    @abstractmethod
    def run_command(self, handle: str, command: str, *, timeout: float, max_output_bytes: int) -> SandboxExecResult:
        """
        Run ``command`` through ``sh -c`` in the sandbox's working directory.

        :param timeout: seconds before the command's whole process tree is killed.
        :param max_output_bytes: bytes kept per stream (the tail), applied while reading.
        :raises SandboxTerminalError: if the sandbox is gone or past its lifetime.
        """

    @abstractmethod
    def destroy(self, handle: str) -> None:
        """Remove the sandbox and everything in it. Destroying a sandbox that is gone is not an error."""

    # -- tags, for attachable backends -----------------------------------------------------------------

    def read_tags(self, handle: str) -> Mapping[str, str]:
        """Return the sandbox's stamps. :raises SandboxTerminalError: if the sandbox is missing or ended."""
        raise SandboxTerminalError(f"Backend {self.name!r} cannot attach to sandboxes provisioned by another task.")

    def write_tags(self, handle: str, tags: Mapping[str, str]) -> None:
        """Replace the sandbox's stamps with ``tags``."""
        raise SandboxTerminalError(f"Backend {self.name!r} cannot attach to sandboxes provisioned by another task.")

    def attach(self, handle: str, *, owner: str, holder: str) -> AttachedSandbox:
        """
        Claim a sandbox another task provisioned.

        The owner stamp must equal ``owner``; the holder stamp must be empty or ``holder`` already (a
        retry of the same task is the same holder). The claim writes the holder and reads it back:
        that catches mistakes made one after another, not two tasks racing, and anyone holding the
        backend's credentials can rewrite the stamps. It is attribution, not a lock.

        :raises SandboxTerminalError: on a wrong owner, another holder, or a sandbox that is gone.
        """
        check_handle(handle)
        tags = dict(self.read_tags(handle))
        found = tags.get(OWNER_TAG)
        if found != owner:
            carries = f"it carries owner {found!r}" if found else "it carries no owner"
            raise SandboxTerminalError(
                f"Sandbox {handle!r} on backend {self.name!r} is not owned by {owner!r}: {carries}. Provision it "
                "with SandboxSpec(owner=dag_run_owner(context)) in the same Dag run, or pass the owner it was "
                "provisioned under."
            )
        current = tags.get(HOLDER_TAG)
        if current and current != holder:
            raise SandboxTerminalError(
                f"Sandbox {handle!r} is held by {current!r}; one task uses a sandbox at a time. Run the tasks "
                "one after another, or provision a sandbox for each."
            )
        if current != holder:
            self.write_tags(handle, {**tags, HOLDER_TAG: holder})
            tags = dict(self.read_tags(handle))
            if tags.get(HOLDER_TAG) != holder:
                raise SandboxTerminalError(
                    f"Sandbox {handle!r} was claimed by {tags.get(HOLDER_TAG)!r} while {holder!r} was attaching. "
                    "Two tasks asked for it at once; provision one sandbox per task."
                )
        remaining: float | None = None
        try:
            remaining = max(0.0, float(tags[EXPIRES_AT_TAG]) - time.time())
        except (KeyError, ValueError):
            remaining = None
        network: SandboxSpec | None = None
        if NETWORK_TAG in tags:
            try:
                network = decode_network_policy(tags[NETWORK_TAG])
            except ValueError:
                log.warning("Sandbox %s carries a network stamp that cannot be read: %r", handle, tags[NETWORK_TAG])
        return AttachedSandbox(
            handle=handle, remaining_lifetime=remaining, network=network, workdir=tags.get(WORKDIR_TAG), tags=tags
        )

    def release(self, handle: str, *, holder: str) -> None:
        """Clear the holder stamp if it is ``holder``'s. Never destroys; releasing twice is fine."""
        tags = dict(self.read_tags(handle))
        if tags.get(HOLDER_TAG) == holder:
            tags.pop(HOLDER_TAG)
            self.write_tags(handle, tags)

    # -- files over the shell --------------------------------------------------------------------------

    def _shell(self, handle: str, script: str, *, max_output_bytes: int, timeout: float = FILE_OP_TIMEOUT):
        return self.run_command(handle, script, timeout=timeout, max_output_bytes=max_output_bytes)

    @staticmethod
    def _file_status_error(code: int, path: str) -> SandboxError | None:
        """The error a :meth:`_checks` exit status stands for (too large excepted), or None."""
        if code == _MISSING:
            return SandboxError(f"{path!r} does not exist in the sandbox, or cannot be read.")
        if code == _IS_DIR:
            return SandboxError(f"{path!r} is a directory; list it with list_directory.")
        if code == _NOT_REGULAR:
            return SandboxError(f"{path!r} is not a regular file.")
        return None

    @classmethod
    def _fail(cls, result: SandboxExecResult, path: str, verb: str) -> SandboxError:
        if result.sandbox_terminated:
            return SandboxTerminalError(f"The sandbox ended while {verb} {path!r}.")
        if result.timed_out:
            return SandboxError(f"Timed out while {verb} {path!r}.")
        known = cls._file_status_error(result.exit_code, path)
        if known is not None:
            return known
        detail = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit status {result.exit_code}"
        return SandboxError(f"Could not finish {verb} {path!r}: {detail}")

    @staticmethod
    def _checks(path: str, max_bytes: int | None) -> str:
        """
        Shell that exits with a reserved status unless ``path`` is a readable regular file of at
        most ``max_bytes``, and prints its size to stderr for :meth:`_reported_size`; continue it
        with the copy.
        """
        q = shlex.quote(path)
        script = (
            f"[ -e {q} ] && [ -r {q} ] || exit {_MISSING}; [ -d {q} ] && exit {_IS_DIR}; "
            f"[ -f {q} ] || exit {_NOT_REGULAR}; s=$(stat -Lc %s -- {q}) || exit {_MISSING}; "
            f"echo {_SIZE_MARK}$s >&2; "
        )
        if max_bytes is not None:
            script += f'[ "$s" -gt {int(max_bytes)} ] && exit {_TOO_LARGE}; '
        return script

    @staticmethod
    def _reported_size(stderr: str) -> int | None:
        """The size :meth:`_checks` printed to ``stderr`` (the last one, past any other noise)."""
        found = re.findall(rf"{_SIZE_MARK}(\d+)", stderr)
        return int(found[-1]) if found else None

    def read_file(self, handle: str, path: str, *, max_bytes: int) -> bytes:
        """
        Return the bytes of the regular file at ``path`` (relative paths resolve in the workdir).

        :param max_bytes: the most bytes to transfer; the cap is enforced inside the sandbox.
        :raises SandboxFileTooLargeError: if the file holds more than ``max_bytes``.
        :raises SandboxError: if it is missing, a directory or not a regular file.
        """
        check_byte_count(max_bytes, "max_bytes")
        q = shlex.quote(check_path(path))
        script = self._checks(path, max_bytes) + f"head -c {int(max_bytes) + 1} -- {q} | base64"
        result = self._shell(handle, script, max_output_bytes=_b64_cap(int(max_bytes)))
        size = self._reported_size(result.stderr)
        if result.exit_code == _TOO_LARGE:
            raise SandboxFileTooLargeError(path, size or max_bytes + 1, max_bytes)
        if not result.ok:
            raise self._fail(result, path, "reading")
        try:
            data = base64.b64decode(result.stdout, validate=False)
        except (binascii.Error, ValueError) as err:
            raise SandboxError(f"Could not decode {path!r} from the sandbox.") from err
        if len(data) > max_bytes:
            raise SandboxFileTooLargeError(path, len(data), max_bytes)
        return data

    def write_file(self, handle: str, path: str, data: bytes) -> None:
        """
        Write ``data`` to ``path``, creating parent directories and replacing what was there.

        :raises SandboxError: if the path cannot be written (a directory there, say).
        """
        if isinstance(data, str):
            data = data.encode()
        self.import_file(handle, path, io.BytesIO(data))

    def import_file(self, handle: str, path: str, source: IO[bytes]) -> int:
        """
        Stream ``source`` into the file at ``path`` in bounded memory; return the bytes written.

        The default appends base64 pieces through the shell; backends with a file API override it.
        """
        q = shlex.quote(check_path(path))
        first = True
        total = 0
        while True:
            chunk = source.read(SHELL_WRITE_CHUNK_BYTES)
            if not chunk and not first:
                break
            encoded = base64.b64encode(chunk or b"").decode()
            redirect = ">" if first else ">>"
            prefix = f'mkdir -p -- "$(dirname -- {q})" && ' if first else ""
            script = f"{prefix}printf %s {shlex.quote(encoded)} | base64 -d {redirect} {q}"
            result = self._shell(handle, script, max_output_bytes=64 * 1024)
            if not result.ok:
                raise self._fail(result, path, "writing")
            total += len(chunk)
            first = False
            if not chunk:
                break
        return total

    def list_directory(self, handle: str, path: str = ".") -> list[tuple[str, bool]]:
        """
        List the entries of the directory at ``path`` as ``(name, is_directory)`` pairs, sorted by name.

        :raises SandboxError: if ``path`` is missing or not a directory, or holds more entries than
            fit in 16 MiB of names (list part of it with a command such as ``find`` instead).
        """
        q = shlex.quote(check_path(path))
        script = f"[ -d {q} ] || exit {_MISSING}; find {q} -mindepth 1 -maxdepth 1 -printf '%y %f\\0'"
        result = self._shell(handle, script, max_output_bytes=LIST_OUTPUT_BYTES)
        if not result.ok:
            if result.exit_code == _MISSING:
                raise SandboxError(f"{path!r} is not a directory in the sandbox.")
            raise self._fail(result, path, "listing")
        if result.stdout_truncated:
            raise SandboxError(
                f"{path!r} holds more entries than one listing returns ({LIST_OUTPUT_BYTES} bytes of names); list "
                "part of it with a command such as find or ls piped to head."
            )
        entries = []
        for item in result.stdout.split("\0"):
            if len(item) >= 3:
                entries.append((item[2:], item[0] == "d"))
        return sorted(entries)

    def export_file(self, handle: str, path: str, stream: IO[bytes], *, max_bytes: int) -> int:
        """
        Copy the regular file at ``path`` into the writable binary ``stream``; return the bytes copied.

        Memory stays bounded by one piece (4 MiB here) however large the file is.

        :raises SandboxFileTooLargeError: if the file holds more than ``max_bytes``.
        :raises SandboxError: if it is missing, not a regular file, or changed while it was copied.
        :raises SandboxTerminalError: if the sandbox ended during the copy.
        """
        check_byte_count(max_bytes, "max_bytes")
        check_path(path)
        result = self._shell(handle, self._checks(path, max_bytes) + "true", max_output_bytes=64 * 1024)
        size = self._reported_size(result.stderr)
        if result.exit_code == _TOO_LARGE:
            raise SandboxFileTooLargeError(path, size or max_bytes + 1, max_bytes)
        if not result.ok:
            raise self._fail(result, path, "exporting")
        if size is None:
            raise SandboxError("The sandbox did not report the size of the file being exported.")
        q = shlex.quote(path)
        copied = 0
        while True:
            script = f"tail -c +{copied + 1} -- {q} | head -c {SHELL_CHUNK_BYTES} | base64"
            piece = self._shell(handle, script, max_output_bytes=_b64_cap(SHELL_CHUNK_BYTES))
            if piece.sandbox_terminated:
                raise SandboxTerminalError(f"The sandbox ended while {path!r} was being exported.")
            if not piece.ok or piece.stdout_truncated:
                raise self._fail(piece, path, "exporting")
            try:
                data = base64.b64decode(piece.stdout)
            except (binascii.Error, ValueError) as err:
                raise SandboxError(f"Could not decode {path!r} from the sandbox.") from err
            copied += len(data)
            if copied > max_bytes:
                raise SandboxFileTooLargeError(path, copied, max_bytes)
            stream.write(data)
            if len(data) < SHELL_CHUNK_BYTES:
                break
        check_export_size(path, size, copied)
        return copied

    # -- connections -----------------------------------------------------------------------------------

    def test_connection(self) -> tuple[bool, str]:
        """Provision a sandbox, run a command in it and destroy it; return ``(ok, message)``."""
        handle = None
        try:
            handle = self.create(spec=SandboxSpec())
            result = self.run_command(handle, "echo sandbox-ok", timeout=60, max_output_bytes=4096)
            if result.ok and "sandbox-ok" in result.stdout:
                return True, f"Ran a command in sandbox {handle} on backend {self.name!r}."
            return False, f"A test command failed on backend {self.name!r}: {result.stderr.strip()[-500:]}"
        except Exception as err:  # test_connection must report, never raise
            return False, f"{type(err).__name__}: {err}"
        finally:
            if handle:
                try:
                    self.destroy(handle)
                except Exception:
                    log.warning("Could not destroy test sandbox %s", handle, exc_info=True)


def check_export_size(path: str, expected: int, copied: int) -> None:
    """:raises SandboxError: when the bytes copied differ from the size reported before the copy."""
    if copied != expected:
        raise SandboxError(
            f"{path!r} changed while it was exported: it held {expected} bytes when the export began and "
            f"{copied} bytes were copied. Something in the sandbox may still be writing it."
        )
