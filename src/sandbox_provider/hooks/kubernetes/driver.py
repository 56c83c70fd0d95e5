"""
Plain functions of the Kubernetes backend: the Pod and NetworkPolicy it sends, the labels it finds
them by, the argv of every exec, and what it reads back from the cluster. Nothing here talks to it.

**Labels and annotations.** A sandbox's creation stamps (owner, expiry, network, workdir, and the
Dag, run, task, map index and try that made it) are the Pod's annotations, exactly as they are, and
the holder joins them when a task attaches. Labels only find pods: a label value is at most 63
characters of ``[A-Za-z0-9_.-]``, so each stamp that is looked up by (the trace and the owner) is
labelled with its value when that is a valid label value, and with a digest of it otherwise; a
search by labels is then confirmed on the annotations.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from sandbox_provider.hooks.kubernetes import guest
from sandbox_provider.sandbox import guest as shared_guest
from sandbox_provider.sandbox.spec import (
    DAG_ID_TAG,
    MAP_INDEX_TAG,
    OWNER_TAG,
    RUN_ID_TAG,
    TASK_ID_TAG,
    TRY_NUMBER_TAG,
)

__all__ = [
    "CONTAINER",
    "SANDBOX_LABEL",
    "label_selector",
    "network_policy_manifest",
    "pod_manifest",
]

#: The label every sandbox Pod (and its NetworkPolicy) carries, its value the handle (the Pod's name).
SANDBOX_LABEL = "airflow-sandbox/handle"
#: The standard label naming the program that manages the objects.
MANAGED_BY = ("app.kubernetes.io/managed-by", "airflow-provider-sandbox")
#: The one container of a sandbox Pod.
CONTAINER = "sandbox"
#: Stamps a search can select by, and the label keys they are labelled under.
STAMP_LABELS = {
    OWNER_TAG: "airflow-sandbox/owner",
    DAG_ID_TAG: "airflow-sandbox/dag-id",
    RUN_ID_TAG: "airflow-sandbox/run-id",
    TASK_ID_TAG: "airflow-sandbox/task-id",
    MAP_INDEX_TAG: "airflow-sandbox/map-index",
    TRY_NUMBER_TAG: "airflow-sandbox/try-number",
}
#: Ranges an ``allow_egress_to_cidrs`` entry never opens by containing them: link-local (the cloud
#: metadata service) and loopback. A range the entry lies within is named by it, and stays open.
ALWAYS_EXCEPTED = ("169.254.0.0/16", "127.0.0.0/8")
#: The shortest lifetime a sandbox Pod gets: ``activeDeadlineSeconds`` counts whole seconds.
MIN_DEADLINE_SECONDS = 1
#: The shortest deadline coreutils ``timeout`` is given, in seconds (0 would mean none).
MIN_TIMEOUT_SECONDS = 0.001
#: A DNS-1123 label: what a Pod's name must be, so every handle is one.
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


def label_value(value: str) -> str:
    """``value`` as a label value: itself when it is a valid one, else ``h-`` and a digest of it."""
    if len(value) <= 63 and _LABEL_VALUE.fullmatch(value):
        return value
    return "h-" + hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()[:40]


def stamp_labels(stamps: Mapping[str, str]) -> dict[str, str]:
    """The labels of the searchable stamps among ``stamps``."""
    return {STAMP_LABELS[key]: label_value(value) for key, value in stamps.items() if key in STAMP_LABELS}


def label_selector(stamps: Mapping[str, str] | None = None, handle: str | None = None) -> str:
    """
    The label selector of the sandboxes carrying every stamp of ``stamps`` (only the searchable ones
    narrow it; check the annotations for the rest), or of the one named ``handle``.
    """
    terms = [f"{MANAGED_BY[0]}={MANAGED_BY[1]}", SANDBOX_LABEL if handle is None else f"{SANDBOX_LABEL}={handle}"]
    terms += [f"{key}={value}" for key, value in stamp_labels(stamps or {}).items()]
    return ",".join(terms)


def quantity_cpu(cpus: float) -> str:
    """CPUs as a Kubernetes quantity, in whole millicores (at least 1)."""
    return f"{max(1, round(cpus * 1000))}m"


def deadline_seconds(lifetime: float) -> int:
    """``activeDeadlineSeconds`` for a lifetime in seconds: rounded up, at least 1."""
    return max(MIN_DEADLINE_SECONDS, math.ceil(lifetime - 1e-6))


def pod_manifest(
    name: str,
    settings: Mapping[str, Any],
    *,
    workdir: str,
    lifetime: float,
    stamps: Mapping[str, str],
    env: Mapping[str, str] | None,
) -> dict[str, Any]:
    """
    The Pod of one sandbox: Pod Security "restricted" (non-root user, no privilege escalation, no
    capabilities, the runtime's default seccomp profile), no service-account token, no service links,
    no host namespaces or paths; the workdir and ``/tmp`` on ``emptyDir`` volumes of at most
    ``disk_bytes`` each; ended by the cluster after ``lifetime`` seconds (``activeDeadlineSeconds``).

    :param settings: the hook's resolved settings (image, resources, user, scheduling).
    :param stamps: the creation stamps, kept as annotations (the searchable ones also as labels).
    """
    uid, disk = int(settings["sandbox_uid"]), str(int(settings["disk_bytes"]))
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "activeDeadlineSeconds": deadline_seconds(lifetime),
        "terminationGracePeriodSeconds": 1,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "hostNetwork": False,
        "hostPID": False,
        "hostIPC": False,
        "shareProcessNamespace": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": uid,
            "runAsGroup": uid,
            "fsGroup": uid,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_container(settings, workdir, env)],
        "volumes": [
            {"name": "workspace", "emptyDir": {"sizeLimit": disk}},
            {"name": "tmp", "emptyDir": {"sizeLimit": disk}},
        ],
    }
    if settings.get("runtime_class_name"):
        spec["runtimeClassName"] = settings["runtime_class_name"]
    if settings.get("node_selector"):
        spec["nodeSelector"] = dict(settings["node_selector"])
    if settings.get("tolerations"):
        spec["tolerations"] = [dict(t) for t in settings["tolerations"]]
    if settings.get("image_pull_secret"):
        spec["imagePullSecrets"] = [{"name": settings["image_pull_secret"]}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": sandbox_labels(name, stamps), "annotations": dict(stamps)},
        "spec": spec,
    }


def _container(settings: Mapping[str, Any], workdir: str, env: Mapping[str, str] | None) -> dict[str, Any]:
    """The one container of a sandbox Pod: the keeper as its command, limits, no privileges."""
    uid, disk = int(settings["sandbox_uid"]), str(int(settings["disk_bytes"]))
    limits = {"cpu": quantity_cpu(settings["cpus"]), "memory": str(int(settings["memory_bytes"]))}
    requests = {
        "cpu": quantity_cpu(min(settings["cpu_request"], settings["cpus"])),
        "memory": str(min(int(settings["memory_request_bytes"]), int(settings["memory_bytes"]))),
    }
    limits["ephemeral-storage"] = requests["ephemeral-storage"] = disk
    return {
        "name": CONTAINER,
        "image": settings["image"],
        "imagePullPolicy": settings["image_pull_policy"],
        "command": ["sh", "-c", guest_code("k8s_keeper.sh"), "airflow-sandbox-keeper"],
        "workingDir": workdir,
        "env": [{"name": k, "value": v} for k, v in {"HOME": workdir, **dict(env or {})}.items()],
        "resources": {"limits": limits, "requests": requests},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
            "runAsUser": uid,
            "runAsGroup": uid,
            "readOnlyRootFilesystem": bool(settings["read_only_root"]),
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [{"name": "workspace", "mountPath": workdir}, {"name": "tmp", "mountPath": "/tmp"}],
    }


def sandbox_labels(name: str, stamps: Mapping[str, str]) -> dict[str, str]:
    """The labels of a sandbox's Pod and NetworkPolicy."""
    return {MANAGED_BY[0]: MANAGED_BY[1], SANDBOX_LABEL: name, **stamp_labels(stamps)}


def egress_rules(cidrs: Sequence[str], cluster_cidrs: Sequence[str]) -> list[dict[str, Any]]:
    """
    The egress rules of a NetworkPolicy that opens ``cidrs`` (on every port and protocol) and nothing
    else. A range that contains one of ``cluster_cidrs`` or of :data:`ALWAYS_EXCEPTED` without
    being it (``0.0.0.0/0`` contains all of them) gets it as an ``except``: those open only when named
    themselves, or by a range inside them.
    """
    if not cidrs:
        return []
    internal = [ipaddress.ip_network(c) for c in (*ALWAYS_EXCEPTED, *cluster_cidrs)]
    peers = []
    for text in cidrs:
        net = ipaddress.ip_network(text)
        excepted = sorted(
            {str(r) for r in internal if r.version == net.version and r != net and r.subnet_of(net)},  # type: ignore[arg-type]
            key=lambda r: (ipaddress.ip_network(r).network_address, ipaddress.ip_network(r).prefixlen),
        )
        block: dict[str, Any] = {"cidr": str(net)}
        if excepted:
            block["except"] = excepted
        peers.append({"ipBlock": block})
    return [{"to": peers}]


def network_policy_manifest(
    name: str, stamps: Mapping[str, str], cidrs: Sequence[str], cluster_cidrs: Sequence[str]
) -> dict[str, Any]:
    """
    The NetworkPolicy of one sandbox: its Pod (selected by the handle label) takes no connection in,
    and makes none out but to ``cidrs`` (see :func:`egress_rules`); no ``cidrs`` means no egress at
    all, DNS included.
    """
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "labels": sandbox_labels(name, stamps)},
        "spec": {
            "podSelector": {"matchLabels": {SANDBOX_LABEL: name}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],
            "egress": egress_rules(cidrs, cluster_cidrs),
        },
    }


