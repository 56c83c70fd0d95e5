"""Call one @task.sandbox function with JSON arguments and store its JSON return value."""

import json
import os
import sys


def _call():
    source_path, name, call_path, result_path = sys.argv[1:5]
    with open(call_path, encoding="utf-8") as handle:
        call = json.load(handle)
    with open(source_path, encoding="utf-8") as handle:
        code = compile(handle.read(), source_path, "exec")
    namespace: dict = {"__name__": "__sandbox_task__", "__file__": source_path}
    exec(code, namespace)
    value = namespace[name](*call["args"], **call["kwargs"])
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as err:
        sys.stderr.write(
            f"The return value of {name}() cannot be sent back as JSON ({err}). Return dicts with string keys, "
            "lists, strings, numbers, booleans or None.\n"
        )
        sys.exit(1)
    with open(result_path + ".partial", "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(result_path + ".partial", result_path)


if __name__ == "__main__":
    _call()
