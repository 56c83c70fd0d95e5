"""airflow-provider-sandbox: isolated sandboxes for Apache Airflow 3 Dags."""

from __future__ import annotations

__version__ = "0.1.0"