def owner_reference(pod: Mapping[str, Any]) -> dict[str, Any]:
    """An ownerReference to a Pod, so the cluster deletes what carries it with the Pod."""
    meta = pod["metadata"]
    return {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"], "blockOwnerDeletion": False}


# -- exec argv ------------------------------------------------------------------------------------------


def guest_code(name: str) -> str:
    """A guest program (this backend's ``k8s_*.sh`` or a shared one) without its comment lines."""
    text = guest.program(name) if name.startswith("k8s_") else shared_guest.program(name)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def timeout_arg(seconds: float) -> str:
    """A deadline as coreutils ``timeout`` reads it, rounded up to whole milliseconds and never 0."""
    millis = max(math.ceil(seconds * 1000 - 1e-6), round(MIN_TIMEOUT_SECONDS * 1000))
    return f"{millis // 1000}.{millis % 1000:03d}"


def runner_argv(command: str, seconds: float, workdir: str, *, staged: bool = False) -> list[str]:
    """The exec's argv for one command with a deadline of ``seconds``; ``staged``: extract stdin's archive first."""
    stage = guest_code("stage.sh") if staged else ""
    return ["sh", "-c", guest_code("k8s_run.sh"), "sandbox-run", timeout_arg(seconds), workdir, command, stage]


def op_argv(workdir: str, program: str, *args: str) -> list[str]:
    """The exec's argv for a file operation: the shared guest program ``program`` in ``workdir``."""
    return ["sh", "-c", guest_code("k8s_op.sh"), "sandbox-op", workdir, guest_code(program), program, *args]


#: The exec that ends every process of the pod's user but itself and the keeper.
SWEEP_ARGV = ["sh", "-c", "kill -KILL -1 2>/dev/null; exit 0"]

#: Seconds to wait for a Pod to read as ended once an exec in it could not be opened after a killed
#: command: the kubelet kills the container at the Pod's deadline and reports the end after that.
ENDING_SETTLE_SECONDS = 15.0
#: Seconds between two reads of a Pod while waiting for it to read as ended.
ENDING_POLL_SECONDS = 0.25


# -- what the cluster reports ------------------------------------------------------------------------


def exit_status(status: Mapping[str, Any]) -> tuple[int | None, str]:
    """
    The exit status an exec's status channel reports, and its message: 0 for ``Success``, the
    ``ExitCode`` cause for ``NonZeroExitCode``; None (with the message) for a failure with no exit
    status (the program could not be started, the container is gone).
    """
    if status.get("status") == "Success":
        return 0, ""
    message = str(status.get("message") or status.get("reason") or "the exec failed")
    for cause in (status.get("details") or {}).get("causes") or []:
        if cause.get("reason") == "ExitCode":
            try:
                return int(cause.get("message")), message
            except (TypeError, ValueError):
                break
    return None, message


def pod_problem(pod: Mapping[str, Any]) -> str | None:
    """
    Why a Pod that is not running yet never will (a pull that failed, an image or config error,
    the Pod ended), in a sentence; None while it may still start.
    """
    status = pod.get("status") or {}
    phase = status.get("phase")
    if phase in ("Failed", "Succeeded"):
        return f"the pod ended ({phase}: {status.get('reason') or ''} {status.get('message') or ''})".replace(
            "  ", " "
        ).replace(": )", ")")
    for item in status.get("containerStatuses") or []:
        waiting = (item.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason") or ""
        if reason in _HOPELESS_WAITS:
            return f"its container cannot start: {reason}: {waiting.get('message') or ''}".rstrip(": ")
        terminated = (item.get("state") or {}).get("terminated")
        if terminated:
            return f"its container ended ({terminated.get('reason')}, exit status {terminated.get('exitCode')})"
    return None


#: Waiting reasons after which a container never starts without a change to the Pod or the cluster.
_HOPELESS_WAITS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "ErrImageNeverPull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "CrashLoopBackOff",
    }
)


