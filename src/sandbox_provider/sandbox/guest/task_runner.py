"""
Call one @task.sandbox function and store its JSON return value.

It starts with nothing to import beyond what the interpreter has loaded already: the arguments
(JSON values, checked and normalised by the worker) come in marshal's format, which the
interpreter reads natively, and a return value made only of plain JSON types is written as the
json module would write it. Any other value goes through the json module itself, which writes
what it can and gives the error for what it cannot. (Importing json costs as much as starting
Python does.)
"""

import marshal
import os
import sys

_INFINITY = float("inf")


class _Plain(Exception):
    """The value holds something only the json module can decide about."""


def _plain_text(value):
    """What ``json.dumps(value, allow_nan=False)`` writes, for the plain JSON types; else :class:`_Plain`."""
    kind = type(value)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if kind is int:
        return int.__repr__(value)
    if kind is float:
        if value != value or value in (_INFINITY, -_INFINITY):
            raise _Plain
        return float.__repr__(value)
    if kind is str:
        return _plain_string(value)
    if kind is list or kind is tuple:
        return "[" + ", ".join([_plain_text(item) for item in value]) + "]"
    if kind is dict:
        items = [_plain_string(key) + ": " + _plain_text(item) for key, item in value.items()]
        return "{" + ", ".join(items) + "}"
    raise _Plain


def _plain_string(value):
    # Printable ASCII without a quote or a backslash is written as it is; json escapes anything else.
    if type(value) is not str or not (value.isascii() and value.isprintable()) or '"' in value or "\\" in value:
        raise _Plain
    return '"' + value + '"'


def _json_text(name, value):
    try:
        return _plain_text(value)
    except (_Plain, RecursionError, ValueError):
        pass
    import json

    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as err:
        sys.stderr.write(
            f"The return value of {name}() cannot be sent back as JSON ({err}). Return dicts with string keys, "
            "lists, strings, numbers, booleans or None.\n"
        )
        sys.exit(1)


def _call():
    source_path, name, call_path, result_path = sys.argv[1:5]
    with open(call_path, "rb") as handle:
        call = marshal.loads(handle.read())
    with open(source_path, encoding="utf-8") as handle:
        code = compile(handle.read(), source_path, "exec")
    namespace: dict = {"__name__": "__sandbox_task__", "__file__": source_path}
    exec(code, namespace)
    value = namespace[name](*call["args"], **call["kwargs"])
    text = _json_text(name, value)
    with open(result_path + ".partial", "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(result_path + ".partial", result_path)


if __name__ == "__main__":
    _call()
