"""@task.sandbox against real bubblewrap: source shipping, JSON both ways, errors at parse and run time."""

from __future__ import annotations

import inspect
from unittest import mock

import pytest
from airflow.sdk import DAG, task
from airflow.sdk.exceptions import AirflowSkipException

from conftest import requires_bwrap
from sandbox_provider.decorators.sandbox import sandbox_task, shipped_source
from sandbox_provider.hooks.local import LocalSandboxHook
from sandbox_provider.operators.sandbox import SandboxCommandError
from sandbox_provider.sandbox import SandboxSpec

pytestmark = requires_bwrap


# -- functions under test live in this file: their source is shipped ------------------------------------------


@task.sandbox
def bare(x):
    return {"spelling": "bare", "x": x}


@task.sandbox(python="python3")
def called(x):
    return {"spelling": "called", "x": x}


@sandbox_task
def factory_bare(x):
    return {"spelling": "factory_bare", "x": x}


@sandbox_task(
    python="python3",
    max_result_bytes=10_000,
)
def factory_multiline(x):
    return {"spelling": "factory_multiline", "x": x}


sbx = task.sandbox


@sbx(timeout=60)
def alias(x):
    return {"spelling": "alias", "x": x}


@task.sandbox
def where():
    import os
    import sys

    return {"cwd": os.getcwd(), "secret": os.environ.get("WORKER_SECRET"), "python": sys.executable}


@task.sandbox
def combine(a, b, *, scale=1, extra=None):
    return {"total": (a + b) * scale, "extra": extra}


@task.sandbox
def with_run_id(x, run_id=None):
    return f"{x}@{run_id}"


@task.sandbox
def fails():
    value = 1
    raise ValueError(f"bad value {value}")


@task.sandbox
def returns_a_set():
    return {1, 2}


@task.sandbox(max_result_bytes=100)
def too_big():
    return "x" * 1000


@task.sandbox
def exits_quietly():
    import sys

    sys.exit(0)


@task.sandbox(skip_on_exit_code=99)
def skips():
    import sys

    sys.exit(99)


@task.sandbox
def writes_report():
    with open("report.txt", "w") as handle:
        handle.write("all good\n")
    return "written"


@task.sandbox
def stats() -> dict:
    return {"mean": 2.5, "n": 4}


@task.sandbox
def takes_any(value):
    return value


@task.sandbox
def forges_a_hostile_result(kind):
    import glob
    import os

    (directory,) = glob.glob(".airflow-sandbox-task/*/")
    hostile = {"nan": "NaN", "deep": "[" * 200000 + "]" * 200000, "bytes": "\udcff"}[kind]
    with open(os.path.join(directory, "result.json"), "w", errors="surrogateescape") as handle:
        handle.write(hostile)
    os._exit(0)


class OnlyInThisFile:
    """A type the sandbox has never heard of."""


@task.sandbox
def annotated(value: OnlyInThisFile) -> OnlyInThisFile:
    return value


def make_nested_with_column_zero_string():
    @task.sandbox
    def nested():
        text = """
first
second"""
        return text.count("\n")

    return nested


@task.sandbox
def reads_shared():
    with open("shared.txt") as handle:
        return handle.read()


# -- helpers ----------------------------------------------------------------------------------------------------


@pytest.fixture
def hook(tmp_path):
    return LocalSandboxHook(state_root=str(tmp_path / "state"))


def context(run_id="run-1", task_id="t"):
    ti = mock.MagicMock(dag_id="d", run_id=run_id, task_id=task_id, map_index=-1)
    return {"ti": ti, "run_id": run_id}


def build(decorated, *args, **overrides):
    """Instantiate the task in a throwaway Dag and return its operator."""
    with DAG("d", schedule=None) as dag:
        decorated.override(**overrides)(*args) if overrides else decorated(*args)
    return dag.tasks[0]


def run(decorated, hook, *args, run_id="run-1", **overrides):
    return build(decorated, *args, backend=hook, **overrides).execute(context(run_id=run_id))


