"""Test settings: a private AIRFLOW_HOME with an SQLite database, set before Airflow is imported."""

from __future__ import annotations

import os
import tempfile

#: This process's Airflow home: the one SANDBOX_TEST_AIRFLOW_HOME names, else a folder of its own, made
#: here and removed when the session passes (_MADE_HOME).
_MADE_HOME = not os.environ.get("SANDBOX_TEST_AIRFLOW_HOME")
_HOME = tempfile.mkdtemp(prefix="sandbox-tests-airflow-") if _MADE_HOME else os.environ["SANDBOX_TEST_AIRFLOW_HOME"]
os.environ["AIRFLOW_HOME"] = _HOME
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "True")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__DATABASE__LOAD_DEFAULT_CONNECTIONS"] = "False"
os.environ.setdefault(
    "AIRFLOW__CORE__DAGS_FOLDER",
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "sandbox_provider", "example_dags"
    ),
)

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

#: tests/ is no package (pytest imports each test file by its name, its folder put first on sys.path), so
#: the helpers a test imports from another folder are found by name too: tests/ itself (fake_hook,
#: scripted_model, dag_runs, ...) and the folder of each backend and shared part under tests/hooks/,
#: which holds that backend's stand-in (modal_server, fake_islo, sbx_fixtures, openshell_gateway,
#: opensandbox_harness, egress_servers, ...) beside its tests. Names of modules are therefore unique
#: across tests/ (test_layout.py checks it).
_TESTS = os.path.dirname(os.path.abspath(__file__))
for _folder in [_TESTS, *sorted(e.path for e in os.scandir(os.path.join(_TESTS, "hooks")) if e.is_dir())]:
    if _folder not in sys.path and not _folder.endswith("__pycache__"):
        sys.path.append(_folder)

import airflow_db  # noqa: E402

#: Fixtures shared across test folders.
pytest_plugins = ["scripted_model", "pid_namespace", "stats_recorder"]


# -- one temporary root per test session ------------------------------------------------------------------


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """
    Without ``--basetemp``, a session's temporary root is a new directory of its own (pytest-xdist's workers
    get ``<root>/gw<N>`` inside it), not the next ``/tmp/pytest-of-<user>/pytest-<N>``: pytest removes all but
    the newest three of those when a session starts, so two sessions at once (the two Airflow legs of CI,
    two developers' runs) could remove each other's directories while their tests use them. Removed at the
    end of a session that passed; one that failed keeps it for a look (its path is printed).
    """
    if getattr(config, "workerinput", None) is None and not config.option.basetemp:
        config.option.basetemp = tempfile.mkdtemp(prefix="sandbox-tests-tmp-")
        config.stash[_MADE_BASETEMP] = config.option.basetemp
    # With -n (pytest-xdist) and no other --dist, each test module runs whole on one worker: its module
    # fixtures (the UI tests' browser, whose event loop must not stay open under another module's tests)
    # live once, and a contract battery's last case judges what the cases before it read. Set here rather
    # than in addopts, so that a virtualenv without pytest-xdist still runs the suite.
    if getattr(config.option, "dist", None) == "load":
        config.option.dist = "loadfile"
    # Modules are handed out in collection order (see LONG_MODULES), not by their number of tests.
    if getattr(config.option, "dist", None) == "loadfile":
        config.option.loadscopereorder = False
    # One migrated metadata database per session, copied into each test's Airflow home (tests/airflow_db.py);
    # set before pytest-xdist starts its workers, which inherit it.
    if getattr(config, "workerinput", None) is None and config.option.basetemp:
        os.environ[airflow_db.CACHE_ENV] = os.path.join(os.path.abspath(config.option.basetemp), "airflow-db")
    _name_the_deployment(config)


def _name_the_deployment(config) -> None:
    """
    Give this session, and each pytest-xdist worker of it, an Airflow deployment of its own
    (``[sandbox] deployment``), before any test runs and in ``os.environ`` so that the Airflow commands
    and task processes tests start inherit it: every Docker create sweeps its deployment's sandboxes
    past their lifetime, and ``airflow sandboxes`` lists and sweeps only them, so a worker never removes
    a sandbox another worker (or another session on the same Engine) left standing on purpose. The
    session is ``tests-<6 hex>``, a worker ``tests-<6 hex>-gw<N>``.
    """
    worker = getattr(config, "workerinput", None)
    session = os.environ.get(_SESSION_DEPLOYMENT)
    if worker is None or not session:  # the controller, a run without xdist, or a worker started elsewhere
        import secrets

        session = os.environ[_SESSION_DEPLOYMENT] = f"tests-{secrets.token_hex(3)}"
    name = session if worker is None else f"{session}-{worker['workerid']}"
    os.environ["AIRFLOW__SANDBOX__DEPLOYMENT"] = name


