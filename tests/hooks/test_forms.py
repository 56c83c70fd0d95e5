"""The connection forms come from the backends' settings tables, and match what each hook reads."""

from __future__ import annotations

import pytest

from sandbox_provider import get_provider_info as provider_info
from sandbox_provider.get_provider_info import PORT_FOR_TEST_BUTTON, connection_forms, ui_field_behaviour
from sandbox_provider.hooks import hook_class
from sandbox_provider.sandbox.settings import Setting

FORMS = {form.conn_type: (path, form) for path, form in connection_forms()}
#: What a hook may resolve from the standard connection fields besides its settings (Docker: daemon
#: and registry; servers and hosted services: address and API key).
STANDARD = {"host", "login", "password", "port", "schema", "api_key", "domain", "protocol"}


def test_local_and_docker_have_forms():
    assert {"sandbox_local", "sandbox_docker"} <= set(FORMS)


@pytest.mark.parametrize("conn_type", sorted(FORMS))
def test_every_field_has_a_label_and_help_with_its_default_and_unit(conn_type):
    _, form = FORMS[conn_type]
    fields = form.settings.form_fields()
    for setting in form.settings:
        field = fields[setting.name]
        assert field["label"] and field["label"] != setting.name, setting.name
        assert "Default" in field["description"], f"{setting.name}: {field['description']}"
        if setting.unit:
            assert setting.unit in f"{field['label']} {field['description']}", setting.name


def _sample(setting: Setting, tmp_path):
    """A valid value for ``setting`` that no default has, as the form would store it."""
    if setting.kind is bool:
        return not setting.default
    if setting.kind is list:
        return [8443, 443]
    if setting.kind is dict:
        return {"mirror.probe.example": ["10.1.2.3", "10.1.2.4"]}
    if setting.choices:
        return next(c for c in setting.choices if c != setting.default)
    if setting.kind is str:
        if setting.name in ("image", "state_root", "uid_lease_dir") and setting.default is None:
            path = tmp_path / setting.name  # local: directories on the worker
            path.mkdir()
            return str(path)
        if setting.name.endswith("url"):
            return "https://probe.example.com"
        return f"probe-{setting.name}"
    low = setting.minimum if setting.minimum is not None else 1
    return int(low) + 7 if setting.kind is int else low + 2.5


@pytest.mark.parametrize("conn_type", sorted(FORMS))
def test_every_setting_the_hook_reads_has_a_field_and_every_field_is_read(conn_type, add_connection, tmp_path):
    path, form = FORMS[conn_type]
    fields = form.settings.form_fields()
    # Nothing is read from the connection without a field: every setting of the table has one.
    assert set(fields) == set(form.settings.names)
    extra = {name: _sample(form.settings[name], tmp_path) for name in fields}
    # A backend of a server needs its address in the standard fields.
    conn_id = add_connection(
        f"{conn_type}_form_probe", conn_type, extra=extra, host="127.0.0.1", port=8080, password="probe-key"
    )
    module, _, name = path.rpartition(".")
    cls = hook_class(f"{module}:{name}")
    resolved = cls(**{cls.conn_name_attr: conn_id})._resolved()
    # Every setting the hook resolved is a field, and every field's value reached the hook.
    assert set(resolved) - STANDARD == set(fields), set(resolved) ^ set(fields)
    # A list or dict extra reaches the hook in the shape it uses (tuples), as its setting checks it.
    assert {name: resolved[name] for name in fields} == {
        name: form.settings[name].check(value, name) for name, value in extra.items()
    }


def test_the_port_is_shown_for_the_test_button_only_where_airflow_needs_it(monkeypatch):
    behaviour = {"hidden-fields": ["host", "port"], "relabeling": {"host": "Daemon"}}
    monkeypatch.setattr(provider_info, "port_needed_by_test_button", lambda: False)
    assert ui_field_behaviour(behaviour) == behaviour
    monkeypatch.setattr(provider_info, "port_needed_by_test_button", lambda: True)
    shown = ui_field_behaviour(behaviour)
    assert shown["hidden-fields"] == ["host"]
    assert shown["relabeling"] == {"host": "Daemon", "port": PORT_FOR_TEST_BUTTON}
    assert shown["placeholders"] == {"port": "0"}
    assert behaviour == {"hidden-fields": ["host", "port"], "relabeling": {"host": "Daemon"}}


def test_provider_info_gives_airflow_the_table_fields():
    info = {entry["connection-type"]: entry for entry in provider_info.get_provider_info()["connection-types"]}
    for conn_type, (_, form) in FORMS.items():
        # The backend's settings, then the task settings every sandbox connection offers (log_output, ...).
        assert info[conn_type]["conn-fields"] == form.form_fields()
        assert list(form.form_fields())[: len(form.settings.form_fields())] == list(form.settings.form_fields())
        assert info[conn_type]["ui-field-behaviour"] == ui_field_behaviour(form.ui_behaviour)