# -- registration and source shipping ---------------------------------------------------------------------------


def test_registered_as_task_sandbox():
    assert task.sandbox is sandbox_task
    op = build(bare, 1)
    assert op.custom_operator_name == "@task.sandbox"
    assert len(set(op.template_fields)) == len(op.template_fields)
    assert "command" not in op.template_fields


@pytest.mark.parametrize("decorated", [bare, called, factory_bare, factory_multiline, alias])
def test_every_spelling_of_the_decorator_runs(decorated, hook):
    source = build(decorated, 1).get_python_source()
    assert "@" not in source and source.lstrip().startswith("def ")
    assert run(decorated, hook, 7) == {"spelling": decorated.function.__name__, "x": 7}


def test_shipped_source_keeps_the_dag_file_line_numbers():
    source, name, first_line = shipped_source(factory_multiline.function)
    lines, start = inspect.getsourcelines(factory_multiline.function)
    assert name == "factory_multiline" and first_line == start
    shipped = source.splitlines()
    assert len(shipped) == len(lines)
    assert shipped[:4] == ["", "", "", ""]  # the four lines of the decorator, blanked
    assert shipped[4] == "def factory_multiline(x):"


# -- running --------------------------------------------------------------------------------------------------------


def test_runs_in_the_sandbox_own_python(hook, monkeypatch):
    monkeypatch.setenv("WORKER_SECRET", "hunter22")
    assert run(where, hook) == {"cwd": "/workspace", "secret": None, "python": "/usr/bin/python3"}


def test_arguments_go_in_as_json(hook):
    op = build(combine, 1, 2, backend=hook)
    op.op_kwargs = {"scale": 10, "extra": {"nested": [1, "two", None, True, 2.5]}}
    assert op.execute(context()) == {"total": 30, "extra": {"nested": [1, "two", None, True, 2.5]}}


def test_context_strings_are_passed_to_parameters_named_after_them(hook):
    assert run(with_run_id, hook, "x", run_id="manual__1") == "x@manual__1"


def test_spec_and_exports_apply(hook, tmp_path):
    target = tmp_path / "report.txt"
    assert (
        run(writes_report, hook, exports={"report.txt": target.as_uri()}, spec=SandboxSpec(env={"A": "b"})) == "written"
    )
    assert target.read_text() == "all good\n"


def test_multiple_outputs_is_inferred_from_a_dict_annotation(hook):
    assert build(stats).multiple_outputs is True
    assert run(stats, hook) == {"mean": 2.5, "n": 4}


def test_attached_sandbox_is_left_as_found(hook):
    owner = "d/run-1"
    handle = hook.create(spec=SandboxSpec(owner=owner))
    try:
        hook.write_file(handle, "shared.txt", b"from the provisioner")
        assert run(reads_shared, hook, attach_to=handle) == "from the provisioner"
        leftovers = hook.run_command(handle, "ls -A .airflow-sandbox-task", timeout=30, max_output_bytes=4096)
        assert leftovers.stdout == ""
    finally:
        hook.destroy(handle)


# -- failures at run time -------------------------------------------------------------------------------------------


def test_an_exception_fails_the_task_with_its_traceback(hook):
    lines, start = inspect.getsourcelines(fails.function)
    raise_line = start + next(i for i, line in enumerate(lines) if "raise ValueError" in line)
    with pytest.raises(SandboxCommandError, match="status 1") as err:
        run(fails, hook)
    message = str(err.value)
    assert "ValueError: bad value 1" in message
    assert f"line {raise_line}, in fails" in message
    assert 'raise ValueError(f"bad value {value}")' in message


def test_a_return_value_that_is_not_json_fails_clearly(hook):
    with pytest.raises(SandboxCommandError, match=r"returns_a_set\(\) cannot be sent back as JSON"):
        run(returns_a_set, hook)