#: The environment variable through which xdist's workers learn their session's deployment name.
_SESSION_DEPLOYMENT = "SANDBOX_TEST_SESSION_DEPLOYMENT"


_MADE_BASETEMP = pytest.StashKey[str]()

#: The modules that take minutes, longest first (their tests' summed durations in a parallel CI leg,
#: from ``--durations=0``; ``python scripts/module_durations.py LOG`` sums them). Under pytest-xdist
#: each module runs whole on one worker, and the modules are handed out in collection order
#: (``loadscopereorder`` off: xdist would hand out the modules with the most tests first, and these
#: have few), so one collected last would leave a worker running it alone while the others idle;
#: these are collected first instead. A module missing here or out of order changes only how long a
#: parallel run takes.
LONG_MODULES = (
    "tests/test_worker_kills.py",  # 476 s in CI's Airflow 3.2 leg, 2 workers beside the other leg (5 December 2026)
    "tests/triggers/test_deferred_docker.py",  # 277 s
    "tests/cli/test_sweep.py",  # 203 s
    "tests/hooks/kubernetes/test_kubernetes.py",  # 163 s
    "tests/hooks/docker/test_docker_hostile.py",  # 102 s
    "tests/hooks/local/test_local_egress.py",  # 96 s
    "tests/hooks/docker/test_docker.py",
    "tests/engine/test_lineage.py",
)


def pytest_collection_modifyitems(session, config, items):
    """Collect the modules of :data:`LONG_MODULES` first, in that order; the rest keep theirs."""
    rank = {module: place for place, module in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == 0 and _MADE_HOME:
        import shutil

        shutil.rmtree(_HOME, ignore_errors=True)  # this process's own Airflow home (each xdist worker has one)
    made = session.config.stash.get(_MADE_BASETEMP, None)
    if made is None:
        return
    if exitstatus == 0:
        import shutil

        shutil.rmtree(made, ignore_errors=True)
    else:
        print(f"\nThe temporary files of this session are kept in {made}", file=sys.stderr)


@pytest.fixture
def add_connection(monkeypatch):
    """Define an Airflow connection through its environment variable; returns a function."""

    def _add(conn_id: str, conn_type: str, *, extra: dict | None = None, **fields) -> str:
        value = {"conn_type": conn_type, **fields}
        if extra is not None:
            value["extra"] = json.dumps(extra)
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(value))
        return conn_id

    return _add


@pytest.fixture
def connection_lookups(monkeypatch):
    """
    Every connection id asked of Airflow (``BaseHook.get_connection``, every hook's and the task
    log's), in order, from a process that has not yet found any default connection missing.
    """
    from airflow.sdk import BaseHook

    from sandbox_provider.sandbox import hook as base_hook

    monkeypatch.setattr(base_hook, "_MISSING_DEFAULTS", set())
    asked: list[str] = []
    real = BaseHook.get_connection.__func__

    def counting(cls, conn_id):
        asked.append(conn_id)
        return real(cls, conn_id)

    monkeypatch.setattr(BaseHook, "get_connection", classmethod(counting))
    return asked


@pytest.fixture(scope="session")
def migrated_airflow_db():
    """Migrate the test AIRFLOW_HOME's SQLite database once per session, for tests that run ``dag.test()``."""
    airflow_db.migrate(os.environ)
    return _HOME


@pytest.fixture(autouse=True)
def _sandbox_can_reach_tmp_path(request):
    """
    As root, the local backend runs sandboxes as an unprivileged user, which must be able to pass
    through the directories above a sandbox's state root; pytest makes its temporary folders 0700.
    """
    if os.geteuid() == 0 and "tmp_path" in request.fixturenames:
        path = request.getfixturevalue("tmp_path")
        for folder in (path, *path.parents):
            if str(folder) in ("/", tempfile.gettempdir()):
                break
            folder.chmod(folder.stat().st_mode | 0o111)


# -- deep trees ----------------------------------------------------------------------------------------


