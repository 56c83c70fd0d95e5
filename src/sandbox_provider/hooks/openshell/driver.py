"""
Plain functions behind :mod:`sandbox_provider.hooks.openshell`: the policy the hook asks an OpenShell
gateway for, the check of the policy the gateway reports back, the exec request and its relay, and
the translation of gRPC failures. Protobuf and gRPC modules are imported inside the functions, so
this module imports without the ``openshell`` extra.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from sandbox_provider.sandbox.spec import EXPIRES_AT_TAG, MAP_INDEX_TAG

#: The label every sandbox of this backend carries; ``list_sandboxes`` selects on it.
MANAGED_LABEL = ("managed-by", "airflow-sandbox")
CREATED_LABEL = "airflow-created-at"
EXPIRES_LABEL = "airflow-expires-at"
#: What the map index label starts with, so that -1 (an unmapped task) survives as a label value.
MAP_INDEX_MARK = "i"
_LABEL_VALUE = re.compile(r"[^A-Za-z0-9._-]+")
#: Name of the one network rule the hook writes (hosts from ``allow_egress_to``, port 443).
EGRESS_RULE = "airflow-egress"
#: Every binary in the sandbox may use the egress rule: the hook restricts destinations, not programs.
ANY_BINARY = "/**"
EGRESS_PORT = 443
#: Landlock must apply or the sandbox must not start.
LANDLOCK_HARD = "hard_requirement"
#: Gateway settings that would let the sandbox widen its own policy.
_PROPOSAL_MODE = "proposal_approval_mode"
_PROPOSALS = "agent_policy_proposals"
#: Variables the supervisor sets (and would silently overwrite): its proxy and its CA bundle.
SUPERVISOR_ENV = frozenset(
    name for base in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY") for name in (base, base.lower())
) | frozenset(
    {
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "NODE_EXTRA_CA_CERTS",
        "GIT_SSL_CAINFO",
        "PIP_CERT",
    }
)
SUPERVISOR_ENV_PREFIX = "OPENSHELL_"
#: System paths a command may read; its working directory and /tmp are writable.
_READ_ONLY = ("/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc", "/proc", "/dev/urandom", "/opt")
_READ_WRITE = ("/tmp", "/dev/null", "/dev/shm")


def supervisor_env_names(env: Mapping[str, str] | None) -> list[str]:
    """The names in ``env`` that the OpenShell supervisor owns."""
    return sorted(k for k in env or {} if k in SUPERVISOR_ENV or k.upper().startswith(SUPERVISOR_ENV_PREFIX))


def sandbox_policy(hosts: Sequence[str], workdir: str) -> Any:
    """
    The complete policy for a new sandbox: never empty, so an image's own, possibly permissive,
    policy never applies. No network rule at all means no egress; ``hosts`` become one rule that lets
    any binary reach each host on port 443.
    """
    from openshell._proto import sandbox_pb2

    policy = sandbox_pb2.SandboxPolicy(
        version=1,
        filesystem=sandbox_pb2.FilesystemPolicy(
            include_workdir=True, read_only=list(_READ_ONLY), read_write=[workdir, *_READ_WRITE]
        ),
        landlock=sandbox_pb2.LandlockPolicy(compatibility=LANDLOCK_HARD),
    )
    if hosts:
        rule = policy.network_policies[EGRESS_RULE]
        rule.name = EGRESS_RULE
        for host in hosts:
            rule.endpoints.add(host=host, port=EGRESS_PORT)
        rule.binaries.add(path=ANY_BINARY)
    return policy


def sandbox_spec(*, image: str, cpu: str | None, memory: str | None, env: Mapping[str, str], policy: Any) -> Any:
    """The create request's spec: image, limits (Kubernetes quantities), environment and policy."""
    from openshell._proto import openshell_pb2

    spec = openshell_pb2.SandboxSpec(environment=dict(env), policy=policy)
    spec.template.image = image
    limits = {key: value for key, value in (("cpu", cpu), ("memory", memory)) if value}
    if limits:
        spec.template.resources.update({"limits": limits})
    return spec


def _destinations(policy: Any) -> set[tuple]:
    found = set()
    for key, rule in policy.network_policies.items():
        binaries = tuple(sorted(binary.path for binary in rule.binaries))
        for endpoint in rule.endpoints:
            ports = tuple(sorted(set(endpoint.ports) | ({endpoint.port} if endpoint.port else set())))
            found.add((key, endpoint.host.lower(), ports, tuple(sorted(endpoint.allowed_ips)), binaries))
        if not rule.endpoints:
            found.add((key, None, (), (), binaries))
    return found


def policy_problem(config: Any, hosts: Sequence[str]) -> str | None:
    """
    What is wrong with the effective configuration ``config`` (a ``GetSandboxConfigResponse``) for a
    sandbox that should reach exactly ``hosts`` on port 443, or None when it is what was asked for.
    """
    from openshell._proto import sandbox_pb2

    policy = config.policy
    wanted = {(EGRESS_RULE, host, (EGRESS_PORT,), (), (ANY_BINARY,)) for host in hosts}
    enforcement = {endpoint.enforcement for rule in policy.network_policies.values() for endpoint in rule.endpoints}
    settings = config.settings
    checks = [
        (config.policy_source != sandbox_pb2.POLICY_SOURCE_SANDBOX, "a gateway-wide policy applies instead of the sandbox's own"),
        (not config.configuration_admitted, f"its configuration was not admitted ({config.configuration_error or 'no reason given'})"),
        (policy.landlock.compatibility != LANDLOCK_HARD, f"Landlock is '{policy.landlock.compatibility or 'unset'}', not a hard requirement"),
        (bool(policy.network_middlewares) or bool(config.supervisor_middleware_services), "network middlewares are attached"),
        (sandbox_pb2.NETWORK_ENFORCEMENT_MODE_AUDIT in enforcement, "a network rule only audits"),
        (_destinations(policy) != wanted, f"its network rules allow {_describe(_destinations(policy))} instead of {_describe(wanted)}"),
        (_PROPOSAL_MODE in settings and settings[_PROPOSAL_MODE].value.string_value == "auto", "policy proposals are approved automatically"),
        (_PROPOSALS in settings and settings[_PROPOSALS].value.bool_value, "the agent may propose policy changes"),
    ]  # fmt: skip
    problems = [why for failed, why in checks if failed]
    return "; ".join(problems) or None