def test_return_value_over_the_byte_limit_fails_clearly(hook):
    with pytest.raises(SandboxCommandError, match="over max_result_bytes=100.*exports="):
        run(too_big, hook)


@pytest.mark.parametrize("kind", ["nan", "deep", "bytes"])
def test_a_hostile_result_file_fails_cleanly(hook, kind):
    with pytest.raises(SandboxCommandError, match="came back as something that is not JSON"):
        run(forges_a_hostile_result, hook, kind)


def test_annotations_naming_dag_file_types_do_not_break_the_sandbox(hook):
    assert run(annotated, hook, 5) == 5


def test_nested_function_with_a_column_zero_string(hook):
    assert run(make_nested_with_column_zero_string(), hook) == 2


def test_a_dag_file_named_like_the_runner(hook, tmp_path):
    import importlib.util

    module_path = tmp_path / "runner.py"
    module_path.write_text("from airflow.sdk import task\n\n\n@task.sandbox\ndef add(a, b):\n    return a + b\n")
    spec = importlib.util.spec_from_file_location("runner_dag_module", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert run(module.add, hook, 2, 3) == 5


def test_a_decorator_that_would_be_dropped_is_refused_at_parse_time():
    import functools

    def logged(fn):
        @functools.wraps(fn)
        def wrapper(*args):
            return {"wrapped": fn(*args)}

        return wrapper

    globals()["logged"] = logged
    try:
        with pytest.raises(ValueError, match=r"carries @logged, which would be dropped"):

            @task.sandbox
            @logged
            def wrapped(x):
                return x
    finally:
        del globals()["logged"]


def test_exit_without_a_return_value_fails_clearly(hook):
    with pytest.raises(SandboxCommandError, match=r"left no return value.*sys.exit"):
        run(exits_quietly, hook)


def test_skip_on_exit_code(hook):
    with pytest.raises(AirflowSkipException):
        run(skips, hook)


def test_non_json_value_from_xcom_fails_before_provisioning(hook, monkeypatch):
    monkeypatch.setattr(LocalSandboxHook, "create", mock.Mock(side_effect=AssertionError("provisioned")))
    op = build(takes_any, "placeholder", backend=hook)
    op.op_args = [object()]  # what a rendered XComArg could hold
    with pytest.raises(ValueError, match="positional argument 0 cannot be sent: a object is not a JSON value"):
        op.execute(context())


# -- failures at parse time -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (object(), "a object is not a JSON value"),
        ({1: "a"}, "dict key 1 is not a string"),
        (float("nan"), "nan has no JSON form"),
        ({"when": {1, 2}}, "a set is not a JSON value"),
    ],
)
def test_non_json_literal_arguments_fail_at_parse_time(value, message):
    with pytest.raises(ValueError, match=message):
        build(takes_any, value)


def test_xcom_arguments_are_checked_at_run_time_only():
    with DAG("d", schedule=None):
        takes_any(bare(1))


def test_lambda_is_refused():
    with pytest.raises(ValueError, match="cannot run a lambda"):
        sandbox_task(lambda: 1)
    with pytest.raises(ValueError, match="cannot run a lambda"), DAG("d", schedule=None):
        task.sandbox()(lambda: 1)()


def test_generators_and_async_functions_are_refused():
    def produce():
        yield 1

    async def wait():
        return 1

    with pytest.raises(ValueError, match="generator produce"):
        sandbox_task(produce)
    with pytest.raises(ValueError, match="not an async def"):
        sandbox_task(wait)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"command": "echo"}, "builds the command from the function"),
        ({"keep_sandbox": True}, "cannot hand on a sandbox"),
        ({"python": ""}, "python must name the interpreter"),
        ({"max_result_bytes": 0}, "max_result_bytes must be a positive"),
        ({"timeout": 0}, "timeout must be a positive"),
    ],
)
def test_bad_options_fail_at_parse_time(overrides, message):
    with pytest.raises(ValueError, match=message):
        build(bare, 1, **overrides)
