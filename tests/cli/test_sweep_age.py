"""
``sweep(older_than=...)`` on the backends whose records carry when a sandbox was made from the
worker's side (local: the worker's record beside the box) or the cluster's (Kubernetes: the Pod's
creationTimestamp): of two sandboxes made a moment apart, a dry run removes nothing, and the sweep
removes the older and keeps the younger, although neither is past its lifetime.
"""

from __future__ import annotations

import time

import pytest

from conftest import requires_bwrap
from sandbox_provider.cli import sweep as api
from sandbox_provider.sandbox.spec import SandboxSpec


def check_by_age(hook, spec: SandboxSpec) -> None:
    older = hook.create(spec=spec)
    younger = None
    try:
        time.sleep(2.2)  # the cluster records whole seconds
        younger = hook.create(spec=spec)
        records = {record.handle: record for record in hook.sandbox_records()}
        made_older, made_younger = records[older].created_at, records[younger].created_at
        assert made_older is not None and made_younger is not None
        assert made_younger - made_older >= 1.0
        now = time.time()
        # Older than the midpoint's age: the first sandbox only. Neither is past its lifetime.
        threshold = now - (made_older + made_younger) / 2
        assert not any(records[h].expired(now) for h in (older, younger))
        # Control: without older_than, nothing of either is a leftover.
        assert not {leftover.record.handle for leftover in api.sweep([hook], now=now).removed} & {older, younger}

        dry = api.sweep([hook], older_than=threshold, dry_run=True, now=now)
        assert older in {leftover.record.handle for leftover in dry.removed}
        assert {older, younger} <= {record.handle for record in hook.sandbox_records()}

        report = api.sweep([hook], older_than=threshold, now=now)
        removed = {leftover.record.handle for leftover in report.removed}
        assert older in removed and younger not in removed, report
        assert {record.handle for record in hook.sandbox_records()} & {older, younger} == {younger}
    finally:
        for handle in (older, younger):
            if handle is not None:
                hook.destroy(handle)


@requires_bwrap
def test_local_sandboxes_are_swept_by_age(tmp_path):
    from sandbox_provider.hooks.local import LocalSandboxHook

    check_by_age(LocalSandboxHook(state_root=str(tmp_path / "sandboxes")), SandboxSpec())


def test_kubernetes_sandboxes_are_swept_by_age(kubernetes_conn):
    from sandbox_provider.hooks.kubernetes import KubernetesSandboxHook

    check_by_age(KubernetesSandboxHook(kubernetes_conn), SandboxSpec())


def test_a_local_sandbox_made_before_its_time_was_recorded_is_never_judged_by_age(tmp_path):
    pytest.importorskip("sandbox_provider.hooks.local")
    from sandbox_provider.hooks.local import state

    box = tmp_path / "sandboxes" / "airflow-sandbox-000000000001"
    box.mkdir(parents=True)
    (box / state.RECORD).write_text('{"stamps": {}, "env": {}, "limits": {}}')
    assert "created_at" not in state.read_record(str(box))
