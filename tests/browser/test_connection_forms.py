"""
The sandbox connection forms in Airflow's own UI, driven in a real browser.

A real ``airflow api-server`` (from the Airflow this suite runs on) listens on loopback with a
temporary ``AIRFLOW_HOME`` and SQLite, ``[core] test_connection = Enabled`` and the simple auth
manager letting everyone in as admin. Headless Debian Chromium, driven by Playwright, opens the
Connections page, creates a ``sandbox_local`` and a ``sandbox_docker`` connection through the
form, presses the row's Test button and checks the success message, which the API server's test
of the connection produced. Screenshots of the filled form and of the result go to
``test-artifacts/connection-forms/airflow-<version>/`` in the repository (gitignored).

Needs ``/usr/bin/chromium`` (``bash scripts/browser/prepare.sh`` installs it; ``SANDBOX_CHROMIUM``
names another) and the ``playwright`` package; without them the module is skipped, unless
``SANDBOX_REQUIRE_BROWSER`` is set (CI sets it), when it fails instead. The local case needs
bubblewrap and the Docker case an Engine with the sandbox image, as their own tests do
(``SANDBOX_REQUIRE_BWRAP`` and ``SANDBOX_REQUIRE_DOCKER`` make those failures too).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import airflow_db
from conftest import DOCKER_IMAGE, requires_bwrap
from sandbox_provider.get_provider_info import PORT_FOR_TEST_BUTTON, port_needed_by_test_button
from sandbox_provider.hooks.forms import docker as docker_form
from sandbox_provider.hooks.forms import local as local_form

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("SANDBOX_CHROMIUM", "/usr/bin/chromium")
REPO = Path(__file__).resolve().parents[2]
STARTUP_SECONDS = 120
#: How long the UI gets to show a test's result; the API server provisions a sandbox meanwhile.
RESULT_MS = 60_000


def _unavailable(reason: str, fix: str = "bash scripts/browser/prepare.sh"):
    if os.environ.get("SANDBOX_REQUIRE_BROWSER"):
        pytest.fail(f"SANDBOX_REQUIRE_BROWSER is set but {reason}. Run: {fix}")
    pytest.skip(f"{reason}; {fix} sets it up")


def _airflow_version() -> str:
    from importlib.metadata import version

    return version("apache-airflow-core")


@dataclass
class ApiServer:
    url: str
    home: Path
    log: Path
    process: subprocess.Popen = field(repr=False)

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=30) as response:
            return json.load(response)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _server_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__DATABASE__LOAD_DEFAULT_CONNECTIONS="False",
        AIRFLOW__CORE__TEST_CONNECTION="Enabled",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="True",
        # What the README gives a deployment to drop Airflow's RFC 3986 warning about the
        # underscore in connection types (the only warning that logger emits).
        AIRFLOW__LOGGING__NAMESPACE_LEVELS="airflow.models.connection.Connection=ERROR",
    )
    return env


@pytest.fixture(scope="module")
def chromium_path() -> str:
    if not os.access(CHROMIUM, os.X_OK):
        _unavailable(f"{CHROMIUM} is not installed")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _unavailable("the playwright package is not installed", fix="pip install -e '.[dev]'")
    return CHROMIUM


@pytest.fixture(scope="module")
def api_server(tmp_path_factory, chromium_path):
    """A real ``airflow api-server`` on a free loopback port, with its own migrated SQLite database."""
    home = tmp_path_factory.mktemp("airflow-home")
    env = _server_env(home)
    airflow = [sys.executable, "-m", "airflow"]
    airflow_db.migrate(env)
    port = _free_port()
    log = home / "api-server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [*airflow, "api-server", "-H", "127.0.0.1", "-p", str(port), "-w", "1"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    server = ApiServer(f"http://127.0.0.1:{port}", home, log, process)
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if process.poll() is not None:
                pytest.fail(f"airflow api-server exited with {process.returncode}:\n{server.log_text()[-4000:]}")
            try:
                server.get("/api/v2/monitor/health")
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"airflow api-server did not answer in {STARTUP_SECONDS} s:\n{server.log_text()[-4000:]}"
                    )
                time.sleep(0.5)
        yield server
    finally:
        _stop(process)


def _stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture(scope="module")
def browser(chromium_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 2000})
    page = context.new_page()
    page.set_default_timeout(30_000)
    yield page
    context.close()


@pytest.fixture(scope="module")
def screenshots() -> Path:
    folder = REPO / "test-artifacts" / "connection-forms" / f"airflow-{_airflow_version()}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


#: The egress gateway's settings as a person types them into the form's JSON editors.
EGRESS = {"egress_ports": "[443, 8443]", "egress_pins": '{"mirror.corp.example": ["10.1.2.3", "10.1.2.4"]}'}


def _local_ready(request, tmp_path_factory) -> dict[str, str]:
    state = tmp_path_factory.mktemp("sandbox-state")
    # As root the sandboxes run as an unprivileged user, who must pass through to the state root.
    for folder in (state, *state.parents):
        if str(folder) in ("/", "/tmp"):
            break
        folder.chmod(folder.stat().st_mode | 0o111)
    return {"state_root": str(state / "sandboxes"), "sandbox_timeout": "600", "max_processes": "256", **EGRESS}


def _docker_ready(request, tmp_path_factory) -> dict[str, str]:
    request.getfixturevalue("docker_client")  # skips, or fails under SANDBOX_REQUIRE_DOCKER, without an Engine
    return {"image": DOCKER_IMAGE, "pids_limit": "128", "sandbox_timeout": "600", **EGRESS}


@dataclass(frozen=True)
class Case:
    conn_type: str
    hook_name: str
    fields: dict
    ready: object
    standard: dict = field(default_factory=dict)


CASES = {
    "sandbox_local": Case("sandbox_local", local_form.FORM.hook_name, local_form.SETTINGS.form_fields(), _local_ready),
    "sandbox_docker": Case(
        "sandbox_docker",
        docker_form.FORM.hook_name,
        docker_form.SETTINGS.form_fields(),
        _docker_ready,
        standard={"Docker daemon address": "unix:///var/run/docker.sock"},
    ),
}


def _field(dialog, label: str):
    """The form field (label, input, help text) whose label reads ``label``."""
    return dialog.get_by_role("group").filter(has=dialog.page.get_by_text(label, exact=True))


def _fill_form(page, case: Case, conn_id: str, extras: dict[str, str], *, port: str | None, shots: Path | None):
    """
    Open Add Connection and fill it as a person would; check that every extra field shows its
    label and, as the input's description, its help text. Screenshots go to ``shots``.
    """
    from playwright.sync_api import expect

    page.get_by_role("button", name="Add Connection").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_label("Connection ID").fill(conn_id)
    dialog.get_by_role("combobox").fill(case.hook_name)
    page.get_by_role("option", name=case.hook_name, exact=True).click()
    standard = dict(case.standard)
    if port is not None:
        standard[PORT_FOR_TEST_BUTTON] = port
    for label, value in standard.items():
        _field(dialog, label).locator("input").fill(value)
    if shots:
        dialog.screenshot(path=shots / f"{case.conn_type}-form-standard.png", animations="disabled")
    dialog.get_by_role("button", name="Extra Fields", exact=True).click()
    for name, spec in case.fields.items():
        group = _field(dialog, spec["label"])
        if _is_json(spec) or "enum" in spec["schema"]:  # a JSON editor or a list to pick from, the help below it
            control = group.get_by_role("code") if _is_json(spec) else group.get_by_role("combobox")
            expect(control, f"{name} has no editor").to_have_count(1)
            expect(group, f"{name} has no help text").to_contain_text(spec["description"])
            continue
        control = group.locator("input")
        expect(control, f"{name} has no help text").to_have_accessible_description(spec["description"])
    for name, value in extras.items():
        group = _field(dialog, case.fields[name]["label"])
        if _is_json(case.fields[name]):
            group.get_by_role("code").click()  # the editor's own input is a hidden element that takes the keys
            page.keyboard.press("Control+A")
            page.keyboard.press("Delete")
            page.keyboard.insert_text(value)
            # The editor closes an opened bracket itself, after the cursor: remove what it added.
            page.keyboard.press("Shift+Control+End")
            page.keyboard.press("Delete")
        else:
            group.locator("input").fill(value)
    if shots:
        dialog.screenshot(path=shots / f"{case.conn_type}-form-extra.png", animations="disabled")
    return dialog


def _is_json(spec: dict) -> bool:
    """Whether a form field takes a JSON list or object (Airflow shows a code editor for it)."""
    return bool({"array", "object"} & set(spec["schema"]["type"]))


def _test_in_row(page, conn_id: str):
    """Press the Test button of the connection's row; return the toast's title and text, and the API's answer."""
    row = page.get_by_role("row").filter(has=page.get_by_text(conn_id, exact=True))
    with page.expect_response(lambda r: r.url.endswith("/api/v2/connections/test"), timeout=RESULT_MS) as answer:
        row.get_by_role("button", name="Test Connection").click()
    toast = page.locator("[data-scope='toast'][data-part='root']").filter(
        has=page.locator("[data-part='title']", has_text=re.compile(r"^Test Connection"))
    )
    toast.wait_for()
    title = toast.locator("[data-part='title']").inner_text()
    message = toast.locator("[data-part='description']").inner_text()
    return toast, title, message, answer.value


