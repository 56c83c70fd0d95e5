"""SandboxToolset against the real local (bubblewrap) backend, driven by scripted pydantic-ai agents."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai import Agent
from pydantic_ai.exceptions import UserError
from pydantic_ai.messages import (
    RetryPromptPart,
)
from pydantic_ai.models.function import FunctionModel

from conftest import requires_bwrap
from fake_hook import FakeSandboxHook
from sandbox_provider.hooks.local import LocalSandboxHook
from sandbox_provider.sandbox import SandboxSpec, SandboxTerminalError
from sandbox_provider.sandbox.errors import SandboxError
from sandbox_provider.sandbox.hook import RunOutcome
from sandbox_provider.sandbox.spec import HOLDER_TAG, OWNER_TAG
from sandbox_provider.toolsets import SandboxToolset
from sandbox_provider.toolsets.sandbox import MASK_MARGIN_BYTES
from scripted_model import Script

pytestmark = requires_bwrap


def agent_with(script: Script, *toolsets: Any) -> Agent:
    return Agent(script.model, toolsets=list(toolsets))


@pytest.fixture
def state_root(tmp_path):
    root = tmp_path / "sandboxes"
    root.mkdir()
    return root


@pytest.fixture
def local(state_root):
    return LocalSandboxHook(state_root=str(state_root))


def standing(state_root: Path) -> list[str]:
    """Handles of the sandboxes still on disk."""
    return sorted(p.name for p in state_root.iterdir() if p.name.startswith("airflow-sandbox-"))


# -- the headline flow -----------------------------------------------------------------------------

BROKEN = "import sys\nrows = [1, 2, 3]\nprint('total', sum(row for row in rowz))\n"
FIXED = (
    "import sys\nrows = [1, 2, 3]\ntotal = sum(rows)\n"
    "open('out/total.txt', 'w').write(f'total={total}\\n')\nprint('total', total)\n"
)


def test_write_run_fail_fix_and_export(local, state_root, tmp_path):
    dest = tmp_path / "landing" / "total.txt"
    toolset = SandboxToolset(local, exports={"out/total.txt": dest.as_uri()})
    script = Script(
        [("write_file", {"path": "job.py", "content": BROKEN})],
        [("run_command", {"command": "mkdir -p out && python3 job.py"})],
        [("write_file", {"path": "job.py", "content": FIXED})],
        [("run_command", {"command": "python3 job.py", "timeout_seconds": 30})],
        [("read_file", {"path": "out/total.txt"}), ("list_directory", {})],
        "done",
    )
    result = agent_with(script, toolset).run_sync("compute the total")

    assert result.output == "done"
    texts = script.texts()
    assert texts[0] == f"Wrote {len(BROKEN)} bytes to 'job.py'."
    assert "[stderr]" in texts[1] and "NameError" in texts[1] and "[exit code: 1]" in texts[1]
    assert texts[3] == "[stdout]\ntotal 6"
    assert texts[4] == "total=6"
    assert texts[5] == "job.py\nout/"
    assert dest.read_text() == "total=6\n"
    assert not list(dest.parent.glob("*.partial"))
    assert standing(state_root) == []


def test_failed_run_exports_nothing_and_destroys(local, state_root, tmp_path):
    dest = tmp_path / "landing" / "out.txt"
    toolset = SandboxToolset(local, exports={"out.txt": dest.as_uri()})

    def explode(_texts):
        raise RuntimeError("the model service went away")

    script = Script([("run_command", {"command": "echo partial > out.txt"})], explode)
    with pytest.raises(RuntimeError, match="went away"):
        agent_with(script, toolset).run_sync("go")
    assert not dest.exists()
    assert standing(state_root) == []


def test_run_that_never_provisions_cannot_export(local, state_root, tmp_path):
    toolset = SandboxToolset(
        local, exports={"report.md": (tmp_path / "r.md").as_uri(), "b.csv": (tmp_path / "b").as_uri()}
    )
    with pytest.raises(SandboxTerminalError, match=r"no sandbox standing.*'report.md', 'b.csv'"):
        agent_with(Script("nothing to do"), toolset).run_sync("go")


def test_a_missing_export_fails_the_run_and_lands_nothing(local, state_root, tmp_path):
    first = tmp_path / "a.txt"
    second = tmp_path / "b.txt"
    first.write_text("from an earlier run\n")
    toolset = SandboxToolset(local, exports={"a.txt": first.as_uri(), "b.txt": second.as_uri()})
    script = Script([("run_command", {"command": "echo new > a.txt"})], "done")
    with pytest.raises(SandboxTerminalError, match="b.txt"):
        agent_with(script, toolset).run_sync("go")
    assert first.read_text() == "from an earlier run\n"
    assert not second.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")) == []
    assert standing(state_root) == []


def test_async_with_agent_exports_once(local, state_root, tmp_path):
    dest = tmp_path / "once.txt"
    toolset = SandboxToolset(local, exports={"once.txt": dest.as_uri()})
    script = Script([("run_command", {"command": "echo once > once.txt"})], "ok")
    agent = agent_with(script, toolset)

    async def body():
        async with agent:
            await agent.run("go")
            assert dest.read_text() == "once\n"
            dest.unlink()

    asyncio.run(body())
    assert not dest.exists()
    assert standing(state_root) == []


def test_a_run_started_while_handling_an_exception_still_exports(local, tmp_path):
    dest = tmp_path / "e.txt"
    toolset = SandboxToolset(local, exports={"e.txt": dest.as_uri()})
    script = Script([("run_command", {"command": "echo recovered > e.txt"})], "ok")
    try:
        raise LookupError("handled by the caller")
    except LookupError:
        agent_with(script, toolset).run_sync("go")
    assert dest.read_text() == "recovered\n"


# -- lifecycle ---------------------------------------------------------------------------------------


def test_sandbox_is_lazy_shared_within_a_run_and_fresh_per_run(local, state_root):
    toolset = SandboxToolset(local)
    agent = Agent(FunctionModel(Script("unused")), toolsets=[toolset])
    assert agent.run_sync("nothing").output == "unused"
    assert standing(state_root) == []

    seen_inside: list[list[str]] = []

    def snapshot(_texts):
        seen_inside.append(standing(state_root))
        return [("run_command", {"command": "cat marker 2>/dev/null || echo absent"})]

    for _ in range(2):
        script = Script([("run_command", {"command": "echo here > marker"})], snapshot, "ok")
        Agent(script.model, toolsets=[toolset]).run_sync("go")
        assert script.texts()[1] == "[stdout]\nhere"
    assert len(seen_inside) == 2 and all(len(s) == 1 for s in seen_inside)
    assert seen_inside[0] != seen_inside[1]
    assert standing(state_root) == []


def test_timeouts_and_empty_output_are_ordinary_results(local):
    toolset = SandboxToolset(local, default_command_timeout=1, max_command_timeout=2)
    script = Script(
        [("run_command", {"command": "sleep 10"})],
        [("run_command", {"command": "sleep 10", "timeout_seconds": 500})],
        [("run_command", {"command": "true"})],
        [("run_command", {"command": "printf partial; exit 3"})],
        [("run_command", {"command": "definitely-not-installed"})],
        "ok",
    )
    agent_with(script, toolset).run_sync("go")
    texts = script.texts()
    assert texts[0] == "(no output)\n[timed out after 1s]"
    assert texts[1] == "(no output)\n[timed out after 2s]"
    assert texts[2] == "(no output)"
    assert texts[3] == "[stdout]\npartial\n[exit code: 3]"
    assert "[exit code: 127]" in texts[4] and "not installed" in texts[4]


def test_mistakes_come_back_as_retries(local):
    toolset = SandboxToolset(local, max_read_bytes=1024)
    script = Script(
        [("read_file", {"path": "missing.txt"})],
        [("run_command", {"command": "echo x", "timeout_seconds": 0})],
        [("run_command", {"command": "head -c 5000 /dev/zero | tr '\\0' a > big.txt"})],
        [("read_file", {"path": "big.txt"})],
        [("run_command", {"command": "echo small > small.txt"}), ("read_file", {"path": "small.txt"})],
        [("read_file", {"path": "."})],
        [("list_directory", {"path": "nowhere"})],
        [("read_file", {"path": "big.txt", "offset": 0})],
        "ok",
    )
    agent_with(script, toolset).run_sync("go")
    retries = [p for p in script.results if getattr(p, "outcome", None) == "retried" or isinstance(p, RetryPromptPart)]
    messages = [str(p.content) for p in retries]
    assert len(retries) == 6, script.texts()
    assert "'missing.txt' does not exist" in messages[0]
    assert "timeout_seconds" in messages[1] and "greater than 0" in messages[1]  # the schema's bound
    assert "'big.txt' is 4.9KB, over the 1.0KB read limit" in messages[2] and "head" in messages[2]
    assert "directory" in messages[3]
    assert "'nowhere'" in messages[4]
    assert "offset" in messages[5] and "greater than or equal to 1" in messages[5]


def test_unencodable_content_is_refused(local):
    with SandboxToolset(local) as toolset, pytest.raises(SandboxError, match="UTF-8"):
        toolset.call("write_file", path="bad.txt", content="\ud800")


def test_file_windows_and_listing_limits(local):
    toolset = SandboxToolset(local, max_output_lines=3)
    lines = "".join(f"line {i}\n" for i in range(1, 11))
    script = Script(
        [("write_file", {"path": "ten.txt", "content": lines})],
        [("read_file", {"path": "ten.txt"})],
        [("read_file", {"path": "ten.txt", "offset": 4, "limit": 2})],
        [("read_file", {"path": "ten.txt", "offset": 11})],
        [("run_command", {"command": "mkdir d && touch d/a d/b d/c d/e && mkdir d/sub"})],
        [("list_directory", {"path": "d"})],
        [("run_command", {"command": "seq 1 10"})],
        "ok",
    )
    agent_with(script, toolset).run_sync("go")
    texts = script.texts()
    assert texts[1] == "line 1\nline 2\nline 3\n[... 7 more line(s); read on with offset=4]"
    assert texts[2] == "line 4\nline 5\n[... 5 more line(s); read on with offset=6]"
    assert texts[3] == "(nothing at offset 11: the file has 10 line(s))"
    assert texts[5].startswith("a\nb\nc\n[... 2 more entries not shown")
    assert texts[6] == (
        "[stdout]\n[... 7 earlier lines (14 bytes) not shown; the limits are 3 lines and 50.0KB. Send the output to a "
        "file and read it in parts, or filter it with grep, head or tail.]\n8\n9\n10"
    )


def test_terminal_errors_fail_the_run(state_root):
    class Unprovisionable(LocalSandboxHook):
        def create(self, *, spec=None):
            raise SandboxError("quota exhausted")

    toolset = SandboxToolset(Unprovisionable(state_root=str(state_root)))
    script = Script([("run_command", {"command": "true"})], "unreachable")
    with pytest.raises(SandboxTerminalError, match="Could not provision a sandbox on backend 'local': quota"):
        agent_with(script, toolset).run_sync("go")


def test_spec_reaches_the_backend_and_the_description(local, state_root):
    toolset = SandboxToolset(local, spec=SandboxSpec(env={"GREETING": "hello there"}))
    script = Script([("run_command", {"command": 'echo "$GREETING"; getent hosts example.com || echo no-dns'})], "ok")
    agent_with(script, toolset).run_sync("go")
    assert script.texts()[0].startswith("[stdout]\nhello there\nno-dns")
    description = script.descriptions["run_command"]
    assert "no network access at all, not even DNS" in description
    assert "deleted when this run ends" in description
    assert "/workspace" in description


def test_the_description_keeps_to_the_backends_longest_command(state_root):
    import dataclasses

    class Capped(LocalSandboxHook):
        capabilities = dataclasses.replace(LocalSandboxHook.capabilities, max_command_seconds=45)

    toolset = SandboxToolset(Capped(state_root=str(state_root)), default_command_timeout=60, max_command_timeout=900)
    script = Script([("run_command", {"command": "true", "timeout_seconds": 600})], "ok")
    agent_with(script, toolset).run_sync("go")
    assert "Commands get 45s unless you pass timeout_seconds (at most 45s)." in script.descriptions["run_command"]
    assert script.texts()[0] == "(no output)"  # no note that the sandbox allowed less than was asked


class _Crashing(LocalSandboxHook):
    """The local backend, except that the command ``crash`` ends the sandbox the way a backend would."""

    def _run(self, handle, command, *, timeout, output):
        if command == "crash":
            self.destroy(handle)
            output.stderr(b"Killed")
            return RunOutcome(137, sandbox_terminated=True)
        return super()._run(handle, command, timeout=timeout, output=output)


def test_a_sandbox_that_ended_is_announced_and_replaced(state_root):
    toolset = SandboxToolset(_Crashing(state_root=str(state_root)))
    handles: list[list[str]] = []
    script = Script(
        [("write_file", {"path": "a.txt", "content": "first\n"})],
        lambda _t: handles.append(standing(state_root)) or [("run_command", {"command": "crash"})],
        [("run_command", {"command": "cat a.txt"})],
        lambda _t: handles.append(standing(state_root)) or "ok",
    )
    agent_with(script, toolset).run_sync("go")
    texts = script.texts()
    assert texts[1] == (
        "[stderr]\nKilled\n[exit code: 137 (killed by SIGKILL)] [the sandbox ended: files from earlier calls are "
        "gone, and the next call gets a new sandbox]"
    )
    assert "No such file" in texts[2]
    assert len(handles[0]) == len(handles[1]) == 1 and handles[0] != handles[1]
    assert standing(state_root) == []


def test_an_attached_sandbox_that_ended_fails_the_task(state_root):
    hook = _Crashing(state_root=str(state_root))
    handle = provision(hook, "o")
    toolset = SandboxToolset(hook, attach_to=handle, owner="o")
    script = Script([("run_command", {"command": "crash"})], "never")
    with pytest.raises(SandboxTerminalError, match=f"attached to, '{handle}', stopped while running a command"):
        agent_with(script, toolset).run_sync("go")
    assert standing(state_root) == []


# -- two sandboxes in one agent -------------------------------------------------------------------------


def test_two_prefixed_toolsets_get_separate_sandboxes(local, state_root):
    py = SandboxToolset(local, tool_prefix="py")
    sh = SandboxToolset(local, tool_prefix="sh")
    script = Script(
        [
            ("py_write_file", {"path": "which.txt", "content": "python box\n"}),
            ("sh_write_file", {"path": "which.txt", "content": "shell box\n"}),
        ],
        [("py_read_file", {"path": "which.txt"}), ("sh_run_command", {"command": "cat which.txt"})],
        "ok",
    )
    agent_with(script, py, sh).run_sync("go")
    assert sorted(script.tool_names) == sorted(
        [f"{p}_{t}" for p in ("py", "sh") for t in ("run_command", "read_file", "write_file", "list_directory")]
    )
    texts = script.texts()
    assert texts[2] == "python box"
    assert texts[3] == "[stdout]\nshell box"
    assert standing(state_root) == []
    assert py.id == "sandbox-local-py" and sh.id == "sandbox-local-sh"


def test_two_toolsets_without_prefixes_conflict(local):
    with pytest.raises(UserError, match="run_command"):
        agent_with(Script("never"), SandboxToolset(local), SandboxToolset(local)).run_sync("go")


def test_prefixed_wrapper_still_exports(local, tmp_path):
    dest = tmp_path / "x.txt"
    toolset = SandboxToolset(local, exports={"x.txt": dest.as_uri()}).prefixed("box")
    script = Script([("box_run_command", {"command": "echo wrapped > x.txt"})], "ok")
    agent_with(script, toolset).run_sync("go")
    assert dest.read_text() == "wrapped\n"


# -- secrets ---------------------------------------------------------------------------------------------

SECRET = "Kx9-vault-Qz7pW"


@pytest.fixture
def secret():
    from airflow.sdk.log import mask_secret

    mask_secret(SECRET)
    return SECRET


def fragments(secret: str, size: int = 4) -> list[str]:
    return [secret[i : i + size] for i in range(len(secret) - size + 1)]


def assert_no_secret(texts: list[str], secret: str) -> None:
    for text in texts:
        for piece in fragments(secret):
            assert piece not in text, f"{piece!r} of the secret leaked into {text!r}"


def test_secret_never_reaches_the_model(local, secret):
    # 40 bytes shown per stream: the cut of the 78-byte line below lands inside the secret.
    toolset = SandboxToolset(local, max_output_bytes=40, max_output_lines=5)
    long_line = "." * 30 + secret + "," * 33
    # Enough output that the backend itself drops bytes, and its cut lands inside the secret too.
    backend_cut = 40 + MASK_MARGIN_BYTES
    flood = "." * 100 + secret + "," * (backend_cut - len(secret) // 2)
    script = Script(
        [("write_file", {"path": "note.txt", "content": f"token={secret}\n" * 3 + long_line + "\n"})],
        [("run_command", {"command": f"printf '%s' '{long_line}'"})],
        [("run_command", {"command": f"printf '%s' '{long_line}' >&2; exit 2"})],
        [("run_command", {"command": f"printf '%s' '{flood}'"})],
        [("read_file", {"path": "note.txt"}), ("read_file", {"path": "note.txt", "offset": 4})],
        [("run_command", {"command": f"touch '{secret}.txt'"}), ("list_directory", {})],
        [("read_file", {"path": f"{secret}/missing"})],
        [("run_command", {"command": "env; head -3 note.txt"})],
        "ok",
    )
    agent_with(script, toolset).run_sync("go")
    texts = script.texts()
    assert len(texts) == 10
    assert_no_secret(texts, secret)
    # Of a line that is only partly shown, the bytes not shown count the masked text (*** for the secret).
    assert texts[1].startswith("[stdout]\n[... the first 38 bytes of the last line not shown")
    assert "***" in texts[1]
    assert "dropped the start" in texts[3] or "not shown" in texts[3]
    assert "token=***" in texts[4] and texts[5].startswith("Line 4 is wider than the 40B output limit")
    assert "***.txt" in texts[7] and "***" in texts[8] and "token=***" in texts[9]


def test_secret_split_by_the_backends_own_cut_is_dropped(local, secret):
    # The backend keeps the last max_output_bytes + MASK_MARGIN_BYTES of a stream, and this output
    # makes its cut land inside a secret. Masking shrinks the many whole copies after it enough
    # that, without dropping the margin, the unmaskable fragment would be within what is shown.
    toolset = SandboxToolset(local, max_output_bytes=2048)
    kept_by_backend = 2048 + MASK_MARGIN_BYTES
    assert kept_by_backend % len(secret) not in (0, len(secret))
    output = "x" * 100 + secret * 500
    script = Script([("run_command", {"command": f"printf '%s' '{output}'"})], "ok")
    agent_with(script, toolset).run_sync("go")
    (text,) = script.texts()
    assert_no_secret([text], secret)
    assert text.startswith("[stdout]\n[... the sandbox dropped the start of this output") or "not shown" in text
    assert text.rstrip().endswith("***")


# -- attach ---------------------------------------------------------------------------------------------


def provision(hook, owner: str, *, lifetime: float | None = None) -> str:
    handle = hook.create(spec=SandboxSpec(owner=owner))
    if lifetime is not None:
        import time

        from sandbox_provider.sandbox.spec import EXPIRES_AT_TAG

        tags = dict(hook.read_tags(handle))
        tags[EXPIRES_AT_TAG] = str(int(time.time() + lifetime))
        hook.write_tags(handle, tags)
    hook.write_file(handle, "input.txt", b"from the provisioner\n")
    return handle


def test_attached_sandbox_is_used_released_and_kept(local, state_root):
    handle = provision(local, "team/run-1", lifetime=1800)
    toolset = SandboxToolset(local, attach_to=handle, owner="team/run-1")
    script = Script(
        [("run_command", {"command": "cat input.txt && echo result > report.md", "timeout_seconds": 300})],
        "ok",
    )
    agent_with(script, toolset).run_sync("go")
    assert script.texts()[0] == "[stdout]\nfrom the provisioner"
    description = script.descriptions["run_command"]
    assert "provisioned by an earlier task for team/run-1" in description
    assert "About 30 minutes of its lifetime were left" in description
    assert "no network access at all" in description
    assert standing(state_root) == [handle]
    tags = local.read_tags(handle)
    assert tags[OWNER_TAG] == "team/run-1" and HOLDER_TAG not in tags
    assert local.read_file(handle, "report.md", max_bytes=100) == b"result\n"
    local.destroy(handle)


def test_attach_refuses_another_owner_before_the_model_runs(local):
    handle = provision(local, "team/run-1")
    script = Script("never")
    toolset = SandboxToolset(local, attach_to=handle, owner="team/run-2")
    with pytest.raises(SandboxTerminalError, match="not owned by 'team/run-2'"):
        agent_with(script, toolset).run_sync("go")
    assert script.steps == ["never"]
    local.destroy(handle)


def test_attach_refuses_a_sandbox_held_by_another_task(local):
    handle = provision(local, "team/run-1")
    local.attach(handle, owner="team/run-1", holder="team/run-1/other_task")
    toolset = SandboxToolset(local, attach_to=handle, owner="team/run-1")
    with pytest.raises(SandboxTerminalError, match="held by 'team/run-1/other_task'"):
        agent_with(Script("never"), toolset).run_sync("go")
    local.destroy(handle)


def test_attach_outside_a_task_needs_an_owner(local):
    handle = provision(local, "team/run-1")
    with pytest.raises(SandboxTerminalError, match="needs an owner"):
        agent_with(Script("never"), SandboxToolset(local, attach_to=handle)).run_sync("go")
    local.destroy(handle)


def test_attached_commands_are_clamped_to_the_lifetime_left(local):
    handle = provision(local, "o", lifetime=2)
    toolset = SandboxToolset(local, attach_to=handle, owner="o")
    script = Script([("run_command", {"command": "sleep 30", "timeout_seconds": 200})], "ok")
    agent_with(script, toolset).run_sync("go")
    assert "Less than a minute" in script.descriptions["run_command"]
    text = script.texts()[0]
    assert "[timed out after" in text
    applied = float(text.rsplit("after ", 1)[1].rstrip("s]"))
    assert applied <= 2
    local.destroy(handle)


@pytest.mark.parametrize("rendered", ["", "None", "   "])
def test_attach_handle_that_rendered_to_nothing_fails(local, rendered):
    toolset = SandboxToolset(local, attach_to="{{ ti.xcom_pull('provision') }}", owner="o")
    toolset.attach_to = rendered  # what AgentOperator's rendering does on its copy
    with pytest.raises(SandboxTerminalError, match="not a sandbox handle"):
        agent_with(Script("never"), toolset).run_sync("go")


# -- outside pydantic-ai -----------------------------------------------------------------------------------


def test_sync_block_for_other_frameworks(local, state_root, tmp_path):
    dest = tmp_path / "n.txt"
    toolset = SandboxToolset(local, exports={"n.txt": dest.as_uri()})
    with pytest.raises(SandboxTerminalError, match="not open"):
        toolset.call("run_command", command="true")
    with toolset:
        assert toolset.call("run_command", command="echo 7 > n.txt") == "(no output)"
        with pytest.raises(SandboxError, match="does not exist"):
            toolset.call("read_file", path="nope")
        with pytest.raises(ValueError, match="Unknown tool"):
            toolset.call("rm_rf")
        assert len(standing(state_root)) == 1
    assert dest.read_text() == "7\n"
    assert standing(state_root) == []
    with pytest.raises(SandboxTerminalError, match="not open"):
        toolset.call("run_command", command="true")


def test_async_block_and_error_inside_exports_nothing(local, state_root, tmp_path):
    dest = tmp_path / "n.txt"
    toolset = SandboxToolset(local, exports={"n.txt": dest.as_uri()})

    async def body():
        async with toolset:
            await toolset.acall("run_command", command="echo 7 > n.txt")
            raise KeyError("the framework failed")

    with pytest.raises(KeyError):
        asyncio.run(body())
    assert not dest.exists()
    assert standing(state_root) == []


# -- construction ----------------------------------------------------------------------------------------


class _PlainHook(FakeSandboxHook):
    """A backend whose sandboxes nobody else can pick up."""

    name = "plain"
    attachable = False


BOUNDS = [
    "default_command_timeout",
    "max_command_timeout",
    "max_output_bytes",
    "max_output_lines",
    "max_read_bytes",
    "max_export_bytes",
]


@pytest.mark.parametrize("field", BOUNDS)
@pytest.mark.parametrize("value", [0, -1, math.inf, math.nan, True, "10", 0.5])
def test_bounds_must_be_positive_and_finite(local, field, value):
    kwargs: dict[str, Any] = {field: value}
    if field == "default_command_timeout" and value is True:
        kwargs["max_command_timeout"] = 300
    if field.endswith("timeout"):
        if value == 0.5:  # half a second is a fine timeout
            kwargs.setdefault("default_command_timeout", 0.5)
            assert getattr(SandboxToolset(local, **kwargs), field) == 0.5
            return
        expected = f"{field} must be a positive finite number"
    else:
        expected = f"{field} must be a whole, positive number"
    with pytest.raises(ValueError, match=expected):
        SandboxToolset(local, **kwargs)


REFUSALS: list[tuple[str, Callable[[Any], Any], str]] = [
    (
        "default above max",
        lambda h: SandboxToolset(h, default_command_timeout=90, max_command_timeout=60),
        r"default_command_timeout \(90\) must not exceed max_command_timeout \(60\)",
    ),
    (
        "prefix with dash",
        lambda h: SandboxToolset(h, tool_prefix="a-b"),
        "tool_prefix must be a Python identifier",
    ),
    (
        "prefix with digit",
        lambda h: SandboxToolset(h, tool_prefix="9lives"),
        "tool_prefix must be a Python identifier",
    ),
    (
        "prefix with space",
        lambda h: SandboxToolset(h, tool_prefix="has space"),
        "tool_prefix must be a Python identifier",
    ),
    (
        "attach to plain backend",
        lambda h: SandboxToolset(_PlainHook(), attach_to="sb-1"),
        "'plain' is not one",
    ),
    (
        "attach with spec",
        lambda h: SandboxToolset(h, attach_to="sb-1", spec=SandboxSpec()),
        "spec cannot be combined",
    ),
    ("attach to empty", lambda h: SandboxToolset(h, attach_to=""), "attach_to must be a sandbox handle"),
    (
        "attach with exports",
        lambda h: SandboxToolset(h, attach_to="sb-1", exports={"a": "file:///tmp/a"}),
        "exports cannot be combined with attach_to",
    ),
    ("owner alone", lambda h: SandboxToolset(h, owner="d/r"), "owner only applies together with attach_to"),
    (
        "spec owner on own sandbox",
        lambda h: SandboxToolset(h, spec=SandboxSpec(owner="d/r")),
        "SandboxSpec.owner",
    ),
    (
        "empty export path",
        lambda h: SandboxToolset(h, exports={"": "file:///tmp/a"}),
        "path may not be empty",
    ),
    ("empty export destination", lambda h: SandboxToolset(h, exports={"a.txt": ""}), "not a storage URL"),
    (
        "relative export destination",
        lambda h: SandboxToolset(h, exports={"a.txt": "out/a.txt"}),
        "not a storage URL",
    ),
    (
        "conn id without exports",
        lambda h: SandboxToolset(h, export_conn_id="aws_default"),
        "export_conn_id only applies together with exports",
    ),
    ("not a hook", lambda h: SandboxToolset("sandbox_default"), "backend must be a sandbox hook instance"),
    (
        "spec of wrong type",
        lambda h: SandboxToolset(h, spec={"block_network": False}),
        "spec must be a SandboxSpec",
    ),
]


@pytest.mark.parametrize(("case", "build", "message"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_constructor_refusals(local, case, build, message):
    with pytest.raises(ValueError, match=message):
        build(local)


def test_templated_values_are_accepted_at_parse_time(local):
    toolset = SandboxToolset(
        local,
        exports={"report.md": "file:///tmp/{{ run_id }}/report.md", "b.csv": "{{ params.dest }}"},
        export_conn_id="{{ params.conn }}",
    )
    assert toolset.exports["b.csv"] == "{{ params.dest }}"
    attach = SandboxToolset(local, attach_to="{{ ti.xcom_pull(task_ids='provision') }}")
    assert attach.agent_template_fields == ("attach_to", "exports", "export_conn_id")


def test_rendered_export_that_is_not_a_url_fails_before_provisioning(local, state_root):
    toolset = SandboxToolset(local, exports={"report.md": "{{ params.dest }}"})
    toolset.exports = {"report.md": "None"}
    with pytest.raises(ValueError, match="not a storage URL"):
        agent_with(Script([("run_command", {"command": "true"})], "ok"), toolset).run_sync("go")
    assert standing(state_root) == []


def test_tool_definitions(local):
    toolset = SandboxToolset(local, tool_prefix="py")
    defs = {d.name: d for d in toolset.tool_definitions()}
    assert list(defs) == ["py_run_command", "py_read_file", "py_write_file", "py_list_directory"]
    assert all(d.sequential for d in defs.values())
    assert defs["py_run_command"].metadata == {"code_arg_name": "command", "code_arg_language": "shell"}
    assert defs["py_read_file"].metadata is None
    assert defs["py_run_command"].parameters_json_schema["required"] == ["command"]


# -- the example Dags, offline, under dag.test() ---------------------------------------------------------

NORMALIZE_BROKEN = """\
import csv
rows = list(csv.DictReader(open('vendor.csv'), delimiter=';'))
with open('staging.csv', 'w', newline='') as out:
    w = csv.writer(out)
    w.writerow(['order_id', 'customer_name', 'ordered_at', 'amount', 'country_code'])
    for r in rows:
        w.writerow([r['OrderNo'], r['Customer'], r['Date'], float(r['Amount']), r['Country']])
