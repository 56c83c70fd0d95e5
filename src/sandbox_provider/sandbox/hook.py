"""
The ``SandboxHook`` contract. The base class carries the policy; a backend only translates it.

``create``, ``run_command`` and ``destroy`` are template methods, the same for every backend: they
check the spec against what the backend declares it can enforce, name the sandbox, compute its
lifetime and creation stamps, check the handle and the command, clamp the deadline to the lifetime
left, stream the output into bounded tails, and build the result. A backend implements
``_provision``, ``_run`` and ``_destroy``, and file operations natively or through
:class:`~sandbox_provider.sandbox.files.ShellFiles`.
"""

from __future__ import annotations

import logging
import os
import re
import time
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import IO, TYPE_CHECKING, Any, ClassVar

from airflow.sdk import BaseHook

from sandbox_provider.sandbox import jobs
from sandbox_provider.sandbox.connection_test import connection_test_origin
from sandbox_provider.sandbox.errors import SandboxError, SandboxHandleError, SandboxTerminalError
from sandbox_provider.sandbox.jobs import DetachedJob, JobCursor, JobState
from sandbox_provider.sandbox.leftovers import SandboxRecord
from sandbox_provider.sandbox.network import NetworkReach, describe_reach, missing_phrases
from sandbox_provider.sandbox.output import TailBuffer
from sandbox_provider.sandbox.settings import ConnectionForm, SettingsTable
from sandbox_provider.sandbox.spec import (
    DEFAULT_WORKDIR,
    EXPIRES_AT_TAG,
    NETWORK_TAG,
    OWNER_TAG,
    SANDBOX_NAME_PREFIX,
    WORKDIR_TAG,
    SandboxExecResult,
    SandboxSpec,
    StreamTotals,
    check_byte_count,
    check_handle,
    check_path,
    check_positive,
    encode_network_policy,
    new_sandbox_name,
    trace_stamps,
)

if TYPE_CHECKING:
    from sandbox_provider.sandbox.batch import ExportLimits, ExportRequest, ExportSink, ImportEntry

log = logging.getLogger(__name__)

__all__ = ["Capabilities", "OutputCallback", "OutputSink", "ProvisionRequest", "RunOutcome", "SandboxHook"]

#: Budget for one file operation, in seconds.
FILE_OP_TIMEOUT = 120.0
#: Bytes read from a local or object-storage stream at a time.
STREAM_CHUNK_BYTES = 1024 * 1024
#: The shortest deadline a command gets when the lifetime left is shorter still, in seconds.
MIN_COMMAND_SECONDS = 0.5
#: Seconds one control program of a detached command (start, poll, stop) may take.
JOB_CONTROL_TIMEOUT = 60.0
#: Bytes of output a control program of a detached command may give back (a poll's base64, both streams).
JOB_CONTROL_OUTPUT_BYTES = 4 * jobs.POLL_BYTES
#: Seconds a connection test waits at most for a backend that does not answer: the Test button's
#: patience, which the UI's request outlasts. A hosted backend's retries stop at it (SandboxHook.patience).
TEST_PATIENCE = 10.0
#: The pattern of the handles ``new_sandbox_name`` makes: the prefix and 1 to 112 plain characters.
NAMED_HANDLE = re.compile(re.escape(SANDBOX_NAME_PREFIX) + r"[A-Za-z0-9][A-Za-z0-9_.-]{0,111}")

#: Called with ``("stdout" | "stderr", bytes)`` as a command's output arrives.
OutputCallback = Callable[[str, bytes], None]


@dataclass(frozen=True)
class Capabilities:
    """
    What a backend can enforce. The base refuses, before anything is provisioned, a spec that asks
    for more.

    :param no_network: ``block_network=True`` with no allowlist: no egress at all, DNS included.
    :param open_network: ``block_network=False``.
    :param egress_hosts: ``allow_egress_to`` (hostname allowlists).
    :param egress_cidrs: ``allow_egress_to_cidrs`` (address-range allowlists).
    :param max_env_bytes: the most bytes of ``spec.env`` (names, values and one ``=`` and NUL each)
        the backend can pass; None for no limit of its own.
    :param max_env_entries: the most entries of ``spec.env`` the backend can pass; None for no limit of
        its own.
    :param max_command_seconds: the longest deadline a command can get; longer ones are cut to it.
    :param advice: a sentence added to every refusal: what a user of this backend can do instead.
    :param network: what each network mode lets through here (ports, protocols, DNS), in the words
        an agent's tool description gives; see :class:`~sandbox_provider.sandbox.network.NetworkReach`.
    """

    no_network: bool = True
    open_network: bool = True
    egress_hosts: bool = False
    egress_cidrs: bool = False
    max_env_bytes: int | None = 128 * 1024
    max_env_entries: int | None = None
    max_command_seconds: float | None = None
    advice: str = ""
    network: NetworkReach = NetworkReach()


@dataclass(frozen=True)
class ProvisionRequest:
    """
    What :meth:`SandboxHook.create` hands a backend's ``_provision``.

    :param name: the sandbox's name, ``airflow-sandbox-`` and 12 hex digits; backends whose vendor
        names sandboxes itself may return another handle.
    :param spec: the checked spec.
    :param lifetime: seconds the sandbox may live.
    :param expires_at: Unix time (seconds) when its lifetime ends.
    :param workdir: its working directory.
    :param stamps: the creation stamps to keep with it: expiry, network, workdir, owner (when
        given) and the task that made it (Dag, run, task, map index, try), all strings.
    """

    name: str
    spec: SandboxSpec
    lifetime: float
    expires_at: float
    workdir: str
    stamps: Mapping[str, str]


