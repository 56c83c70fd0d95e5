"""
The guide's guards with common-ai's AgentOperator, as users install it, under ``dag.test()`` with a
scripted pydantic-ai model and the real local backend:

- ``durable=True`` is refused with any SandboxToolset, ``enable_hitl_review=True`` with one that
  provisions its own sandbox: when the Dag is parsed, and, for a toolset AgentOperator cannot see
  then (built per run by a function), when the run opens it, before any tool runs;
- a tool that needs approval fails the task when the toolset provisioned its own sandbox;
- with an attached sandbox, review and per-tool approval work, and the later run finds the files.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from airflow.models.dagrun import DagRun
from airflow.models.taskinstance import TaskInstance
from airflow.utils.session import create_session
from airflow.utils.state import TaskInstanceState
from pydantic_ai.capabilities import Toolset
from pydantic_ai.toolsets import DynamicToolset

from conftest import requires_bwrap
from dag_runs import run_dag_defined_here as run_dag
from sandbox_provider.hooks.local import LocalSandboxHook
from sandbox_provider.sandbox import SandboxSpec, SandboxTerminalError, dag_run_owner
from sandbox_provider.toolsets import SandboxToolset
from sandbox_provider.toolsets._agent_guards import APPROVAL_REFUSAL, DURABLE_REFUSAL, REVIEW_REFUSAL
from scripted_model import Script

pytestmark = requires_bwrap

AgentOperator = pytest.importorskip("airflow.providers.common.ai.operators.agent").AgentOperator


def _airflow_at_least(major: int, minor: int) -> bool:
    from airflow import __version__

    return tuple(int(p) for p in __version__.split(".")[:2]) >= (major, minor)


@pytest.fixture
def state_root(tmp_path):
    root = tmp_path / "sandboxes"
    root.mkdir()
    return root


@pytest.fixture
def local(state_root):
    return LocalSandboxHook(state_root=str(state_root))


def standing(state_root: Path) -> list[str]:
    return sorted(p.name for p in state_root.iterdir() if p.name.startswith("airflow-sandbox-"))


def new_dag(name: str):
    from airflow.sdk import DAG

    return DAG(
        dag_id=f"guards_{name}_{uuid.uuid4().hex[:8]}",
        schedule=None,
        start_date=datetime(2024, 1, 1, tzinfo=UTC),
        catchup=False,
    )


def agent(**kwargs):
    kwargs.setdefault("task_id", "agent")
    kwargs.setdefault("llm_conn_id", "pydanticai_default")
    kwargs.setdefault("prompt", "Work in the sandbox.")
    return AgentOperator(**kwargs)


def states(dag_run) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}


# -- when the Dag is parsed -------------------------------------------------------------------------------


PLACEMENTS = ["direct", "prefixed", "filtered", "approval-wrapped", "capability", "agent_params"]


def _placements(toolset):
    """The compositions AgentOperator looks inside: as given, wrapped, combined, in a capability, in agent_params."""
    return {
        "direct": {"toolsets": [toolset]},
        "prefixed": {"toolsets": [toolset.prefixed("box")]},
        "filtered": {"toolsets": [toolset.filtered(lambda ctx, tool: True)]},
        "approval-wrapped": {"toolsets": [toolset.approval_required()]},
        "capability": {"capabilities": [Toolset(toolset)]},
        "agent_params": {"agent_params": {"toolsets": [toolset]}},
    }


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_durable_is_refused_with_any_sandbox_toolset_when_the_dag_is_parsed(local, placement):
    for toolset in (SandboxToolset(local), SandboxToolset(local, attach_to="{{ ti.xcom_pull('provision') }}")):
        with (
            new_dag("durable_parse"),
            pytest.raises(ValueError, match=r"durable=True cannot be used with a SandboxToolset"),
        ):
            agent(durable=True, **_placements(toolset)[placement])


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_review_is_refused_with_a_self_provisioned_sandbox_when_the_dag_is_parsed(local, placement):
    with new_dag("review_parse"), pytest.raises(ValueError, match=r"provisions its own sandbox.*attach_to=") as err:
        agent(enable_hitl_review=True, **_placements(SandboxToolset(local))[placement])
    assert "drop enable_hitl_review=True" in str(err.value)
    # Attached to a sandbox another task provisioned, review is allowed.
    with new_dag("review_parse_ok"):
        attached = SandboxToolset(local, attach_to="{{ ti.xcom_pull('provision') }}")
        agent(enable_hitl_review=True, **_placements(attached)[placement])


def test_approval_pauses_only_with_attached_sandboxes(local):
    with new_dag("approval_parse"):
        own = agent(task_id="own", toolsets=[SandboxToolset(local).approval_required()])
        attached = agent(
            task_id="attached",
            toolsets=[SandboxToolset(local, attach_to="{{ ti.xcom_pull('p') }}").approval_required()],
        )
        plain = agent(task_id="plain", toolsets=[])
    assert own._supports_tool_approval() is False  # so a call that needs approval fails the task
    assert attached._supports_tool_approval() is plain._supports_tool_approval() is _airflow_at_least(3, 3)


def test_the_flags_stay_usable_without_a_sandbox_and_a_sandbox_without_them(local):
    with new_dag("no_sandbox"):
        agent(task_id="a", enable_hitl_review=True)
        agent(task_id="b", toolsets=[SandboxToolset(local)])


# -- when the run opens a toolset AgentOperator could not see --------------------------------------------


def _per_run(hook, **kwargs):
    """A function that builds the toolset per run: AgentOperator cannot look inside it when the Dag is parsed."""

    def build(ctx):
        return SandboxToolset(hook, **kwargs)

    return build


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [({"durable": True}, DURABLE_REFUSAL), ({"enable_hitl_review": True}, REVIEW_REFUSAL)],
    ids=["durable", "review"],
)
def test_a_toolset_built_per_run_is_refused_before_any_tool_runs(
    migrated_airflow_db, scripted_llm, local, state_root, monkeypatch, flags, refusal
):
    from sandbox_provider.toolsets import sandbox as toolset_module

    raised: list[BaseException] = []
    guard = toolset_module.refuse_unsafe_agent_features

    def watched(**kwargs):
        try:
            guard(**kwargs)
        except BaseException as err:
            raised.append(err)
            raise

    monkeypatch.setattr(toolset_module, "refuse_unsafe_agent_features", watched)
    # Before Airflow 3.3 a durable run keeps its journal in object storage, which must be configured.
    monkeypatch.setenv("AIRFLOW__COMMON_AI__DURABLE_CACHE_PATH", (state_root.parent / "durable").as_uri())
    script = scripted_llm(Script([("write_file", {"path": "notes.txt", "content": "x"})], "done"))
    with new_dag("per_run") as dag:
        agent(toolsets=[DynamicToolset(_per_run(local), id="sandbox")], hitl_poll_interval=0.1, **flags)
    dag_run = run_dag(dag)
    assert states(dag_run) == {"agent": "failed"}
    assert [str(err) for err in raised] == [refusal]  # what failed the task, in its words
    assert script.results == [] and len(script.steps) == 2  # the model was never asked, no tool ran
    assert standing(state_root) == []


def test_the_run_time_guard_lets_review_through_with_an_attached_sandbox(local, state_root, monkeypatch):
    from sandbox_provider.toolsets import _agent_guards

    class ReviewedTask:
        durable = False
        enable_hitl_review = True

    monkeypatch.setattr(_agent_guards, "_current_task", lambda: ReviewedTask())
    handle = local.create(spec=SandboxSpec(owner="d/r"))
    with SandboxToolset(local, attach_to=handle, owner="d/r") as toolset:
        assert toolset.call("run_command", command="echo attached") == "[stdout]\nattached"
    with pytest.raises(SandboxTerminalError, match="provisions its own sandbox"), SandboxToolset(local):
        pass
    local.destroy(handle)


# -- per-tool approval with a self-provisioned sandbox ----------------------------------------------------


def test_a_tool_that_needs_approval_fails_the_task_with_a_self_provisioned_sandbox(
    migrated_airflow_db, scripted_llm, local, state_root, caplog
):
    script = scripted_llm(
        Script(
            [("write_file", {"path": "notes.txt", "content": "first draft\n"})],
            [("run_command", {"command": "cat notes.txt > seen.txt"})],
            "done",
        )
    )
    needs_approval = SandboxToolset(local).approval_required(lambda ctx, tool, args: tool.name == "run_command")
    with new_dag("approval_own") as dag:
        agent(toolsets=[needs_approval])
    dag_run = run_dag(dag)
    assert states(dag_run) == {"agent": "failed"}  # failed, not AWAITING_INPUT with its sandbox gone
    assert [str(r.content) for r in script.results] == ["Wrote 12 bytes to 'notes.txt'."]  # run_command never ran
    assert standing(state_root) == []
    assert APPROVAL_REFUSAL in caplog.text  # the task log says what to change


# -- with an attached sandbox, review and approval work ---------------------------------------------------


def _provision_and_collect(local: LocalSandboxHook, collected: dict):
    from airflow.sdk import TriggerRule, task

    @task
    def provision(**context) -> str:
        handle = local.create(spec=SandboxSpec(owner=dag_run_owner(context)))
        local.write_file(handle, "input.txt", b"from provision\n")
        return handle

    @task(trigger_rule=TriggerRule.ALL_DONE)
    def collect(handle: str) -> None:
        try:
            collected["notes"] = local.read_file(handle, "notes.txt", max_bytes=1024).decode()
        finally:
            local.destroy(handle)

    return provision, collect


class _Reviewer(threading.Thread):
    """Answers a HITL review through the review plugin's REST API, as a person in the UI does."""

    def __init__(self, answers: list[tuple[str, str]]) -> None:
        super().__init__(daemon=True)
        # Imported here, in the test's thread: an import in this thread while the other sets up
        # the ORM would deadlock on the import lock.
        from airflow.providers.common.ai.plugins.hitl_review import hitl_review_app
        from fastapi.testclient import TestClient

        for route in hitl_review_app.routes:  # the UI's login is not what is under test
            for dependency in getattr(route, "dependencies", []):
                hitl_review_app.dependency_overrides[dependency.dependency] = lambda: None
        self.client = TestClient(hitl_review_app)
        self.answers = list(answers)  # ("feedback", text) or ("approve", "")
        self.dag_id = ""
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            self._run()
        except BaseException as err:  # noqa: BLE001 - reported by the test
            self.error = err
            _end_the_wait(self.dag_id)

    def _run(self) -> None:
        client = self.client
        answered = 0
        while self.answers and not self.stop.is_set():
            run_id = self._run_id()
            where = {"dag_id": self.dag_id, "task_id": "agent", "run_id": run_id}
            found = client.get("/sessions/find", params=where) if run_id else None
            if found is None or found.status_code != 200:
                time.sleep(0.1)
                continue
            session = found.json()
            if session["status"] != "pending_review" or session["iteration"] <= answered:
                time.sleep(0.1)
                continue
            kind, text = self.answers.pop(0)
            if kind == "feedback":
                response = client.post("/sessions/feedback", params=where, json={"feedback": text})
            else:
                response = client.post("/sessions/approve", params=where)
            response.raise_for_status()
            answered = session["iteration"]

    def _run_id(self) -> str | None:
        with create_session() as session:
            run = session.query(DagRun).filter(DagRun.dag_id == self.dag_id).first()
            return run.run_id if run else None