def deep_tree(top: str, depth: int) -> None:
    """A tree ``depth`` directories deep (``top/d/d/.../d/bottom``), built through descriptors (its paths are far past PATH_MAX)."""
    os.mkdir(top)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        with open(os.open("bottom", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "w") as f:
            f.write("x")
    finally:
        os.close(fd)


@pytest.fixture
def fast_dir(tmp_path):
    """A tmpfs of its own where the worker may mount one: removing thousands of directories from this host's disk is slow."""
    where = tmp_path / "fast"
    where.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "t", str(where)]).returncode == 0
    )
    yield where
    if mounted:
        subprocess.run(["umount", "-l", str(where)], check=True)


# -- what a test needs from the machine ------------------------------------------------------------------

#: Marks a test (or, as ``pytestmark``, a module) that needs bubblewrap. Without it the test is skipped,
#: unless SANDBOX_REQUIRE_BWRAP is set (CI sets it), when it fails instead.
requires_bwrap = pytest.mark.skipif(
    not os.path.exists("/usr/bin/bwrap") and not os.environ.get("SANDBOX_REQUIRE_BWRAP"),
    reason="bubblewrap is not installed (apt-get install bubblewrap; SANDBOX_REQUIRE_BWRAP=1 makes this a failure)",
)

DOCKER_IMAGE = os.environ.get("SANDBOX_DOCKER_IMAGE", "airflow-sandbox-python:bookworm")
DOCKER_CONN_ID = "sandbox_docker_test"


def missing_machinery(reason: str, *, required_by: str, prepare: str, what: str):
    """Skip a test that needs ``what`` (which ``prepare`` sets up), or fail it when ``required_by`` is set."""
    if os.environ.get(required_by):
        pytest.fail(f"{required_by} is set but {reason}. Run: {prepare}")
    pytest.skip(f"{reason}; run {prepare} to test {what}")


def docker_unavailable(reason: str):
    """Skip (or, with SANDBOX_REQUIRE_DOCKER set, fail) a test that needs the Docker Engine."""
    missing_machinery(
        reason,
        required_by="SANDBOX_REQUIRE_DOCKER",
        prepare="bash scripts/docker/prepare.sh",
        what="the Docker backend",
    )


@pytest.fixture(scope="session")
def docker_client():
    """A raw SDK client to the Engine under test, for checks from outside the hook."""
    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env(version="auto", timeout=10)
        client.ping()
    except Exception as err:
        docker_unavailable(f"no Docker Engine is reachable ({err})")
    try:
        client.images.get(DOCKER_IMAGE)
    except docker.errors.ImageNotFound:
        docker_unavailable(f"the Engine has no image {DOCKER_IMAGE!r}")
    yield client
    client.close()


def container_gone(client, handle: str, *, within: float = 0.0) -> bool:
    """Whether the Engine has no container ``handle``, looking again for up to ``within`` seconds."""
    import time

    import docker.errors

    deadline = time.monotonic() + within
    while True:
        try:
            client.api.inspect_container(handle)
        except docker.errors.NotFound:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