"""

NORMALIZE_FIXED = """\
import csv
rows = list(csv.DictReader(open('vendor.csv'), delimiter=';'))
with open('staging.csv', 'w', newline='') as out:
    w = csv.writer(out)
    w.writerow(['order_id', 'customer_name', 'ordered_at', 'amount', 'country_code'])
    for r in rows:
        d, m, y = r['Date'].split('.')
        amount = r['Amount'].replace('.', '').replace(',', '.')
        w.writerow([r['OrderNo'], r['Customer'], f'{y}-{m}-{d}', amount, r['Country']])
"""


def _states(dag_run) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}


def test_example_agent_dag_runs_offline(migrated_airflow_db, scripted_llm, tmp_path):
    from sandbox_provider.example_dags.example_sandbox_agent import VENDOR_SAMPLE, agent_dag

    script = scripted_llm(
        Script(
            [
                ("write_file", {"path": "vendor.csv", "content": VENDOR_SAMPLE}),
                ("write_file", {"path": "normalize.py", "content": NORMALIZE_BROKEN}),
            ],
            [("run_command", {"command": "python3 normalize.py"})],
            [("write_file", {"path": "normalize.py", "content": NORMALIZE_FIXED})],
            [("run_command", {"command": "python3 normalize.py && cat staging.csv"})],
            "OrderNo->order_id, Customer->customer_name, Date->ordered_at, Amount->amount, Country->country_code",
        )
    )
    dag_run = agent_dag.test(run_conf={"output_base": tmp_path.as_uri()})

    assert _states(dag_run) == {"normalize": "success", "load": "success"}
    texts = script.texts()
    assert "ValueError" in texts[2] and "[exit code: 1]" in texts[2]
    assert "A-1001,Acme GmbH,2024-01-03,1234.50,DE" in texts[4]
    (staging,) = tmp_path.glob("*/staging.csv")
    assert staging.read_text().splitlines()[1] == "A-1001,Acme GmbH,2024-01-03,1234.50,DE"
    load = next(ti for ti in dag_run.get_task_instances() if ti.task_id == "load")
    assert load.xcom_pull(task_ids="load") == 3


def test_example_attach_dag_provision_agent_collect(migrated_airflow_db, scripted_llm, tmp_path):
    from sandbox_provider.example_dags.example_sandbox_agent import attach_dag

    report_script = (
        "import csv, collections\n"
        "totals = collections.Counter()\n"
        "for row in csv.DictReader(open('data/sales.csv')):\n"
        "    totals[row['region']] += int(row['amount'])\n"
        "open('data/report.md', 'w').write(''.join(f'- {k}: {v}\\n' for k, v in sorted(totals.items())))\n"
    )
    script = scripted_llm(
        Script(
            [("run_command", {"command": "cat data/sales.csv"})],
            [("write_file", {"path": "report.py", "content": report_script})],
            [("run_command", {"command": "python3 report.py && cat data/report.md"})],
            "north 150, south 80",
        )
    )
    dag_run = attach_dag.test(run_conf={"output_base": tmp_path.as_uri()})

    assert _states(dag_run) == {"provision": "success", "analyse": "success", "collect": "success"}
    texts = script.texts()
    assert texts[0].startswith("[stdout]\nregion,amount\nnorth,120")
    assert texts[2] == "[stdout]\n- north: 150\n- south: 80"
    description = script.descriptions["run_command"]
    assert f"provisioned by an earlier task for {attach_dag.dag_id}/{dag_run.run_id}" in description
    (report,) = tmp_path.glob("*/report.md")
    assert report.read_text() == "- north: 150\n- south: 80\n"
    handle = next(ti for ti in dag_run.get_task_instances() if ti.task_id == "provision").xcom_pull(
        task_ids="provision"
    )
    with pytest.raises(SandboxTerminalError):
        LocalSandboxHook().read_tags(handle)


def test_example_agent_dags_parse_without_connections(monkeypatch):
    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk import BaseHook
    from airflow.sdk.definitions.connection import Connection

    def refuse(*args, **kwargs):
        raise AssertionError("a connection was looked up while the Dag file was parsed")

    monkeypatch.setattr(BaseHook, "get_connection", classmethod(refuse))
    monkeypatch.setattr(Connection, "get", classmethod(refuse))
    import sandbox_provider.example_dags.example_sandbox_agent as example

    bag = DagBag(dag_folder=example.__file__)
    assert bag.import_errors == {}
    assert sorted(bag.dag_ids) == ["example_sandbox_agent", "example_sandbox_agent_attach"]
