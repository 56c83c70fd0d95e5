"""
The Kubernetes backend's guest programs, run on the host under plain ``sh``: the runner ends processes
with ``kill(-1)`` and the keeper is meant to be PID 1, so each runs in a PID namespace of its own
(``pid_namespace``), where ``kill(-1)`` reaches only what the test started.
"""

from __future__ import annotations

import os
import shutil
import signal
import tarfile

import pytest

from pid_namespace import MARK, Namespace, until
from sandbox_provider.hooks.kubernetes import driver
from sandbox_provider.hooks.kubernetes import guest as k8s_guest

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None and not os.environ.get("SANDBOX_REQUIRE_BWRAP"), reason="bubblewrap is not installed"
)

RUNNER = k8s_guest.program("k8s_run.sh")


def test_runner_passes_the_status_and_output_through_in_the_workdir(in_namespace, tmp_path):
    (tmp_path / "work").mkdir()
    _, result = in_namespace(RUNNER, "30", str(tmp_path / "work"), "pwd; echo err >&2; exit 3", "")
    assert result == (3, f"{tmp_path / 'work'}\n", "err\n")
    _, missing = in_namespace(RUNNER, "30", str(tmp_path / "nowhere"), "echo never", "")
    assert missing[0] == 125 and "cannot enter the working directory" in missing[2] and missing[1] == ""


def test_runner_kills_at_the_deadline_and_adds_nothing(in_namespace, tmp_path):
    _, result = in_namespace(RUNNER, "0.5", str(tmp_path), f"echo partial; sleep 3{MARK}", "")
    assert result == (137, "partial\n", "")


@pytest.mark.parametrize(
    "escape",
    [
        "setsid sh -c 'sleep {m}' > /dev/null 2>&1 &",
        "nohup sh -c 'sleep {m}' > /dev/null 2>&1 &",
        "(setsid sh -c 'trap \"\" TERM HUP; (setsid sleep {m} &); sleep {m}' &)",
    ],
    ids=["setsid", "nohup", "double-fork"],
)
@pytest.mark.parametrize("ends", ["by-itself", "at-deadline"])
def test_runner_leaves_nothing_running_but_pid_1(in_namespace, tmp_path, escape, ends):
    command = escape.format(m=MARK) + ("\nsleep 0.3; exit 0" if ends == "by-itself" else "\nsleep 30")
    # The positive control: the same command under plain sh leaves its daemons running.
    control, _ = in_namespace('sh -c "$1"', command.replace("sleep 30", "exit 0"))
    assert until(lambda: control.marked(), timeout=10)
    control.close()
    ns, (code, _, _) = in_namespace(RUNNER, "2", str(tmp_path), command, "")
    assert code == (0 if ends == "by-itself" else 137)
    assert not ns.marked(), ns.marked()
    assert ns.proc.poll() is None  # PID 1 (the namespace's host, here) is out of kill(-1)'s reach


def test_runner_extracts_the_staged_archive_first_or_does_not_run(in_namespace, tmp_path):
    staged = tmp_path / "staged.tar"
    with tarfile.open(staged, "w") as archive:
        source = tmp_path / "src.txt"
        source.write_text("staged\n")
        archive.add(source, arcname="in/file.txt")
    stage = driver.guest_code("stage.sh")
    ns_script = f"exec < {staged}\n" + RUNNER
    _, result = in_namespace(ns_script, "30", str(tmp_path), "cat in/file.txt", stage)
    assert result == (0, "staged\n", "")
    (tmp_path / "blocked").write_text("a file where a directory must go")
    with tarfile.open(staged, "w") as archive:
        archive.add(source, arcname="blocked/file.txt")
    _, failed = in_namespace(ns_script, "30", str(tmp_path), "echo ran", stage)
    assert failed[0] == 125 and failed[1] == "" and "sandbox-stage-failed" in failed[2]


def test_op_runs_a_program_in_the_workdir_with_its_arguments(in_namespace, tmp_path):
    (tmp_path / "w").mkdir()
    _, result = in_namespace(
        k8s_guest.program("k8s_op.sh"), str(tmp_path / "w"), 'echo "$0|$1|$2|$PWD"', "named", "a b", ""
    )
    assert result == (0, f"named|a b||{tmp_path / 'w'}\n", "")


def test_keeper_waits_as_pid_1_reaps_orphans_and_ends_on_term(tmp_path):
    ns = Namespace(tmp_path, k8s_guest.program("k8s_keeper.sh"), pid1=True)
    try:
        assert until(lambda: any("sleep" in cmd for _, cmd in ns.members().values()))
        os.kill(ns.pid, signal.SIGUSR2)  # not trapped: ignored by a PID 1
        assert ns.proc.poll() is None
        os.kill(ns.pid, signal.SIGTERM)
        code, _, err = ns.wait(15)
        assert code == 0 and err == ""
    finally:
        ns.close()
