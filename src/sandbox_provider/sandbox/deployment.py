"""
The deployment scope: the Airflow option ``[sandbox] deployment`` names this Airflow deployment, so that
two deployments sharing one place where sandboxes run never sweep each other's sandboxes.

A backend whose sandboxes can live beside another deployment's (a shared Docker Engine) stamps the name
on every sandbox it creates (:data:`DEPLOYMENT_TAG`) and, in its sweeps and listings, considers only the
sandboxes with the same name; an empty name means the sandboxes without one, as before the option
existed. Backends that isolate deployments by a place of their own (a state root, a Kubernetes namespace,
a server) do not read it.
"""

from __future__ import annotations

import re

from sandbox_provider.sandbox.config import option
from sandbox_provider.sandbox.errors import SandboxTerminalError

__all__ = ["DEPLOYMENT_OPTION", "DEPLOYMENT_TAG", "MAX_DEPLOYMENT_CHARS", "deployment"]

#: The Airflow option (section ``sandbox``) naming this deployment.
DEPLOYMENT_OPTION = "deployment"
#: The stamp (a Docker label) that carries the deployment's name on a sandbox.
DEPLOYMENT_TAG = "airflow_deployment"
#: Longest name: what a Kubernetes label value holds, so that any backend can carry it as a label.
MAX_DEPLOYMENT_CHARS = 63

# Letters, digits, '-', '_' and '.', beginning and ending with a letter or digit: a valid label value on
# Docker and on Kubernetes alike.
_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?")


def deployment() -> str:
    """
    This deployment's name, from the Airflow option ``[sandbox] deployment``
    (``AIRFLOW__SANDBOX__DEPLOYMENT``), surrounding spaces dropped; ``""`` when unset.

    :returns: up to 63 letters, digits, ``-``, ``_`` and ``.``, beginning and ending with a letter or digit;
        or ``""``.
    :raises SandboxTerminalError: for any other value, naming the option.
    """
    raw = option(DEPLOYMENT_OPTION)
    name = raw.strip()
    if name and (len(name) > MAX_DEPLOYMENT_CHARS or not _NAME.fullmatch(name)):
        raise SandboxTerminalError(
            f"[sandbox] {DEPLOYMENT_OPTION} is {raw!r}, which cannot be stamped on a sandbox: use up to "
            f"{MAX_DEPLOYMENT_CHARS} letters, digits, '-', '_' and '.', beginning and ending with a letter or digit "
            "(for example 'prod-eu'), or leave it empty. Fix the Airflow configuration of this worker "
            "(AIRFLOW__SANDBOX__DEPLOYMENT)."
        )
    return name
