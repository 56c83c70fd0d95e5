"""The Kubernetes backend's plain functions: the Pod and NetworkPolicy it would send, with no cluster."""

from __future__ import annotations

import pytest

from sandbox_provider.hooks.kubernetes import KubernetesSandboxHook, driver
from sandbox_provider.sandbox.spec import OWNER_TAG


def settings(**changes):
    values = {
        "image": "python:3.12-slim",
        "image_pull_policy": "IfNotPresent",
        "image_pull_secret": None,
        "cpus": 2.0,
        "cpu_request": 0.25,
        "memory_bytes": 2 * 1024**3,
        "memory_request_bytes": 512 * 1024**2,
        "disk_bytes": 5 * 1024**3,
        "sandbox_uid": 1234,
        "read_only_root": False,
        "runtime_class_name": None,
        "node_selector": None,
        "tolerations": None,
    }
    values.update(changes)
    return values


def test_scheduling_and_runtime_settings_reach_the_pod_spec():
    tolerations = [{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}]
    pod = driver.pod_manifest(
        "airflow-sandbox-0123456789ab",
        settings(
            runtime_class_name="gvisor",
            node_selector={"pool": "sandboxes"},
            tolerations=tolerations,
            image_pull_secret="registry",
            read_only_root=True,
        ),
        workdir="/workspace",
        lifetime=90.2,
        stamps={OWNER_TAG: "dag/run"},
        env={"A": "1"},
    )
    spec, container = pod["spec"], pod["spec"]["containers"][0]
    assert spec["runtimeClassName"] == "gvisor" and spec["nodeSelector"] == {"pool": "sandboxes"}
    assert spec["tolerations"] == tolerations and spec["imagePullSecrets"] == [{"name": "registry"}]
    assert spec["activeDeadlineSeconds"] == 91
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["resources"] == {
        "limits": {"cpu": "2000m", "memory": str(2 * 1024**3), "ephemeral-storage": str(5 * 1024**3)},
        "requests": {"cpu": "250m", "memory": str(512 * 1024**2), "ephemeral-storage": str(5 * 1024**3)},
    }
    assert container["env"] == [{"name": "HOME", "value": "/workspace"}, {"name": "A", "value": "1"}]
    assert pod["metadata"]["annotations"] == {OWNER_TAG: "dag/run"}
    assert pod["metadata"]["labels"]["airflow-sandbox/owner"] == driver.label_value("dag/run")
    # Without them, none of those fields is sent.
    plain = driver.pod_manifest("airflow-sandbox-0", settings(), workdir="/w", lifetime=5, stamps={}, env=None)
    assert not {"runtimeClassName", "nodeSelector", "tolerations", "imagePullSecrets"} & set(plain["spec"])


def test_requests_never_exceed_limits_and_labels_fit_kubernetes():
    pod = driver.pod_manifest(
        "airflow-sandbox-0",
        settings(cpu_request=4.0, memory_request_bytes=8 * 1024**3),
        workdir="/w",
        lifetime=5,
        stamps={},
        env=None,
    )
    requests = pod["spec"]["containers"][0]["resources"]["requests"]
    assert requests["cpu"] == "2000m" and requests["memory"] == str(2 * 1024**3)
    assert driver.label_value("my_dag") == "my_dag"
    hashed = driver.label_value("manual__2026-01-01T00:00:00+00:00")
    assert hashed.startswith("h-") and len(hashed) <= 63


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("node_selector", "{not json", "must be JSON"),
        ("node_selector", {"a": 1}, "must map node label names"),
        ("tolerations", [{"key": "a", "colour": "red"}], "list of tolerations"),
    ],
)
def test_scheduling_settings_are_checked_when_the_hook_is_built(where, value, message):
    with pytest.raises(ValueError, match=message):
        KubernetesSandboxHook(None, **{where: value})