@pytest.mark.skipif(not _airflow_at_least(3, 1), reason="HITL review needs Airflow 3.1+")
def test_review_with_an_attached_sandbox_regenerates_in_the_same_sandbox(migrated_airflow_db, scripted_llm, local):
    script = scripted_llm(
        Script(
            [("run_command", {"command": "cat input.txt && echo 'draft 1' > notes.txt"})],
            "Draft one is in notes.txt.",
            # The run regenerated after the reviewer's feedback: the first run's file is still there.
            [("run_command", {"command": "cat notes.txt && echo 'draft 2' >> notes.txt"})],
            "Draft two is in notes.txt.",
        )
    )
    collected: dict = {}
    provision, collect = _provision_and_collect(local, collected)
    reviewer = _Reviewer([("feedback", "Add a second draft."), ("approve", "")])
    with new_dag("review_attached") as dag:
        handle = provision()
        reviewed = agent(
            enable_hitl_review=True,
            hitl_poll_interval=0.1,
            hitl_timeout=timedelta(seconds=120),  # a reviewer that never answers fails the test, not hangs it
            toolsets=[SandboxToolset(local, attach_to="{{ ti.xcom_pull(task_ids='provision') }}")],
        )
        handle >> reviewed >> collect(handle)
    reviewer.dag_id = dag.dag_id
    reviewer.start()
    try:
        dag_run = run_dag(dag)
    finally:
        reviewer.stop.set()
        reviewer.join(10)
    assert reviewer.error is None, reviewer.error
    assert reviewer.answers == []
    assert states(dag_run) == {"provision": "success", "agent": "success", "collect": "success"}
    assert [str(r.content) for r in script.results] == ["[stdout]\nfrom provision", "[stdout]\ndraft 1"]
    assert collected["notes"] == "draft 1\ndraft 2\n"


