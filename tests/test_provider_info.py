"""The provider registers with Airflow the way Airflow reads it."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path

import jsonschema
import pytest
from packaging.utils import canonicalize_name

from sandbox_provider.get_provider_info import get_provider_info


def test_matches_airflows_schema_and_distribution_name():
    import airflow

    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    info = get_provider_info()
    jsonschema.validate(info, schema)
    assert info["package-name"] == canonicalize_name(importlib.metadata.metadata("airflow-provider-sandbox")["Name"])


def test_entry_point_is_registered():
    points = importlib.metadata.entry_points(group="apache_airflow_provider")
    assert any(p.value == "sandbox_provider.get_provider_info:get_provider_info" for p in points)


def test_every_dotted_path_imports_and_hooks_agree():
    info = get_provider_info()
    for conn in info["connection-types"]:
        module, _, name = conn["hook-class-name"].rpartition(".")
        hook = getattr(importlib.import_module(module), name)
        assert hook.conn_type == conn["connection-type"]
        assert hook.conn_name_attr and hook.hook_name
        assert hasattr(hook, "test_connection")
    for decorator in info["task-decorators"]:
        module, _, name = decorator["class-name"].rpartition(".")
        assert callable(getattr(importlib.import_module(module), name))


def test_airflow_finds_the_decorator_and_hooks():
    from airflow.sdk import task
    from airflow.sdk.providers_manager_runtime import ProvidersManagerTaskRuntime

    assert callable(task.sandbox)
    hooks = ProvidersManagerTaskRuntime().hooks
    assert hooks["sandbox_local"].hook_class_name == "sandbox_provider.hooks.local.LocalSandboxHook"
    assert hooks["sandbox_local"].connection_testable


def test_form_fields_and_the_settings_hooks_read_are_one_list():
    from sandbox_provider.get_provider_info import connection_forms
    from sandbox_provider.hooks import hook_class

    forms = connection_forms()
    assert {form.conn_type for _, form in forms} == {"sandbox_local", "sandbox_docker"} | {
        form.conn_type for _, form in forms
    }
    for path, form in forms:
        module, _, name = path.rpartition(".")
        cls = hook_class(f"{module}:{name}")
        assert cls.settings is form.settings and cls.conn_type == form.conn_type
        fields = form.settings.form_fields()
        assert set(fields) == {s.name for s in form.settings if s.form}
        for field in fields.values():
            assert field["label"] and field["description"], field
        hook = cls()
        assert set(hook._args) <= set(form.settings.names)
        # What the hook reads is recorded where it reads it: a name outside the table (and the standard fields
        # the hook adds) is refused at once, and every setting of the table is read while the contract battery
        # runs (tests/contract/battery.py checks it).
        values = form.settings.resolve({}, {})
        with pytest.raises(KeyError, match="is no setting of this backend"):
            values.get("no_such_setting")


def test_a_backend_that_reads_the_port_keeps_its_label(monkeypatch):
    import sandbox_provider.get_provider_info as info

    monkeypatch.setattr(info, "port_needed_by_test_button", lambda: True)
    shown = info.ui_field_behaviour({"hidden-fields": ["schema"], "relabeling": {"port": "Gateway port"}})
    assert shown["relabeling"]["port"] == "Gateway port"
    hidden = info.ui_field_behaviour({"hidden-fields": ["port", "schema"]})
    assert hidden["relabeling"]["port"] == info.PORT_FOR_TEST_BUTTON and "port" not in hidden["hidden-fields"]


def test_the_deferrable_default_and_the_trigger_are_registered(monkeypatch):
    from airflow.configuration import conf

    info = get_provider_info()
    option = info["config"]["sandbox"]["options"]["default_deferrable"]
    assert option["type"] == "boolean" and option["default"] == "False"
    assert conf.getboolean("sandbox", "default_deferrable") is False  # Airflow reads the provider's default
    monkeypatch.setenv("AIRFLOW__SANDBOX__DEFAULT_DEFERRABLE", "true")
    assert conf.getboolean("sandbox", "default_deferrable") is True
    deployment = info["config"]["sandbox"]["options"]["deployment"]
    assert deployment["type"] == "string" and deployment["default"] == ""
    monkeypatch.delenv("AIRFLOW__SANDBOX__DEPLOYMENT", raising=False)  # conftest.py names one per test worker
    assert conf.get("sandbox", "deployment") == ""
    (trigger,) = info["triggers"]
    for module in trigger["python-modules"]:
        assert hasattr(importlib.import_module(module), "SandboxCommandTrigger")
