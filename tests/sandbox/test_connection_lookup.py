"""
Every backend with a connection type of its own reads it one way (``SandboxHook.connection_or_none``):
a missing named connection is an error that says what to do; a missing default one means defaults,
and is asked for once per worker process.
"""

from __future__ import annotations

import pytest

from sandbox_provider.hooks import HOOK_CLASSES, hook_class
from sandbox_provider.sandbox import SandboxTerminalError

#: The backends on a connection type of this provider (Modal and Kubernetes use their providers' own).
OWN_TYPES = [
    path for path in HOOK_CLASSES if path.rsplit(":", 1)[1] not in ("ModalSandboxHook", "KubernetesSandboxHook")
]


def _hook(path: str, conn_id: str | None = None):
    cls = hook_class(path)
    return cls(**({cls.conn_name_attr: conn_id} if conn_id else {}))


@pytest.mark.parametrize("path", OWN_TYPES, ids=lambda path: path.rsplit(":", 1)[1])
def test_a_missing_named_connection_says_how_to_define_it_or_leave_it_out(path):
    hook = _hook(path, "no_such_connection_here")
    if path.endswith("LocalSandboxHook"):  # the local backend raises Airflow's own error
        from airflow.exceptions import AirflowNotFoundException

        with pytest.raises(AirflowNotFoundException):
            hook._resolved()
        return
    with pytest.raises(SandboxTerminalError) as info:
        hook._resolved()
    text = str(info.value)
    assert "'no_such_connection_here' does not exist" in text, text
    assert f"type {hook.conn_type}" in text and f"leave {hook.conn_name_attr} unset to use" in text, text


@pytest.mark.parametrize("path", OWN_TYPES, ids=lambda path: path.rsplit(":", 1)[1])
def test_a_missing_default_connection_means_defaults_and_is_asked_for_once(path, monkeypatch, connection_lookups):
    cls = hook_class(path)
    monkeypatch.delenv(f"AIRFLOW_CONN_{cls.default_conn_name.upper()}", raising=False)
    for key in ("BOAT_API_KEY", "ISLO_API_KEY"):  # what the hosted backends need without a connection
        monkeypatch.setenv(key, "test-key")
    for named in (None, cls.default_conn_name, None):  # naming the default one is the same as leaving it out
        assert isinstance(_hook(path, named)._resolved(), dict)
    assert connection_lookups == [cls.default_conn_name]
