"""
One table of settings per backend: each setting once, with its type, default, bounds and help.

The table resolves a hook's settings (the hook's own argument over the connection's extra over the
default), checks each value, and generates the connection form fields Airflow shows and the hook's
documentation of them, so neither can drift from what the hook reads. The values it resolves record
which settings the hook reads (:attr:`SettingsTable.read`), and refuse a name the table lacks.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["TASK_SETTINGS", "ConnectionForm", "ResolvedSettings", "Setting", "SettingsTable"]

_KINDS: dict[type, str] = {
    int: "integer",
    float: "number",
    str: "string",
    bool: "boolean",
    list: "array",
    dict: "object",
}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Setting:
    """
    One setting a backend reads.

    :param name: the hook argument and the connection extra of the same name.
    :param kind: ``int``, ``float``, ``str``, ``bool``, or ``list`` / ``dict`` with ``parse``.
    :param default: the value when neither argument nor extra gives one; None for "not set".
    :param label: the form field's label.
    :param help: one or two sentences for the form and the hook's documentation: what it does and
        its unit. Not its default: the setting adds ``Default: ...`` itself.
    :param default_text: the default in words, when the value alone does not say it (``"no limit"``,
        a path computed at run time); without it the default value is shown, or ``none``.
    :param unit: the unit of a number (``"seconds"``, ``"bytes"``), shown in the help.
    :param minimum: the smallest value accepted (numbers).
    :param maximum: the largest value accepted (numbers).
    :param choices: the values accepted (strings).
    :param form: False for a setting with no form field (a hook argument only).
    :param parse: for a ``list`` or ``dict`` setting: checks a value (a Python list or mapping; a
        connection extra typed as JSON text is decoded first) and returns it in the shape the hook
        uses, or raises ValueError saying what to give.
    :param items: for a ``list`` setting: the JSON type of its entries, for the form's editor.
    """

    name: str
    kind: type
    default: Any = None
    label: str = ""
    help: str = ""
    unit: str | None = None
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None
    form: bool = True
    default_text: str | None = None
    parse: Callable[[Any], Any] | None = None
    items: str | None = None

    def __post_init__(self) -> None:
        if (self.kind in (list, dict)) != (self.parse is not None):
            raise ValueError(f"Setting {self.name!r}: a list or dict setting needs parse=, and only one does.")
        if re.search(r"\bdefault\s*:", self.help, re.IGNORECASE):
            raise ValueError(
                f"Setting {self.name!r}: its help states a default ({self.help!r}). Leave it out: the setting writes "
                "'Default: ...' itself, from default= or, when that does not say it, default_text='<in words>'."
            )

    @property
    def default_words(self) -> str:
        """The default as the form and the documentation state it: ``default_text``, the value, or ``none``."""
        if self.default_text is not None:
            return self.default_text
        if self.default is None:
            return "none"
        return self._default_text()

    @property
    def description(self) -> str:
        """The help with the default: the form field's description and the hook argument's documentation."""
        return f"{self.help} Default: {self.default_words}.".strip()

    def check(self, value: Any, where: str, *, strict: bool = False) -> Any:
        """
        Return ``value`` converted to the setting's kind, if it is within bounds; None passes.

        Strings are converted, since connection extras typed in a form are often strings, unless
        ``strict`` (hook arguments, written in Python, must have the right type).

        :raises ValueError: naming ``where`` (the argument or extra) and what to give instead.
        """
        if value is None or (value == "" and self.kind is not str):
            return None
        if self.parse is not None:
            return self._parsed(value, where, strict)
        converted = self._convert(value, strict)
        if converted is None:
            raise ValueError(f"{where} must be {self._shape()}, got {value!r}.")
        if isinstance(converted, (int, float)) and not isinstance(converted, bool):
            low_ok = self.minimum is None or converted >= self.minimum
            high_ok = self.maximum is None or converted <= self.maximum
            if not (low_ok and high_ok):
                raise ValueError(f"{where} must be {self._shape()}, got {value!r}.")
        if self.choices is not None and converted not in self.choices:
            raise ValueError(f"{where} must be one of {', '.join(map(repr, self.choices))}; got {value!r}.")
        return converted

    def _parsed(self, value: Any, where: str, strict: bool) -> Any:
        """A list or dict setting's value through ``parse``; an extra may be JSON text (a list also ``443, 8443``)."""
        assert self.parse is not None
        if isinstance(value, str) and not strict:
            text = value.strip()
            try:
                value = json.loads(text)
            except ValueError:
                if self.kind is not list:
                    raise ValueError(
                        f"{where} must be a JSON object such as {self._example()}, got {value!r}."
                    ) from None
                value = [_scalar(part) for part in re.split(r"[\s,]+", text) if part]
            if self.kind is list and isinstance(value, int) and not isinstance(value, bool):
                value = [value]  # one port typed alone
        try:
            return self.parse(value)
        except (ValueError, TypeError) as err:
            message = str(err)
            raise ValueError(message if where == self.name else f"{where}: {message}") from None

    def _example(self) -> str:
        return "[443, 8443]" if self.kind is list else '{"mirror.example.org": "10.1.2.3"}'

    def _convert(self, value: Any, strict: bool) -> Any:
        kind = self.kind
        if kind is str and isinstance(value, os.PathLike):
            value = os.fspath(value)
        if strict and kind is not float and not isinstance(value, kind):
            return None
        if strict and kind is float and (isinstance(value, str) or isinstance(value, bool)):
            return None
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            return True if text in _TRUE else False if text in _FALSE else None
        if isinstance(value, bool):
            return None
        if kind is str:
            return value if isinstance(value, str) and value.strip() and "\0" not in value else None
        if isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                return None
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        if kind is int:
            return int(value) if float(value).is_integer() else None
        return float(value)

    def _shape(self) -> str:
        if self.kind is bool:
            return "true or false"
        if self.kind is str:
            return "a non-empty string"
        what = "a whole number" if self.kind is int else "a number"
        if self.unit:
            what += f" of {self.unit}"
        if self.minimum is not None and self.maximum is not None:
            return f"{what} from {_number(self.minimum)} to {_number(self.maximum)}"
        if self.minimum is not None:
            return f"{what} of at least {_number(self.minimum)}"
        return what

    def form_field(self) -> dict[str, Any]:
        """The ``conn-fields`` entry Airflow renders for this setting."""
        types = [_KINDS[self.kind], "null"]
        schema: dict[str, Any] = {"type": types}
        if self.items is not None:
            schema["items"] = {"type": self.items}
        if self.minimum is not None:
            schema["minimum"] = self.minimum
        if self.maximum is not None:
            schema["maximum"] = self.maximum
        if self.choices is not None:
            schema["enum"] = [*self.choices, None]
        return {"label": self.label or self.name, "schema": schema, "description": self.description}

    def _default_text(self) -> str:
        if self.kind in (list, dict):
            return json.dumps(list(self.default) if self.kind is list else dict(self.default))
        if self.kind is bool:
            return "true" if self.default else "false"
        if isinstance(self.default, float) and self.default.is_integer():
            return str(int(self.default))
        return str(self.default)


