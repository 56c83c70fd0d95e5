"""The OpenShell hook's policy and readback rules, on the SDK's real protobuf messages."""

from __future__ import annotations

import pytest

pytest.importorskip("openshell")

from openshell._proto import sandbox_pb2  # noqa: E402

from sandbox_provider.hooks.openshell import driver  # noqa: E402

HOSTS = ["files.pythonhosted.org", "pypi.org"]


def admitted(policy) -> sandbox_pb2.GetSandboxConfigResponse:
    return sandbox_pb2.GetSandboxConfigResponse(
        policy=policy, policy_source=sandbox_pb2.POLICY_SOURCE_SANDBOX, configuration_admitted=True
    )


def test_deny_all_policy_has_no_network_rule_but_is_not_empty():
    policy = driver.sandbox_policy([], "/sandbox")
    assert not policy.network_policies
    assert policy.landlock.compatibility == "hard_requirement"
    assert "/sandbox" in policy.filesystem.read_write and "/usr" in policy.filesystem.read_only
    assert driver.policy_problem(admitted(policy), []) is None


def test_hosts_become_one_rule_on_port_443_for_any_binary():
    policy = driver.sandbox_policy(HOSTS, "/sandbox")
    (rule,) = policy.network_policies.values()
    assert [(e.host, e.port) for e in rule.endpoints] == [(h, 443) for h in HOSTS]
    assert [b.path for b in rule.binaries] == ["/**"]
    assert driver.policy_problem(admitted(policy), HOSTS) is None


def test_spec_carries_image_limits_environment_and_policy():
    policy = driver.sandbox_policy([], "/sandbox")
    spec = driver.sandbox_spec(image="img:1", cpu="1", memory="2Gi", env={"A": "b"}, policy=policy)
    assert spec.template.image == "img:1"
    assert dict(spec.template.resources["limits"]) == {"cpu": "1", "memory": "2Gi"}
    assert dict(spec.environment) == {"A": "b"} and spec.policy == policy


def drifted(change, hosts=()):
    config = admitted(driver.sandbox_policy(list(hosts), "/sandbox"))
    change(config)
    return driver.policy_problem(config, list(hosts))


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda c: setattr(c, "policy_source", sandbox_pb2.POLICY_SOURCE_GLOBAL), "gateway-wide policy"),
        (lambda c: setattr(c, "configuration_admitted", False), "not admitted"),
        (lambda c: setattr(c.policy.landlock, "compatibility", "best_effort"), "best_effort"),
        (
            lambda c: c.policy.network_middlewares["m"].CopyFrom(sandbox_pb2.NetworkMiddlewareConfig(name="m")),
            "middlewares",
        ),
        (lambda c: c.supervisor_middleware_services.add(), "middlewares"),
        (lambda c: c.policy.network_policies["x"].endpoints.add(host="evil.example", port=443), "evil.example:443"),
        (lambda c: c.policy.network_policies["x"].binaries.add(path="/usr/bin/curl"), "(any host)"),
        (
            lambda c: c.settings["proposal_approval_mode"].value.CopyFrom(
                sandbox_pb2.SettingValue(string_value="auto")
            ),
            "proposals",
        ),
        (
            lambda c: c.settings["agent_policy_proposals"].value.CopyFrom(sandbox_pb2.SettingValue(bool_value=True)),
            "propose",
        ),
    ],
)
def test_every_drift_from_deny_all_is_named(change, says):
    assert says in (drifted(change) or "")


def endpoint(config):
    return config.policy.network_policies[driver.EGRESS_RULE].endpoints[0]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda c: setattr(endpoint(c), "port", 80), "files.pythonhosted.org:80"),
        (lambda c: endpoint(c).ports.append(8443), "443,8443"),
        (lambda c: endpoint(c).allowed_ips.append("10.0.0.0/8"), "10.0.0.0/8"),
        (lambda c: setattr(endpoint(c), "host", "*.pythonhosted.org"), "*.pythonhosted.org"),
        (lambda c: setattr(endpoint(c), "enforcement", sandbox_pb2.NETWORK_ENFORCEMENT_MODE_AUDIT), "audits"),
        (
            lambda c: c.policy.network_policies[driver.EGRESS_RULE].binaries[0].__setattr__("path", "/usr/bin/python3"),
            "instead of",
        ),
        (lambda c: c.policy.network_policies.pop(driver.EGRESS_RULE), "no destination"),
    ],
)
def test_every_drift_from_a_host_list_is_named(change, says):
    assert says in (drifted(change, ["files.pythonhosted.org", "pypi.org"]) or "")


def test_supervisor_owned_variables():
    env = {
        "HTTPS_PROXY": "x",
        "no_proxy": "y",
        "SSL_CERT_FILE": "z",
        "OPENSHELL_TOKEN": "t",
        "openshell_x": "u",
        "OK": "1",
    }
    assert driver.supervisor_env_names(env) == [
        "HTTPS_PROXY",
        "OPENSHELL_TOKEN",
        "SSL_CERT_FILE",
        "no_proxy",
        "openshell_x",
    ]


def test_labels_carry_the_sweep_marker_expiry_and_a_label_safe_trace():
    stamps = {
        "airflow_expires_at": "1900000000",
        "airflow_network": '{"block_network": true}',
        "airflow_workdir": "/sandbox",
        "airflow_dag_id": "my_dag",
        "airflow_run_id": "manual__2026-10-27T21:17:09.931899+00:00",
    }
    labels = driver.labels(stamps, 1900000000.0)
    assert labels["managed-by"] == "airflow-sandbox" and labels["airflow-expires-at"] == "1900000000"
    assert labels["airflow-dag-id"] == "my_dag"
    assert labels["airflow-run-id"] == "manual__2026-10-27T21_17_09.931899_00_00"
    assert "airflow-network" not in labels and "airflow-workdir" not in labels


@pytest.mark.parametrize(
    ("host", "port", "tls", "expected"),
    [
        ("gw.example", None, True, ("gw.example:443", True)),
        ("gw.example", 8080, False, ("gw.example:8080", False)),
        ("gw.example:9000", None, False, ("gw.example:9000", False)),
        ("https://gw.example", None, False, ("gw.example:443", True)),
        ("http://127.0.0.1:5000", None, False, ("127.0.0.1:5000", False)),
    ],
)
def test_endpoint(host, port, tls, expected):
    assert driver.endpoint(host, port, tls) == expected