def _end_the_wait(dag_id: str) -> None:
    """A helper that cannot answer fails the parked task, so dag.test() ends and the test reports why."""
    from sqlalchemy.exc import OperationalError

    for _ in range(50):
        try:
            with create_session() as session:
                for ti in session.query(TaskInstance).filter_by(dag_id=dag_id, task_id="agent"):
                    if ti.state == TaskInstanceState.AWAITING_INPUT:
                        ti.state = TaskInstanceState.FAILED
            return
        except OperationalError:  # SQLite busy: try again
            time.sleep(0.2)


class _ParkedByDagTest(logging.Handler):
    """
    Set once ``dag.test()`` says it waits for Human-in-the-loop input, the point after which an answer
    resumes the task. Before it, ``dag.test()`` has not yet written back the state the task ended in:
    the task parks itself in AWAITING_INPUT through the execution API, and only after the in-process
    task returns does ``dag.test()`` set that state again on its own copy of the task instance. An
    answer that lands in between (the answer's handler sets SCHEDULED) is overwritten with
    AWAITING_INPUT, and ``dag.test()`` waits for a second answer that never comes; on a loaded
    machine that window is wide enough to be hit.
    """

    LOGGER = "airflow.sdk.definitions.dag"

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self._event = threading.Event()
        self._level: int | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Waiting for Human-in-the-loop input"):
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def attach(self) -> None:
        logger = logging.getLogger(self.LOGGER)
        self._level = logger.level
        if not logger.isEnabledFor(logging.INFO):
            logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def detach(self) -> None:
        logger = logging.getLogger(self.LOGGER)
        logger.removeHandler(self)
        if self._level is not None:
            logger.setLevel(self._level)


