"""
``SandboxToolset``: a shell and files in an isolated sandbox, as pydantic-ai tools.

The toolset is a thin layer over :class:`~sandbox_provider.engine.session.SandboxSession`: the
session provisions or attaches, runs, exports and tears down; the toolset turns model requests
into session calls and shapes what comes back (masked, then cut to the output limits).
"""

from __future__ import annotations

import asyncio
import copy
import math
import sys
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, NotRequired, Self

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, with_config
from pydantic_ai.exceptions import ModelRetry
from pydantic_ai.tools import ToolDefinition
from pydantic_ai.toolsets.abstract import AbstractToolset, ToolsetTool
from typing_extensions import TypedDict

from sandbox_provider.engine.options import SessionOptions, check_attachable
from sandbox_provider.engine.output import MASK_MARGIN_BYTES, command_output, file_window, head_lines, mask_text
from sandbox_provider.engine.session import SandboxSession
from sandbox_provider.engine.transfer import DEFAULT_MAX_EXPORT_BYTES
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError, SandboxTerminalError
from sandbox_provider.sandbox.hook import SandboxHook
from sandbox_provider.sandbox.output import format_size, listing
from sandbox_provider.sandbox.spec import OWNER_TAG, SandboxSpec, check_byte_count, check_positive
from sandbox_provider.toolsets._agent_guards import (
    explain_refused_approval,
    present_to_agent_operator,
    refuse_unsafe_agent_features,
)

__all__ = ["SandboxToolset"]


_OPERATIONS = ("run_command", "read_file", "write_file", "list_directory")
_TOOL_RETRIES = 3


# Strict: a value of the wrong type (``true`` or ``"10"`` for a number) is refused, never converted, and the
# refusal goes back to the model as a retry naming the argument and what it must be. The bounds are in the
# schema the model sees.
_STRICT = ConfigDict(strict=True, extra="forbid")


@with_config(_STRICT)
class _RunCommandArgs(TypedDict):
    command: Annotated[str, Field(min_length=1, description="The shell command line, run with sh -c in the sandbox.")]
    timeout_seconds: NotRequired[
        Annotated[
            float | None,
            Field(
                gt=0,
                allow_inf_nan=False,
                description="Seconds to wait before the command is killed, above 0. Omit it for the default.",
            ),
        ]
    ]


@with_config(_STRICT)
class _ReadFileArgs(TypedDict):
    path: Annotated[str, Field(min_length=1, description="File path; a relative path starts at the working directory.")]
    offset: NotRequired[Annotated[int | None, Field(ge=1, description="First line to show, counting from 1.")]]
    limit: NotRequired[Annotated[int | None, Field(ge=1, description="Most lines to show, at least 1.")]]


@with_config(_STRICT)
class _WriteFileArgs(TypedDict):
    path: Annotated[str, Field(min_length=1, description="File path; missing parent directories are created.")]
    content: Annotated[str, Field(description="The complete new text of the file.")]


@with_config(_STRICT)
class _ListDirectoryArgs(TypedDict):
    path: NotRequired[
        Annotated[str | None, Field(min_length=1, description="Directory to list. Omit it for the working directory.")]
    ]


_ARGS: dict[str, TypeAdapter[Any]] = {
    "run_command": TypeAdapter(_RunCommandArgs),
    "read_file": TypeAdapter(_ReadFileArgs),
    "write_file": TypeAdapter(_WriteFileArgs),
    "list_directory": TypeAdapter(_ListDirectoryArgs),
}


def _schema(op: str) -> dict[str, Any]:
    schema = _ARGS[op].json_schema()
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    schema["additionalProperties"] = False
    return schema


def _argument_errors(err: ValidationError) -> str:
    """What was wrong with each argument, in one line: ``timeout_seconds: Input should be a valid number (got True)``."""
    parts = []
    for item in err.errors(include_url=False):
        where = ".".join(str(p) for p in item.get("loc", ())) or "arguments"
        parts.append(f"{where}: {item.get('msg', 'invalid')} (got {item.get('input')!r})")
    return "; ".join(parts)


def lifetime_note(remaining: float | None) -> str:
    """Tell the model how long an attached sandbox had left when the run began."""
    if remaining is None:
        return "How long it has left is not known."
    if remaining < 60:
        return "Less than a minute of its lifetime was left when this run began, so finish quickly."
    minutes = round(remaining / 60)
    if minutes == 1:
        return "About 1 minute of its lifetime was left when this run began."
    return f"About {minutes} minutes of its lifetime were left when this run began."


