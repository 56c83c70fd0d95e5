"""
The Docker backend's guest programs, run on the host under plain ``sh``.

Both end processes with ``kill(-1)``, so every run here happens in a PID namespace of its own
(bubblewrap), with the host's system read-only: what ``kill(-1)`` reaches is only what the test
started there. Processes are observed from the host, by their PID namespace, so nothing inside can
fake what the test sees.
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import time

import pytest

from pid_namespace import MARK, Namespace, until
from sandbox_provider.hooks.docker import guest as docker_guest
from sandbox_provider.sandbox import guest

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None and not os.environ.get("SANDBOX_REQUIRE_BWRAP"), reason="bubblewrap is not installed"
)


#: Starts a few processes, each with MARK in its command line, then becomes the keeper (still PID 1).
def _with_children(*commands: str) -> str:
    return "".join(f"{c}\n" for c in commands) + 'exec sh "$KEEPER" "$@"\n'


@pytest.fixture
def keeper(tmp_path, monkeypatch):
    (tmp_path / "keeper.sh").write_text(docker_guest.program("docker_keeper.sh"))
    started: list[Namespace] = []

    def start(*children: str, lifetime: int = 60, owner: str = "") -> Namespace:
        script = _with_children(*children).replace('"$KEEPER"', str(tmp_path / "keeper.sh"))
        ns = Namespace(tmp_path, script, owner, str(lifetime), str(tmp_path / "state"), pid1=True)
        started.append(ns)
        assert until(lambda: (tmp_path / "state" / "swept").exists()), ns.wait(5)
        return ns

    yield start
    for ns in started:
        ns.close()


def test_keeper_ends_at_its_lifetime_and_keeps_its_state_to_itself(keeper, tmp_path):
    ns = keeper(lifetime=2)
    state = tmp_path / "state"
    assert state.stat().st_mode & 0o777 == 0o711  # passable, not listable
    assert (state / "swept").stat().st_size == 0 and (state / "swept").stat().st_mode & 0o777 == 0o600
    # The runner's shell: others may run it, not read it.
    assert (state / "sh").stat().st_mode & 0o777 == 0o711
    assert (state / "sh").read_bytes() == open("/bin/sh", "rb").read()
    assert ns.proc.poll() is None
    code, _, err = ns.wait(15)
    assert code == 0 and err == ""


def test_keeper_sweep_kills_everything_else_and_counts(keeper, tmp_path):
    ns = keeper(
        f"sleep {MARK}1 &",
        f"setsid sh -c 'sleep {MARK}2' &",
        f"nohup sh -c 'sleep {MARK}3' >/dev/null 2>&1 &",
        f"(sh -c 'sleep {MARK}4' &) &",
        f"cp /bin/sleep \"$(printf 'x\\ny\\001z')\" && \"./$(printf 'x\\ny\\001z')\" {MARK} &",
    )
    assert until(lambda: len(ns.marked()) >= 5)  # the positive control: they run
    os.kill(ns.pid, signal.SIGUSR1)
    assert until(lambda: (tmp_path / "state" / "swept").stat().st_size == 1)
    assert until(lambda: not ns.marked()), ns.marked()
    assert ns.proc.poll() is None  # the keeper itself lives on, and sleeps again
    assert until(lambda: any("sleep" in cmd for _, cmd in ns.members().values()))
    for _ in range(3):
        os.kill(ns.pid, signal.SIGUSR1)
        time.sleep(0.05)
    assert until(lambda: (tmp_path / "state" / "swept").stat().st_size == 4)
    assert ns.proc.poll() is None


def test_keeper_is_out_of_reach_of_kill_minus_one_and_stops(keeper):
    attack = f"sh -c 'sleep 0.3; kill -STOP -1; kill -KILL -1; kill -STOP 1; kill -KILL 1; sleep {MARK}6' &"
    ns = keeper(f"sleep {MARK}5 &", attack, lifetime=3)
    assert until(lambda: f"sleep {MARK}6" in " ".join(ns.marked()))
    # kill(-1) reached the sibling (the positive control), not PID 1, which is not stopped either.
    assert not any("victim" in cmd for cmd in ns.marked())
    assert ns.members()[ns.pid][0] != "T"
    code, _, _ = ns.wait(15)  # and the lifetime still ends it, and with it the namespace
    assert code == 0


def test_keeper_reaps_orphans(keeper):
    ns = keeper("for i in 1 2 3 4 5 6 7 8; do (sh -c 'sleep 0.2' &) ; done")
    time.sleep(1)
    assert until(lambda: ns.zombies() == 0, timeout=5), ns.zombies()


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a directory to another user needs root")
def test_keeper_hands_the_working_directory_to_the_command_user(keeper, tmp_path):
    keeper(owner="65432:65431")
    assert (tmp_path.stat().st_uid, tmp_path.stat().st_gid) == (65432, 65431)


def test_runner_passes_the_exit_status_and_the_output_through(in_namespace):
    _, result = in_namespace(docker_guest.program("docker_run.sh"), "30", "echo out; echo err >&2; exit 3")
    assert result == (3, "out\n", "err\n")


def test_runner_reads_a_file_back_on_its_trailer_once_the_command_succeeded(in_namespace, monkeypatch):
    monkeypatch.setenv("AIRFLOW_SANDBOX_STATUS", "tok")
    runner, reader = docker_guest.program("docker_run.sh"), guest.program("file.sh")
    back = base64.b64encode(b"x\n" * 60).decode()  # over one line of base64: the runner joins the lines
    _, result = in_namespace(runner, "30", "printf 'x\\n%.0s' $(seq 60) > f; echo done", "", reader, "f", "1000")
    assert result == (0, "done\n", f"\x1esandbox-status:tok:0:{back}\n")
    # Nothing read back: a failed command, a file over the limit, a missing one, no token.
    for command, limit in (("exit 3", "1000"), ("true", "10"), ("rm f", "1000")):
        _, (code, _, err) = in_namespace(runner, "30", command, "", reader, "f", limit)
        assert err == f"\x1esandbox-status:tok:{code}\n"
    monkeypatch.delenv("AIRFLOW_SANDBOX_STATUS")
    assert in_namespace(runner, "30", "echo > f", "", reader, "f", "1000")[1] == (0, "", "")


def test_runner_deadline_adds_nothing_to_the_output(in_namespace):
    _, result = in_namespace(docker_guest.program("docker_run.sh"), "0.5", f"echo partial; sleep 3{MARK}")
    assert result == (137, "partial\n", "")
    # The positive control: coreutils timeout's default mode kills its own group, and the shell says so.
    _, plain = in_namespace('timeout -s KILL "$1" sh -c "$2"', "0.5", "echo partial; sleep 30")
    assert plain[0] == 137 and "Killed" in plain[2]


@pytest.mark.parametrize(
    "escape",
    [
        "setsid sh -c 'sleep {m}' > /dev/null 2>&1 &",
        "nohup sh -c 'sleep {m}' > /dev/null 2>&1 &",
        "(setsid sh -c 'trap \"\" TERM HUP; (setsid sleep {m} &); sleep {m}' &)",
        "cp /bin/sleep \"$(printf 'a\\nb')\" && (\"./$(printf 'a\\nb')\" {m} &)",
        "i=0; while [ $i -lt 20 ]; do setsid sh -c 'sleep {m}' & i=$((i + 1)); done",
    ],
    ids=["setsid", "nohup", "double-fork", "newline-name", "many-sessions"],
)
@pytest.mark.parametrize("ends", ["by-itself", "at-deadline"])
def test_runner_leaves_nothing_of_the_user_running(in_namespace, escape, ends):
    command = escape.format(m=MARK) + ("\nsleep 0.3; exit 0" if ends == "by-itself" else "\nsleep 30")
    # The positive control: the same command under plain sh leaves its daemons running.
    control, _ = in_namespace('sh -c "$1"', command.replace("sleep 30", "exit 0"))
    assert until(lambda: control.marked(), timeout=10)
    control.close()
    ns, (code, _, err) = in_namespace(docker_guest.program("docker_run.sh"), "1.5", command)
    assert (code, err) == (0 if ends == "by-itself" else 137, "")
    # kill(-1) returns once the signals are sent; the host may see a process for a moment more.
    assert until(lambda: not ns.marked(), timeout=5), ns.marked()