class _Approver(threading.Thread):
    """Answers a tool approval request through Airflow's HITL REST route, as a person in the UI does."""

    def __init__(self, dag_id: str, choice: str) -> None:
        super().__init__(daemon=True)
        # Imported in the test's thread, for the reason _Reviewer gives.
        import airflow.api_fastapi.core_api.datamodels.hitl
        import airflow.api_fastapi.core_api.routes.public.hitl  # noqa: F401

        self.dag_id = dag_id
        self.choice = choice
        self.error: BaseException | None = None
        self.answered = False
        self.stop = threading.Event()
        self.parked = _ParkedByDagTest()

    def start(self) -> None:
        self.parked.attach()
        super().start()

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        self.parked.detach()

    def run(self) -> None:
        from fastapi import HTTPException
        from sqlalchemy.exc import OperationalError

        give_up = time.monotonic() + 120
        while not self.stop.is_set():
            if time.monotonic() > give_up:
                # Never parked, not answered, or answered and the task never resumed: end dag.test() with a failure.
                self.error = TimeoutError(
                    f"within 120 s: dag.test() parked the task for input={self.parked.is_set()}, "
                    f"answered={self.answered}, and dag.test() still waits"
                )
                _end_the_wait(self.dag_id)
                return
            try:
                # Only once dag.test() itself has parked the task: until then its own loop may still write
                # AWAITING_INPUT over the answer's SCHEDULED (see _ParkedByDagTest), and nothing would resume it.
                if not self.answered and self.parked.is_set():
                    self._answer_if_waiting()
            except OperationalError:
                pass  # the test database (SQLite) is busy with the task's own writes: ask again
            except HTTPException as err:
                if err.status_code != 404:  # 404: the request is not readable yet
                    self.error = err
                    _end_the_wait(self.dag_id)
                    return
            except BaseException as err:  # noqa: BLE001 - reported by the test
                self.error = err
                _end_the_wait(self.dag_id)
                return
            time.sleep(0.1)

    def _answer_if_waiting(self) -> None:
        from airflow.api_fastapi.core_api.datamodels.hitl import UpdateHITLDetailPayload
        from airflow.api_fastapi.core_api.routes.public.hitl import update_hitl_detail

        class Person:
            def get_id(self) -> str:
                return "reviewer"

            def get_name(self) -> str:
                return "Reviewer"

        with create_session() as session:
            ti = session.query(TaskInstance).filter_by(dag_id=self.dag_id, task_id="agent").one_or_none()
            if ti is None or ti.state != TaskInstanceState.AWAITING_INPUT:
                return
            payload = UpdateHITLDetailPayload(chosen_options=[self.choice], params_input={"reason": "", "request": 1})
            update_hitl_detail(
                dag_id=self.dag_id,
                dag_run_id=ti.run_id,
                task_id="agent",
                update_hitl_detail_payload=payload,
                user=Person(),
                session=session,
            )
        self.answered = True


