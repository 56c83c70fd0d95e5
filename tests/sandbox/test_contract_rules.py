"""
The rules a backend author meets, made checks of the contract itself: a setting writes its own default,
reads of settings are recorded (and a name outside the table is refused), each setting is documented
from the table, and a backend words every network mode it accepts, all at definition or first use.
"""

from __future__ import annotations

import pathlib
from typing import Any, ClassVar

import pytest

from fake_hook import FakeSandboxHook
from sandbox_provider.sandbox import SandboxSpec
from sandbox_provider.sandbox.hook import Capabilities, SandboxHook
from sandbox_provider.sandbox.network import NetworkReach
from sandbox_provider.sandbox.settings import ConnectionForm, Setting, SettingsTable

OPEN = SandboxSpec(block_network=False)


def _table() -> SettingsTable:
    return SettingsTable(
        Setting("root", str, label="Root", help="Where the sandboxes go."),
        Setting("size", int, 10, label="Size", help="How big.", minimum=1),
        Setting("quota", int, label="Quota", help="Bytes at most.", default_text="no limit"),
    )


# -- defaults --------------------------------------------------------------------------------------------


def test_a_setting_writes_its_own_default():
    table = _table()
    assert table["root"].description == "Where the sandboxes go. Default: none."
    assert table["size"].description == "How big. Default: 10."
    assert table["quota"].description == "Bytes at most. Default: no limit."
    assert table.form_fields()["quota"]["description"] == "Bytes at most. Default: no limit."


@pytest.mark.parametrize("help", ["Where. Default: /tmp.", "Where (default: /tmp).", "Where. DEFAULT : x"])
def test_a_help_that_states_a_default_is_refused_with_what_to_write(help):
    with pytest.raises(ValueError, match=r"Setting 'root': its help states a default .* default_text="):
        Setting("root", str, help=help)


# -- reads are recorded ----------------------------------------------------------------------------------


def test_reads_are_recorded_by_index_and_by_get_and_a_name_outside_the_table_is_refused():
    table = _table()
    cfg = table.resolve({"size": 3}, {"root": "/srv"})
    assert table.read == set()
    assert cfg.get("root") == "/srv" and cfg["size"] == 3
    assert table.read == {"root", "size"}
    for read in (lambda: cfg["rot"], lambda: cfg.get("rot")):
        with pytest.raises(KeyError, match=r"'rot' is no setting of this backend .* add Setting\('rot', \.\.\.\)"):
            read()
    assert "rot" not in table.read


class _ToyHook(SandboxHook):
    """A toy backend with a form, built as a newcomer would."""

    name = "toy"
    display_name = "toy"
    form = ConnectionForm(conn_type="sandbox_toy", hook_name="Toy", settings=_table(), ui_behaviour={})
    capabilities = Capabilities(network=NetworkReach(blocked="has nothing", open="has everything"))

    def __init__(self, sandbox_conn_id: str | None = None, *, root: str | None = None, size: int | None = None):
        super().__init__()
        self.sandbox_conn_id = sandbox_conn_id
        self._args = self.settings.arguments(locals())

    def _resolved(self) -> Any:
        return self.settings.resolve(self._args, {})

    def where(self) -> str:
        cfg = self._resolved()
        return cfg.get("root")

    def _provision(self, request):  # pragma: no cover - never provisioned here
        raise NotImplementedError

    def _run(self, handle, command, *, timeout, output):  # pragma: no cover
        raise NotImplementedError

    def _destroy(self, handle):  # pragma: no cover
        raise NotImplementedError


def test_a_read_through_a_local_name_is_recorded_as_any_other():
    assert _ToyHook(root=str(pathlib.Path("/srv"))).where() == "/srv"
    assert "root" in _ToyHook.settings.read


def test_arguments_are_taken_from_the_signature_and_checked():
    assert _ToyHook(root=pathlib.Path("/srv"), size=4)._args == {"root": "/srv", "size": 4}  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="size must be a whole number of at least 1, got 0"):
        _ToyHook(size=0)


# -- the settings are documented from the table ------------------------------------------------------------


def test_the_docstring_documents_each_setting_from_the_table():
    doc = _ToyHook.__doc__ or ""
    assert ":param root: Where the sandboxes go. Default: none." in doc
    assert ":param size: How big. Default: 10." in doc
    # quota is no argument of the toy's constructor: the connection gives it.
    assert "Read from the connection's extras only:" in doc and "- ``quota``: Bytes at most. Default: no limit." in doc


def test_a_setting_documented_by_hand_is_refused():
    with pytest.raises(TypeError, match=r"_Twice's docstring documents the settings root by hand: remove those"):

        class _Twice(_ToyHook):
            """
            :param root: written here too.
            """

            form = _ToyHook.form


# -- the network modes -------------------------------------------------------------------------------------


def test_a_backend_that_accepts_a_mode_without_its_phrase_fails_when_defined():
    with pytest.raises(TypeError, match=r'_Mute accepts the network modes hosts .*NetworkReach\(hosts="\.\.\."\)'):

        class _Mute(_ToyHook):
            form = _ToyHook.form
            capabilities = Capabilities(egress_hosts=True, network=NetworkReach(blocked="has none", open="has all"))


def test_a_backend_that_words_the_modes_itself_is_judged_by_what_it_returns():
    class _Own(_ToyHook):
        form = _ToyHook.form
        capabilities = Capabilities(egress_hosts=True)

        def describe_network(self, spec: SandboxSpec) -> str | None:
            return "This sandbox reaches what its proxy allows."

    assert _Own().network_description(OPEN) == "This sandbox reaches what its proxy allows."


def test_a_stand_in_without_a_connection_type_keeps_the_contract_wording(tmp_path):
    class _Plain(FakeSandboxHook):
        capabilities: ClassVar[Capabilities] = Capabilities(egress_hosts=True)

    assert _Plain(str(tmp_path)).network_description(OPEN) == "This sandbox has outbound network access."


def test_a_read_of_the_hooks_own_arguments_is_recorded_too():
    hook = _ToyHook(size=3)
    _ToyHook.settings.read.discard("size")
    assert hook._args.get("size") == 3 and "size" in _ToyHook.settings.read
    with pytest.raises(KeyError, match="'quota' is no argument of this hook: it is read from the connection"):
        hook._args.get("quota")
