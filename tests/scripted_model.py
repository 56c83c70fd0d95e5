"""A pydantic-ai model that plays a script, and the fixture routing AgentOperator's model to one."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel


class Script:
    """
    A FunctionModel body that plays ``steps`` in order and records what came back from each tool.

    A step is a list of ``(tool name, args)`` calls, a final answer string, or a callable taking
    the results seen so far and returning either.
    """

    def __init__(self, *steps: Any) -> None:
        self.steps = list(steps)
        self.results: list[ToolReturnPart | RetryPromptPart] = []
        self.tool_names: list[str] = []
        self.descriptions: dict[str, str] = {}
        self._calls = 0

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.tool_names = [t.name for t in info.function_tools]
        self.descriptions = {t.name: t.description or "" for t in info.function_tools}
        last = messages[-1]
        if isinstance(last, ModelRequest):
            self.results.extend(p for p in last.parts if isinstance(p, (ToolReturnPart, RetryPromptPart)))
        step = self.steps.pop(0)
        if callable(step):
            step = step(self.texts())
        if isinstance(step, str):
            return ModelResponse(parts=[TextPart(step)])
        parts = []
        for name, args in step:
            self._calls += 1
            parts.append(ToolCallPart(name, args, tool_call_id=f"call-{self._calls}"))
        return ModelResponse(parts=parts)

    def texts(self) -> list[str]:
        """Every tool result and retry prompt the model saw, as text, in order."""
        out = []
        for part in self.results:
            if isinstance(part, ToolReturnPart):
                out.append(str(part.content))
            else:
                out.append(part.model_response())
        return out

    @property
    def model(self) -> FunctionModel:
        return FunctionModel(self)


@pytest.fixture
def scripted_llm(monkeypatch, add_connection):
    """
    Route AgentOperator's model to a Script: the operator builds its agent from
    ``PydanticAIHook.get_hook(llm_conn_id).get_conn()``, so the connection is defined (with no
    secret) and ``get_conn`` returns the scripted FunctionModel instead of a provider's model.
    """
    from airflow.providers.common.ai.hooks.pydantic_ai import PydanticAIHook

    add_connection("pydanticai_default", "pydanticai")

    def use(script: Script) -> Script:
        monkeypatch.setattr(PydanticAIHook, "get_conn", lambda self: script.model)
        return script

    return use