def _scalar(text: str) -> Any:
    """A whole number typed in a list extra (``443, 8443``) as a number; other text as it is."""
    return int(text) if re.fullmatch(r"[+-]?\d+", text) else text


def _one_of(setting: Setting) -> str:
    """The values a setting of choices accepts, as a sentence for its documentation; else nothing."""
    return f" One of {', '.join(map(repr, setting.choices))}." if setting.choices else ""


def _number(value: float) -> str:
    """A bound as people write it: ``2592000``, not ``2.592e+06``."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


class SettingsTable:
    """
    The settings of one backend, in form order.

    :param settings: each setting once.
    :raises ValueError: when two settings share a name.
    """

    def __init__(self, *settings: Setting) -> None:
        names = [s.name for s in settings]
        if len(set(names)) != len(names):
            raise ValueError(f"settings must be named once each: {names!r}")
        self._settings = {s.name: s for s in settings}
        #: The names a hook has read from values this table resolved, in this process.
        self.read: set[str] = set()

    def __iter__(self):
        return iter(self._settings.values())

    def __contains__(self, name: object) -> bool:
        return name in self._settings

    def __getitem__(self, name: str) -> Setting:
        return self._settings[name]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._settings)

    def check_args(self, args: Mapping[str, Any]) -> ResolvedSettings:
        """
        Check hook arguments (None for "not given") at construction, so a Dag file fails at parse time.
        A path-like value of a string setting is taken as its path. Reads of what it returns are
        recorded, as those of :meth:`resolve`'s values are.

        :raises ValueError: for a value of the wrong kind or out of bounds, naming the argument.
        """
        unknown = sorted(set(args) - set(self._settings))
        if unknown:
            raise ValueError(f"not settings of this backend: {unknown!r}")
        checked = ResolvedSettings(self)
        for name, value in args.items():
            checked[name] = self._settings[name].check(value, name, strict=True)
        return checked

    def arguments(self, given: Mapping[str, Any]) -> ResolvedSettings:
        """
        The hook arguments among ``given`` (a constructor's ``locals()``) that are settings of this
        table, checked as :meth:`check_args` does. A setting the constructor does not take is read
        from the connection only.
        """
        return self.check_args({name: given[name] for name in self._settings if name in given})

    def resolve(
        self, args: Mapping[str, Any], extra: Mapping[str, Any] | None = None, *, conn_id: str | None = None
    ) -> dict[str, Any]:
        """
        Return every setting's value: the hook argument if given, else the connection extra, else the default.

        :param args: hook arguments by setting name, None for "not given" (already checked).
        :param extra: the connection's extras.
        :param conn_id: the connection, named in errors.
        :raises ValueError: for an extra of the wrong kind or out of bounds, naming the connection and extra.
        """
        extra = extra or {}
        _warn_unknown(extra, self._settings, conn_id)
        given = dict(args.items())  # not a read of the hook's: nothing is recorded
        values = ResolvedSettings(self)
        for name, setting in self._settings.items():
            value = given.get(name)
            if value is None and name in extra:
                where = f"Connection {conn_id!r} extra {name!r}" if conn_id else f"extra {name!r}"
                value = setting.check(extra[name], where)
            values[name] = setting.default if value is None else value
        return values

    def form_fields(self) -> dict[str, dict[str, Any]]:
        """The ``conn-fields`` mapping for ``get_provider_info()``: one field per setting with ``form=True``."""
        return {s.name: s.form_field() for s in self._settings.values() if s.form}

    def document(self, owner: str, doc: str | None, init: Callable[..., Any]) -> str:
        """
        ``doc`` (the docstring of the hook class ``owner``) with its settings documented from this
        table: a ``:param:`` line each for the settings ``init`` takes as arguments, then those read
        from the connection only.

        :raises TypeError: when ``doc`` documents a setting itself: the table's help is the one place.
        """
        text = inspect.cleandoc(doc or "")
        by_hand = [name for name in self._settings if re.search(rf"^:param {re.escape(name)}:", text, re.M)]
        if by_hand:
            raise TypeError(
                f"{owner}'s docstring documents the settings {', '.join(by_hand)} by hand: remove those :param "
                "lines; the docstring gets them from the settings table (each Setting's help and default)."
            )
        taken = inspect.signature(init).parameters
        argued = [s for s in self._settings.values() if s.name in taken]
        extras = [s for s in self._settings.values() if s.name not in taken]
        head, raises, tail = text.partition("\n:raises")
        lines = [head, *[f":param {s.name}: {s.description}{_one_of(s)}" for s in argued]]
        if raises:
            lines.append(raises.lstrip("\n") + tail)
        if argued:
            lines.append(
                f"\nThe parameters from ``{argued[0].name}`` to ``{argued[-1].name}`` are settings: each is also read "
                "from the connection's extra of the same name, and an argument given here wins."
            )
        if extras:
            lines += ["Read from the connection's extras only:", ""]
            lines += [f"- ``{s.name}``: {s.description}{_one_of(s)}" for s in extras]
        return "\n".join(lines) + "\n"

    def extend(self, settings: Iterable[Setting]) -> SettingsTable:
        """A new table with these settings added after this table's."""
        return SettingsTable(*self._settings.values(), *settings)


class ResolvedSettings(dict[str, Any]):
    """
    A hook's resolved settings: a dict that records in its table each name read (``values[name]``,
    ``values.get(name)``), so which settings a hook reads is known from running it. A name neither
    the table nor the hook put there is refused, also by ``get``: a misspelt setting never reads as
    "not set".
    """

    def __init__(self, table: SettingsTable) -> None:
        super().__init__()
        self.table = table

    def __getitem__(self, name: str) -> Any:
        if name not in self:
            raise KeyError(self._unknown(name))
        self.table.read.add(name)
        return super().__getitem__(name)

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        if name not in self:
            raise KeyError(self._unknown(name))
        self.table.read.add(name)
        return super().get(name, default)

    def _unknown(self, name: str) -> str:
        if name in self.table:
            return f"{name!r} is no argument of this hook: it is read from the connection, in the resolved settings."
        return (
            f"{name!r} is no setting of this backend (it reads {', '.join(sorted(self))}): add "
            f"Setting({name!r}, ...) to its settings table (hooks/forms/<backend>.py), or fix the name."
        )


#: Settings of the tasks that use a sandbox connection, which the consumers read (operator and decorator
#: arguments of the same names win), not the hook: every sandbox connection's form has them.
TASK_SETTINGS = SettingsTable(
    Setting(
        "log_output",
        str,
        "all",
        label="Command output in the task log",
        help=(
            "What of a command's output the task log gets: all (every line, as fast as the log takes them; "
            "lines it cannot keep up with are counted and left out), head_tail (the first and last "
            "log_output_lines lines and a count of the rest) or none (a count only). The task's result "
            "keeps the end of each stream whatever this says."
        ),
        choices=("all", "head_tail", "none"),
    ),
    Setting(
        "log_output_lines",
        int,
        100,
        label="Lines at each end (head_tail)",
        help="With log_output head_tail: the lines logged at the start and at the end of a command's output.",
        minimum=1,
        maximum=1000,
    ),
    Setting(
        "log_output_max_bytes",
        int,
        label="Most output in the task log (bytes)",
        help="The most bytes of command output one task logs, in any log_output mode; the rest is counted.",
        default_text="no ceiling",
        unit="bytes",
        minimum=1,
    ),
)

#: Extras a connection may carry that no backend's settings table reads (Airflow's own, other
#: providers', and the task settings, which the consumers read).
_FOREIGN_EXTRAS = frozenset({"__extra__", *TASK_SETTINGS.names})


def _warn_unknown(extra: Mapping[str, Any], settings: Mapping[str, Setting], conn_id: str | None) -> None:
    """Log each extra no setting reads, with the nearest setting's name: a typo must not switch a limit off."""
    import difflib
    import logging

    for key in sorted(set(extra) - set(settings) - _FOREIGN_EXTRAS):
        if extra[key] in (None, ""):
            continue
        near = difflib.get_close_matches(key, list(settings), n=1)
        hint = f" Did you mean {near[0]!r}?" if near else f" This backend reads: {', '.join(sorted(settings))}."
        logging.getLogger(__name__).warning(
            "Connection %s has an extra %r that this backend does not read; it has no effect.%s",
            repr(conn_id) if conn_id else "(none)",
            key,
            hint,
        )


@dataclass(frozen=True)
class ConnectionForm:
    """
    How one backend appears among Airflow's connection types. It imports nothing of Airflow, since
    Airflow reads it while it starts; the backend's hook takes its connection type, name and settings
    from it.

    :param conn_type: the connection type, ``sandbox_<backend>``.
    :param hook_name: the name shown in the connection form's type list.
    :param settings: the backend's settings table; its fields become the form's extra fields.
    :param ui_behaviour: the form's standard fields: ``hidden-fields``, ``relabeling``, ``placeholders``.
    :param conn_name_attr: the hook argument naming the connection.
    """

    conn_type: str
    hook_name: str
    settings: SettingsTable
    ui_behaviour: Mapping[str, Any]
    conn_name_attr: str = "sandbox_conn_id"

    @property
    def default_conn_name(self) -> str:
        return f"{self.conn_type}_default"

    def form_fields(self) -> dict[str, dict[str, Any]]:
        """The ``conn-fields`` Airflow renders: the backend's settings, then :data:`TASK_SETTINGS`."""
        return {**self.settings.form_fields(), **TASK_SETTINGS.form_fields()}
