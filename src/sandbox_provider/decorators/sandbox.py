"""
``@task.sandbox``: run a Python function's body inside a sandbox.

The function's source is shipped into the sandbox and run there by the sandbox's own Python (the
``python`` option). Arguments go in as JSON values (in marshal's format, which that Python reads
without an import) and the return value comes back as JSON; nothing is ever unpickled from a
sandbox. The function must therefore be self-contained: import what it
needs inside its body, and take and return JSON values (dicts with string keys, lists, strings,
numbers, booleans, None).
"""

from __future__ import annotations

import ast
import datetime
import inspect
import json
import marshal
import math
import os
import secrets
import shlex
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.sdk.bases.decorator import DecoratedOperator, TaskDecorator, task_decorator_factory
from airflow.sdk.definitions.context import KNOWN_CONTEXT_KEYS

from sandbox_provider.engine.options import is_reference
from sandbox_provider.operators.sandbox import SandboxCommandError, SandboxOperator
from sandbox_provider.sandbox import guest
from sandbox_provider.sandbox.errors import SandboxError, SandboxFileTooLargeError
from sandbox_provider.sandbox.output import format_size

if TYPE_CHECKING:
    from airflow.sdk import Context

    from sandbox_provider.engine.session import SandboxSession
    from sandbox_provider.sandbox.spec import SandboxExecResult

__all__ = ["sandbox_task"]

#: Default cap on the JSON return value, in bytes.
DEFAULT_MAX_RESULT_BYTES = 1024 * 1024
_FUTURE = "from __future__ import annotations\n"
#: marshal's format version 2 (no shared references), which every Python 3 reads.
_MARSHAL_VERSION = 2
#: Where a call's files live, relative to the sandbox's working directory.
_TASK_DIR = ".airflow-sandbox-task"


# -- parse-time checks -----------------------------------------------------------------------------------


def _check_callable(fn: Any) -> None:
    if not inspect.isfunction(fn):
        raise ValueError(f"@task.sandbox decorates a function defined with def, got {type(fn).__name__}.")
    if fn.__name__ == "<lambda>":
        raise ValueError(
            "@task.sandbox cannot run a lambda: its source cannot be shipped on its own. Define the function with def."
        )
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise ValueError(
            f"@task.sandbox cannot run the generator {fn.__name__}(): a task returns one value. Return a list instead "
            "of yielding."
        )
    if inspect.iscoroutinefunction(fn):
        raise ValueError(f"@task.sandbox runs plain functions; make {fn.__name__}() a def, not an async def.")


def _no_constant(name: str) -> Any:
    """Refuse NaN and the infinities in a result: they are not JSON, whatever Python's parser allows."""
    raise ValueError(f"{name} is not a JSON value")


def _json_problem(value: Any, *, allow_references: bool) -> str | None:
    """Describe why ``value`` cannot cross into the sandbox as JSON, or return None if it can."""
    if allow_references and is_reference(value):
        return None
    if value is None or isinstance(value, (bool, int, str)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value!r} has no JSON form"
    if isinstance(value, (list, tuple)):
        for item in value:
            problem = _json_problem(item, allow_references=allow_references)
            if problem:
                return problem
        return None
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"the dict key {key!r} is not a string (JSON would turn it into one)"
            problem = _json_problem(item, allow_references=allow_references)
            if problem:
                return problem
        return None
    return f"a {type(value).__name__} is not a JSON value"


def _check_arguments(op_args: Sequence[Any], op_kwargs: Mapping[str, Any], *, allow_references: bool) -> None:
    named = [(f"positional argument {i}", v) for i, v in enumerate(op_args)]
    named += [(f"argument {k!r}", v) for k, v in op_kwargs.items()]
    for where, value in named:
        problem = _json_problem(value, allow_references=allow_references)
        if problem:
            raise ValueError(
                f"@task.sandbox sends arguments into the sandbox as JSON, and {where} cannot be sent: {problem}. "
                "Pass dicts with string keys, lists, strings, numbers, booleans or None (e.g. str() a date)."
            )


# -- source shipping -------------------------------------------------------------------------------------


