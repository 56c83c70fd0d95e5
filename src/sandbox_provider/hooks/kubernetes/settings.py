"""
The Kubernetes backend's settings: hook arguments, or extras of the cncf provider's ``kubernetes``
connection (which has no form of ours: its form is that provider's), hook arguments first.
"""

from __future__ import annotations

import re

from sandbox_provider.sandbox.settings import Setting, SettingsTable

__all__ = ["CONNECTION_EXTRAS", "DEFAULT_IMAGE", "ENV_NAME", "SETTINGS"]

DEFAULT_IMAGE = "python:3.12-slim"
#: The user (and group) id a sandbox's processes run as: one no account of a common image has.
DEFAULT_SANDBOX_UID = 65432
#: The ranges a cluster's pods and services commonly use, excepted from wider allowlisted ranges.
DEFAULT_CLUSTER_CIDRS = "10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,100.64.0.0/10"
#: The connection extras of the cncf provider's ``kubernetes`` type, which its hook reads, not ours.
CONNECTION_EXTRAS = frozenset(
    {
        "in_cluster",
        "kube_config_path",
        "kube_config",
        "cluster_context",
        "disable_verify_ssl",
        "disable_tcp_keepalive",
        "xcom_sidecar_container_image",
        "xcom_sidecar_container_resources",
        "xcom_sidecar_container_security_context",
        "node_selector",
        "tolerations",
    }
)
ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")

SETTINGS = SettingsTable(
    Setting("namespace", str, "default", label="Namespace", help="Namespace the sandbox Pods are created in."),
    Setting(
        "image",
        str,
        DEFAULT_IMAGE,
        label="Image",
        help="Image the sandboxes run; it needs sh, sleep, coreutils timeout and GNU tar, and must run as a "
        "non-root user id (sandbox_uid).",
    ),
    Setting(
        "image_pull_policy",
        str,
        "IfNotPresent",
        label="Image pull policy",
        help="When the kubelet pulls the image.",
        choices=("IfNotPresent", "Always", "Never"),
    ),
    Setting(
        "image_pull_secret",
        str,
        label="Image pull secret",
        help="A Secret in the namespace to pull the image with.",
        default_text="none",
    ),
    Setting("cpus", float, 1.0, label="CPU limit", help="CPUs per sandbox; fractions allowed.", minimum=0.001),
    Setting(
        "cpu_request",
        float,
        0.1,
        label="CPU request",
        help="CPUs the scheduler reserves per sandbox (at most the limit).",
        minimum=0.001,
    ),
    Setting(
        "memory_bytes",
        int,
        1024**3,
        label="Memory limit (bytes)",
        help="Memory per sandbox; past it the kernel kills the largest process.",
        unit="bytes",
        minimum=16 * 1024 * 1024,
    ),
    Setting(
        "memory_request_bytes",
        int,
        256 * 1024 * 1024,
        label="Memory request (bytes)",
        help="Memory the scheduler reserves per sandbox (at most the limit); equal to the limit, with the CPU "
        "request equal to its limit, makes the Pod Guaranteed.",
        unit="bytes",
        minimum=4 * 1024 * 1024,
    ),
    Setting(
        "disk_bytes",
        int,
        1024**3,
        label="Disk limit (bytes)",
        help="Ephemeral storage per sandbox: the workdir, /tmp and the container's own writes together; the "
        "kubelet evicts a sandbox past it.",
        unit="bytes",
        minimum=1024 * 1024,
    ),
    Setting(
        "sandbox_timeout",
        float,
        3600,
        label="Sandbox lifetime (seconds)",
        help="Seconds a sandbox may live (the Pod's activeDeadlineSeconds); the cluster ends it then.",
        unit="seconds",
        minimum=1,
    ),
    Setting(
        "sandbox_uid",
        int,
        DEFAULT_SANDBOX_UID,
        label="User id",
        help="User and group id of the sandbox's processes; never root.",
        minimum=1,
        maximum=2**31 - 2,
    ),
    Setting(
        "read_only_root",
        bool,
        False,
        label="Read-only root filesystem",
        help="Mount the image read-only: only the workdir and /tmp can be written.",
    ),
    Setting(
        "runtime_class_name",
        str,
        label="Runtime class",
        help="A RuntimeClass of the cluster (gVisor, Kata) to run sandboxes under.",
        default_text="the cluster's default runtime",
    ),
    Setting(
        "network_policy_enforced",
        bool,
        False,
        label="The cluster enforces NetworkPolicy",
        help="Declare that the cluster's network plugin enforces NetworkPolicy (Calico, Cilium, ...); without "
        "it a spec that blocks or narrows the network is refused, since the API cannot tell.",
    ),
    Setting(
        "cluster_cidrs",
        str,
        DEFAULT_CLUSTER_CIDRS,
        label="Cluster address ranges",
        help="Comma-separated ranges of the cluster's own pods, services and nodes: a wider range in "
        "allow_egress_to_cidrs does not open them unless they are named.",
    ),
    Setting(
        "start_timeout",
        float,
        300,
        label="Start timeout (seconds)",
        help="Seconds a new sandbox may take to be scheduled, pulled and started.",
        unit="seconds",
        minimum=1,
    ),
)