@pytest.fixture(scope="session")
def docker_conn(docker_client):
    """An Airflow connection of type sandbox_docker for the local Engine and the test image."""
    value = json.dumps(
        {
            "conn_type": "sandbox_docker",
            "extra": {"image": DOCKER_IMAGE, "cpus": 1, "memory_bytes": 512 * 1024 * 1024, "pids_limit": 256},
        }
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(f"AIRFLOW_CONN_{DOCKER_CONN_ID.upper()}", value)
        yield DOCKER_CONN_ID


@pytest.fixture(scope="session")
def opensandbox_server(docker_client, tmp_path_factory):
    """
    The real ``opensandbox-server`` on loopback, one per session, with the project's execd image
    (``tests/hooks/opensandbox/opensandbox_harness.py``); at the end it stops and removes what it created.
    """
    pytest.importorskip("opensandbox")
    from opensandbox_harness import OpenSandboxServer, missing_prerequisite

    reason = missing_prerequisite(docker_client)
    if reason:
        docker_unavailable(reason)
    server = OpenSandboxServer(tmp_path_factory.mktemp("opensandbox-server"), docker_client)
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def opensandbox_conn(opensandbox_server):
    """An Airflow connection of type sandbox_opensandbox for the test server and the sandbox image."""
    from opensandbox_harness import SANDBOX_IMAGE

    conn_id = "sandbox_opensandbox_test"
    host, port = opensandbox_server.domain.split(":")
    value = {
        "conn_type": "sandbox_opensandbox",
        "host": host,
        "port": int(port),
        "schema": "http",
        "password": opensandbox_server.api_key,
        "extra": {"image": SANDBOX_IMAGE, "cpu": "1", "memory": "1Gi", "sandbox_timeout": 600},
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(value))
        yield conn_id


# -- the Kubernetes cluster of scripts/kubernetes/prepare.sh ---------------------------------------------

#: Where scripts/kubernetes/prepare.sh keeps the cluster's state: kubeconfigs, certificates, PID files.
KUBERNETES_STATE = os.environ.get("SANDBOX_KUBERNETES_STATE", "/var/lib/airflow-sandbox-kubernetes")


def kubernetes_unavailable(reason: str):
    """Skip (or, with SANDBOX_REQUIRE_KUBERNETES set, fail) a test that needs the Kubernetes cluster."""
    missing_machinery(
        reason,
        required_by="SANDBOX_REQUIRE_KUBERNETES",
        prepare="bash scripts/kubernetes/prepare.sh",
        what="the Kubernetes backend",
    )


@pytest.fixture(scope="session")
def kubernetes_cluster():
    """
    The test cluster, as the admin's ``CoreV1Api`` (a client of its own configuration, so nothing
    global changes); skips, or fails under SANDBOX_REQUIRE_KUBERNETES, when it does not answer.
    """
    kubernetes = pytest.importorskip("kubernetes")
    path = os.path.join(KUBERNETES_STATE, "admin.kubeconfig")
    if not os.path.exists(path):
        kubernetes_unavailable(f"there is no {path}")
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(path, client_configuration=configuration)
    api = kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(configuration))
    try:
        nodes = api.list_node(_request_timeout=10).items
    except Exception as err:
        kubernetes_unavailable(f"the cluster of {path} does not answer ({err})")
    ready = [
        n.metadata.name
        for n in nodes
        if any(c.type == "Ready" and c.status == "True" for c in (n.status.conditions or []))
    ]
    if not ready:
        kubernetes_unavailable(f"the cluster of {path} has no Ready node")
    yield api
    api.api_client.close()


#: The image the test sandboxes run: the sandbox image the Docker Engine under the kubelet has.
KUBERNETES_CONN_ID = "kubernetes_sandbox_test"
#: The user the cluster's token file names for the worker: no rights until a RoleBinding grants some.
KUBERNETES_WORKER = "airflow-sandbox-worker"


@pytest.fixture(scope="session")
def kubernetes_namespace(kubernetes_cluster):
    """
    A namespace of this test session's own, where the worker's identity has exactly the Role shipped in
    ``hooks/kubernetes/rbac.yaml`` (bound to the worker's token user); deleted, with what is in it, at the end.
    """
    import uuid
    from importlib import resources

    import yaml
    from kubernetes import client

    name = f"sandbox-test-{uuid.uuid4().hex[:8]}"
    kubernetes_cluster.create_namespace({"metadata": {"name": name}})
    rbac = client.RbacAuthorizationV1Api(kubernetes_cluster.api_client)
    text = resources.files("sandbox_provider.hooks.kubernetes").joinpath("rbac.yaml").read_text()
    role = next(doc for doc in yaml.safe_load_all(text) if doc["kind"] == "Role")
    rbac.create_namespaced_role(name, role)
    binding = {
        "metadata": {"name": "airflow-sandbox-worker"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": KUBERNETES_WORKER}],
    }
    rbac.create_namespaced_role_binding(name, binding)
    yield name
    kubernetes_cluster.delete_namespace(name, grace_period_seconds=1)


@pytest.fixture(scope="session")
def kubernetes_conn(kubernetes_namespace):
    """
    An Airflow connection of type ``kubernetes`` (the cncf provider's) as the worker: its kubeconfig, the
    test namespace, the sandbox image, small requests (a 2-core node holds 20 sandboxes). The test cluster
    has no network plugin that enforces NetworkPolicy; the connection declares one so that the specs that
    need a policy are provisioned and the policy sent can be checked (the tests say which checks are of
    the objects only).
    """
    value = {
        "conn_type": "kubernetes",
        "extra": {
            "kube_config_path": os.path.join(KUBERNETES_STATE, "worker.kubeconfig"),
            "namespace": kubernetes_namespace,
            "image": DOCKER_IMAGE,
            "image_pull_policy": "Never",
            "cpu_request": 0.05,
            "memory_bytes": 512 * 1024 * 1024,
            "memory_request_bytes": 32 * 1024 * 1024,
            "network_policy_enforced": True,
        },
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(f"AIRFLOW_CONN_{KUBERNETES_CONN_ID.upper()}", json.dumps(value))
        yield KUBERNETES_CONN_ID
