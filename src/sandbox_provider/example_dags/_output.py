"""Where the example Dags write their results (a helper module, not an example)."""

from __future__ import annotations

import os
from pathlib import Path


def output_base() -> str:
    """
    Return the storage URL the examples write under: ``SANDBOX_DEMO_OUTPUT`` (a URL, or a local
    directory turned into a ``file://`` URL), else ``file:///tmp/airflow-sandbox-demo``.
    """
    base = os.environ.get("SANDBOX_DEMO_OUTPUT") or "/tmp/airflow-sandbox-demo"
    return base.rstrip("/") if "://" in base else Path(base).absolute().as_uri()