@dataclass(frozen=True)
class RunOutcome:
    """
    How one command ended, as a backend's ``_run`` reports it; the output went to the sink.

    :param exit_code: the command's status; ignored when ``timed_out``.
    :param timed_out: the deadline passed and the command was killed.
    :param sandbox_terminated: the sandbox ended (the backend ended it to stop the command, or it died).
    :param applied_timeout: the deadline the vendor really applied, in seconds, when it rounds the one
        it was given (to whole seconds, say); None for exactly the one given.
    """

    exit_code: int
    timed_out: bool = False
    sandbox_terminated: bool = False
    applied_timeout: float | None = None


class OutputSink:
    """
    Where a backend's ``_run`` writes a command's output as it arrives.

    It keeps the last ``max_output_bytes`` of each stream (memory stays bounded however much is
    written) and passes every piece on to ``on_output``, for live logs. An exception raised by
    ``on_output`` (a task timeout or Ctrl-C raised by a signal while it ran, say) propagates at once,
    so a backend reading in the calling thread stops and kills the command; a backend reading in a
    thread of its own gets it raised by :meth:`result`. The callback is not called again after it.

    :param max_output_bytes: bytes kept per stream.
    :param on_output: called with ``("stdout" | "stderr", bytes)``; None keeps tails only.
    :param whole_lines: after a cut, drop the partial first line of a tail too.
    """

    def __init__(
        self, max_output_bytes: int, on_output: OutputCallback | None = None, *, whole_lines: bool = False
    ) -> None:
        self.max_output_bytes = max(0, int(max_output_bytes))
        self.out = TailBuffer(max_output_bytes)
        self.err = TailBuffer(max_output_bytes)
        self.whole_lines = whole_lines
        self._on_output = on_output
        self.callback_error: BaseException | None = None

    def stdout(self, data: bytes | str) -> None:
        self._write("stdout", self.out, data)

    def stderr(self, data: bytes | str) -> None:
        self._write("stderr", self.err, data)

    def stream_totals(self, stream: str, *, total_bytes: int, newlines: int) -> None:
        """
        For a backend whose vendor or guest program passes on only the tail of a stream: what the
        command wrote to ``stream`` (``"stdout"`` or ``"stderr"``) in all, ``total_bytes`` bytes
        and ``newlines`` newline characters, so the tail is marked truncated and counted exactly.
        """
        (self.out if stream == "stdout" else self.err).account(total_bytes=total_bytes, newlines=newlines)

    def restate(self, stream: str, data: bytes, *, total_bytes: int, newlines: int) -> None:
        """
        For a backend whose vendor streams the output reshaped (line by line, dropping what ended each
        line) but keeps the exact bytes where the backend can read them once the command ended: the
        result's ``stream`` becomes ``data``, the stream's last bytes (``max_output_bytes`` of them, one
        more when there are more), with ``total_bytes`` and ``newlines`` for the whole stream. What was
        passed to ``on_output`` stays as it was.
        """
        (self.out if stream == "stdout" else self.err).restate(data, total_bytes=total_bytes, newlines=newlines)

    def _write(self, stream: str, buffer: TailBuffer, data: bytes | str) -> None:
        if isinstance(data, str):
            data = data.encode("utf-8", "replace")
        if not data:
            return
        buffer.write(data)
        if self._on_output is not None and self.callback_error is None:
            try:
                self._on_output(stream, data)
            except BaseException as err:
                self.callback_error = err
                raise

    def result(self, outcome: RunOutcome, applied_timeout: float) -> SandboxExecResult:
        if self.callback_error is not None:
            raise self.callback_error
        stdout, stdout_totals = self._tail(self.out)
        stderr, stderr_totals = self._tail(self.err)
        return SandboxExecResult(
            exit_code=int(outcome.exit_code),
            stdout=stdout,
            stderr=stderr,
            timed_out=bool(outcome.timed_out),
            stdout_truncated=self.out.truncated,
            stderr_truncated=self.err.truncated,
            sandbox_terminated=bool(outcome.sandbox_terminated),
            applied_timeout=applied_timeout if outcome.applied_timeout is None else outcome.applied_timeout,
            stdout_totals=stdout_totals,
            stderr_totals=stderr_totals,
        )

    def _tail(self, buffer: TailBuffer) -> tuple[str, StreamTotals]:
        text, at_line = buffer.tail(whole_lines=self.whole_lines)
        return text, StreamTotals(bytes=buffer.total, lines=buffer.lines, tail_at_line_start=at_line)


def _check_network_words(cls: type[SandboxHook]) -> None:
    """
    :raises TypeError: when ``cls`` accepts a network mode without saying what it lets through (and
        words none itself in an overridden ``describe_network``).
    """
    if cls.describe_network is not SandboxHook.describe_network:
        return  # it words the modes itself; what it returns is checked per backend by the tests
    caps = cls.capabilities
    accepted = {
        "blocked": caps.no_network,
        "open": caps.open_network,
        "hosts": caps.egress_hosts,
        "cidrs": caps.egress_cidrs,
    }
    missing = missing_phrases(caps.network, accepted)
    if missing:
        fields = ", ".join(f'{mode}="..."' for mode in missing)
        raise TypeError(
            f"{cls.__name__} accepts the network modes {', '.join(missing)} but does not say what they let through: "
            f"give capabilities = Capabilities(..., network=NetworkReach({fields})), each phrase completing "
            '"This sandbox ..." (which ports, protocols and DNS answers), or override describe_network.'
        )


def check_command(command: Any) -> str:
    """:raises SandboxError: unless ``command`` is a non-empty shell command line without NUL."""
    if not isinstance(command, str) or not command.strip() or "\0" in command:
        raise SandboxError(f"{command!r} cannot be run: give a non-empty shell command line without NUL characters.")
    return command


def _check_env_shape(env: Any) -> None:
    """Refuse an env that bypassed ``SandboxSpec``'s own checks (set with ``object.__setattr__``)."""
    if env is None:
        return
    if not isinstance(env, Mapping):
        raise SandboxTerminalError(f"SandboxSpec.env must map strings to strings, got {type(env).__name__}.")
    bad = sorted(str(k) for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str))
    if bad:
        raise SandboxTerminalError(
            f"SandboxSpec.env must map strings to strings; these entries do not: {bad!r}. Convert each value in "
            "the Dag, e.g. str(port), so the sandbox sees what you meant."
        )


