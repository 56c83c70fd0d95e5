"""
Sandboxes as Docker Sandboxes microVMs on the worker, driven through the ``sbx`` CLI.

How the pieces map onto sbx:

- **A sandbox** is an sbx sandbox of the ``shell`` agent named ``airflow-sandbox-<hex>`` (the
  handle), made with ``sbx create`` from the template image with the memory and CPUs set. Its
  workspace mount is an empty directory on the worker, mounted read-only; commands work in
  ``/workspace`` inside the VM.
- **No lifetime in sbx.** A sandbox stays until it is removed, and a worker killed mid-task leaves
  it running. Each sandbox keeps its expiry in ``/etc/airflow-sandbox/expires_at``;
  :meth:`SbxSandboxHook.remove_expired` removes the ones past it. Sandboxes are found by name.
- **Network**: sbx applies egress rules host-wide (``sbx policy``), which this hook cannot see. So
  ``host_network_policy`` says what the host has: only on a ``deny-all`` host can a sandbox be
  offline (``block_network=True``) or limited to ``allow_egress_to`` hostnames (added with
  ``sbx policy allow network --sandbox``). ``block_network=False`` is always accepted: egress is
  whatever the host allows. sbx has no per-sandbox address ranges, so those are refused.
- **Environment** is written into the guest profile (``/etc/profile.d/airflow-sandbox-env.sh``) on
  stdin, never on a command line, and sourced before every command.
- **Commands** travel on stdin to the guest program ``run_session.sh`` through ``sbx exec -i``:
  the deadline is enforced in the guest, which kills the command's whole session and keeps the
  sandbox. If the CLI itself has not returned ``cli_grace`` seconds past the deadline, it is
  killed, the sandbox destroyed, and the result says so.
- **Files**: reads, exports and writes stream raw bytes through one ``sbx exec`` each; listings use
  the shell guest programs.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shlex
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import IO, Any, ClassVar

from sandbox_provider.hooks.forms.sbx import FORM
from sandbox_provider.hooks.hosted.service import check_conn_id, resolve_settings
from sandbox_provider.hooks.sbx import driver
from sandbox_provider.sandbox import guest
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError
from sandbox_provider.sandbox.files import (
    CountingReader,
    ShellFiles,
    check_export_size,
    checked_size,
    reported_size,
    write_step_error,
    write_through_temp,
)
from sandbox_provider.sandbox.hook import (
    FILE_OP_TIMEOUT,
    Capabilities,
    OutputSink,
    ProvisionRequest,
    RunOutcome,
    SandboxHook,
)
from sandbox_provider.sandbox.leftovers import SandboxRecord
from sandbox_provider.sandbox.spec import (
    EXPIRES_AT_TAG,
    SandboxExecResult,
    SandboxSpec,
    check_byte_count,
    check_path,
    hostname_allowlist,
)

log = logging.getLogger(__name__)

__all__ = ["SbxSandboxBackend", "SbxSandboxHook", "SbxSandboxInfo"]

#: The guest profile file holding ``spec.env``; sourced before every command.
ENV_FILE = "/etc/profile.d/airflow-sandbox-env.sh"
#: Where a sandbox keeps its expiry (Unix seconds).
EXPIRY_FILE = "/etc/airflow-sandbox/expires_at"
#: Seconds a short CLI call (rm, ls, policy, setup) may take.
CLI_TIMEOUT = 120.0
_MIN_MEMORY = 1 << 30
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ADVICE = (
    "sbx has no per-sandbox address-range rule and cannot keep a sandbox for another task: list hostnames in "
    "allow_egress_to on a deny-all host instead, drop owner, or use a backend that enforces them."
)
#: Prepares a new sandbox as root: the working directory (owned by $3), the environment profile
#: (from stdin) and the expiry stamp.
_SETUP = r"""
set -e
mkdir -p "$1" && chown "$3" "$1"
mkdir -p "$(dirname "$2")" && cat > "$2" && chmod 0644 "$2"
mkdir -p "$(dirname "$4")" && printf '%s\n' "$5" > "$4"
"""


@dataclass(frozen=True)
class SbxSandboxInfo:
    """
    One sandbox of this provider, as :meth:`SbxSandboxHook.list_sandboxes` finds it.

    :param handle: the sandbox name.
    :param expires_at: Unix time (seconds) its lifetime ends, or None if it could not be read.
    """

    handle: str
    expires_at: float | None

    def expired(self, now: float | None = None) -> bool:
        """True when the lifetime has run out at ``now`` (default: the current time)."""
        return self.expires_at is not None and self.expires_at <= (time.time() if now is None else now)


class SbxSandboxHook(ShellFiles, SandboxHook):
    """
    Provision sandboxes with the Docker Sandboxes ``sbx`` CLI on the worker (local development and
    single-host deployments: the worker needs ``sbx``, a ``sbx login`` and KVM).

    Connection (type ``sandbox_sbx``, default id ``sandbox_sbx_default``, optional): extras with
    the settings below, which the hook arguments override.

    :param sbx_conn_id: the Airflow connection to read, if defined.
    :raises ValueError: for a setting of the wrong type or out of bounds, or less than 1 GiB of memory.
    """

    name: ClassVar[str] = "sbx"
    display_name: ClassVar[str] = "sbx"
    capabilities = Capabilities(egress_hosts=True, egress_cidrs=False, advice=_ADVICE)
    form = FORM

    def __init__(
        self,
        sbx_conn_id: str = FORM.default_conn_name,
        *,
        image: str | None = None,
        memory: str | None = None,
        cpus: int | None = None,
        sbx_path: str | None = None,
        host_network_policy: str | None = None,
        create_timeout: float | None = None,
        cli_grace: float | None = None,
        sandbox_timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.sbx_conn_id = check_conn_id(sbx_conn_id, "sbx_conn_id")
        self._args = self.settings.arguments(locals())
        if memory is not None:
            _check_memory(memory, "memory")
        self._lock = threading.Lock()
        self._settings_obj: dict[str, Any] | None = None

    # -- settings ------------------------------------------------------------------------------------

    def _resolved(self) -> dict[str, Any]:
        with self._lock:
            if self._settings_obj is not None:
                return self._settings_obj
            conn = self.connection_or_none(otherwise="the hook's arguments and defaults")
            extra = dict(conn.extra_dejson or {}) if conn is not None else {}
            settings = resolve_settings(self.settings, self._args, extra, self.sbx_conn_id)
            self._settings_obj = settings
            return settings

    def _lifetime_seconds(self) -> float:
        return float(self._resolved()["sandbox_timeout"])

    def _host_policy(self) -> str:
        given = self._args.get("host_network_policy")
        return given if given is not None else self._resolved()["host_network_policy"]

    def _refusal(self, spec: SandboxSpec) -> str | None:
        policy = self._host_policy()
        if spec.allow_egress_to:
            try:
                hostname_allowlist(spec.allow_egress_to)
            except ValueError as err:
                return str(err)
        if spec.block_network and policy != "deny-all":
            return _network_refusal(spec, policy)
        bad = sorted(k for k in spec.env or {} if not _ENV_NAME.fullmatch(k))
        if bad:
            return (
                f"SandboxSpec.env names {bad} cannot be set through the sandbox's shell profile. Use names of "
                "letters, digits and underscores that do not start with a digit."
            )
        return None

    def describe_network(self, spec: SandboxSpec) -> str | None:
        if not spec.block_network:
            return (
                "The sandbox's network access is whatever this machine's sbx policy allows, which may be nothing; "
                "test before relying on it. Only HTTP and HTTPS leave a sandbox, through sbx's proxy."
            )
        if spec.allow_egress_to:
            hosts = ", ".join(hostname_allowlist(spec.allow_egress_to))
            return (
                f"The sandbox can reach only {hosts}, over HTTP or HTTPS through sbx's proxy; every other destination "
                "fails, so installing packages from elsewhere will not work."
            )
        return None

    # -- the CLI -------------------------------------------------------------------------------------

    def _binary(self) -> str:
        path = self._resolved()["sbx_path"]
        found = shutil.which(path)
        if found is None:
            raise SandboxTerminalError(
                f"The sbx CLI ({path!r}) was not found on this worker. Install Docker Sandboxes (the docker-sbx "
                "package), run 'sbx login', or point sbx_path at the binary."
            )
        return found

    def _cli(self, *args: str, wall: float = CLI_TIMEOUT, stdin: bytes = b"", what: str) -> driver.CliResult:
        """Run ``sbx args...``; a CLI that hangs or fails is a terminal error naming ``what``."""
        argv = [self._binary(), *args]
        try:
            result = driver.run(argv, wall=wall, stdin=stdin)
        except driver.CliHung:
            raise SandboxTerminalError(
                f"'sbx {args[0]}' did not finish within {wall:g} seconds while {what}."
            ) from None
        except OSError as err:
            raise SandboxTerminalError(f"Could not run the sbx CLI while {what}: {err}.") from None
        if result.returncode != 0:
            raise SandboxTerminalError(
                f"'sbx {args[0]}' failed (exit {result.returncode}) while {what}: {result.error_text()}"
            )
        return result

    def _names(self) -> list[str]:
        listed = self._cli("ls", "-q", what="listing sandboxes").stdout.decode("utf-8", "replace")
        return [line.strip() for line in listed.splitlines() if line.strip()]

    # -- lifecycle -----------------------------------------------------------------------------------

    def _provision(self, request: ProvisionRequest) -> str:
        settings = self._resolved()
        try:
            _check_memory(settings["memory"], f"Connection {self.sbx_conn_id!r} extra 'memory'")
        except ValueError as err:
            raise SandboxTerminalError(f"{err} Fix the extra or pass memory= to the hook.") from None
        name = request.name
        binary = self._binary()
        workspace = tempfile.mkdtemp(prefix=f"{name}-")
        argv = [binary, "create", "shell", f"{workspace}:ro", "--name", name, "--memory", settings["memory"]]
        argv += ["--template", settings["image"], "--quiet"]
        if settings["cpus"]:
            argv += ["--cpus", str(settings["cpus"])]
        try:
            try:
                made = driver.run(argv, wall=settings["create_timeout"])
            except driver.CliHung:
                raise SandboxTerminalError(
                    f"'sbx create' did not finish within {settings['create_timeout']:g} seconds; raise create_timeout "
                    "or check 'sbx diagnose' on the worker."
                ) from None
            if made.returncode != 0:
                raise SandboxTerminalError(f"'sbx create' failed (exit {made.returncode}): {made.error_text()}")
            hosts = hostname_allowlist(request.spec.allow_egress_to or [])
            if hosts:
                self._cli(
                    "policy", "allow", "network", "--sandbox", name, ",".join(hosts), what=f"allowing egress for {name}"
                )
            self._setup(name, request)
        except BaseException:
            self._destroy_quietly(name)
            raise
        log.info("Created sbx sandbox %s from %s", name, settings["image"])
        return name

    def _setup(self, name: str, request: ProvisionRequest) -> None:
        owner = self._cli("exec", name, "sh", "-c", 'echo "$(id -u):$(id -g)"', what=f"preparing {name}")
        profile = "".join(f"export {key}={shlex.quote(value)}\n" for key, value in (request.spec.env or {}).items())
        self._cli(
            "exec", "-i", "-u", "root", name, "sh", "-c", _SETUP, "setup", self.workdir, ENV_FILE,
            owner.stdout.decode().strip(), EXPIRY_FILE, str(int(request.expires_at)),
            stdin=profile.encode(), what=f"preparing {name}",
        )  # fmt: skip

    def _destroy(self, handle: str) -> None:
        try:
            self._cli("rm", "--force", handle, what=f"removing {handle}")
        except SandboxTerminalError:
            if handle in self._names():
                raise
        for folder in glob.glob(os.path.join(tempfile.gettempdir(), glob.escape(handle) + "-*")):
            shutil.rmtree(folder, ignore_errors=True)

    def _destroy_quietly(self, handle: str) -> None:
        try:
            self._destroy(handle)
        except Exception:
            log.warning(
                "Could not remove sbx sandbox %s; remove it with 'sbx rm --force %s'", handle, handle, exc_info=True
            )

    def list_sandboxes(self) -> list[SbxSandboxInfo]:
        """
        List this provider's sandboxes on the worker (by name), with their expiry. Reading the expiry
        starts a stopped sandbox, as every ``sbx exec`` does.

        :raises SandboxTerminalError: if the CLI fails.
        """
        found = []
        for name in self._names():
            if not self.handle_pattern.fullmatch(name):
                continue
            try:
                text = self._cli("exec", name, "cat", EXPIRY_FILE, what=f"reading the expiry of {name}").stdout
                expires: float | None = float(text.decode().strip())
            except (SandboxTerminalError, ValueError):
                expires = None
            found.append(SbxSandboxInfo(handle=name, expires_at=expires))
        return found

    def sandbox_records(self) -> list[SandboxRecord]:
        """This provider's sandboxes on the worker, with their expiry (sbx keeps no other stamp of a sandbox)."""
        return [
            SandboxRecord(info.handle, {EXPIRES_AT_TAG: str(int(info.expires_at))} if info.expires_at else {})
            for info in sorted(self.list_sandboxes(), key=lambda i: i.handle)
        ]

    def remove_expired(self, *, now: float | None = None, include_unknown: bool = False) -> list[str]:
        """
        Remove this provider's sandboxes past their lifetime; return their handles. sbx has no
        lifetime of its own, so run this on a schedule.

        :param now: the Unix time to judge expiry by; default the current time.
        :param include_unknown: also remove sandboxes whose expiry cannot be read.
        """
        removed = []
        for info in self.list_sandboxes():
            if info.expired(now) or (include_unknown and info.expires_at is None):
                self.destroy(info.handle)
                removed.append(info.handle)
        if removed:
            log.info("Removed %d leftover sbx sandboxes: %s", len(removed), ", ".join(removed))
        return removed

    # -- commands ------------------------------------------------------------------------------------

    def _exec(self, handle: str, argv: list[str], *, stdin, wall: float, on_stdout, on_stderr) -> int:
        """``sbx exec -i handle argv...``; raises :class:`driver.CliHung` when the CLI overruns ``wall``."""
        try:
            return driver.stream(
                [self._binary(), "exec", "-i", handle, *argv],
                stdin=stdin,
                wall=wall,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
            )
        except OSError as err:
            raise SandboxTerminalError(f"Could not run the sbx CLI for sandbox {handle}: {err}.") from None

    def _gone_unless_listed(self, handle: str, code: int) -> None:
        """After a failure that may be the CLI's own: :raises SandboxTerminalError: if the sandbox is gone."""
        if code not in (0, guest.RUN_TIMEOUT_STATUS) and handle not in self._names():
            raise SandboxTerminalError(f"Sandbox {handle} is gone: 'sbx ls' no longer lists it.")

    def _run(self, handle: str, command: str, *, timeout: float, output: OutputSink) -> RunOutcome:
        head = bytearray()

        def on_stderr(data: bytes) -> None:
            if len(head) < 512:
                head.extend(data[: 512 - len(head)])
            output.stderr(data)

        started = time.monotonic()
        try:
            code = self._exec(
                handle,
                guest.run_session_argv(timeout, self.workdir, ENV_FILE),
                stdin=command.encode(),
                wall=timeout + self._resolved()["cli_grace"],
                on_stdout=output.stdout,
                on_stderr=on_stderr,
            )
        except driver.CliHung:
            log.warning("'sbx exec' hung past the deadline in sandbox %s; destroying it", handle)
            self._destroy_quietly(handle)
            return RunOutcome(exit_code=-1, timed_out=True, sandbox_terminated=True)
        elapsed = time.monotonic() - started
        self._gone_unless_listed(handle, code)
        guest.check_run_session(code, bytes(head), handle)
        return RunOutcome(exit_code=code, timed_out=code == guest.RUN_TIMEOUT_STATUS and elapsed >= timeout)

    # -- files: raw bytes through one exec each ------------------------------------------------------

    def _file_exec(self, handle: str, argv: list[str], *, what: str, stdin=b"", on_stdout=None) -> tuple[int, str]:
        err = bytearray()

        def on_stderr(data: bytes) -> None:
            if len(err) < 64 * 1024:
                err.extend(data)

        try:
            code = self._exec(
                handle, _in_workdir(self.workdir, argv), stdin=stdin, wall=FILE_OP_TIMEOUT,
                on_stdout=on_stdout or (lambda _: None), on_stderr=on_stderr,
            )  # fmt: skip
        except driver.CliHung:
            raise SandboxError(f"{what} did not finish within {FILE_OP_TIMEOUT:g} seconds.") from None
        self._gone_unless_listed(handle, code)
        return code, err.decode("utf-8", "replace")

    def _copy_out(self, handle: str, path: str, max_bytes: int, sink, verb: str) -> int:
        handle = self.check_handle(handle)
        check_byte_count(max_bytes, "max_bytes")
        check_path(path)
        copied = 0

        def on_stdout(data: bytes) -> None:
            nonlocal copied
            copied += len(data)
            if copied > max_bytes:
                raise SandboxFileTooLargeError(path, copied, max_bytes)
            sink(data)

        argv = ["sh", "-c", guest.program("file.sh"), "file.sh", path, str(int(max_bytes)), "cat"]
        code, err = self._file_exec(handle, argv, what=f"{verb} {path!r}", on_stdout=on_stdout)
        size = checked_size(SandboxExecResult(exit_code=code, stdout="", stderr=err), path, max_bytes, verb)
        check_export_size(path, size, copied)
        return copied

    def read_file(self, handle: str, path: str, *, max_bytes: int) -> bytes:
        """See :meth:`SandboxHook.read_file`; the bytes come raw through one ``sbx exec``."""
        parts: list[bytes] = []
        self._copy_out(handle, path, max_bytes, parts.append, "reading")
        return b"".join(parts)

    def export_file(self, handle: str, path: str, stream: IO[bytes], *, max_bytes: int) -> int:
        """See :meth:`SandboxHook.export_file`; memory stays bounded by one 64 KiB piece."""
        return self._copy_out(handle, path, max_bytes, stream.write, "exporting")

    def import_file(self, handle: str, path: str, source: IO[bytes]) -> int:
        """
        See :meth:`SandboxHook.import_file`: ``source`` streams into a temporary sibling through one
        ``sbx exec``, which is renamed into place only when it holds every byte read.
        """
        handle = self.check_handle(handle)
        check_path(path)
        write = guest.program("write.sh")
        what = f"writing {path!r}"
        counted = CountingReader(source)

        def start() -> str:
            out = bytearray()
            code, err = self._file_exec(
                handle, ["sh", "-c", write, "write.sh", "start", path], what=what, on_stdout=out.extend
            )
            if code != 0 or not out.strip():
                raise write_step_error(path, err, "no temporary file")
            return out.decode().strip().splitlines()[-1]

        def fill(temp: str) -> int:
            code, err = self._file_exec(handle, ["sh", "-c", 'cat > "$1"', "append", temp], what=what, stdin=counted)
            if code != 0:
                raise write_step_error(path, err, "copy failed")
            check = ["sh", "-c", guest.program("file.sh"), "file.sh", temp, "-", "check"]
            code, err = self._file_exec(handle, check, what=what)
            if code != 0 or reported_size(err) != counted.total:
                raise SandboxError(
                    f"Could not write {path!r}: the sandbox holds {reported_size(err)} of the {counted.total} bytes sent."
                )
            return counted.total

        def commit(temp: str) -> None:
            code, err = self._file_exec(handle, ["sh", "-c", write, "write.sh", "commit", temp, path], what=what)
            if code != 0:
                raise write_step_error(path, err, "rename failed")

        return write_through_temp(
            start=start,
            fill=fill,
            commit=commit,
            abort=lambda temp: self._file_exec(
                handle, ["sh", "-c", write, "write.sh", "abort", temp], what="cleaning up"
            ),
        )


