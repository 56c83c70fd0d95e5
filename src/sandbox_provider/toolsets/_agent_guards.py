"""
The guards that keep an agent run and its sandbox in step.

A sandbox the toolset provisions lives for one agent run. Three features of common-ai's
``AgentOperator`` assume more: ``durable=True`` replays recorded tool results on a retry without
running them; ``enable_hitl_review=True`` regenerates after review in a second run; per-tool
approval pauses the task and resumes it in a later run. ``AgentOperator`` refuses the first two,
and fails a tool call that needs approval, for every toolset it recognises as a sandbox toolset,
when the Dag is parsed. It recognises them by ``isinstance`` against its own ``SandboxToolset``
class, an abstract base class, so this toolset registers itself there (:func:`present_to_agent_operator`)
and gets the same guards with the same meaning; they read only ``attach_to``.

What ``AgentOperator`` cannot see when the Dag is parsed, such as a toolset a function builds per
run, :func:`refuse_unsafe_agent_features` refuses when the run opens the toolset, before the
model's first request and so before any tool runs.
"""

from __future__ import annotations

import logging
from typing import Any

from sandbox_provider.sandbox.errors import SandboxTerminalError

log = logging.getLogger(__name__)

__all__ = ["explain_refused_approval", "present_to_agent_operator", "refuse_unsafe_agent_features"]

DURABLE_REFUSAL = (
    "AgentOperator(durable=True) cannot run with a SandboxToolset: a retry replays the recorded tool results "
    "without running them, so the transcript would describe files the retry's sandbox does not hold. Drop "
    "durable=True, or do the sandbox work in a task of its own."
)
APPROVAL_REFUSAL = (
    "A tool call needed approval, and AgentOperator fails the task instead of pausing it because a SandboxToolset "
    "here provisions its own sandbox, which ends with the run, so the resumed run would find none of its files. "
    "To approve tool calls, attach the toolset to a sandbox another task provisioned (attach_to=...); otherwise "
    "drop the approval requirement from the tools."
)
REVIEW_REFUSAL = (
    "AgentOperator(enable_hitl_review=True) cannot run with a SandboxToolset that provisions its own sandbox: a "
    "run regenerated after review would start in an empty sandbox while its history describes the files of the "
    "first run. Attach the toolset to a sandbox another task provisioned (attach_to=...), drop "
    "enable_hitl_review=True, or do the sandbox work in a task of its own."
)


def present_to_agent_operator(toolset_class: type) -> None:
    """
    Register ``toolset_class`` as a virtual subclass of common-ai's ``SandboxToolset``, so
    ``AgentOperator`` applies its sandbox guards to it. Nothing happens when common-ai is not
    installed or has no such class; the run-time guard still holds then.
    """
    try:
        from airflow.providers.common.ai.toolsets.sandbox import SandboxToolset as AgentSandboxToolset
    except Exception:  # noqa: BLE001 - not installed, or a version without it
        log.debug("common-ai's SandboxToolset is not importable; AgentOperator's parse-time guards do not apply")
        return
    register = getattr(AgentSandboxToolset, "register", None)
    if callable(register):
        register(toolset_class)


def _current_task() -> Any:
    try:
        from airflow.sdk import get_current_context

        return get_current_context().get("task")
    except Exception:  # noqa: BLE001 - outside a running task there is nothing to check
        return None


def refuse_unsafe_agent_features(*, attached: bool) -> None:
    """
    Refuse, in a running task, the agent features that assume the sandbox outlives one run:
    ``durable=True`` with any sandbox toolset, ``enable_hitl_review=True`` unless ``attached``.

    :param attached: the toolset works in a sandbox another task provisioned (``attach_to``).
    :raises SandboxTerminalError: saying what to change, which fails the task.
    """
    task = _current_task()
    if task is None:
        return
    if getattr(task, "durable", False) is True:
        raise SandboxTerminalError(DURABLE_REFUSAL)
    if getattr(task, "enable_hitl_review", False) is True and not attached:
        raise SandboxTerminalError(REVIEW_REFUSAL)


def explain_refused_approval(error: BaseException | None) -> None:
    """
    Log what to change when a run with a toolset that provisions its own sandbox failed because a
    tool call needed approval: pydantic-ai's own error speaks of output types, which the Dag author
    does not set for ``AgentOperator``.
    """
    if error is None:
        return
    from pydantic_ai.exceptions import UserError

    if isinstance(error, UserError) and "DeferredToolRequests" in str(error):
        log.error(APPROVAL_REFUSAL)
