"""
The test cluster of ``scripts/kubernetes/prepare.sh`` itself: a pod from the sandbox image runs under
the restricted security context, exec reports exit statuses on its status channel, and the kubelet's
writes to kernel settings stay in its own mount namespace.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid

import pytest

from conftest import KUBERNETES_STATE

#: What the kubelet sets these to (pkg/kubelet/cm, setupKernelTunables), where the host differs.
KUBELET_WANTS = {"vm/overcommit_memory": "1", "kernel/panic": "10", "kernel/panic_on_oops": "1"}
IMAGE = os.environ.get("SANDBOX_DOCKER_IMAGE", "airflow-sandbox-python:bookworm")


@pytest.fixture
def pod(kubernetes_cluster):
    from kubernetes import client

    name = f"cluster-check-{uuid.uuid4().hex[:8]}"
    body = client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(
            restart_policy="Never",
            automount_service_account_token=False,
            security_context=client.V1PodSecurityContext(
                run_as_non_root=True, run_as_user=65432, seccomp_profile=client.V1SeccompProfile(type="RuntimeDefault")
            ),
            containers=[
                client.V1Container(
                    name="main",
                    image=IMAGE,
                    image_pull_policy="Never",
                    command=["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"],
                    security_context=client.V1SecurityContext(
                        allow_privilege_escalation=False, capabilities=client.V1Capabilities(drop=["ALL"])
                    ),
                )
            ],
        ),
    )
    kubernetes_cluster.create_namespaced_pod("default", body)
    try:
        deadline = time.monotonic() + 60
        while kubernetes_cluster.read_namespaced_pod(name, "default").status.phase != "Running":
            assert time.monotonic() < deadline, "the pod did not reach Running within 60 s"
            time.sleep(0.2)
        yield name
    finally:
        kubernetes_cluster.delete_namespaced_pod(name, "default", grace_period_seconds=1)


def exec_in(api, pod: str, argv: list[str]) -> tuple[dict[int, bytes], dict]:
    """Run ``argv`` in the pod; return its output by channel and the status channel's JSON."""
    from kubernetes.stream import stream
    from websocket import ABNF

    ws = stream(
        api.connect_get_namespaced_pod_exec,
        pod,
        "default",
        command=argv,
        stdout=True,
        stderr=True,
        stdin=False,
        tty=False,
        _preload_content=False,
        binary=True,
    )
    channels: dict[int, bytes] = {}
    while True:
        opcode, frame = ws.sock.recv_data_frame(True)
        if opcode == ABNF.OPCODE_CLOSE:
            break
        if frame.data:
            channels[frame.data[0]] = channels.get(frame.data[0], b"") + frame.data[1:]
    ws.close()
    return channels, json.loads(channels.get(3, b"{}"))


def test_a_restricted_pod_runs_and_exec_reports_its_status(kubernetes_cluster, pod):
    channels, status = exec_in(kubernetes_cluster, pod, ["sh", "-c", "id -u; echo err >&2; exit 3"])
    assert channels[1] == b"65432\n" and channels[2] == b"err\n"
    assert status["reason"] == "NonZeroExitCode"
    assert status["details"]["causes"] == [{"reason": "ExitCode", "message": "3"}]
    channels, status = exec_in(
        kubernetes_cluster, pod, ["sh", "-c", "grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/1/status"]
    )
    assert status == {"metadata": {}, "status": "Success"}
    assert channels[1].split() == [b"CapEff:", b"0000000000000000", b"NoNewPrivs:", b"1", b"Seccomp:", b"2"]


def test_the_kubelets_kernel_settings_stay_in_its_mount_namespace(kubernetes_cluster):
    pid = open(os.path.join(KUBERNETES_STATE, "run", "kubelet.pid")).read().strip()
    for setting, wanted in KUBELET_WANTS.items():
        recorded = open(os.path.join(KUBERNETES_STATE, "kernel-settings", "host", setting.replace("/", "."))).read()
        if recorded.strip() == wanted:
            continue  # the host already has the kubelet's value: nothing to tell apart
        # What the kubelet sees: the value it wrote (the positive control that it did write).
        seen = subprocess.run(
            ["nsenter", "-t", pid, "-m", "cat", f"/proc/sys/{setting}"], capture_output=True, text=True, check=True
        ).stdout
        assert seen.strip() == wanted
        # What the machine has: its own value, as it was before the cluster started.
        assert open(f"/proc/sys/{setting}").read() == recorded
