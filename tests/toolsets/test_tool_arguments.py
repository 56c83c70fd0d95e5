"""The toolset's tool arguments are strict: no coercion, bounds in the schema, wrong types back as retries."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic_ai")

from pydantic_ai import Agent  # noqa: E402
from pydantic_ai.messages import ModelResponse, RetryPromptPart, TextPart, ToolCallPart  # noqa: E402
from pydantic_ai.models.function import FunctionModel  # noqa: E402

from fake_hook import FakeSandboxHook  # noqa: E402
from sandbox_provider.sandbox import SandboxError  # noqa: E402
from sandbox_provider.toolsets import SandboxToolset  # noqa: E402


@pytest.fixture
def hook(tmp_path):
    return FakeSandboxHook(str(tmp_path))


def schemas(toolset):
    return {d.name: d.parameters_json_schema for d in toolset.tool_definitions()}


def test_the_schema_carries_strict_types_and_bounds(hook):
    found = schemas(SandboxToolset(hook))
    timeout = found["run_command"]["properties"]["timeout_seconds"]["anyOf"][0]
    assert timeout == {"type": "number", "exclusiveMinimum": 0}
    assert found["run_command"]["properties"]["command"]["minLength"] == 1
    assert found["read_file"]["properties"]["offset"]["anyOf"][0] == {"type": "integer", "minimum": 1}
    assert found["read_file"]["properties"]["limit"]["anyOf"][0] == {"type": "integer", "minimum": 1}
    assert all(schema["additionalProperties"] is False for schema in found.values())


@pytest.mark.parametrize(
    ("tool", "args", "wrong"),
    [
        ("run_command", {"command": "echo hi", "timeout_seconds": True}, "timeout_seconds"),
        ("run_command", {"command": "echo hi", "timeout_seconds": "10"}, "timeout_seconds"),
        ("run_command", {"command": "echo hi", "timeout_seconds": 0}, "greater than 0"),
        ("run_command", {"command": 7}, "command"),
        ("run_command", {"command": "echo hi", "shell": "bash"}, "shell"),
        ("read_file", {"path": "a", "offset": "2"}, "offset"),
        ("read_file", {"path": "a", "limit": 2.0}, "limit"),
        ("read_file", {"path": "a", "offset": 0}, "greater than or equal to 1"),
        ("write_file", {"path": "a", "content": 5}, "content"),
        ("list_directory", {"path": ""}, "at least 1 character"),
    ],
)
def test_a_wrong_argument_comes_back_to_the_model_as_a_retry(hook, tool, args, wrong):
    seen: list[str] = []
    calls = iter([[ToolCallPart(tool, args, tool_call_id="c1")], "done"])

    def model(messages, info):
        for part in messages[-1].parts:  # pydantic-ai sends a retry as either of these, by version
            if isinstance(part, RetryPromptPart):
                seen.append(part.model_response())
            elif getattr(part, "outcome", None) == "retried":
                seen.append(str(part.content))
        step = next(calls)
        return ModelResponse(parts=[TextPart(step)] if isinstance(step, str) else step)

    toolset = SandboxToolset(hook)
    Agent(FunctionModel(model), toolsets=[toolset]).run_sync("go")
    assert len(seen) == 1
    assert wrong in seen[0]
    assert not any(call[0] == "run" for call in hook.calls)  # nothing ran on a coerced value


def test_call_outside_pydantic_ai_says_what_was_wrong(hook):
    with SandboxToolset(hook) as toolset:
        with pytest.raises(SandboxError, match=r"timeout_seconds: Input should be a valid number.*\(got True\)"):
            toolset.call("run_command", command="echo hi", timeout_seconds=True)
        with pytest.raises(SandboxError, match=r"timeout_seconds.*\(got '10'\)"):
            toolset.call("run_command", command="echo hi", timeout_seconds="10")
        assert toolset.call("run_command", command="echo hi", timeout_seconds=10) == "[stdout]\nhi"
