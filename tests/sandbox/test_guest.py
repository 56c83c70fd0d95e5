"""The guest programs, run on the host under plain sh and python3, as a sandbox runs them."""

from __future__ import annotations

import json
import marshal
import subprocess
import sys

import pytest

from sandbox_provider.sandbox import guest


def sh(name, *args, cwd, stdin=b""):
    return subprocess.run(
        guest.shell_command(name, *args), shell=True, cwd=cwd, input=stdin, capture_output=True, check=False
    )


def test_every_program_is_listed_and_loads():
    from importlib import resources

    names = {p.name for p in resources.files(guest).iterdir() if p.name.endswith((".sh", ".py"))} - {"__init__.py"}
    assert {"file.sh", "write.sh", "list.sh", "task_runner.py"} <= names
    for name in names:
        assert guest.program(name).strip()
    for bad in ("../hook.py", "__init__.py", ".hidden"):
        with pytest.raises(FileNotFoundError):
            guest.program(bad)
    with pytest.raises(ValueError, match="NUL"):
        guest.shell_command("file.sh", "a\0b")


def test_file_checks_and_statuses(tmp_path):
    (tmp_path / "ten").write_bytes(b"0123456789")
    (tmp_path / "d").mkdir()
    (tmp_path / "-dash").write_bytes(b"x")
    ok = sh("file.sh", "ten", 10, "head", cwd=tmp_path)
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, b"0123456789", b"sandbox-size:10\n")
    assert sh("file.sh", "ten", 9, "head", cwd=tmp_path).returncode == guest.TOO_LARGE_STATUS
    assert sh("file.sh", "missing", 9, "head", cwd=tmp_path).returncode == guest.MISSING_STATUS
    assert sh("file.sh", "d", 9, "check", cwd=tmp_path).returncode == guest.IS_DIR_STATUS
    assert sh("file.sh", "/dev/null", 9, "check", cwd=tmp_path).returncode == guest.NOT_REGULAR_STATUS
    assert sh("file.sh", "ten", "-", "chunk", 3, 4, cwd=tmp_path).stdout.strip() == b"MzQ1Ng=="
    assert sh("file.sh", "-dash", "-", "cat", cwd=tmp_path).stdout == b"x"


def test_write_is_atomic_and_replaces_links(tmp_path):
    target = tmp_path / "outside"
    target.write_text("keep")
    (tmp_path / "link").symlink_to(target)
    assert sh("write.sh", "stdin", "link", cwd=tmp_path, stdin=b"new").returncode == 0
    assert target.read_text() == "keep" and (tmp_path / "link").read_bytes() == b"new"
    temp = sh("write.sh", "start", "a/b/c.txt", cwd=tmp_path).stdout.decode().strip()
    assert sh("write.sh", "append", temp, "aGk=", cwd=tmp_path).returncode == 0
    assert not (tmp_path / "a/b/c.txt").exists()
    assert sh("write.sh", "commit", temp, "a/b/c.txt", cwd=tmp_path).returncode == 0
    assert (tmp_path / "a/b/c.txt").read_bytes() == b"hi"
    assert sorted(p.name for p in (tmp_path / "a/b").iterdir()) == ["c.txt"]


def test_write_copies_a_file_on_standard_input_and_checks_its_size(tmp_path):
    source = tmp_path / "source"
    source.write_bytes(b"x" * 1000)
    (tmp_path / "out").mkdir()
    copy = f"{guest.shell_command('write.sh', 'copy', 'out/a/copy', 1000)} < {source}"
    done = subprocess.run(copy, shell=True, cwd=tmp_path, capture_output=True, check=False)
    assert done.returncode == 0 and (tmp_path / "out/a/copy").read_bytes() == b"x" * 1000
    wrong = f"{guest.shell_command('write.sh', 'copy', 'out/b', 999)} < {source}"
    refused = subprocess.run(wrong, shell=True, cwd=tmp_path, capture_output=True, check=False)
    assert refused.returncode == 3 and b"held 1000 bytes, not 999" in refused.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a"]  # no temporary file left