def _describe(destinations: Iterable[tuple]) -> str:
    parts = sorted(
        f"{host or '(any host)'}:{','.join(map(str, ports)) or '*'}" + (f" ips={list(ips)}" if ips else "")
        for _, host, ports, ips, _ in destinations
    )
    return ", ".join(parts) if parts else "no destination"


def workspace_scope(workspace: str) -> Any:
    from openshell._proto import datamodel_pb2

    return datamodel_pb2.WorkspaceSelector(workspace=workspace)


def exec_request(*, workspace: str, name: str, argv: Sequence[str], stdin: bytes, workdir: str) -> Any:
    """An ``ExecSandboxRequest`` for ``argv`` with ``stdin`` in ``workdir``, outside any login shell."""
    import uuid

    from openshell._proto import openshell_pb2

    return openshell_pb2.ExecSandboxRequest(
        workspace_scope=workspace_scope(workspace),
        sandbox=name,
        command=list(argv),
        stdin=stdin,
        workdir=workdir,
        no_login_shell=True,
        request_id=uuid.uuid4().hex,
    )


def config_request(*, workspace: str, name: str) -> Any:
    from openshell._proto import sandbox_pb2

    return sandbox_pb2.GetSandboxConfigRequest(workspace_scope=workspace_scope(workspace), name=name)


def relay(events: Iterator[Any], on_stdout, on_stderr) -> int | None:
    """
    Pass an ``ExecSandbox`` event stream's output to the callbacks as raw bytes, in order; return
    the exit code, or None when the stream ended without one.
    """
    code = None
    for event in events:
        kind = event.WhichOneof("payload")
        if kind == "stdout":
            on_stdout(bytes(event.stdout.data))
        elif kind == "stderr":
            on_stderr(bytes(event.stderr.data))
        elif kind == "exit":
            code = int(event.exit.exit_code)
    return code


def status_code(error: BaseException) -> Any:
    """The gRPC status code of ``error``, or None when it is no RPC error."""
    import grpc

    if isinstance(error, grpc.RpcError) and callable(getattr(error, "code", None)):
        return error.code()
    return None


def describe(error: BaseException) -> str:
    code = status_code(error)
    details_of = getattr(error, "details", None)
    details = details_of() if callable(details_of) else str(error)
    return f"{code.name}: {details}" if code is not None else str(error)


def get_request(*, workspace: str, name: str) -> Any:
    from openshell._proto import openshell_pb2

    return openshell_pb2.GetSandboxRequest(workspace_scope=workspace_scope(workspace), name=name)


def endpoint(host: str, port: int | None, tls: bool) -> tuple[str, bool]:
    """``host:port`` for the gRPC channel and whether it uses TLS, from a connection's host and port."""
    if "://" in host:
        parts = urlsplit(host)
        tls = tls or parts.scheme == "https"
        host, port = parts.hostname or "", port or parts.port
    elif host.count(":") == 1:
        host, _, given = host.partition(":")
        port = port or int(given)
    return f"{host}:{port or (443 if tls else 80)}", tls


def labels(stamps: Mapping[str, str], expires_at: float) -> dict[str, str]:
    """
    A new sandbox's labels: the sweep marker, creation and expiry times (Unix seconds), and the task
    that made it, each value cut to what a label holds (63 letters, digits, ``.``, ``_``, ``-``).
    """
    found = {MANAGED_LABEL[0]: MANAGED_LABEL[1], CREATED_LABEL: str(int(time.time()))}
    found[EXPIRES_LABEL] = stamps.get(EXPIRES_AT_TAG, str(int(expires_at)))
    for key, value in stamps.items():
        if key.startswith("airflow_") and key != EXPIRES_AT_TAG and not key.endswith(("_network", "_workdir")):
            if key == MAP_INDEX_TAG:  # a label cannot start with "-": -1 (unmapped) would read as map index 1
                value = MAP_INDEX_MARK + value
            cleaned = _LABEL_VALUE.sub("_", value)[:63].strip("._-")
            if cleaned:
                found[key.replace("_", "-")] = cleaned
    return found


def stamps_of(found: Mapping[str, str]) -> dict[str, str]:
    """The stamps a sandbox's labels carry (see :func:`labels`): the expiry, and the task's as cut to a label."""
    stamps = {key.replace("-", "_"): str(value) for key, value in found.items() if key.startswith("airflow-")}
    stamps.pop("airflow_created_at", None)
    index = stamps.pop(MAP_INDEX_TAG, "")
    if index.startswith(MAP_INDEX_MARK):
        stamps[MAP_INDEX_TAG] = index[len(MAP_INDEX_MARK) :]
    return stamps


def number(value: str | None) -> float | None:
    """A label's number, or None when it is missing or not one."""
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