def is_running(pod: Mapping[str, Any]) -> bool:
    """True when the Pod runs, its one container has started, and it is not being deleted."""
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return any(((item.get("state") or {}).get("running") is not None) for item in status.get("containerStatuses") or [])


def timestamp(text: str | None) -> float:
    """An API timestamp (``2024-01-02T03:04:05Z``) as Unix seconds; 0 when there is none."""
    if not text:
        return 0.0
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def unschedulable(pod: Mapping[str, Any]) -> str | None:
    """The scheduler's message when it could not place the Pod yet, else None."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return str(condition.get("message") or condition.get("reason") or "not scheduled")
    return None


# -- settings that the settings table cannot hold -------------------------------------------------------


def cidr_list(text: str, where: str) -> list[str]:
    """
    A comma-separated list of address ranges as canonical strings (``"10.0.0.0/8"``), each once.

    :raises ValueError: naming ``where`` and the first entry that is not a range without host bits.
    """
    ranges: list[str] = []
    for entry in (part.strip() for part in str(text).split(",")):
        if not entry:
            continue
        try:
            net = ipaddress.ip_network(entry, strict=True)
        except ValueError:
            raise ValueError(
                f"{where} entry {entry!r} is not an address range: give a network address with its prefix length "
                "and no host bits, such as '203.0.113.0/24'."
            ) from None
        if str(net) not in ranges:
            ranges.append(str(net))
    return ranges


def check_node_selector(value: Any, where: str) -> dict[str, str] | None:
    """
    ``value`` (a mapping, or its JSON text from a connection extra) as a node selector; None for none.

    :raises ValueError: unless it maps strings to strings.
    """
    value = _from_json(value, where)
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(
            f"{where} must map node label names to values (strings), e.g. {{'pool': 'sandboxes'}}; got {value!r}."
        )
    return dict(value) or None


def check_tolerations(value: Any, where: str) -> list[dict[str, Any]] | None:
    """
    ``value`` (a list of tolerations in the API's shape, or its JSON text) checked; None for none.

    :raises ValueError: unless each is a mapping with only the API's toleration fields.
    """
    value = _from_json(value, where)
    if value is None:
        return None
    fields = {"key", "operator", "value", "effect", "tolerationSeconds"}
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, Mapping) and set(t) <= fields for t in value):
        raise ValueError(
            f"{where} must be a list of tolerations with the fields {sorted(fields)}, e.g. "
            f"[{{'key': 'sandbox', 'operator': 'Exists', 'effect': 'NoSchedule'}}]; got {value!r}."
        )
    return [dict(t) for t in value] or None


def _from_json(value: Any, where: str) -> Any:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        import json

        try:
            return json.loads(value)
        except ValueError:
            raise ValueError(f"{where} must be JSON when given as text; got {value!r}.") from None
    return value


#: What a worker's identity must be allowed in the sandboxes' namespace (``rbac.yaml`` grants exactly
#: this): ``(resource attributes, verb, API group)``. Exec is a GET upgraded to a websocket; newer API
#: servers also ask for create on it.
NEEDED_PERMISSIONS: tuple[tuple[dict[str, str], str, str], ...] = (
    *(({"resource": "pods"}, verb, "") for verb in ("create", "get", "list", "watch", "patch", "delete")),
    *(({"resource": "pods", "subresource": "exec"}, verb, "") for verb in ("get", "create")),
    *(({"resource": "networkpolicies"}, verb, "networking.k8s.io") for verb in ("create", "list", "patch", "delete")),
)


def permission_text(resource: Mapping[str, str], verb: str) -> str:
    """``"create pods/exec"``: a permission as RBAC rules name it."""
    sub = resource.get("subresource")
    return f"{verb} {resource['resource']}{'/' + sub if sub else ''}"