def shipped_source(fn: Callable) -> tuple[str, str, int]:
    """
    Return ``(source, function name, first line)`` for the function as the sandbox runs it.

    Every decorator is removed, however it is spelled (``@task.sandbox``, ``@task.sandbox(...)``,
    ``@sandbox_task``, an alias), by blanking its lines, so line numbers in a traceback are those
    of the Dag file.

    :raises ValueError: if the source cannot be read (a function typed into a REPL) or parsed.
    """
    try:
        lines, first_line = inspect.getsourcelines(fn)
    except (OSError, TypeError) as err:
        raise ValueError(
            f"@task.sandbox ships the source of {fn.__name__}() into the sandbox and cannot read it ({err}). Define "
            "the function in a .py file."
        ) from err
    text = _outdent(lines)
    try:
        tree = ast.parse(text)
    except SyntaxError as err:
        raise ValueError(f"Could not parse the source of {fn.__name__}() to ship it into the sandbox: {err}") from err
    node = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if node is None:
        raise ValueError(f"Could not find the def of {fn.__name__}() in its source to ship it into the sandbox.")
    foreign = [d for d in node.decorator_list if _is_foreign_decorator(d, fn)]
    if foreign:
        names = ", ".join("@" + ast.unparse(d) for d in foreign)
        raise ValueError(
            f"{fn.__name__}() carries {names}, which would be dropped when its body is shipped into the sandbox. "
            "Call that logic inside the function instead, or put @task.sandbox on a function without it."
        )
    kept = text.splitlines()
    for decorator in node.decorator_list:
        # The "@" sits on the decorator's first line; blank through its last.
        for index in range(decorator.lineno - 1, (decorator.end_lineno or decorator.lineno)):
            kept[index] = ""
    return "\n".join(kept) + "\n", node.name, max(1, first_line)


def _is_foreign_decorator(decorator: ast.expr, fn: Callable) -> bool:
    """
    True for a decorator that is neither ``@task.sandbox`` (however spelled) nor one of Airflow's
    own (``@setup``, ``@task.skip_if``, ...), which apply to the task rather than the function.
    A name that cannot be looked up (a local alias) is given the benefit of the doubt.
    """
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    try:
        value = eval(compile(ast.Expression(target), "<decorator>", "eval"), dict(fn.__globals__))  # noqa: S307
    except Exception:
        return False
    if value is sandbox_task:
        return False
    module = getattr(value, "__module__", None) or type(value).__module__ or ""
    return not (module.startswith("airflow.") or module.startswith("sandbox_provider."))


def _outdent(lines: list[str]) -> str:
    """
    Shift a nested function's source to column 0 by the indentation of its first line.

    Unlike :func:`textwrap.dedent`, lines that start left of it (the inside of a triple-quoted
    string, say) are kept as they are, so such a string does not stop the shift.
    """
    first = lines[0]
    indent = first[: len(first) - len(first.lstrip())]
    return "".join(line[len(indent) :] if line.startswith(indent) else line for line in lines)


def _context_value(name: str, value: Any) -> Any:
    if isinstance(value, (datetime.datetime, datetime.date)):
        return value.isoformat()
    if isinstance(value, Mapping):
        value = dict(value)
    if _json_problem(value, allow_references=False) is None:
        return value
    raise ValueError(
        f"The function takes the context value {name!r}, which cannot cross into a sandbox (it is a "
        f"{type(value).__name__}). Take a string such as ds, run_id or ts instead, or pass what you need as an argument."
    )