def _in_workdir(workdir: str, argv: list[str]) -> list[str]:
    """``argv`` started in ``workdir`` (relative paths resolve there, as in commands)."""
    return ["sh", "-c", 'cd "$1" && shift && exec "$@"', "in-workdir", workdir, *argv]


def _check_memory(value: str, where: str) -> None:
    size = driver.memory_bytes(value)
    if size < _MIN_MEMORY:
        raise ValueError(f"{where} must be at least 1 GiB ('1g' or '1024m'), as sbx requires; got {value!r}.")


def _network_refusal(spec: SandboxSpec, policy: str) -> str:
    """Why a spec that needs a blocked host cannot run on a host whose policy is ``policy``."""
    asks = (
        "SandboxSpec allows egress only to the hosts in allow_egress_to"
        if spec.allow_egress_to
        else "SandboxSpec asks for no network egress"
    )
    if policy == "allow-all":
        return (
            f"{asks}, but host_network_policy='allow-all' says this worker's sbx lets every sandbox reach any host, and "
            "sbx cannot narrow that per sandbox. Switch the host to 'sbx policy init deny-all' and pass "
            "host_network_policy='deny-all', or pass SandboxSpec(block_network=False) to accept open egress."
        )
    return (
        f"{asks}, but sbx enforces egress with a host-wide policy that this backend cannot see, and the host's policy "
        "has not been declared. Run 'sbx policy init deny-all' on the worker host and pass "
        "host_network_policy='deny-all', or pass SandboxSpec(block_network=False) to accept that egress is open."
    )


#: The hook under the name the public guide uses.
SbxSandboxBackend = SbxSandboxHook
