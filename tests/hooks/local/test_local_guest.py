"""The local backend's own guest program (``export_into.sh``), run on the host under plain sh."""

from __future__ import annotations

import subprocess

from sandbox_provider.hooks.local import guest as local_guest
from sandbox_provider.sandbox import guest


def sh(name, *args, cwd, stdin=b""):
    return subprocess.run(
        local_guest.shell_command(name, *args), shell=True, cwd=cwd, input=stdin, capture_output=True, check=False
    )


def test_export_into_extracts_each_request_under_its_index(tmp_path):
    work = tmp_path / "work"
    (work / "d" / "s").mkdir(parents=True)
    (work / "d" / "a").write_text("a")
    (work / "d" / "s" / "b").write_text("b")
    (work / "x.csv").write_text("x")
    into = tmp_path / "into"
    (into / "0").mkdir(parents=True)
    (into / "1").mkdir()
    tree = guest.program("export_tree.sh")
    done = sh("export_into.sh", into, tree, 1 << 20, 100, "tree", "d", "glob", "./\n*.csv", cwd=work)
    assert done.returncode == 0, done.stderr
    assert sorted(str(p.relative_to(into)) for p in into.rglob("*") if p.is_file()) == ["0/a", "0/s/b", "1/x.csv"]
    missing = sh("export_into.sh", into, tree, 1 << 20, 100, "tree", "d", "tree", "nope", cwd=work)
    assert missing.returncode == guest.MISSING_STATUS and b"sandbox-export-failed:1" in missing.stderr
    nothing = sh("export_into.sh", into, tree, 1 << 20, 100, "glob", "./\n*.none", cwd=work)
    assert nothing.returncode == 0  # an empty archive ends the stream: nothing matched is no failure
    # Past its caps it stops, whatever the archive still holds: the members' bytes, their number.
    (work / "d" / "big").write_bytes(b"z" * 100_000)
    (tmp_path / "into2" / "0").mkdir(parents=True)
    assert sh("export_into.sh", tmp_path / "into2", tree, 99_999, 100, "tree", "d", cwd=work).returncode == 71
    assert sh("export_into.sh", into, tree, 1 << 20, 2, "tree", "d", cwd=work).returncode == 72