@pytest.mark.parametrize(
    "conn_type", [pytest.param("sandbox_local", marks=requires_bwrap), pytest.param("sandbox_docker")]
)
def test_form_creates_a_connection_that_the_test_button_passes(
    conn_type, api_server, page, screenshots, request, tmp_path_factory
):
    case = CASES[conn_type]
    extras = case.ready(request, tmp_path_factory)
    conn_id = f"ui_{conn_type}"
    port = "0" if port_needed_by_test_button() else None
    page.goto(f"{api_server.url}/connections")
    dialog = _fill_form(page, case, conn_id, extras, port=port, shots=screenshots)
    dialog.get_by_role("button", name="Save").click()
    dialog.wait_for(state="hidden")

    stored = api_server.get(f"/api/v2/connections/{conn_id}")
    assert stored["conn_type"] == conn_type
    saved = json.loads(stored["extra"])
    for name, value in extras.items():
        expected = json.loads(value) if _is_json(case.fields[name]) else value
        assert (saved[name] if _is_json(case.fields[name]) else str(saved[name])) == expected, (name, saved)

    toast, title, message, _ = _test_in_row(page, conn_id)
    page.screenshot(path=screenshots / f"{conn_type}-tested.png", animations="disabled")
    toast.screenshot(path=screenshots / f"{conn_type}-tested-message.png", animations="disabled")
    assert title == "Test Connection Successful", f"{title}: {message}"
    assert message.startswith(f"Connection '{conn_id}', tested by the API server (pid "), message
    assert "worker's" not in message
    if conn_type == "sandbox_local":
        # The API server's hook read the form's state directory: the test sandbox lived there.
        assert os.listdir(extras["state_root"]) == []