def test_write_concatenates_pieces_a_file_api_wrote(tmp_path):
    temp = sh("write.sh", "start", "out.bin", cwd=tmp_path).stdout.decode().strip()
    (tmp_path / temp).write_bytes(b"\x00first|")
    (tmp_path / "piece").write_bytes(b"second\xff")
    assert sh("write.sh", "concat", temp, "piece", cwd=tmp_path).returncode == 0
    assert not (tmp_path / "piece").exists()
    assert sh("write.sh", "concat", temp, "piece", cwd=tmp_path).returncode != 0  # a missing piece fails
    assert sh("write.sh", "commit", temp, "out.bin", cwd=tmp_path).returncode == 0
    assert (tmp_path / "out.bin").read_bytes() == b"\x00first|second\xff"


def test_list_records(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "f").write_text("")
    out = sh("list.sh", ".", cwd=tmp_path).stdout.split(b"\0")
    assert sorted(r for r in out if r) == [b"d sub", b"f f"]
    assert sh("list.sh", "f", cwd=tmp_path).returncode == guest.MISSING_STATUS


def _run_task(tmp_path, source, args=(), kwargs=None):
    (tmp_path / "fn.py").write_text(source)
    (tmp_path / "call.marshal").write_bytes(marshal.dumps({"args": list(args), "kwargs": kwargs or {}}, 2))
    runner = tmp_path / "runner.py"
    runner.write_text(guest.program("task_runner.py"))
    return subprocess.run(
        [sys.executable, str(runner), "fn.py", "fn", "call.marshal", "result.json"],
        cwd=tmp_path,
        capture_output=True,
        check=False,
    )


def test_task_runner_round_trip(tmp_path):
    done = _run_task(tmp_path, "def fn(a, b):\n    return {'sum': a + b}\n", [1, 2])
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "result.json").read_text()) == {"sum": 3}


def test_task_runner_starts_without_importing_json(tmp_path):
    done = _run_task(
        tmp_path, "import sys\ndef fn():\n    return sorted(m for m in sys.modules if m in ('json', 're'))\n"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "result.json").read_text()) == []


RESULTS = [
    None,
    True,
    False,
    0,
    -12,
    10**40,
    1.5,
    -0.0,
    1e16,
    1e-7,
    "",
    "plain words 123 ~!@#$%^&*()",
    'a "quote"',
    "back\\slash",
    "tab\tnewline\n",
    "\x7f",
    "caf\u00e9 \u2603 \U0001f600",
    "\ud800",
    [],
    [1, [2, [3, {}]], "x"],
    (1, 2),
    {"a": 1, "b": [True, None], "c": {"d": "e"}},
    {7: "int key", 2.5: "float key", True: "bool key", None: "none key"},
    {"\u00e9": "non-ASCII key"},
    [[[[[[[[[[1]]]]]]]]]],
]


def test_task_runner_writes_what_json_writes(tmp_path):
    """Its own writer, for plain values, and json for the rest: the same text as json.dumps every time."""
    source = "def fn():\n    return " + repr(RESULTS) + "\n"
    done = _run_task(tmp_path, source)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "result.json").read_text() == json.dumps(RESULTS, allow_nan=False)
    for value in RESULTS:
        done = _run_task(tmp_path, "def fn():\n    return " + repr(value) + "\n")
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "result.json").read_text() == json.dumps(value, allow_nan=False), value


@pytest.mark.parametrize("value", ["float('nan')", "float('inf')", "[1, {2, 3}]", "object()", "{(1, 2): 3}"])
def test_task_runner_refuses_what_json_refuses(tmp_path, value):
    done = _run_task(tmp_path, f"def fn():\n    return {value}\n")
    assert done.returncode == 1
    assert b"cannot be sent back as JSON" in done.stderr
    assert not (tmp_path / "result.json").exists()
