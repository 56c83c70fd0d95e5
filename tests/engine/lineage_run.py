"""
Run one Dag of SandboxOperator exports under ``dag.test()`` in a process of its own, with the
OpenLineage provider enabled or hidden, and write what happened as JSON to ``WORK_DIR/result.json``:

    python tests/engine/lineage_run.py with-openlineage|without-openlineage WORK_DIR

``with-openlineage`` turns the provider on (set before Airflow is imported, as in a deployment) with
its file transport writing every event to ``WORK_DIR/events.jsonl``. ``without-openlineage`` makes
``openlineage`` and ``airflow.providers.openlineage`` unimportable and leaves their distributions out
of the installed ones (so no entry point names them) before Airflow is imported, as if neither were
installed.

The Dag reads a ``file://`` file, a ``file://`` directory and a ``memory://`` object, and exports a
file, a directory and a glob to ``file://`` and a directory to ``memory://`` (an fsspec memory store
attached to Airflow's object storage in this process), the report file as an ``Asset``.
"""

from __future__ import annotations

import importlib.abc
import json
import os
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

HIDDEN = ("openlineage", "airflow.providers.openlineage")
HIDDEN_DISTRIBUTIONS = frozenset(
    {"apache-airflow-providers-openlineage", "openlineage-python", "openlineage-integration-common", "openlineage-sql"}
)


class _Hidden(importlib.abc.MetaPathFinder):
    """Refuse the OpenLineage packages, as an environment without them would."""

    def find_spec(self, name, path=None, target=None):
        if any(name == hidden or name.startswith(hidden + ".") for hidden in HIDDEN):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None


def _hide_openlineage() -> None:
    """The OpenLineage modules cannot be imported and their distributions are not listed (no entry points)."""
    import importlib.metadata

    import importlib_metadata

    sys.meta_path.insert(0, _Hidden())
    for module in (importlib.metadata, importlib_metadata):
        listed = module.distributions

        def distributions(*args, _listed=listed, **kwargs):
            return (
                d for d in _listed(*args, **kwargs) if (d.metadata["Name"] or "").lower() not in HIDDEN_DISTRIBUTIONS
            )

        module.distributions = distributions


def _configure(mode: str, work: Path) -> None:
    if mode == "with-openlineage":
        os.environ["AIRFLOW__OPENLINEAGE__TRANSPORT"] = json.dumps(
            {"type": "file", "log_file_path": str(work / "events.jsonl"), "append": True}
        )
        os.environ["AIRFLOW__OPENLINEAGE__NAMESPACE"] = "sandbox-tests"
        # Events are sent from a thread of the task process (not a fork), so they are written before it ends.
        os.environ["AIRFLOW__OPENLINEAGE__EXECUTE_IN_THREAD"] = "True"
        os.environ.pop("AIRFLOW__OPENLINEAGE__DISABLED", None)
    else:
        _hide_openlineage()


def _prepare_inputs(work: Path):
    import fsspec
    from airflow.sdk.io import attach

    memory = fsspec.filesystem("memory")
    attach("memory", fs=memory)
    memory.pipe("/lineage-bucket/in/rates.csv", b"rate\n3\n")
    (work / "in" / "table").mkdir(parents=True)
    (work / "in" / "words.txt").write_text("one two three\n")
    (work / "in" / "table" / "part-0.csv").write_text("a\n1\n")
    (work / "in" / "table" / "part-1.csv").write_text("a\n2\n")
    os.chmod(work, 0o755)
    for folder in (work / "in", work / "in" / "table"):
        os.chmod(folder, 0o755)
    return memory


def _dag(work: Path, state_root: Path):
    from airflow.sdk import DAG, Asset

    from sandbox_provider.hooks.local import LocalSandboxHook
    from sandbox_provider.operators.sandbox import SandboxOperator

    with DAG(
        dag_id=f"lineage_{uuid.uuid4().hex[:8]}",
        schedule=None,
        start_date=datetime(2024, 1, 1, tzinfo=UTC),
        catchup=False,
    ) as dag:
        SandboxOperator(
            task_id="job",
            backend=LocalSandboxHook(state_root=str(state_root)),
            inputs={
                "words.txt": (work / "in" / "words.txt").as_uri(),
                "table/": (work / "in" / "table").as_uri() + "/",
                "rates.csv": "memory://lineage-bucket/in/rates.csv",
            },
            command=(
                "mkdir -p out/deep && wc -w < words.txt > report.txt && cat table/*.csv > out/all.csv "
                "&& cp rates.csv out/deep/rates.csv && echo 1 > out/a.csv && echo 2 > out/b.csv"
            ),
            exports={
                "report.txt": Asset((work / "out" / "report.txt").as_uri()),
                "out/": (work / "out" / "tree").as_uri() + "/",
                "out/*.csv": (work / "out" / "glob").as_uri() + "/",
                "out/deep/": "memory://lineage-bucket/out/deep/",
            },
        )
    return dag


def main(mode: str, work_dir: str) -> None:
    work = Path(work_dir)
    _configure(mode, work)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dag_runs import run_dag_defined_here

    memory = _prepare_inputs(work)
    dag = _dag(work, work / "state")
    dag_run = run_dag_defined_here(dag)
    from airflow.models.asset import AssetEvent
    from airflow.utils.session import create_session

    with create_session() as session:
        events = [
            {"uri": event.asset.uri, "extra": event.extra}
            for event in session.query(AssetEvent).filter(AssetEvent.source_dag_id == dag.dag_id)
        ]
    loaded = sorted(name for name in sys.modules if any(name.startswith(h) for h in HIDDEN))
    result = {
        "state": str(dag_run.state),
        "asset_events": events,
        "memory_exports": sorted(memory.find("/lineage-bucket/out")),
        "openlineage_modules_loaded": loaded,
    }
    (work / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
