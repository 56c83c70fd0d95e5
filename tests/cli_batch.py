"""
Several ``airflow`` commands run by one real ``airflow`` process, one after the other.

Each ``python -m airflow ...`` pays Airflow's import (about 5 s of CPU), so a test that runs eight
commands spent most of its time starting them. :func:`run` starts this file as a subprocess, which
imports Airflow once and runs each command through ``airflow.__main__.main`` as ``python -m airflow``
would (the parser, the configuration check, the command's function), with its own ``sys.argv``,
standard output and standard error; a command's exit status is the one it would exit with.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import traceback


def run(env: dict, *commands: list[str], timeout: float) -> list[subprocess.CompletedProcess]:
    """
    Run ``commands`` (each the arguments after ``airflow``) in order in one process with ``env``; one
    ``CompletedProcess`` (returncode, stdout, stderr as text) each. :raises AssertionError: when the
    process itself fails (its output in the message).
    """
    done = subprocess.run(
        [sys.executable, __file__, json.dumps([list(c) for c in commands])],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"the batch of airflow commands failed: {done.stdout[-3000:]}{done.stderr[-3000:]}"
    results = json.loads(done.stdout.splitlines()[-1])
    return [
        subprocess.CompletedProcess(["airflow", *c], r["returncode"], r["stdout"], r["stderr"])
        for c, r in zip(commands, results, strict=True)
    ]


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # SystemExit("message"): Python prints it and exits with 1
    return 1


def _main(commands: list[list[str]]) -> None:
    from airflow.__main__ import main

    results = []
    for argv in commands:
        out, err = io.StringIO(), io.StringIO()
        sys.argv = ["airflow", *argv]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                status = 0
            except SystemExit as stop:
                status = _exit_status(stop.code)
            except Exception:  # an uncaught error: Python prints the traceback and exits with 1
                traceback.print_exc()
                status = 1
        results.append({"returncode": status, "stdout": out.getvalue(), "stderr": err.getvalue()})
    print(json.dumps(results))


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