class _SandboxDecoratedOperator(DecoratedOperator, SandboxOperator):
    """
    Run a Python function in a sandbox; the operator behind ``@task.sandbox``.

    :param python: the Python interpreter inside the sandbox; default ``python3``.
    :param max_result_bytes: the largest JSON return value, in bytes; default 1 MiB. Move bigger
        results out with ``exports``.
    All other options are :class:`~sandbox_provider.operators.sandbox.SandboxOperator`'s, except
    ``command`` (built from the function) and ``keep_sandbox=True`` (the XCom is the return value).
    """

    custom_operator_name = "@task.sandbox"
    template_fields: Sequence[str] = (
        *DecoratedOperator.template_fields,
        *(f for f in SandboxOperator.template_fields if f != "command"),
    )
    template_fields_renderers: ClassVar[dict[str, str]] = {**DecoratedOperator.template_fields_renderers}

    def __init__(
        self,
        *,
        python_callable: Callable,
        python: str = "python3",
        max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
        **kwargs: Any,
    ) -> None:
        _check_callable(python_callable)
        if "command" in kwargs:
            raise ValueError(
                "@task.sandbox builds the command from the function; drop command=, or use SandboxOperator."
            )
        if kwargs.get("keep_sandbox") is True:
            raise ValueError(
                "@task.sandbox returns the function's value, so it cannot hand on a sandbox with keep_sandbox=True. "
                "Provision with SandboxOperator(keep_sandbox=True) and pass its handle here as attach_to."
            )
        if not isinstance(python, str) or not python.strip():
            raise ValueError(f"python must name the interpreter inside the sandbox, e.g. 'python3'; got {python!r}.")
        if isinstance(max_result_bytes, bool) or not isinstance(max_result_bytes, int) or max_result_bytes <= 0:
            raise ValueError(f"max_result_bytes must be a positive number of bytes, got {max_result_bytes!r}.")
        shipped_source(python_callable)  # a function whose source cannot be shipped fails at parse time
        super().__init__(python_callable=python_callable, command="(built from the function)", **kwargs)
        _check_arguments(list(self.op_args), self.op_kwargs, allow_references=True)
        self.python = python
        self.max_result_bytes = max_result_bytes
        self._call_dir: str | None = None

    def get_python_source(self) -> str:
        return shipped_source(self.python_callable)[0]

    def _call_arguments(self, context: Context) -> dict[str, Any]:
        args = list(self.op_args)
        kwargs = dict(self.op_kwargs)
        signature = inspect.signature(self.python_callable)
        positional = [
            p.name
            for p in signature.parameters.values()
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ]
        given = set(positional[: len(args)]) | set(kwargs)
        for name, param in signature.parameters.items():
            if name in given or name not in KNOWN_CONTEXT_KEYS or param.kind is inspect.Parameter.VAR_KEYWORD:
                continue
            if name in context:
                kwargs[name] = _context_value(name, context[name])  # type: ignore[literal-required]
        _check_arguments(args, kwargs, allow_references=False)
        return {"args": args, "kwargs": kwargs}

    def _prepare(self, context: Context) -> tuple[str, Mapping[str, str | bytes]]:
        source, name, first_line = shipped_source(self.python_callable)
        # The values as JSON would carry them (tuples become lists, say), in marshal's format, which the
        # sandbox's Python reads without importing anything.
        call = marshal.dumps(json.loads(json.dumps(self._call_arguments(context), allow_nan=False)), _MARSHAL_VERSION)
        directory = f"{_TASK_DIR}/{secrets.token_hex(6)}"
        self._call_dir = directory
        module_file = os.path.basename(inspect.getsourcefile(self.python_callable) or "task.py")
        # Its own folder, so no Dag file name can collide with the runner's files.
        source_path = f"{directory}/dag/{module_file}"
        # Padding keeps the Dag file's line numbers in tracebacks. Annotations stay unevaluated:
        # they may name types that exist only where the Dag file is parsed.
        header = _FUTURE + "\n" * (first_line - 2) if first_line > 1 else _FUTURE
        files = {
            **self.files,
            source_path: header + source,
            f"{directory}/runner.py": guest.program("task_runner.py"),
            f"{directory}/call.marshal": call,
        }
        command = " ".join(
            shlex.quote(part)
            for part in (
                self.python,
                f"{directory}/runner.py",
                source_path,
                name,
                f"{directory}/call.marshal",
                f"{directory}/result.json",
            )
        )
        return command, files

    def _deferred_state(self) -> dict[str, Any]:
        return {"call_dir": self._call_dir}

    def _restore_deferred_state(self, state: Mapping[str, Any]) -> None:
        self._call_dir = state.get("call_dir")

    def _what_ran(self, command: str | None) -> str:
        return f"{self.python_callable.__name__}() in the sandbox's {self.python}"

    def _result_path(self) -> str:
        return f"{self._call_dir}/result.json"

    def _read_back(self) -> str | None:
        return self._result_path()

    def _collect(self, session: SandboxSession, result: SandboxExecResult | None) -> Any:
        path = self._result_path()
        try:
            raw = session.read_file(path, max_bytes=self.max_result_bytes)
        except SandboxFileTooLargeError as err:
            raise SandboxCommandError(
                f"The return value of {self.python_callable.__name__}() is {format_size(err.size_bytes)} of JSON, over "
                f"max_result_bytes={self.max_result_bytes}. Write large results to a file and move it out with exports=, "
                "or raise max_result_bytes."
            ) from err
        except SandboxError as err:
            raise SandboxCommandError(
                f"{self.python_callable.__name__}() left no return value in the sandbox ({err}). Did it call sys.exit(0)?"
            ) from err
        finally:
            if session.attach_mode and self.keep_sandbox is not False:
                self._tidy(session)
        try:
            return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            raise SandboxCommandError(
                f"The return value of {self.python_callable.__name__}() came back as something that is not JSON: {err}"
            ) from err

    def _tidy(self, session: SandboxSession) -> None:
        # An attached sandbox outlives this task: leave it as this task found it.
        try:
            session.run(f"rm -rf -- {shlex.quote(self._call_dir or '')}", timeout=60, max_output_bytes=4096)
        except Exception:
            self.log.warning("Could not remove %s from sandbox %s", self._call_dir, session.handle, exc_info=True)

    def _xcom(self, session: SandboxSession, result: SandboxExecResult | None, collected: Any) -> Any:
        return collected


def sandbox_task(
    python_callable: Callable | None = None,
    multiple_outputs: bool | None = None,
    **kwargs: Any,
) -> TaskDecorator:
    """
    Run the decorated function's body in a sandbox; registered as ``@task.sandbox``.

    Accepts every :class:`~sandbox_provider.operators.sandbox.SandboxOperator` option except
    ``command``, plus ``python`` (the interpreter in the sandbox, default ``python3``) and
    ``max_result_bytes`` (default 1 MiB). Arguments and the return value travel as JSON.

    :raises ValueError: when the Dag is parsed, for a lambda, a generator or async function, or an
        argument that is not JSON.
    """
    if python_callable is not None:
        _check_callable(python_callable)
        shipped_source(python_callable)
    return task_decorator_factory(
        python_callable=python_callable,
        multiple_outputs=multiple_outputs,
        decorated_operator_class=_SandboxDecoratedOperator,
        **kwargs,
    )