def env_bytes(env: Mapping[str, str] | None) -> int:
    """The bytes ``env`` takes in a process's environment block: ``NAME=value`` and a NUL each."""
    return sum(len(k.encode()) + len(v.encode()) + 2 for k, v in (env or {}).items())


#: Default connections this worker process looked up and did not find (see :meth:`SandboxHook.connection_or_none`).
_MISSING_DEFAULTS: set[str] = set()


class SandboxHook(BaseHook):
    """
    A backend that provisions sandboxes and runs commands in them; one subclass per backend.

    A sandbox is named by a string **handle** that ``create`` returns. Every method takes it, so a
    handle pushed to XCom lets another task of an attachable backend pick the sandbox up.

    Rules every backend keeps:

    - The constructor is cheap: it runs when a Dag file is parsed, so it stores arguments and
      checks them, and resolves connections and clients lazily, on first use.
    - ``create`` refuses, with :class:`SandboxTerminalError`, any spec field the backend cannot
      enforce (``capabilities``), before anything is provisioned. It never provisions something weaker.
    - ``destroy`` is idempotent.
    - :class:`SandboxTerminalError` for what no caller can fix (credentials, a sandbox that is
      gone); :class:`SandboxError` for what they can.
    """

    conn_name_attr = "sandbox_conn_id"
    default_conn_name = "sandbox_default"
    conn_type = "sandbox"
    hook_name = "Sandbox"

    #: Short backend name, used in messages and tool ids (``"local"``, ``"docker"``).
    name: ClassVar[str] = "sandbox"
    #: The backend's name in sentences (``"Docker"``).
    display_name: ClassVar[str] = "sandbox"
    #: What the backend can enforce; see :class:`Capabilities`.
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: Every handle of this backend matches this pattern in full; checked before any call.
    handle_pattern: ClassVar[re.Pattern[str]] = NAMED_HANDLE
    #: What a handle looks like, and an example, for error messages.
    handle_shape: ClassVar[str] = (
        f"{SANDBOX_NAME_PREFIX!r} followed by letters, digits, '.', '_' or '-' (no '/' and no spaces)"
    )
    handle_example: ClassVar[str] = SANDBOX_NAME_PREFIX + "0123456789ab"
    #: The backend's settings: hook arguments over connection extras over defaults, and the form.
    settings: ClassVar[SettingsTable] = SettingsTable()
    #: The connection form's standard fields (hidden, relabelled, placeholders).
    ui_behaviour: ClassVar[Mapping[str, Any]] = {}
    #: Whether another task can find this backend's sandboxes by handle (``attach``/``release``).
    attachable: ClassVar[bool] = False
    #: The spec ``test_connection`` provisions with; None (the default) for no network, or an open one
    #: when ``capabilities`` cannot block it.
    connection_test_spec: ClassVar[SandboxSpec | None] = None
    #: Whether commands can run detached here (:meth:`start_detached`, :meth:`poll`, :meth:`stop`), checked
    #: from another process than the one that started them: what ``deferrable=True`` needs.
    detached_commands: ClassVar[bool] = False
    #: For a backend that cannot, why not, in a sentence that completes the refusal.
    detached_refusal: ClassVar[str] = (
        "it has no way to leave a command running in the background and check on it from another process."
    )

    workdir: str = DEFAULT_WORKDIR

    #: The backend's connection form (``hooks/forms/<backend>.py``); it sets ``conn_type``,
    #: ``hook_name``, ``conn_name_attr``, ``default_conn_name``, ``settings`` and ``ui_behaviour``.
    form: ClassVar[ConnectionForm | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """
        Take a backend's form, document its settings from the table, and check that it words every
        network mode it accepts.

        :raises TypeError: for a backend with a connection type whose ``capabilities.network`` leaves out
            the phrase of a mode it accepts, or whose docstring documents a setting by hand.
        """
        super().__init_subclass__(**kwargs)
        form = cls.__dict__.get("form")
        if form is not None:
            cls.conn_type = form.conn_type
            cls.hook_name = form.hook_name
            cls.conn_name_attr = form.conn_name_attr
            cls.default_conn_name = form.default_conn_name
            cls.settings = form.settings
            cls.ui_behaviour = form.ui_behaviour
            cls.__doc__ = form.settings.document(cls.__name__, cls.__doc__, cls.__init__)
        if form is not None or "conn_type" in cls.__dict__:
            _check_network_words(cls)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: Expiry times (Unix seconds) this hook learnt, by handle, to clamp deadlines without asking again.
        self._known_expiry: dict[str, float] = {}
        #: Why this hook destroyed each sandbox it destroyed (the latest few), for a command running in it then.
        self._destroyed_because: dict[str, str] = {}
        #: When the running connection test must have answered (monotonic seconds); None outside a test.
        self._test_ends: float | None = None

    def connection_or_none(self, *, otherwise: str | None = None) -> Any:
        """
        The connection this hook names, else its default connection, or None when it is the default
        connection (named or not) and does not exist.

        That a default connection does not exist is remembered for the rest of the worker process (one
        task: each ask is a round trip to the supervisor, and a task asks for its hook's settings and
        for its log policy); one defined in the environment (``AIRFLOW_CONN_<NAME>``) is always looked up.

        :param otherwise: what applies without a connection, for the error about a named one that does
            not exist (``"the worker's own Docker Engine"``); None raises Airflow's own error instead.
        :raises SandboxTerminalError: when a connection named explicitly does not exist, with ``otherwise``.
        :raises AirflowNotFoundException: the same, without ``otherwise``.
        """
        from airflow.exceptions import AirflowNotFoundException

        named = getattr(self, self.conn_name_attr, None)
        if named and named != self.default_conn_name:
            try:
                return self.get_connection(named)
            except AirflowNotFoundException:
                if otherwise is None:
                    raise
                raise SandboxTerminalError(
                    f"The Airflow connection {named!r} does not exist. Define it with type {self.conn_type}, or "
                    f"leave {self.conn_name_attr} unset to use {otherwise}."
                ) from None
        name = self.default_conn_name
        if name in _MISSING_DEFAULTS and f"AIRFLOW_CONN_{name.upper()}" not in os.environ:
            return None
        try:
            conn = self.get_connection(name)
        except AirflowNotFoundException:
            _MISSING_DEFAULTS.add(name)
            return None
        _MISSING_DEFAULTS.discard(name)
        return conn

    # -- what a backend implements -------------------------------------------------------------------

    @abstractmethod
    def _provision(self, request: ProvisionRequest) -> str:
        """Make the sandbox ``request`` describes, ready for commands; return its handle."""

    @abstractmethod
    def _run(self, handle: str, command: str, *, timeout: float, output: OutputSink) -> RunOutcome:
        """
        Run ``command`` with ``sh -c`` in the workdir, writing output to ``output`` as it arrives,
        killing everything it started after ``timeout`` seconds (already clamped).

        :raises SandboxTerminalError: if the sandbox is gone.
        """

    @abstractmethod
    def _destroy(self, handle: str) -> None:
        """Remove the sandbox and everything in it; a sandbox that is gone is not an error."""

    def _read_back_hint(self, handle: str, path: str) -> None:
        """``run_command(read_back=path)``: the caller reads ``path`` right after this command; a backend may fetch it with the command. Default: nothing."""

    def _run_staged(
        self, handle: str, command: str, stage: Sequence[ImportEntry], *, timeout: float, output: OutputSink
    ) -> RunOutcome:
        """``_run`` after writing ``stage`` in: :meth:`import_batch`, then ``_run``; override to do both at once."""
        self.import_batch(handle, stage)
        return self._run(handle, command, timeout=timeout, output=output)

    def _refusal(self, spec: SandboxSpec) -> str | None:
        """A backend-specific reason to refuse ``spec``, phrased as what to change; None to accept."""
        return None

    def describe_network(self, spec: SandboxSpec) -> str | None:
        """
        Override point: what a sandbox made from ``spec`` can reach, in sentences for an agent, when
        ``capabilities.network`` cannot say it (the wording depends on a setting, say); None (the
        default) for the wording built from ``capabilities.network``.
        """
        return None

    def location(self, handle: str) -> str | None:
        """
        Override point: where sandbox ``handle`` lives, in words for the task log's provisioning line
        (a directory on this worker, say); None (the default) when the handle says enough.
        Nothing is contacted.
        """
        return None

    def network_description(self, spec: SandboxSpec) -> str:
        """
        What a sandbox made from ``spec`` can reach on this backend, in sentences for an agent (the
        ``run_command`` description): :meth:`describe_network`, else the wording built from
        ``capabilities.network``; for a setting the backend refuses, the refusal. Nothing is contacted.
        """
        network = SandboxSpec(
            block_network=spec.block_network,
            allow_egress_to=spec.allow_egress_to,
            allow_egress_to_cidrs=spec.allow_egress_to_cidrs,
        )
        try:
            self.check_spec(network)
        except SandboxTerminalError as err:
            return f"No sandbox is provisioned with this network setting: {err}"
        return self.describe_network(network) or describe_reach(self.capabilities.network, network)

    def _remaining_lifetime(self, handle: str) -> float | None:
        """Seconds the sandbox has left, or None when unknown. Default: what this hook learnt at create."""
        expires = self._known_expiry.get(handle)
        return None if expires is None else expires - time.time()

    def _lifetime_seconds(self) -> float:
        """The lifetime of a new sandbox, in seconds: the ``sandbox_timeout`` setting by default."""
        value = self._resolved().get("sandbox_timeout")
        return float(value) if value else 3600.0

    def _resolved(self) -> Mapping[str, Any]:
        """The backend's resolved settings; backends with a connection override this."""
        return {}

    # -- the template --------------------------------------------------------------------------------

    def check_spec(self, spec: SandboxSpec | None) -> SandboxSpec:
        """
        Return ``spec`` (``SandboxSpec()`` for None) if this backend can enforce all of it.

        Nothing is contacted: call it before provisioning anything, even at parse time.

        :raises SandboxTerminalError: naming what it cannot enforce and what to change.
        """
        spec = SandboxSpec() if spec is None else spec
        if not isinstance(spec, SandboxSpec):
            raise ValueError(f"spec must be a SandboxSpec, got {type(spec).__name__}.")
        _check_env_shape(spec.env)
        caps = self.capabilities
        missing: list[str] = []
        if not spec.block_network and not caps.open_network:
            missing.append("an open network (block_network=False)")
        if spec.block_network and not spec.has_allowlist and not caps.no_network:
            missing.append("a blocked network (block_network=True)")
        if spec.allow_egress_to and not caps.egress_hosts:
            missing.append("an egress allowlist of hostnames (allow_egress_to)")
        if spec.allow_egress_to_cidrs and not caps.egress_cidrs:
            missing.append("an egress allowlist of address ranges (allow_egress_to_cidrs)")
        if spec.owner and not self.attachable:
            missing.append("an owner for later tasks to attach (owner), since its sandboxes cannot be attached")
        if missing:
            advice = caps.advice or "Drop those fields, or use a backend that enforces them (see the README)."
            raise SandboxTerminalError(
                f"The {self.display_name} backend cannot enforce {' or '.join(missing)}, and it does not provision "
                f"a sandbox weaker than asked. {advice}"
            )
        size = env_bytes(spec.env)
        if caps.max_env_bytes is not None and size > caps.max_env_bytes:
            raise SandboxTerminalError(
                f"SandboxSpec.env holds {size} bytes, more than the {self.display_name} backend can pass "
                f"({caps.max_env_bytes} bytes). Stage large values as files (files= or inputs=) and read them there."
            )
        count = len(spec.env or {})
        if caps.max_env_entries is not None and count > caps.max_env_entries:
            raise SandboxTerminalError(
                f"SandboxSpec.env holds {count} variables, more than the {self.display_name} backend can pass "
                f"({caps.max_env_entries}). Put related values into one variable (as JSON, say) or into a file "
                "(files=), and read them there."
            )
        reason = self._refusal(spec)
        if reason:
            raise SandboxTerminalError(reason)
        return spec

    def create(self, *, spec: SandboxSpec | None = None) -> str:
        """
        Provision a sandbox and return its handle.

        :param spec: what the sandbox must be; None means ``SandboxSpec()`` (no network, no env).
        :raises SandboxTerminalError: if the spec asks for something this backend cannot enforce
            (before anything is provisioned), or provisioning fails.
        """
        spec = self.check_spec(spec)
        lifetime = float(self._lifetime_seconds())
        expires_at = time.time() + lifetime
        stamps = {
            EXPIRES_AT_TAG: str(int(expires_at)),
            NETWORK_TAG: encode_network_policy(spec),
            WORKDIR_TAG: self.workdir,
            **trace_stamps(),
        }
        if spec.owner:
            stamps[OWNER_TAG] = spec.owner
        request = ProvisionRequest(
            name=new_sandbox_name(),
            spec=spec,
            lifetime=lifetime,
            expires_at=expires_at,
            workdir=self.workdir,
            stamps=stamps,
        )
        handle = self._provision(request)
        self._known_expiry[handle] = expires_at
        return handle

    def check_handle(self, handle: Any) -> str:
        """
        Return ``handle`` if it can name a sandbox of this backend.

        :raises SandboxHandleError: (a ``ValueError`` and a ``SandboxTerminalError``) otherwise.
        """
        check_handle(handle)
        if not self.handle_pattern.fullmatch(handle) or handle in (".", ".."):
            raise SandboxHandleError(
                f"{handle!r} is not a {self.display_name} sandbox handle. Pass the string create() returned: "
                f"{self.handle_shape}, such as {self.handle_example!r}."
            )
        return handle

    def run_command(
        self,
        handle: str,
        command: str,
        *,
        timeout: float,
        max_output_bytes: int,
        on_output: OutputCallback | None = None,
        stage: Sequence[ImportEntry] = (),
        read_back: str | None = None,
    ) -> SandboxExecResult:
        """
        Run ``command`` through ``sh -c`` in the sandbox's working directory.

        :param timeout: seconds before the command's whole process tree is killed; cut to the
            sandbox's remaining lifetime when that is shorter (``applied_timeout`` says what applied).
        :param max_output_bytes: bytes kept per stream (the tail), applied while reading.
        :param on_output: called with ``("stdout" | "stderr", bytes)`` as output arrives, for live logs.
        :param stage: files to write in first (see :meth:`import_batch`), in the same launch where the
            backend can (``_run_staged``); a failure to write them raises before the command runs.
        :param read_back: a file the caller reads next with :meth:`read_file`, which a backend may
            fetch in the command's own launch (``_read_back_hint``); that read's checks and errors
            stay the same. Default None.
        :raises SandboxError: for an empty command or one holding NUL, or files that could not be staged.
        :raises SandboxTerminalError: if the sandbox is gone or past its lifetime.
        """
        handle = self.check_handle(handle)
        check_positive(timeout, "timeout")
        check_byte_count(max_output_bytes, "max_output_bytes")
        check_command(command)
        if handle in self._destroyed_because:
            raise SandboxTerminalError(
                f"Sandbox {handle} is gone: {self._destroyed_because[handle]}. Provision a new one."
            )
        budget = self._deadline(handle, float(timeout))
        sink = OutputSink(int(max_output_bytes), on_output)
        if read_back is not None:
            self._read_back_hint(handle, check_path(read_back))
        try:
            if stage:
                outcome = self._run_staged(handle, command, stage, timeout=budget, output=sink)
            else:
                outcome = self._run(handle, command, timeout=budget, output=sink)
        except SandboxError as err:
            # Whatever the backend made of its sandbox vanishing, the cause known here is the truth.
            why = self._why_ended(handle)
            if why is None:
                raise
            raise SandboxTerminalError(f"Sandbox {handle} ended while the command ran: {why}.") from err
        if handle in self._destroyed_because and not outcome.sandbox_terminated:
            # Destroyed meanwhile (on_kill, on another thread): whatever status the backend saw, that ended it.
            outcome = replace(outcome, sandbox_terminated=True)
        result = sink.result(outcome, budget)
        if outcome.sandbox_terminated:
            result = replace(result, ended_because=self._why_ended(handle))
            self._known_expiry.pop(handle, None)
        return result

    def _why_ended(self, handle: str) -> str | None:
        """Why sandbox ``handle`` ended, when this hook knows: it destroyed it, or its lifetime ran out."""
        if handle in self._destroyed_because:
            return self._destroyed_because[handle]
        expires = self._known_expiry.get(handle)
        if expires is not None and time.time() >= expires - 1.0:
            return "it reached the end of its lifetime (the backend's sandbox_timeout setting)"
        return None

    def _deadline(self, handle: str, timeout: float) -> float:
        """``timeout`` cut to the backend's longest deadline and to the lifetime the sandbox has left."""
        cap = self.capabilities.max_command_seconds
        if cap is not None:
            timeout = min(timeout, cap)
        left = self._remaining_lifetime(handle)
        if left is None or left >= timeout:
            return timeout
        if left <= 0:
            raise SandboxTerminalError(
                f"Sandbox {handle} has reached the end of its lifetime; provision a new one, or give the backend a "
                "longer sandbox_timeout."
            )
        return max(MIN_COMMAND_SECONDS, left)

    # -- detached commands ---------------------------------------------------------------------------

    def start_detached(self, handle: str, command: str, *, timeout: float, max_output_bytes: int) -> DetachedJob:
        """
        Start ``command`` through ``sh -c`` in the sandbox's working directory and return at once,
        the command running on; its output and exit status stay in the sandbox for :meth:`poll`.

        :param timeout: seconds before the command's process group is killed, enforced in the sandbox
            itself; cut to the lifetime the sandbox has left (the job's ``timeout`` says what applied).
        :param max_output_bytes: bytes of each stream the result's tails keep; the sandbox keeps at
            least this much of each stream (and at least :data:`~sandbox_provider.sandbox.jobs.RELAY_WINDOW_BYTES`).
        :returns: the :class:`~sandbox_provider.sandbox.jobs.DetachedJob` (its ``id`` names it).
        :raises SandboxError: for an empty command, or one the sandbox could not start (no coreutils).
        :raises SandboxTerminalError: on a backend without detached commands, or a sandbox that is gone.
        """
        handle = self.check_handle(handle)
        check_positive(timeout, "timeout")
        check_byte_count(max_output_bytes, "max_output_bytes")
        check_command(command)
        self._require_detached()
        budget = self._deadline(handle, float(timeout))
        job = jobs.new_job_id()
        started_at = time.time()
        code, out, err = self._job_exec(
            handle,
            jobs.start_command(job, command, budget, int(max_output_bytes)),
            timeout=JOB_CONTROL_TIMEOUT,
            starts=True,
        )
        if code != 0 or b"airflow-sandbox-job started" not in out:
            reason = err.decode("utf-8", "replace").strip()[-500:] or f"status {code}"
            raise SandboxError(f"Could not start a detached command in sandbox {handle}: {reason}")
        return DetachedJob(id=job, timeout=budget, started_at=started_at)

    def poll(
        self,
        handle: str,
        job: str | DetachedJob,
        since: JobCursor | None = None,
        *,
        max_bytes: int = jobs.POLL_BYTES,
        keep_cursor: bool = False,
        in_flight: bool = True,
    ) -> JobState:
        """
        Read what detached job ``job`` wrote since ``since`` (byte offsets of each stream; None: the
        start), at most ``max_bytes`` of each stream, and whether it ended. Read from the returned
        ``cursor`` on next time: no byte comes twice, and ``skipped`` counts any no longer kept.

        :param keep_cursor: record ``since`` in the sandbox, beside the output, as where this reader
            stands (it handed on everything before it); a reader that restarts finds it in the
            state's ``kept_cursor``. Default False.
        :param in_flight: with ``keep_cursor``, also record the ends of what this poll returns as in
            flight (the reader is handing them on until its next record), so a reader that restarts
            knows which bytes the one before may have handed on unrecorded (the state's
            ``in_flight``); False records that nothing is in flight. Default True.
        :raises SandboxError: when the sandbox holds no such job.
        :raises SandboxTerminalError: when the sandbox is gone.
        """
        handle = self.check_handle(handle)
        job_id = jobs.check_job_id(job)
        since = JobCursor.from_value(since)
        budget = int(check_byte_count(max_bytes, "max_bytes"))
        return self._poll_job(handle, job_id, since, budget, keep_cursor, in_flight)

    def _poll_job(
        self,
        handle: str,
        job: str,
        since: JobCursor | None,
        max_bytes: int,
        keep_cursor: bool = False,
        in_flight: bool = True,
    ) -> JobState:
        self._require_detached()
        code, out, err = self._job_exec(
            handle,
            jobs.poll_command(job, since, max_bytes, keep_cursor=keep_cursor, in_flight=in_flight),
            timeout=JOB_CONTROL_TIMEOUT,
            max_output_bytes=2 * (4 * (max_bytes // 3 + 1) + 256),
        )
        if code == jobs.NO_JOB_STATUS:
            raise SandboxError(
                f"Sandbox {handle} holds no detached command {job}: it was never started there, or the sandbox was "
                "replaced."
            )
        if code != 0:
            reason = err.decode("utf-8", "replace").strip()[-500:] or f"status {code}"
            raise SandboxError(f"Could not read the state of detached command {job} in sandbox {handle}: {reason}")
        return jobs.parse_poll(out, since, handle)

    def job_result(
        self, handle: str, job: str | DetachedJob, *, max_output_bytes: int, timeout: float
    ) -> SandboxExecResult:
        """
        The result of detached job ``job`` once it ended, as :meth:`run_command` would have given it:
        its exit status and the last ``max_output_bytes`` of each stream, with their totals.

        :param timeout: the deadline it ran under (the job's ``timeout``), for ``applied_timeout``.
        :raises SandboxError: when the job has not ended, or the sandbox holds no such job.
        :raises SandboxTerminalError: when the sandbox is gone.
        """
        handle = self.check_handle(handle)
        job_id = jobs.check_job_id(job)
        limit = int(check_byte_count(max_output_bytes, "max_output_bytes"))
        state = self._poll_job(handle, job_id, None, limit + 1)
        if state.exit_code is None:
            raise SandboxError(f"Detached command {job_id} in sandbox {handle} is still running; poll until it ended.")
        sink = OutputSink(limit)
        sink.restate("stdout", state.stdout, total_bytes=state.totals.stdout, newlines=state.newlines.stdout)
        sink.restate("stderr", state.stderr, total_bytes=state.totals.stderr, newlines=state.newlines.stderr)
        outcome = RunOutcome(exit_code=state.exit_code, timed_out=state.timed_out)
        return sink.result(outcome, float(timeout))

    def stop(self, handle: str, job: str | DetachedJob) -> None:
        """
        Kill detached job ``job`` (its process group) and wait, a few seconds at most, until its status
        is kept. A job that ended already, or that the sandbox does not hold, is no error.

        :raises SandboxTerminalError: when the sandbox is gone.
        """
        handle = self.check_handle(handle)
        job_id = jobs.check_job_id(job)
        self._require_detached()
        code, _, err = self._job_exec(handle, jobs.stop_command(job_id), timeout=JOB_CONTROL_TIMEOUT)
        if code not in (0, jobs.NO_JOB_STATUS):
            log.warning(
                "Detached command %s in sandbox %s did not confirm it stopped (status %s)", job_id, handle, code
            )

    def _require_detached(self) -> None:
        if not self.detached_commands:
            raise SandboxTerminalError(
                f"The {self.display_name} backend cannot run commands detached. {self.detached_refusal}".strip()
            )

    def _job_exec(
        self,
        handle: str,
        command: str,
        *,
        timeout: float,
        starts: bool = False,
        max_output_bytes: int = JOB_CONTROL_OUTPUT_BYTES,
    ) -> tuple[int, bytes, bytes]:
        """``(exit status, stdout, stderr)`` of a control program (see :meth:`_control`), ``max_output_bytes`` of stdout at most."""
        output = OutputSink(max(max_output_bytes, JOB_CONTROL_OUTPUT_BYTES))
        code = self._control(handle, command, timeout=timeout, starts=starts, output=output)
        return code, output.out.getvalue(), output.err.getvalue()

    def _control(self, handle: str, command: str, *, timeout: float, starts: bool, output: OutputSink) -> int:
        """
        Run a control program of a detached command (a short ``sh -c`` command line), writing its
        output to ``output``, and return its exit status. What it leaves running in the background
        must live on, and nothing may end the sandbox's other processes. Default: :meth:`_run`, for
        backends whose commands leave background processes be; a backend whose ``_run`` ends them
        overrides this.

        :param starts: this program starts a job (a backend may first end what an earlier holder
            left running, as before any command); the others only read or stop one.
        :raises SandboxError: when it ran past ``timeout``; :raises SandboxTerminalError: sandbox gone.
        """
        outcome = self._run(handle, command, timeout=timeout, output=output)
        if outcome.sandbox_terminated:
            raise SandboxTerminalError(f"Sandbox {handle} ended while a detached command was checked on.")
        if outcome.timed_out:
            raise SandboxError(f"Checking on a detached command in sandbox {handle} took longer than {timeout:g}s.")
        return outcome.exit_code

    def detached_arguments(self) -> dict[str, Any]:
        """
        Keyword arguments that build, in another process (the triggerer), a hook of this class that
        reaches the same sandboxes: the connection id and the settings given as arguments. JSON values.
        """
        arguments: dict[str, Any] = {}
        conn_id = getattr(self, self.conn_name_attr, None)
        if conn_id is not None:
            arguments[self.conn_name_attr] = conn_id
        given = getattr(self, "_args", None) or {}
        arguments.update({name: value for name, value in dict(given).items() if value is not None})
        return arguments

    def destroy(self, handle: str, *, reason: str | None = None, wait: bool = True) -> None:
        """
        Remove the sandbox and everything in it. Destroying a sandbox that is gone is not an error.

        :param reason: why, as words that follow "destroyed because" would (``"the task was stopped"``);
            a command still running in it then fails saying so. Default: destroyed by this worker.
        :param wait: True (the default): return once everything of it is removed. False: return once
            it has ended (nothing of it runs any more, and no caller reaches it); the removal of what
            is left (its files, its container) may finish afterwards, which the backend still
            guarantees (its lifetime, its sweep). For a caller that depends on nothing of it being
            left, such as a count of leftovers, keep True.
        """
        handle = self.check_handle(handle)
        # Recorded first: a command failing meanwhile (on another thread) must already find the reason.
        self._destroyed_because[handle] = (
            f"this worker destroyed it because {reason}" if reason else "this worker destroyed it"
        )
        while len(self._destroyed_because) > 256:
            self._destroyed_because.pop(next(iter(self._destroyed_because)))
        try:
            if wait:
                self._destroy(handle)
            else:
                self._end(handle)
        except BaseException:
            self._destroyed_because.pop(handle, None)
            raise
        self._known_expiry.pop(handle, None)

    def _end(self, handle: str) -> None:
        """
        :meth:`destroy` without waiting (``wait=False``): end the sandbox now, and leave the removal
        of what is left to finish afterwards. Default: :meth:`_destroy`, the whole removal now.
        """
        self._destroy(handle)

    def find_sandboxes(self, stamps: Mapping[str, str]) -> dict[str, dict[str, str]]:
        """
        This backend's sandboxes whose creation stamps hold every item of ``stamps``, as
        ``{handle: its stamps}``. The session uses it, before provisioning, to end what earlier tries
        of the same task instance left running (see :func:`~sandbox_provider.sandbox.spec.trace_stamps`).

        :raises NotImplementedError: on a backend that cannot search its sandboxes by stamps (the
            default); the session then logs that it could not look.
        """
        raise NotImplementedError(f"The {self.display_name} backend cannot look for sandboxes by their stamps.")

    #: For a backend that cannot list its sandboxes: one sentence saying what ends what a killed
    #: worker leaves there instead (the vendor's own lifetime, say). Empty where the backend can list.
    leftovers_bound: ClassVar[str] = ""

    def sandbox_records(self) -> list[SandboxRecord]:
        """
        Every sandbox of this provider the hook's connection reaches, in any state, as uniform
        :class:`~sandbox_provider.sandbox.leftovers.SandboxRecord` s sorted by handle. Default: from
        :meth:`find_sandboxes` with no filter (stamps only); a backend that knows a sandbox's state or
        age adds them. ``airflow sandboxes`` lists and sweeps these.

        :raises NotImplementedError: on a backend that cannot list its sandboxes (see
            :attr:`leftovers_bound`); :raises SandboxTerminalError: if the backend cannot be reached.
        """
        return [SandboxRecord(handle, dict(stamps)) for handle, stamps in sorted(self.find_sandboxes({}).items())]

    # -- files: native, or ShellFiles ----------------------------------------------------------------

    @abstractmethod
    def read_file(self, handle: str, path: str, *, max_bytes: int) -> bytes:
        """
        Return the bytes of the regular file at ``path`` (relative paths resolve in the workdir).

        :param max_bytes: the most bytes to transfer; checked before or while copying.
        :raises SandboxFileTooLargeError: if the file holds more than ``max_bytes``.
        :raises SandboxError: if it is missing, a directory or not a regular file.
        """

    def write_file(self, handle: str, path: str, data: bytes) -> None:
        """
        Write ``data`` to ``path``, creating parent directories and replacing what was there.

        :raises SandboxError: if the path cannot be written (a directory there, say).
        """
        import io

        if isinstance(data, str):
            data = data.encode()
        self.import_file(handle, path, io.BytesIO(data))

    @abstractmethod
    def import_file(self, handle: str, path: str, source: IO[bytes]) -> int:
        """Stream ``source`` into the file at ``path`` in bounded memory; return the bytes written."""

    @abstractmethod
    def export_file(self, handle: str, path: str, stream: IO[bytes], *, max_bytes: int) -> int:
        """
        Copy the regular file at ``path`` into the writable binary ``stream``; return the bytes copied.

        :raises SandboxFileTooLargeError: if the file holds more than ``max_bytes``.
        :raises SandboxError: if it is missing, not a regular file, or changed while it was copied.
        :raises SandboxTerminalError: if the sandbox ended during the copy.
        """

    @abstractmethod
    def list_directory(self, handle: str, path: str = ".") -> list[tuple[str, bool]]:
        """
        List the entries of the directory at ``path`` as ``(name, is_directory)`` pairs, sorted by name.

        :raises SandboxError: if ``path`` is missing or not a directory, or holds more entries than one
            listing returns.
        """

    def import_batch(self, handle: str, entries: Sequence[ImportEntry]) -> int:
        """
        Write each :class:`~sandbox_provider.sandbox.batch.ImportEntry` (a regular file) in, making
        parent directories, replacing what is there; return the bytes. Default: ``import_file`` each.

        :raises SandboxError: naming the entry that failed; :raises SandboxTerminalError: sandbox gone.
        """
        from sandbox_provider.sandbox.batch import default_import_batch

        return default_import_batch(self, self.check_handle(handle), entries)

    def export_batch(
        self, handle: str, requests: Sequence[ExportRequest], sink: ExportSink, *, limits: ExportLimits
    ) -> int:
        """
        Copy the regular files each :class:`~sandbox_provider.sandbox.batch.ExportRequest` names (as the
        sandbox sees them) into ``sink``, within ``limits``; return the bytes. Default: ``export_file`` each.

        :raises SandboxFileTooLargeError: over a limit; :raises SandboxError: missing, wrong kind, hostile.
        """
        from sandbox_provider.sandbox.batch import default_export_batch

        return default_export_batch(self, self.check_handle(handle), requests, sink, limits=limits)

    # -- attach: see sandbox.attach.Attachable -------------------------------------------------------

    def attach(self, handle: str, *, owner: str, holder: str) -> Any:
        """:raises SandboxTerminalError: this backend's sandboxes cannot be attached."""
        raise SandboxTerminalError(
            f"The {self.display_name} backend cannot attach to sandboxes provisioned by another task; provision one "
            "in this task instead, or use an attachable backend (see the README's backends table)."
        )

    def release(self, handle: str, *, holder: str) -> None:
        """Nothing to release on a backend that cannot attach."""

    # -- connections ---------------------------------------------------------------------------------

    #: A sentence the success message of a connection test ends with (where tasks' sandboxes run).
    test_connection_note: ClassVar[str] = ""

    def patience(self, seconds: float) -> float:
        """
        ``seconds``, cut while a connection test runs to what is left of its :data:`TEST_PATIENCE`
        (never below half a second). A backend's retry loops and waits take their budgets through it,
        so a Test against an unreachable service answers within the Test button's patience.
        """
        if self._test_ends is None:
            return seconds
        return max(0.5, min(seconds, self._test_ends - time.monotonic()))

    @property
    def testing(self) -> bool:
        """Whether a connection test is running on this hook."""
        return self._test_ends is not None

    def test_connection(self) -> tuple[bool, str]:
        """
        Check the backend from the process running the test; return ``(ok, message)``, never raise.

        The message names the connection the person tested (not the temporary id Airflow's API
        server tests it under) and the process that ran the test: the API server for the UI's Test
        button, the CLI process for ``airflow connections test``. The check itself is
        :meth:`_check_connection`.
        """
        origin = connection_test_origin(getattr(self, self.conn_name_attr, None))
        self._test_ends = time.monotonic() + TEST_PATIENCE
        try:
            ok, message = True, self._check_connection()
            if self.test_connection_note:
                message = f"{message} {self.test_connection_note}"
        except Exception as err:  # test_connection must report, never raise
            ok, message = False, f"{type(err).__name__}: {err}"
        finally:
            self._test_ends = None
        subject = f"Connection {origin.tested_id!r}" if origin.tested_id else f"The {self.display_name} backend"
        return ok, origin.name_tested(f"{subject}, tested by {origin.runner}: {message}")

    def _check_connection(self) -> str:
        """
        Provision a sandbox, run a command in it and destroy it; return what happened, as a sentence.

        :raises Exception: whatever stopped the check; :meth:`test_connection` reports it.
        """
        spec = self.connection_test_spec or SandboxSpec(block_network=self.capabilities.no_network)
        handle = self.create(spec=spec)
        try:
            result = self.run_command(handle, "echo sandbox-ok", timeout=60, max_output_bytes=4096)
        finally:
            try:
                self.destroy(handle)
            except Exception:
                log.warning("Could not destroy test sandbox %s", handle, exc_info=True)
        if not (result.ok and "sandbox-ok" in result.stdout):
            raise SandboxError(
                f"A test command in sandbox {handle} on the {self.display_name} backend failed: "
                f"{result.stderr.strip()[-500:]}"
            )
        return f"provisioned sandbox {handle} on the {self.display_name} backend, ran a command in it and destroyed it."


#: The contract's base class under the name the public guide uses.
SandboxBackend = SandboxHook