def _check_naming(backend: SandboxHook, tool_prefix: Any, attach_to: Any, owner: Any) -> None:
    """The toolset's tool prefix and attach arguments; :raises ValueError: saying what to change."""
    if not isinstance(tool_prefix, str) or (tool_prefix and not tool_prefix.isidentifier()):
        raise ValueError(f"tool_prefix must be a Python identifier such as 'py' or 'node_box', got {tool_prefix!r}.")
    if attach_to is not None:
        check_attachable(backend)
    if attach_to is not None and (not isinstance(attach_to, str) or not attach_to.strip()):
        raise ValueError(f"attach_to must be a sandbox handle or a template that renders to one, got {attach_to!r}.")
    if owner is not None and attach_to is None:
        raise ValueError("owner only applies together with attach_to; drop it, or pass attach_to.")


def _check_limits(
    *,
    default_command_timeout: Any,
    max_command_timeout: Any,
    max_output_bytes: Any,
    max_output_lines: Any,
    max_read_bytes: Any,
    max_export_bytes: Any,
) -> None:
    """The toolset's timeouts and byte and line limits; :raises ValueError: for a bad bound or order."""
    check_positive(default_command_timeout, "default_command_timeout")
    check_positive(max_command_timeout, "max_command_timeout")
    for name, value in (
        ("max_output_bytes", max_output_bytes),
        ("max_read_bytes", max_read_bytes),
        ("max_export_bytes", max_export_bytes),
    ):
        check_byte_count(value, name)
    check_byte_count(max_output_lines, "max_output_lines", unit="lines")
    if default_command_timeout > max_command_timeout:
        raise ValueError(
            f"default_command_timeout ({default_command_timeout}) must not exceed max_command_timeout "
            f"({max_command_timeout}); raise max_command_timeout or lower the default."
        )


def _check_own_sandbox(
    spec: SandboxSpec | None, attach_to: str | None, exports: Mapping[str, str], export_conn_id: str | None
) -> None:
    """What only an agent's toolset refuses: its own sandbox ends with the run. :raises ValueError:"""
    if attach_to is not None and exports:
        raise ValueError(
            "exports cannot be combined with attach_to: the attached sandbox outlives this run and "
            "belongs to the task that provisioned it, so collect its files in a later task."
        )
    if attach_to is None and spec is not None and spec.owner is not None:
        raise ValueError(
            "SandboxSpec.owner marks a sandbox for another task to attach to, but the toolset "
            "destroys the sandbox it provisions when the run ends. Provision it in a task with "
            "SandboxSpec(owner=...) and pass the handle as attach_to, or drop owner."
        )
    if export_conn_id is not None and not exports:
        raise ValueError("export_conn_id only applies together with exports; drop it, or pass exports.")


