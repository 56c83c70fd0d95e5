"""
Sandboxes as Pods on a Kubernetes cluster, driven through the official ``kubernetes`` client that the
``apache-airflow-providers-cncf-kubernetes`` provider configures from its ``kubernetes`` connection.

- **A sandbox** is one Pod named ``airflow-sandbox-<hex>`` (the handle) in the connection's namespace,
  hardened to Pod Security "restricted" (see :func:`~sandbox_provider.hooks.kubernetes.driver.pod_manifest`):
  a non-root user with no capabilities, no privilege escalation, the runtime's default seccomp profile,
  no service-account token, no service links, no host namespaces or paths; the workdir and ``/tmp`` on
  size-limited ``emptyDir`` volumes; CPU, memory and ephemeral-storage limits. Its creation stamps are
  the Pod's annotations (and labels, to find it), the trace back to the Dag, run, task and try included.
- **Lifetime, enforced by the cluster.** The Pod's ``activeDeadlineSeconds`` is the lifetime: the
  kubelet kills it then with no worker involved, so a worker killed outright leaves nothing running past
  it. What an ended Pod leaves (its object and its ``emptyDir`` on the node) is deleted by the next
  create in the namespace, by :meth:`KubernetesSandboxHook.remove_expired`, and by the provider's
  sweep. Why not a Job with ``ttlSecondsAfterFinished``: it adds a controller between the create and
  the Pod (slower, and the Pod's name is no longer the handle), a Job retries Pods that a sandbox must
  never restart, and that field is not on by default before Kubernetes 1.21.
- **Commands** run through the exec subresource under the runner (``guest/k8s_run.sh``), which keeps
  the deadline inside the Pod (closing an exec does not end its process) and ends everything the
  command started; the exit status comes from the exec's status channel. See
  :mod:`~sandbox_provider.hooks.kubernetes.commands`.
- **Files** go through exec as the Pod's user with the shared guest programs; a batch is one tar stream
  per direction.
- **Network**: ``block_network=True`` gets a NetworkPolicy of its own denying all ingress and egress;
  ``allow_egress_to_cidrs`` opens those ranges (the cloud metadata service, loopback and the cluster's
  own ranges excepted unless named). A NetworkPolicy is only as good as the cluster's network plugin,
  which the API cannot tell: a spec that needs one is refused unless the connection declares
  ``network_policy_enforced``. Hostname allowlists are refused (a NetworkPolicy matches addresses).
- **Attach**: the holder is an annotation, claimed by a compare-and-swap on the Pod's
  ``resourceVersion`` (see :mod:`~sandbox_provider.hooks.kubernetes.stamps`), so two tasks cannot both hold it.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

from sandbox_provider.hooks.kubernetes import driver
from sandbox_provider.hooks.kubernetes.commands import KubernetesExec
from sandbox_provider.hooks.kubernetes.settings import CONNECTION_EXTRAS, ENV_NAME, SETTINGS
from sandbox_provider.hooks.kubernetes.stamps import KubernetesStamps
from sandbox_provider.sandbox.attach import Attachable, expiry_of
from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError
from sandbox_provider.sandbox.files import ShellFiles, StreamFiles
from sandbox_provider.sandbox.hook import Capabilities, ProvisionRequest, SandboxHook
from sandbox_provider.sandbox.leftovers import SandboxRecord
from sandbox_provider.sandbox.network import NetworkReach
from sandbox_provider.sandbox.spec import (
    SandboxSpec,
)

log = logging.getLogger(__name__)

__all__ = ["KubernetesSandboxBackend", "KubernetesSandboxHook"]

T = TypeVar("T")

#: Seconds a NetworkPolicy without its Pod is left alone: a create makes the policy first, then the Pod.
ORPHAN_POLICY_GRACE = 600.0
#: Longest deadline for a command when the sandbox's end is unknown (30 days).
MAX_COMMAND_SECONDS = 30 * 24 * 3600.0


class KubernetesSandboxHook(KubernetesExec, KubernetesStamps, StreamFiles, ShellFiles, Attachable, SandboxHook):
    """
    Provision sandboxes as Pods on a Kubernetes cluster.

    Connection: type ``kubernetes`` of apache-airflow-providers-cncf-kubernetes (in cluster, a
    kubeconfig file or its content, a context; its ``namespace`` extra is the sandboxes' namespace).
    When the default connection ``kubernetes_default`` is not defined, the worker's own configuration
    is used (in cluster under KubernetesExecutor, else ``~/.kube/config``). The settings below are hook
    arguments, or extras of that connection; hook arguments win.

    :param kubernetes_conn_id: the Airflow connection; None uses the worker's own configuration.
    :param namespace: where sandboxes are created; default the connection's, else ``"default"``.
    :param image: the image sandboxes run; default ``python:3.12-slim``.
    :param image_pull_policy: ``"IfNotPresent"`` (default), ``"Always"`` or ``"Never"``.
    :param image_pull_secret: a Secret of the namespace to pull the image with; default none.
    :param cpus: CPU limit per sandbox; default 1.
    :param cpu_request: CPUs reserved per sandbox; default 0.1.
    :param memory_bytes: memory limit per sandbox in bytes; default 1 GiB.
    :param memory_request_bytes: memory reserved per sandbox in bytes; default 256 MiB.
    :param disk_bytes: ephemeral storage per sandbox in bytes; default 1 GiB.
    :param sandbox_timeout: lifetime in seconds; default 3600.
    :param sandbox_uid: the (non-zero) user and group id of the sandbox's processes; default 65432.
    :param read_only_root: mount the image read-only; default False.
    :param runtime_class_name: a RuntimeClass (gVisor, Kata); default the cluster's.
    :param node_selector: node labels a sandbox's node must have, e.g. ``{"pool": "sandboxes"}``.
    :param tolerations: Kubernetes tolerations (dicts in the API's shape) for tainted sandbox nodes.
    :param network_policy_enforced: declare that the cluster enforces NetworkPolicy; default False.
    :param cluster_cidrs: comma-separated cluster ranges a wider allowlisted range does not open.
    :param start_timeout: seconds a sandbox may take to start; default 300.
    :raises ValueError: for a setting out of bounds.
    """

    conn_name_attr = "kubernetes_conn_id"
    default_conn_name = "kubernetes_default"
    conn_type = "kubernetes"
    hook_name = "Sandbox (Kubernetes)"

    name: ClassVar[str] = "kubernetes"
    display_name: ClassVar[str] = "Kubernetes"
    detached_commands: ClassVar[bool] = True
    capabilities = Capabilities(
        egress_hosts=False,
        egress_cidrs=True,
        max_command_seconds=MAX_COMMAND_SECONDS,
        network=NetworkReach(
            blocked="has no network access at all, not even DNS: a NetworkPolicy of its own denies all its traffic",
            open=(
                "has the outbound network access of its Kubernetes pod network: whatever the cluster lets pods reach, "
                "DNS included"
            ),
            cidrs=("any port and protocol reaches them; names resolve only if a range holds the cluster's DNS service"),
        ),
        advice=(
            "A NetworkPolicy matches addresses, not names: list the address ranges in allow_egress_to_cidrs, or set "
            "block_network=False for the pod network's open egress."
        ),
    )
    handle_pattern = re.compile(r"airflow-sandbox-[a-z0-9](?:[-a-z0-9]{0,45}[a-z0-9])?")
    handle_shape = "'airflow-sandbox-' followed by lowercase letters, digits and '-' (a Pod name)"
    settings = SETTINGS
    test_connection_note = "Sandboxes run as Pods of that cluster."

    def __init__(
        self,
        kubernetes_conn_id: str | None = default_conn_name,
        *,
        namespace: str | None = None,
        image: str | None = None,
        image_pull_policy: str | None = None,
        image_pull_secret: str | None = None,
        cpus: float | None = None,
        cpu_request: float | None = None,
        memory_bytes: int | None = None,
        memory_request_bytes: int | None = None,
        disk_bytes: int | None = None,
        sandbox_timeout: float | None = None,
        sandbox_uid: int | None = None,
        read_only_root: bool | None = None,
        runtime_class_name: str | None = None,
        node_selector: Mapping[str, str] | None = None,
        tolerations: Sequence[Mapping[str, Any]] | None = None,
        network_policy_enforced: bool | None = None,
        cluster_cidrs: str | None = None,
        start_timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if kubernetes_conn_id is not None and (
            not isinstance(kubernetes_conn_id, str) or not kubernetes_conn_id.strip()
        ):
            raise ValueError(f"kubernetes_conn_id must be a connection id or None, got {kubernetes_conn_id!r}.")
        self.kubernetes_conn_id = kubernetes_conn_id
        self._args = self.settings.check_args(
            {
                "namespace": namespace,
                "image": image,
                "image_pull_policy": image_pull_policy,
                "image_pull_secret": image_pull_secret,
                "cpus": cpus,
                "cpu_request": cpu_request,
                "memory_bytes": memory_bytes,
                "memory_request_bytes": memory_request_bytes,
                "disk_bytes": disk_bytes,
                "sandbox_timeout": sandbox_timeout,
                "sandbox_uid": sandbox_uid,
                "read_only_root": read_only_root,
                "runtime_class_name": runtime_class_name,
                "network_policy_enforced": network_policy_enforced,
                "cluster_cidrs": cluster_cidrs,
                "start_timeout": start_timeout,
            }
        )
        if cluster_cidrs is not None:
            driver.cidr_list(cluster_cidrs, "cluster_cidrs")
        self._scheduling = {
            "node_selector": driver.check_node_selector(node_selector, "node_selector"),
            "tolerations": driver.check_tolerations(tolerations, "tolerations"),
        }
        self._lock = threading.Lock()
        self._settings_obj: dict[str, Any] | None = None
        self._k8s_hook: Any = None
        self._apis: tuple[Any, Any] | None = None
        #: What this hook knows of its sandboxes' Pods (metadata), by handle; and the ones it destroyed.
        self._pods: dict[str, dict[str, Any]] = {}
        self._gone: set[str] = set()

    # -- connection ------------------------------------------------------------------------------------

    def _where(self) -> str:
        conn = f"connection {self.kubernetes_conn_id!r}" if self.kubernetes_conn_id else "the worker's configuration"
        return f"namespace {self._resolved()['namespace']!r} of the cluster of {conn}"

    def _resolved(self) -> dict[str, Any]:
        if self._settings_obj is not None:
            return self._settings_obj
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
        from kubernetes import client

        probe = KubernetesHook(kubernetes_conn_id=self.kubernetes_conn_id)
        try:
            extras = dict(probe.conn_extras or {})
        except Exception as err:  # AirflowNotFoundException, a broken secrets backend
            raise SandboxTerminalError(
                f"Cannot read the Airflow connection {self.kubernetes_conn_id!r}: {err}. Define it with type "
                "kubernetes, or pass kubernetes_conn_id=None to use the worker's own Kubernetes configuration."
            ) from None
        ours = {k: v for k, v in extras.items() if k not in CONNECTION_EXTRAS and not k.startswith("extra__")}
        try:
            settings = self.settings.resolve(self._args, ours, conn_id=self.kubernetes_conn_id)
            settings["cluster_cidrs"] = driver.cidr_list(settings["cluster_cidrs"], "cluster_cidrs")
            for key, check in (
                ("node_selector", driver.check_node_selector),
                ("tolerations", driver.check_tolerations),
            ):
                settings[key] = self._scheduling[key] or check(extras.get(key), f"extra {key!r}")
        except ValueError as err:
            raise SandboxTerminalError(
                f"{err} Fix the extra of connection {self.kubernetes_conn_id!r} or pass the setting to the hook."
            ) from None
        # The provider's in-cluster branch configures the client's default configuration, not one given.
        in_cluster = str(extras.get("in_cluster", "")).lower() in ("true", "1", "yes")
        self._k8s_hook = KubernetesHook(
            kubernetes_conn_id=self.kubernetes_conn_id,
            client_configuration=None if in_cluster else client.Configuration(),
        )
        self._settings_obj = settings
        return settings

    def _api(self) -> tuple[Any, Any]:
        """The ``CoreV1Api`` and ``NetworkingV1Api`` of the connection's cluster, made on first use."""
        with self._lock:
            if self._apis is None:
                self._resolved()
                from kubernetes import client

                try:
                    api_client = self._k8s_hook.api_client
                except Exception as err:  # ConfigException, a kubeconfig that does not parse, ...
                    raise SandboxTerminalError(
                        f"Cannot configure a Kubernetes client from {self._where()}: {type(err).__name__}: {err}. "
                        "Fix the connection's kubeconfig (or in_cluster), or the worker's ~/.kube/config."
                    ) from err
                self._apis = (client.CoreV1Api(api_client), client.NetworkingV1Api(api_client))
            return self._apis

    def _call(self, doing: str, fn: Callable[[], T], handle: str | None = None) -> T:
        """One API call; its errors as this package's, saying what to change."""
        from kubernetes.client.exceptions import ApiException

        try:
            return fn()
        except ApiException as err:
            raise self._api_error(err, doing, handle) from err
        except (OSError, ValueError) as err:  # urllib3 errors are OSErrors: refused, TLS, timeouts
            raise SandboxTerminalError(
                f"Cannot reach the Kubernetes API server while {doing} ({self._where()}): {err}. Check the "
                "connection's kubeconfig and that the cluster answers from this worker."
            ) from err

    def _api_error(self, err: Any, doing: str, handle: str | None) -> SandboxError:
        reason = _api_message(err)
        if err.status in (401, 403):
            return SandboxTerminalError(
                f"The Kubernetes API refused {doing} in {self._where()} ({err.status}: {reason}). Give the worker's "
                "identity the Role in sandbox_provider/hooks/kubernetes/rbac.yaml in that namespace."
            )
        if err.status == 404 and handle is not None:
            return SandboxTerminalError(f"Sandbox {handle} does not exist in {self._where()} (destroyed, or ended).")
        cls = SandboxTerminalError if err.status in (400, 409, 422) or err.status >= 500 else SandboxError
        return cls(f"The Kubernetes API failed {doing} in {self._where()} ({err.status}: {reason}).")

    def _json(self, response: Any) -> dict[str, Any]:
        return json.loads(response.data)

    # -- the spec ----------------------------------------------------------------------------------------

    def _refusal(self, spec: SandboxSpec) -> str | None:
        bad = sorted(k for k in spec.env or {} if not ENV_NAME.fullmatch(k))
        if bad:
            return (
                f"SandboxSpec.env names {bad} are not valid Kubernetes environment variable names. Use letters, "
                "digits, '_', '-' and '.', not starting with a digit."
            )
        if spec.allow_egress_to_cidrs:
            try:
                driver.cidr_list(",".join(spec.allow_egress_to_cidrs), "allow_egress_to_cidrs")
            except ValueError as err:
                return str(err)
        if not spec.block_network:
            return None
        enforced = self._args.get("network_policy_enforced")
        if enforced is None:
            enforced = self._resolved()["network_policy_enforced"]
        if enforced:
            return None
        asks = "an egress allowlist of address ranges" if spec.allow_egress_to_cidrs else "no network"
        return (
            f"SandboxSpec asks for {asks}, which this backend enforces with a NetworkPolicy, and a NetworkPolicy is "
            "only enforced by a network plugin that implements it (Calico, Cilium, ...); the Kubernetes API cannot "
            "tell. If the cluster's plugin enforces it, declare so with network_policy_enforced=True (the hook "
            "argument or the connection extra); otherwise pass SandboxSpec(block_network=False) to accept the pod "
            "network's open egress."
        )

    # -- lifecycle -----------------------------------------------------------------------------------------

    def _provision(self, request: ProvisionRequest) -> str:
        settings = self._resolved()
        core, net = self._api()
        namespace = settings["namespace"]
        self._sweep_namespace()
        name = request.name
        began = time.monotonic()
        policy = None
        if request.spec.block_network:
            cidrs = driver.cidr_list(",".join(request.spec.allow_egress_to_cidrs or []), "allow_egress_to_cidrs")
            policy = driver.network_policy_manifest(name, request.stamps, cidrs, settings["cluster_cidrs"])
            self._call(
                "creating the sandbox's NetworkPolicy", lambda: net.create_namespaced_network_policy(namespace, policy)
            )
        manifest = driver.pod_manifest(
            name,
            settings,
            workdir=self.workdir,
            lifetime=request.lifetime,
            stamps=request.stamps,
            env=request.spec.env,
        )
        try:
            created = self._json(
                self._call(
                    "creating the sandbox Pod",
                    lambda: core.create_namespaced_pod(namespace, manifest, _preload_content=False),
                )
            )
            if policy is not None:
                self._own_policy(name, created)
            pod = self._await_running(name, created, settings["start_timeout"])
        except BaseException:
            self._remove(name, quietly=True)
            raise
        self._pods[name] = pod["metadata"]
        self._known_expiry[name] = request.expires_at
        log.info(
            "Started Kubernetes sandbox %s from %s in %s in %.1fs, lifetime %ss",
            name,
            settings["image"],
            self._where(),
            time.monotonic() - began,
            driver.deadline_seconds(request.lifetime),
        )
        return name

    def _own_policy(self, name: str, pod: Mapping[str, Any]) -> None:
        """Make the Pod own its NetworkPolicy, so the cluster deletes both together (best effort)."""
        _, net = self._api()
        body = {"metadata": {"ownerReferences": [driver.owner_reference(pod)]}}
        try:
            net.patch_namespaced_network_policy(name, self._resolved()["namespace"], body)
        except Exception:  # destroy and the sweep delete it by name all the same
            log.warning("Could not make Pod %s the owner of its NetworkPolicy", name, exc_info=True)

    def _await_running(self, name: str, pod: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Watch the new Pod until its container runs; :raises SandboxTerminalError: when it will not."""
        from kubernetes import watch

        core, _ = self._api()
        namespace = self._resolved()["namespace"]
        deadline = time.monotonic() + timeout
        while not driver.is_running(pod):
            problem = driver.pod_problem(pod)
            if problem is not None:
                raise SandboxTerminalError(
                    f"Sandbox Pod {name} did not start in {self._where()}: {problem}. Check the image "
                    f"{self._resolved()['image']!r} and its pull policy and secret."
                )
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = driver.unschedulable(pod) or f"phase {(pod.get('status') or {}).get('phase')}"
                raise SandboxTerminalError(
                    f"Sandbox Pod {name} was not running {timeout:.0f}s after its creation in {self._where()} "
                    f"({waiting}). Give the cluster room for it (its CPU and memory requests), or a longer start_timeout."
                )
            stream = watch.Watch().stream(
                core.list_namespaced_pod,
                namespace,
                field_selector=f"metadata.name={name}",
                resource_version=pod["metadata"]["resourceVersion"],
                timeout_seconds=max(1, int(min(left, 60))),
            )
            try:
                for event in stream:
                    if event["type"] == "DELETED":
                        raise SandboxTerminalError(f"Sandbox Pod {name} was deleted while it started.")
                    pod = event["raw_object"]
                    if driver.is_running(pod) or driver.pod_problem(pod) is not None:
                        break
            except SandboxTerminalError:
                raise
            except Exception:  # an expired watch (410) or a dropped connection: read the Pod and watch again
                pod = self._read_pod(name, "watching the new sandbox Pod")
            finally:
                stream.close()
        return pod

    def _read_pod(self, name: str, doing: str) -> dict[str, Any]:
        core, _ = self._api()
        namespace = self._resolved()["namespace"]
        return self._json(
            self._call(doing, lambda: core.read_namespaced_pod(name, namespace, _preload_content=False), handle=name)
        )

    def _destroy(self, handle: str) -> None:
        # A sandbox that is gone (destroyed, or deleted by a sweep) is not an error.
        self._gone.add(handle)
        self._forget(handle)
        self._remove(handle, quietly=False)

    def _remove(self, handle: str, *, quietly: bool) -> None:
        """Delete the Pod and the NetworkPolicy named ``handle``; those already gone are fine."""
        from kubernetes.client.exceptions import ApiException

        core, _ = self._api()
        namespace = self._resolved()["namespace"]
        try:
            core.delete_namespaced_pod(handle, namespace, grace_period_seconds=1, _preload_content=False)
        except ApiException as err:
            if err.status != 404 and not quietly:
                raise self._api_error(err, f"deleting the Pod of sandbox {handle}", None) from err
            if err.status != 404:
                log.warning("Could not delete the Pod of sandbox %s: %s", handle, _api_message(err))
        except Exception:
            if not quietly:
                raise
            log.warning("Could not delete the Pod of sandbox %s", handle, exc_info=True)
        self._remove_policy(handle, quietly=quietly)

    def _remove_policy(self, handle: str, *, quietly: bool = True) -> None:
        """Delete the NetworkPolicy named ``handle``; one that is gone (or never was) is fine."""
        from kubernetes.client.exceptions import ApiException

        _, net = self._api()
        try:
            net.delete_namespaced_network_policy(handle, self._resolved()["namespace"], _preload_content=False)
        except ApiException as err:
            if err.status == 404:
                return
            if not quietly:
                raise self._api_error(err, f"deleting the NetworkPolicy of sandbox {handle}", None) from err
            log.warning("Could not delete the NetworkPolicy of sandbox %s: %s", handle, _api_message(err))
        except Exception:
            if not quietly:
                raise
            log.warning("Could not delete the NetworkPolicy of sandbox %s", handle, exc_info=True)

    def _forget(self, handle: str) -> None:
        self._pods.pop(handle, None)
        self._known_expiry.pop(handle, None)

    # -- exec plumbing (see commands) ----------------------------------------------------------------------

    def _running_pod(self, handle: str) -> dict[str, Any]:
        """The metadata of the sandbox's Pod, read once per handle; :raises SandboxTerminalError: unless it runs."""
        if handle in self._gone:
            raise SandboxTerminalError(f"Sandbox {handle} was destroyed; provision a new one.")
        meta = self._pods.get(handle)
        if meta is None:
            pod = self._read_pod(handle, f"reading sandbox {handle}")
            meta = pod["metadata"]
            if (meta.get("labels") or {}).get(driver.SANDBOX_LABEL) != handle:
                raise SandboxTerminalError(f"Pod {handle!r} was not created by this provider; it cannot be used.")
            if not driver.is_running(pod):
                raise SandboxTerminalError(
                    f"Sandbox {handle} is not running: {driver.pod_problem(pod) or 'it is ending'}."
                )
            self._pods[handle] = meta
        return meta

    def _ended(self, handle: str, *, settle: float = 0.0) -> str | None:
        """
        Why the sandbox can run nothing more (deleted, ended), or None while its Pod runs.

        :param settle: seconds to keep reading while the Pod still reads as running (default 0: one
            read). The kubelet kills the container at the Pod's deadline first and reports the Pod's
            end after, so an exec can end in a SIGKILL before the Pod reads as ended.
        """
        from kubernetes.client.exceptions import ApiException

        core, _ = self._api()
        namespace = self._resolved()["namespace"]
        until = time.monotonic() + settle
        while True:
            try:
                pod = self._json(core.read_namespaced_pod(handle, namespace, _preload_content=False))
            except ApiException as err:
                if err.status == 404:
                    return "its Pod was deleted"
                pod = None
            except Exception:  # the API server does not answer: nothing can be told yet
                pod = None
            if pod is not None and not driver.is_running(pod):
                return driver.pod_problem(pod) or "its Pod is being deleted"
            if time.monotonic() >= until:
                return None
            time.sleep(driver.ENDING_POLL_SECONDS)

    def _open_exec(self, handle: str, argv: list[str], *, stdin: bool) -> Any:
        """Open an exec in the sandbox's container (a client of its own: opening one swaps the client's request)."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException
        from kubernetes.stream import stream

        core, _ = self._api()
        api_client = client.ApiClient(core.api_client.configuration)
        try:
            return stream(
                client.CoreV1Api(api_client).connect_get_namespaced_pod_exec,
                handle,
                self._resolved()["namespace"],
                container=driver.CONTAINER,
                command=argv,
                stdin=stdin,
                stdout=True,
                stderr=True,
                tty=False,
                _preload_content=False,
                binary=True,
            )
        except ApiException as err:
            why = self._ended(handle)
            if why is not None:
                self._forget(handle)
                raise SandboxTerminalError(f"Sandbox {handle} has ended: {why}.") from err
            raise self._api_error(err, f"starting a program in sandbox {handle}", None) from err
        finally:
            api_client.close()

    # -- finding what is left ------------------------------------------------------------------------------

    def _list(self, selector: str, doing: str) -> list[dict[str, Any]]:
        core, _ = self._api()
        namespace = self._resolved()["namespace"]
        return self._json(
            self._call(
                doing, lambda: core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False)
            )
        )["items"]

    def find_sandboxes(self, stamps: Mapping[str, str]) -> dict[str, dict[str, str]]:
        """
        This provider's sandboxes in the namespace (running or ended, not those being deleted) whose
        stamps hold every item of ``stamps``, as ``{handle: stamps}``; ``{}`` for ``stamps`` finds all.
        """
        return {
            record.handle: dict(record.stamps)
            for record in self._pod_records(stamps)
            if all(record.stamps.get(key) == value for key, value in stamps.items())
        }

    def sandbox_records(self) -> list[SandboxRecord]:
        """
        Every sandbox of this provider in the namespace, with the Pod's phase as its state and the
        cluster's creationTimestamp as when it was made (set by the API server: the Pod cannot change it).
        """
        return sorted(self._pod_records({}), key=lambda record: record.handle)

    def _pod_records(self, stamps: Mapping[str, str]) -> list[SandboxRecord]:
        records = []
        for pod in self._list(driver.label_selector(stamps), "listing sandboxes"):
            meta = pod["metadata"]
            tags = {str(k): str(v) for k, v in (meta.get("annotations") or {}).items() if k.startswith("airflow_")}
            handle = (meta.get("labels") or {}).get(driver.SANDBOX_LABEL)
            if handle != meta["name"] or meta.get("deletionTimestamp"):
                continue
            phase = (pod.get("status") or {}).get("phase")
            made = driver.timestamp(meta.get("creationTimestamp")) or None  # 0: the API gave none
            records.append(SandboxRecord(handle, tags, phase.lower() if phase else None, made))
        return records

    def remove_expired(self, *, now: float | None = None) -> list[str]:
        """
        Delete this provider's sandboxes in the namespace that have ended (the cluster ended them at
        their lifetime, or their keeper ended) or are past their expiry stamp, and the NetworkPolicies
        left without a Pod; return the handles. Every ``create`` runs the same sweep first.

        :param now: the Unix time to judge expiry by; default the current time.
        """
        judged = time.time() if now is None else now
        pods = self._list(driver.label_selector(), "listing sandboxes")
        alive = {p["metadata"]["name"] for p in pods}
        removed = []
        for pod in pods:
            meta, phase = pod["metadata"], (pod.get("status") or {}).get("phase")
            expires = expiry_of(meta.get("annotations") or {})
            if meta.get("deletionTimestamp") or not (
                phase in ("Failed", "Succeeded") or (expires and expires <= judged)
            ):
                continue
            self._remove(meta["name"], quietly=True)
            log.info("Removed Kubernetes sandbox %s (%s)", meta["name"], phase if phase != "Running" else "expired")
            removed.append(meta["name"])
        _, net = self._api()
        namespace = self._resolved()["namespace"]
        policies = self._json(
            self._call(
                "listing sandbox NetworkPolicies",
                lambda: net.list_namespaced_network_policy(
                    namespace, label_selector=driver.label_selector(), _preload_content=False
                ),
            )
        )["items"]
        for policy in policies:
            # A policy is made before its Pod: one without a Pod is left over only once no create can
            # still be on its way to making the Pod.
            name, made = policy["metadata"]["name"], driver.timestamp(policy["metadata"].get("creationTimestamp"))
            if name in alive or not self.handle_pattern.fullmatch(name) or judged - made < ORPHAN_POLICY_GRACE:
                continue
            self._remove_policy(name)
            removed.append(name)
        return sorted(set(removed))

    def _sweep_namespace(self) -> None:
        """What every create does first; a failure to sweep never stops the create."""
        try:
            self.remove_expired()
        except (SandboxError, ValueError):
            log.warning("Could not sweep ended Kubernetes sandboxes in %s", self._where(), exc_info=True)

    def _remaining_lifetime(self, handle: str) -> float | None:
        expires = self._known_expiry.get(handle)
        if expires is None:
            expires = expiry_of(self._running_pod(handle).get("annotations") or {})
            if expires is None:
                return None
            self._known_expiry[handle] = expires
        return expires - time.time()

    # -- connection test ---------------------------------------------------------------------------------

    def _may(self, namespace: str, resource: Mapping[str, str], verb: str, group: str) -> bool:
        """Whether this identity may ``verb`` the ``resource`` in ``namespace`` (a SelfSubjectAccessReview)."""
        from kubernetes import client

        core, _ = self._api()
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": {"namespace": namespace, "verb": verb, "group": group, **resource}},
        }
        authz = client.AuthorizationV1Api(core.api_client)
        answer = self._call("checking permissions", lambda: authz.create_self_subject_access_review(review))
        return bool(answer.status.allowed)

    def _check_connection(self) -> str:
        """Ask the API server its version and whether this identity may do what sandboxes need (nothing is created)."""
        from kubernetes import client

        core, _ = self._api()
        namespace = self._resolved()["namespace"]
        version = self._call("reading the server version", lambda: client.VersionApi(core.api_client).get_code())
        missing = [
            driver.permission_text(resource, verb)
            for resource, verb, group in driver.NEEDED_PERMISSIONS
            if not self._may(namespace, resource, verb, group)
        ]
        if missing:
            raise SandboxTerminalError(
                f"Kubernetes {version.git_version} answered, but this identity may not {', '.join(missing)} in "
                f"{self._where()}; bind it to the Role in sandbox_provider/hooks/kubernetes/rbac.yaml there."
            )
        return f"Kubernetes {version.git_version} answered; this identity may run sandboxes in {self._where()}."


def _api_message(err: Any) -> str:
    """The message of an API error's Status body, else its reason."""
    try:
        return str(json.loads(err.body).get("message") or err.reason)
    except (TypeError, ValueError, AttributeError):
        return str(getattr(err, "reason", err))


#: The same class, under the name the public sandbox guide uses for backends.
KubernetesSandboxBackend = KubernetesSandboxHook
