"""
The documentation holds: every Python block of the README and of docs/ parses, every one that is a
Dag loads with no import error, the backend pages' settings tables are the ones the settings tables
make, the README's links lead to files that exist, and the pages build with no warning.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import settings_tables

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(?P<code>.*?)^```", re.S | re.M)
#: The README stays a page a new user reads in one go; the details live in docs/.
README_MAX_LINES = 250


def _blocks() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for number, match in enumerate(BLOCK.finditer(text), 1):
            found.append((f"{page.relative_to(ROOT)}#{number}", match.group("code")))
    return found


BLOCKS = _blocks()
DAG_BLOCKS = [(name, code) for name, code in BLOCKS if re.search(r"@dag\b|\bDAG\(", code)]


def test_the_docs_hold_python_blocks_and_dags():
    # The checks below run over what these find: a pattern that stopped matching would pass them all.
    assert len(BLOCKS) >= 5
    assert any(name.startswith("README.md") for name, _ in DAG_BLOCKS)
    assert any(name.startswith("docs/") for name, _ in DAG_BLOCKS)


def test_every_block_that_makes_tasks_is_a_whole_dag():
    # A block that makes a task (an operator, a sandbox task) is a Dag the test below loads, not a fragment
    # that only parses: a fragment's missing import or wrong argument would go unseen.
    fragments = [
        name
        for name, code in BLOCKS
        if re.search(r"\w+Operator\(|@task\.sandbox", code) and (name, code) not in DAG_BLOCKS
    ]
    assert fragments == [], f"make these blocks whole Dags (@dag, imports, the call): {fragments}"


@pytest.mark.parametrize(("name", "code"), BLOCKS, ids=[name for name, _ in BLOCKS])
def test_every_python_block_parses(name, code):
    ast.parse(code, filename=name)


@pytest.mark.parametrize(("name", "code"), DAG_BLOCKS, ids=[name for name, _ in DAG_BLOCKS])
def test_every_dag_block_loads(name, code, tmp_path):
    from airflow.dag_processing.dagbag import DagBag

    dag_file = tmp_path / "docs_dag.py"
    dag_file.write_text(code, encoding="utf-8")
    bag = DagBag(dag_folder=str(dag_file), safe_mode=False)
    assert not bag.import_errors, f"{name} does not load: {bag.import_errors}"
    assert bag.dags, f"{name} defines no Dag"


def test_a_broken_dag_block_is_caught(tmp_path):
    # The positive control of the check above: a Dag block with a bad import is an import error.
    from airflow.dag_processing.dagbag import DagBag

    dag_file = tmp_path / "docs_dag.py"
    dag_file.write_text(
        "from airflow.sdk import dag\nfrom sandbox_provider.operators.sandbox import NoSuchOperator\n\n"
        "@dag(schedule=None)\ndef broken():\n    NoSuchOperator(task_id='x')\n\nbroken()\n",
        encoding="utf-8",
    )
    assert DagBag(dag_folder=str(dag_file), safe_mode=False).import_errors


@pytest.mark.parametrize("page", settings_tables.pages(), ids=lambda p: p.name)
def test_settings_tables_are_the_generated_ones(page):
    text = page.read_text(encoding="utf-8")
    assert settings_tables.rendered(text) == text, (
        f"{page.relative_to(ROOT)}'s settings table differs from the backend's settings table; run "
        "python tests/docs/settings_tables.py"
    )


def test_every_backend_with_a_form_has_its_table():
    from sandbox_provider.hooks import BACKENDS

    documented = {
        m.group("module") for p in settings_tables.pages() for m in settings_tables.MARKED.finditer(p.read_text())
    }
    missing = sorted({forms for forms in BACKENDS.values() if forms} - documented)
    assert missing == [], (
        f"no page under docs/backends/ holds the settings table of {missing}: give the backend a page (in "
        "mkdocs.yml's nav) with the lines '<!-- settings:<module> -->' and '<!-- /settings -->', then run "
        "python tests/docs/settings_tables.py to fill it in"
    )


def test_readme_is_short_and_its_links_lead_somewhere():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    links = re.findall(r"\]\((?!https?://|#)([^)#]+)(?:#[^)]*)?\)", text)
    assert links
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing


def test_the_pages_build_without_a_warning(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs, "mkdocs is in the dev extra; install it with the lock file"
    run = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