@requires_bwrap
def test_airflow_3_3_refuses_the_test_button_for_an_empty_port(
    api_server, page, screenshots, request, tmp_path_factory
):
    """
    Why the form asks for port 0 on Airflow 3.3: left empty, Airflow's API refuses the UI's test.
    When this fails, the installed Airflow fixed it: narrow ``port_needed_by_test_button``.
    """
    if not port_needed_by_test_button():
        pytest.skip(f"Airflow {_airflow_version()} tests a connection with an empty port")
    case = CASES["sandbox_local"]
    page.goto(f"{api_server.url}/connections")
    dialog = _fill_form(page, case, "ui_empty_port", case.ready(request, tmp_path_factory), port=None, shots=None)
    dialog.get_by_role("button", name="Save").click()
    dialog.wait_for(state="hidden")
    toast, title, message, answer = _test_in_row(page, "ui_empty_port")
    toast.screenshot(path=screenshots / "empty-port-refused.png", animations="disabled")
    assert (title, message, answer.status) == ("Test Connection Failed", "Bad Request", 400)
    assert "host or port to test differs from the stored connection" in answer.json()["detail"]


def test_api_server_logs_no_rfc_3986_warning(api_server):
    """With the README's setting, testing a sandbox connection logs no warning about its type's underscore."""
    body = {"connection_id": "api_probe", "conn_type": "sandbox_docker", "host": "unix:///nonexistent/docker.sock"}
    request = urllib.request.Request(
        f"{api_server.url}/api/v2/connections/test",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        result = json.load(response)
    assert result["status"] is False and "Connection 'api_probe', tested by the API server" in result["message"]
    assert "RFC3986" not in api_server.log_text()
