"""The provider's own Airflow options (section ``[sandbox]``), read the one way every reader uses."""

from __future__ import annotations

import os

__all__ = ["SECTION", "option"]

#: The Airflow configuration section of the provider's options.
SECTION = "sandbox"


def option(name: str) -> str:
    """
    The raw value of the Airflow option ``[sandbox] <name>``: the environment
    (``AIRFLOW__SANDBOX__<NAME>``) first, else Airflow's configuration; ``""`` when unset.
    """
    raw = os.environ.get(f"AIRFLOW__{SECTION.upper()}__{name.upper()}")
    if raw is not None:
        return raw
    try:
        from airflow.sdk.configuration import conf
    except ImportError:  # pragma: no cover - Airflow without the task SDK's configuration
        from airflow.configuration import conf
    return conf.get(SECTION, name, fallback="") or ""