class SandboxToolset(AbstractToolset[Any]):
    """
    Tools that give an agent a shell and files in an isolated sandbox.

    The tools are ``run_command(command, timeout_seconds)``, ``read_file(path, offset, limit)``,
    ``write_file(path, content)`` and ``list_directory(path)``, each named ``<tool_prefix>_<tool>``
    when a prefix is given. Use it in ``AgentOperator(toolsets=[...])`` or any ``pydantic_ai.Agent``.

    Each agent run gets its own copy and its own sandbox, provisioned on the first tool call and
    destroyed when the run ends; the files named in ``exports`` are copied out first, and only if
    the run succeeded. With ``attach_to`` the run uses a sandbox an earlier task provisioned
    instead, claims it when the run starts, and releases it (never destroys it) at the end.

    Outside pydantic-ai, open it with ``with toolset:`` or ``async with toolset:`` and call
    :meth:`call` (or :meth:`acall`) with a tool name and its arguments.

    With common-ai's ``AgentOperator`` it is a ``SandboxToolset`` to the operator's guards (it
    registers as a virtual subclass of common-ai's class): ``durable=True`` is refused with it,
    ``enable_hitl_review=True`` unless it is attached, when the Dag is parsed, and a tool that needs
    approval fails the task unless it is attached. Built per run by a function, where the operator
    cannot see it, it refuses ``durable`` and unattached review itself when the run opens it.

    The ``run_command`` description says what the sandbox can reach, in the backend's words
    (``backend.network_description(spec)``), and results read the same on every backend.

    A mistake the model can fix (a bad path, a file over the read limit, a bad timeout) goes back
    to it as a retry prompt; what it cannot fix (provisioning, credentials, an attached sandbox
    that ended) raises :class:`~sandbox_provider.sandbox.errors.SandboxTerminalError` and fails the
    task. A command that exits non-zero or times out is ordinary output. Every result passes
    through Airflow's secret masker before it is cut to the output limits.

    :param backend: the sandbox hook, e.g. ``LocalSandboxHook()``. Its constructor must not touch
        a connection, because the toolset is built when the Dag file is parsed.
    :param spec: what the sandbox must be; default ``SandboxSpec()`` (no network, no env). Not with
        ``attach_to``, and without ``owner``: a sandbox the toolset provisions is destroyed at the
        end of the run, so nothing attaches to it.
    :param tool_prefix: prefix for the tool names, a Python identifier; needed to give one agent
        two sandboxes. Default ``""``.
    :param attach_to: handle of a sandbox another task provisioned (templated per task, e.g.
        ``"{{ ti.xcom_pull(task_ids='provision') }}"``). Needs an attachable backend.
    :param owner: the owner the attached sandbox must carry; default the current Dag run
        (``dag_run_owner(context)``). Only with ``attach_to``.
    :param exports: ``{sandbox path: storage URL}`` copied out when a run succeeds (templated);
        all or nothing. Not with ``attach_to``.
    :param export_conn_id: Airflow connection for the export URLs (templated). Only with ``exports``.
    :param default_command_timeout: seconds a command gets when the model names none. Default 60.
    :param max_command_timeout: most seconds a command may get; longer requests are shortened. Default 300.
    :param max_output_bytes: bytes shown per output stream or file read. Default 50 KiB.
    :param max_output_lines: lines shown per output stream or file read. Default 2000.
    :param max_read_bytes: largest file ``read_file`` transfers, in bytes. Default 5 MiB.
    :param max_export_bytes: largest file an export copies, in bytes. Default 1 GiB.
    :raises ValueError: for any bad combination or bound, when the Dag file is parsed.
    """

    #: Rendered by ``AgentOperator`` on a per-task copy of the toolset, never in place.
    agent_template_fields: ClassVar[tuple[str, ...]] = ("attach_to", "exports", "export_conn_id")

    def __init__(
        self,
        backend: SandboxHook,
        *,
        spec: SandboxSpec | None = None,
        tool_prefix: str = "",
        attach_to: str | None = None,
        owner: str | None = None,
        exports: Mapping[str, str] | None = None,
        export_conn_id: str | None = None,
        default_command_timeout: float = 60.0,
        max_command_timeout: float = 300.0,
        max_output_bytes: int = 50 * 1024,
        max_output_lines: int = 2000,
        max_read_bytes: int = 5 * 1024 * 1024,
        max_export_bytes: int = DEFAULT_MAX_EXPORT_BYTES,
    ) -> None:
        if not isinstance(backend, SandboxHook):
            raise ValueError(
                f"backend must be a sandbox hook instance such as LocalSandboxHook(), got {type(backend).__name__}."
            )
        _check_limits(
            default_command_timeout=default_command_timeout,
            max_command_timeout=max_command_timeout,
            max_output_bytes=max_output_bytes,
            max_output_lines=max_output_lines,
            max_read_bytes=max_read_bytes,
            max_export_bytes=max_export_bytes,
        )
        _check_naming(backend, tool_prefix, attach_to, owner)
        self._options = SessionOptions(
            spec=spec,
            attach_to=attach_to,
            sandbox_owner=owner,
            exports=exports or {},
            export_conn_id=export_conn_id,
            max_export_bytes=max_export_bytes,
            templated=True,
        )
        exports_map = dict(self._options.exports)
        _check_own_sandbox(spec, attach_to, exports_map, export_conn_id)

        self.backend = backend
        self.spec = spec
        self.tool_prefix = tool_prefix
        self.attach_to = attach_to
        self.owner = owner
        self.exports: dict[str, str] = exports_map
        self.export_conn_id = export_conn_id
        self.default_command_timeout = float(default_command_timeout)
        self.max_command_timeout = float(max_command_timeout)
        self.max_output_bytes = int(max_output_bytes)
        self.max_output_lines = int(max_output_lines)
        self.max_read_bytes = int(max_read_bytes)
        self.max_export_bytes = int(max_export_bytes)
        # Fixed here so a handle that renders to nothing can never turn into a provisioned sandbox.
        self._attach_mode = attach_to is not None
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        self._session: SandboxSession | None = None
        self._depth = 0
        self._exc_at_enter: BaseException | None = None
        self._forked = False
        self._description: str | None = None

    # -- identity ------------------------------------------------------------------------------------

    @property
    def id(self) -> str:
        base = f"sandbox-{self.backend.name}"
        return f"{base}-{self.tool_prefix}" if self.tool_prefix else base

    @property
    def tool_names(self) -> list[str]:
        """The names the model sees, in the order ``run_command, read_file, write_file, list_directory``."""
        return [self._tool_name(op) for op in _OPERATIONS]

    def _tool_name(self, op: str) -> str:
        return f"{self.tool_prefix}_{op}" if self.tool_prefix else op

    def _operation(self, name: str) -> str:
        for op in _OPERATIONS:
            if self._tool_name(op) == name:
                return op
        raise ValueError(f"Unknown tool: {name!r}; this toolset has {', '.join(self.tool_names)}.")

    def __repr__(self) -> str:
        mode = f"attach_to={self.attach_to!r}" if self._attach_mode else f"spec={self.spec!r}"
        return f"{type(self).__name__}({self.backend.name!r}, {mode}, tool_prefix={self.tool_prefix!r})"

    # -- per-run copies and the session ----------------------------------------------------------------

    async def for_run(self, ctx: Any) -> SandboxToolset:
        """Return a fresh copy for one agent run, with the same (rendered) configuration and no sandbox."""
        run_copy = self._copy_for_run()
        self._forked = True
        return run_copy

    def _copy_for_run(self) -> SandboxToolset:
        run_copy = copy.copy(self)
        run_copy._reset_run_state()
        return run_copy

    def _new_session(self) -> SandboxSession:
        # The session checks the rendered handle, and takes owner and holder from the running task.
        attach_to = self.attach_to if self._attach_mode else None
        options = self._options.rendered(attach_to=attach_to, exports=self.exports)
        return SandboxSession(self.backend, options)

    def _open(self) -> None:
        if self._depth:
            self._depth += 1
            return
        refuse_unsafe_agent_features(attached=self._attach_mode)
        session = self._new_session()
        session.open()
        self._session = session
        self._description = None
        self._depth = 1

    def _close(self, *, failed: bool) -> None:
        if not self._depth:
            return
        self._depth -= 1
        if self._depth:
            return
        session, self._session = self._session, None
        if session is None:
            return
        # The copy for_run handed out did the work; this instance's own session never provisioned.
        unused_original = self._forked and session.handle is None
        session.close(succeeded=not failed and not unused_original)

    def __enter__(self) -> Self:
        self._open()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._close(failed=exc_type is not None)

    async def __aenter__(self) -> Self:
        # pydantic-ai exits toolsets from an exit stack that may not pass the run's exception on,
        # so remember what was being handled here and compare at exit.
        self._exc_at_enter = sys.exc_info()[1]
        await asyncio.to_thread(self._open)
        return self

    async def __aexit__(self, exc_type=None, exc=None, tb=None) -> bool | None:
        handling = sys.exc_info()[1]
        failed = exc_type is not None or (handling is not None and handling is not self._exc_at_enter)
        if failed and not self._attach_mode:
            explain_refused_approval(exc if exc is not None else handling)
        await asyncio.to_thread(self._close, failed=failed)
        return None

    def _require_session(self) -> SandboxSession:
        session = self._session
        if session is None:
            raise SandboxTerminalError(
                "SandboxToolset is not open. Call its tools inside `with toolset:` or "
                "`async with toolset:` (an agent run does this itself), so the sandbox it provisions is "
                "removed when the block ends."
            )
        return session

    # -- what the model sees ---------------------------------------------------------------------------

    def _run_command_description(self) -> str:
        if self._description is not None:
            return self._description
        session = self._session
        attached = session.attached if session is not None else None
        workdir = (attached.workdir if attached is not None else None) or getattr(self.backend, "workdir", None)
        parts = [
            (
                "Run a shell command line in an isolated sandbox and return its output. Pipes, redirection, "
                "&& and globs work. Each call starts a new shell: files persist between calls, shell "
                "variables and background jobs do not. A non-zero exit status is reported, not raised: read "
                "stderr and fix the command. The sandbox has none of Airflow's connections, variables or "
                "environment."
            ),
            f"Relative paths start at {workdir or 'the working directory'}.",
            (
                f"Commands get {self._command_seconds()[0]:g}s unless you pass timeout_seconds "
                f"(at most {self._command_seconds()[1]:g}s)."
            ),
        ]
        if self._attach_mode:
            owner = (attached.tags.get(OWNER_TAG) if attached is not None else None) or self.owner
            whose = f" for {owner}" if owner else ""
            parts.append(
                f"This sandbox was provisioned by an earlier task{whose}, and your files stay in it after "
                "this run for a later task to collect."
            )
            if attached is not None and attached.network is not None:
                parts.append(self.backend.network_description(attached.network))
            else:
                parts.append(
                    "Its network access is whatever the task that provisioned it allowed; test before relying on it."
                )
            if attached is not None:
                parts.append(lifetime_note(attached.remaining_lifetime))
        else:
            parts.append(self.backend.network_description(self.spec or SandboxSpec()))
            if self.exports:
                names = listing([repr(p) for p in self.exports])
                verb = "is" if len(self.exports) == 1 else "are"
                parts.append(
                    f"When this run ends, {names} {verb} copied out of the sandbox and everything else is "
                    "deleted, so write your results there before you finish."
                )
            else:
                parts.append("The sandbox and everything in it are deleted when this run ends.")
        description = " ".join(parts)
        if session is not None:
            # Fixed for the run once attached, so the tool list (and a prompt cache) does not change per step.
            self._description = description
        return description

    def tool_definitions(self) -> list[ToolDefinition]:
        """The four tool definitions (name, description, JSON schema), for frameworks outside pydantic-ai."""
        descriptions = {
            "run_command": self._run_command_description(),
            "read_file": (
                "Read a text file from the sandbox. A long file is cut and the result says which offset "
                f"reads on; at most {self.max_output_lines} lines or {format_size(self.max_output_bytes)} "
                f"are shown at once, and files over {format_size(self.max_read_bytes)} must be read with a "
                "shell command."
            ),
            "write_file": (
                "Write a text file in the sandbox, replacing it if it exists and creating parent directories."
            ),
            "list_directory": "List a directory in the sandbox, sorted by name; directories end with '/'.",
        }
        definitions = []
        for op in _OPERATIONS:
            definitions.append(
                ToolDefinition(
                    name=self._tool_name(op),
                    description=descriptions[op],
                    parameters_json_schema=_schema(op),
                    sequential=True,
                    metadata={"code_arg_name": "command", "code_arg_language": "shell"}
                    if op == "run_command"
                    else None,
                )
            )
        return definitions

    async def get_tools(self, ctx: Any) -> dict[str, ToolsetTool[Any]]:
        return {
            tool_def.name: ToolsetTool(
                toolset=self,
                tool_def=tool_def,
                max_retries=_TOOL_RETRIES,
                args_validator=_ARGS[self._operation(tool_def.name)].validator,  # type: ignore[arg-type]
            )
            for tool_def in self.tool_definitions()
        }

    # -- calling tools -------------------------------------------------------------------------------

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: Any, tool: Any) -> str:
        op = self._operation(name)
        return await asyncio.to_thread(self._dispatch, op, dict(tool_args))

    def call(self, name: str, **arguments: Any) -> str:
        """
        Call a tool by name, for frameworks that call tools outside pydantic-ai; inside an open block.

        :returns: the text the model would see.
        :raises SandboxError: with a masked message the model can act on, for a mistake it can fix.
        :raises SandboxTerminalError: for what it cannot fix.
        :raises ValueError: for a tool name this toolset does not have.
        """
        op = self._operation(name)
        try:
            args = _ARGS[op].validate_python(arguments)
        except ValidationError as err:
            raise SandboxError(f"{name} was called with arguments it does not take: {_argument_errors(err)}") from None
        try:
            return self._dispatch(op, args)
        except ModelRetry as retry:
            raise SandboxError(str(retry.message)) from None

    async def acall(self, name: str, **arguments: Any) -> str:
        """Async :meth:`call`."""
        return await asyncio.to_thread(self.call, name, **arguments)

    def _dispatch(self, op: str, args: dict[str, Any]) -> str:
        session = self._require_session()
        try:
            if op == "run_command":
                text = self._run_command(session, args["command"], args.get("timeout_seconds"))
            elif op == "read_file":
                text = self._read_file(session, args["path"], args.get("offset"), args.get("limit"))
            elif op == "write_file":
                text = self._write_file(session, args["path"], args["content"])
            else:
                text = self._list_directory(session, args.get("path"))
        except SandboxTerminalError:
            raise
        except SandboxFileTooLargeError as err:
            raise ModelRetry(
                mask_text(
                    f"{err.path!r} is {format_size(err.size_bytes)}, over the {format_size(err.max_bytes)} "
                    "read limit. Read only the part you need with a shell command instead, e.g. head, tail, "
                    "sed -n '100,200p' or grep."
                )
            ) from None
        except SandboxError as err:
            raise ModelRetry(mask_text(f"{self._tool_name(op)} failed: {err}")) from None
        return mask_text(text)

    def _command_seconds(self) -> tuple[float, float]:
        """The default and the longest deadline of a command, in seconds, within what the backend allows."""
        cap = getattr(getattr(self.backend, "capabilities", None), "max_command_seconds", None)
        longest = self.max_command_timeout if cap is None else min(self.max_command_timeout, float(cap))
        return min(self.default_command_timeout, longest), longest

    def _run_command(self, session: SandboxSession, command: str, timeout_seconds: Any) -> str:
        default, longest = self._command_seconds()
        if timeout_seconds is None:
            budget = default
        else:
            if (
                isinstance(timeout_seconds, bool)
                or not isinstance(timeout_seconds, (int, float))
                or not math.isfinite(timeout_seconds)
                or timeout_seconds <= 0
            ):
                raise ModelRetry(f"timeout_seconds must be a number of seconds above 0, got {timeout_seconds!r}.")
            budget = min(float(timeout_seconds), longest)
        # The backend keeps MASK_MARGIN_BYTES more than is shown, for what masking after its cut needs.
        result = session.run(command, timeout=budget, max_output_bytes=self.max_output_bytes + MASK_MARGIN_BYTES)
        return command_output(result, timeout=budget, max_lines=self.max_output_lines, max_bytes=self.max_output_bytes)

    def _read_file(self, session: SandboxSession, path: str, offset: Any, limit: Any) -> str:
        start = 1 if offset is None else offset
        if not isinstance(start, int) or isinstance(start, bool) or start < 1:
            raise ModelRetry(f"offset counts lines from 1, got {offset!r}.")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ModelRetry(f"limit must be a number of lines above 0, got {limit!r}.")
        data = session.read_file(path, max_bytes=self.max_read_bytes)
        text = mask_text(data.decode("utf-8", errors="replace"))
        window = file_window(
            text, offset=start, limit=limit, max_lines=self.max_output_lines, max_bytes=self.max_output_bytes
        )
        if b"\0" in data[:8192]:
            window = (
                "[this looks like a binary file; it is shown as text with undecodable bytes replaced. "
                "Inspect it with a shell command such as od -c or xxd instead]\n" + window
            )
        return window

    def _write_file(self, session: SandboxSession, path: str, content: str) -> str:
        try:
            data = content.encode("utf-8")
        except UnicodeEncodeError:
            raise ModelRetry(
                "content holds characters that cannot be written as UTF-8 (unpaired surrogates); remove them "
                "and try again."
            ) from None
        session.write_file(path, data)
        return f"Wrote {len(data)} bytes to {path!r}."

    def _list_directory(self, session: SandboxSession, path: str | None) -> str:
        target = path or "."
        entries = session.list_directory(target)
        if not entries:
            return "(empty directory)"
        names = [mask_text(name) + ("/" if is_dir else "") for name, is_dir in sorted(entries)]
        kept, dropped = head_lines(names, max_lines=self.max_output_lines, max_bytes=self.max_output_bytes)
        text = "\n".join(kept)
        if dropped:
            text += (
                f"\n[... {dropped} more entr{'y' if dropped == 1 else 'ies'} not shown; list the rest with a "
                f"shell command such as ls -p {target} | tail -n +{len(kept) + 1}]"
            )
        return text


# AgentOperator applies its durable, review and approval guards to the toolsets it recognises as
# sandbox toolsets; this makes it recognise this one (see toolsets/_agent_guards.py).
present_to_agent_operator(SandboxToolset)