@pytest.mark.skipif(not _airflow_at_least(3, 3), reason="per-tool approval needs Airflow 3.3+")
def test_approval_with_an_attached_sandbox_runs_the_approved_call_in_the_same_sandbox(
    migrated_airflow_db, scripted_llm, local
):
    script = scripted_llm(
        Script(
            [("write_file", {"path": "notes.txt", "content": "before the pause\n"})],
            [("run_command", {"command": "cat notes.txt input.txt && echo approved >> notes.txt"})],
            "done",
        )
    )
    collected: dict = {}
    provision, collect = _provision_and_collect(local, collected)
    needs_approval = SandboxToolset(local, attach_to="{{ ti.xcom_pull(task_ids='provision') }}").approval_required(
        lambda ctx, tool, args: tool.name == "run_command"
    )
    with new_dag("approval_attached") as dag:
        handle = provision()
        handle >> agent(toolsets=[needs_approval]) >> collect(handle)
    approver = _Approver(dag.dag_id, "Approve")
    approver.start()
    try:
        dag_run = run_dag(dag)
    finally:
        approver.stop.set()
        approver.join(10)
    assert approver.error is None and approver.answered
    assert states(dag_run) == {"provision": "success", "agent": "success", "collect": "success"}
    texts = [str(r.content) for r in script.results]
    assert texts == ["Wrote 17 bytes to 'notes.txt'.", "[stdout]\nbefore the pause\nfrom provision"]
    assert collected["notes"] == "before the pause\napproved\n"
