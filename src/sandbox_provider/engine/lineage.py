"""
What a sandbox job read and wrote, told to Airflow: Asset events for exports, hook-level lineage for
every consumer, and the names OpenLineage gives storage URLs.

- **Assets.** A consumer's ``inputs`` and ``exports`` may give an Airflow ``Asset`` where a URL goes;
  :func:`plan_assets` turns each into its URL for the transfer and says which Assets the task reads
  (its inlets) and writes (its outlets). After a successful export, :func:`emit_asset_events` attaches
  what was exported (bytes, files, backend, handle) to each outlet's event; Airflow sends the events
  only when the task succeeds, so a failed or partial export emits none.
- **Hook lineage.** The session reports every input it staged and every file it exported to Airflow's
  hook lineage collector (:func:`report_hook_lineage`), as a hook does; the OpenLineage provider turns
  that into datasets for any operator that does not describe its own (``AgentOperator`` with a
  ``SandboxToolset``, say). It goes through ``common.compat``, and does nothing when no lineage reader
  is installed.
- **Dataset names.** :func:`dataset_name` follows OpenLineage's naming of file systems and object
  stores. The OpenLineage objects themselves are built in :mod:`~sandbox_provider.engine.openlineage`,
  which only the OpenLineage provider's calls import.

Nothing here fails a task over lineage: what cannot be reported is logged and left out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sandbox_provider.engine.options import is_template
from sandbox_provider.sandbox.batch import is_glob

if TYPE_CHECKING:
    from sandbox_provider.engine.transfer import ExportRecord
    from sandbox_provider.sandbox.spec import AttachedSandbox, SandboxSpec

log = logging.getLogger(__name__)

__all__ = [
    "AssetPlan",
    "SandboxReport",
    "dataset_name",
    "emit_asset_events",
    "network_mode",
    "plan_assets",
    "report_hook_lineage",
]

#: Object-store schemes spelled another way by some tools, and the one OpenLineage names them by.
_SCHEME_NAMES = {"gcs": "gs", "s3a": "s3", "s3n": "s3"}
#: Schemes whose ``user@host`` authority names a container, not an Airflow connection.
_AZURE_SCHEMES = frozenset({"abfs", "abfss", "wasb", "wasbs", "az", "adl"})


def dataset_name(url: str) -> tuple[str, str]:
    """
    The OpenLineage ``(namespace, name)`` of a storage URL, after OpenLineage's dataset naming:

    - ``file:///data/out.csv`` is ``("file", "/data/out.csv")``;
    - an object store is ``("<scheme>://<bucket>", "<key>")``: ``s3://bucket/a/b.csv`` is
      ``("s3://bucket", "a/b.csv")``, and ``gcs://`` is named ``gs://``;
    - a connection id written into the URL (``s3://aws_conn@bucket/key``, which ``ObjectStoragePath``
      reads) is not part of the name; an Azure ``container@account`` is;
    - a directory (a URL ending in ``/``, for a tree or a glob) is one dataset, named without the ``/``.

    :raises ValueError: for a value that is not ``scheme://...``.
    """
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(f"{url!r} is not a storage URL such as s3://bucket/key or file:///path.")
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    authority, _, path = rest.partition("/")
    if scheme == "file":
        return "file", "/" + path.strip("/")
    if "@" in authority and scheme not in _AZURE_SCHEMES:
        authority = authority.rsplit("@", 1)[1]
    return f"{_SCHEME_NAMES.get(scheme, scheme)}://{authority}", path.strip("/")


# -- Assets -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AssetPlan:
    """
    The Assets of one consumer's ``inputs`` and ``exports``: see :func:`plan_assets`.

    :param inputs: the inputs with every Asset replaced by its URL (templates left as they are).
    :param exports: the exports likewise.
    :param export_assets: ``{sandbox path: Asset}``: the Asset each such export's event goes to.
    :param alias: the ``AssetAlias`` the other exports are emitted through, once their URLs are rendered.
    :param inlets: the Assets given as inputs.
    """

    inputs: dict[str, Any]
    exports: dict[str, Any]
    export_assets: dict[str, Any] = field(default_factory=dict)
    alias: Any = None
    inlets: list[Any] = field(default_factory=list)

    @property
    def outlets(self) -> list[Any]:
        """What the task adds to its outlets: each export's Asset, and the alias."""
        return [*self.export_assets.values(), *([self.alias] if self.alias is not None else [])]


def _is_directory(path: str, *, export: bool) -> bool:
    return path.endswith("/") or (export and is_glob(path))


def _asset_url(path: str, asset: Any, what: str, *, export: bool) -> str:
    """The URL of ``asset`` for the transfer: its URI, with ``/`` for a directory."""
    uri = asset.uri
    directory = _is_directory(path, export=export)
    if not directory and asset.name == uri.rstrip("/") + "/":
        raise ValueError(
            f"{what}[{path!r}] is {asset!r}, written as a directory (ending in '/'), but the sandbox path {path!r} "
            f"names a file. End the sandbox path with '/' ({path.rstrip('/')}/) to move a directory"
            f"{', or give a glob' if export else ''}, or drop the '/' from the Asset to move one file."
        )
    return uri.rstrip("/") + "/" if directory else uri


def _check_exports_as_assets(value: Any) -> Any:
    from airflow.sdk import AssetAlias

    if isinstance(value, (bool, AssetAlias)):
        return value
    raise ValueError(
        f"exports_as_assets must be True, False or an AssetAlias, got {value!r}. True makes each export URL an "
        "Asset; an AssetAlias('name') emits each rendered URL through the alias."
    )


def plan_assets(
    inputs: Mapping[str, Any] | None, exports: Mapping[str, Any] | None, exports_as_assets: Any = False
) -> AssetPlan:
    """
    Take the Assets out of ``inputs`` and ``exports`` (``{sandbox path: URL or Asset}``).

    An ``Asset`` stands for its URI. It is a directory when its sandbox path ends in ``/`` (or, for an
    export, is a glob such as ``out/*.csv``); an Asset written with a trailing ``/`` must be one.

    :param exports_as_assets: False (default): only exports given as an Asset are outlets. True: every
        export URL is one too, as ``Asset(url)`` (a directory's without its trailing ``/``); a templated
        URL is refused, since an outlet must be known when the Dag is parsed. An ``AssetAlias``: the alias
        is the outlet, and each export not given as an Asset is emitted through it as ``Asset(<rendered
        URL>)`` when the task succeeds (the way for templated URLs).
    :returns: an :class:`AssetPlan`.
    :raises ValueError: for an alias or another kind of asset where a URL goes, a bad
        ``exports_as_assets``, or a templated export with ``exports_as_assets=True``; each says what to give.
    """
    from airflow.sdk import Asset, AssetAlias
    from airflow.sdk.definitions.asset import BaseAsset

    mode = _check_exports_as_assets(exports_as_assets)
    plan = AssetPlan(inputs=dict(inputs or {}), exports=dict(exports or {}))
    for what, mapping in (("inputs", plan.inputs), ("exports", plan.exports)):
        for path, value in mapping.items():
            if isinstance(value, Asset):
                mapping[path] = _asset_url(path, value, what, export=what == "exports")
                if what == "exports":
                    plan.export_assets[path] = value
                else:
                    plan.inlets.append(value)
            elif isinstance(value, BaseAsset):
                raise ValueError(
                    f"{what}[{path!r}] is {value!r}, which names no single location. Give an Asset or a URL; to emit "
                    "templated export URLs through an alias, pass exports_as_assets=AssetAlias(...)."
                )
    if mode is True:
        for path, value in plan.exports.items():
            if path in plan.export_assets:
                continue
            if is_template(value):
                raise ValueError(
                    f"exports[{path!r}] is the template {value!r}, so the Asset it would be is not known when the Dag "
                    "is parsed, and Airflow schedules Dags on Assets it knows then. Give a literal URL or an Asset "
                    "here, or pass exports_as_assets=AssetAlias('<name>') to emit the rendered URLs through an alias."
                )
            if isinstance(value, str):
                plan.export_assets[path] = Asset(value.rstrip("/"))
    elif isinstance(mode, AssetAlias):
        object.__setattr__(plan, "alias", mode)
    return plan


def emit_asset_events(
    context: Mapping[str, Any], plan: AssetPlan, records: Sequence[ExportRecord], *, backend: str, handle: str | None
) -> None:
    """
    Attach to each exported file's Asset event what was exported: ``bytes``, ``file_count``,
    ``backend``, ``handle`` and ``sandbox_path``. Exports emitted through the alias are added to it as
    ``Asset(<URL>)`` (a directory's without its trailing ``/``). Call after the export succeeded; Airflow
    sends the events when the task succeeds.
    """
    if not plan.outlets or not records:
        return
    events = context.get("outlet_events")
    if events is None:
        log.debug("No outlet events in this context (not a task run); no Asset event is recorded")
        return
    from airflow.sdk import Asset

    for record in records:
        extra = {
            "bytes": record.size_bytes,
            "file_count": record.file_count,
            "backend": backend,
            "handle": handle,
            "sandbox_path": record.path,
        }
        asset = plan.export_assets.get(record.path)
        if asset is not None:
            events[asset].extra.update(extra)
            log.info("Asset event for %s: %s", asset.uri, extra)
        elif plan.alias is not None:
            emitted = Asset(record.url.rstrip("/"))
            events[plan.alias].add(emitted, extra=extra)
            log.info("Asset event for %s through alias %s: %s", emitted.uri, plan.alias.name, extra)


# -- what one session did -----------------------------------------------------------------------------------


def network_mode(spec: SandboxSpec | None) -> tuple[str, list[str]]:
    """``("blocked" | "open" | "allowlist", [allowed hosts and address ranges])`` for ``spec``."""
    if spec is None:
        return "unknown", []
    if not spec.block_network:
        return "open", []
    allowed = [*(spec.allow_egress_to or ()), *(spec.allow_egress_to_cidrs or ())]
    return ("allowlist" if allowed else "blocked"), allowed


def image_of(hook: Any) -> str | None:
    """The image (or root filesystem) ``hook``'s sandboxes start from, as text; None when it has none to name."""
    try:
        if "image" in hook.settings:
            value = hook._resolved().get("image")
        else:
            value = getattr(hook, "image", None)
    except Exception:
        log.debug("Could not read the image setting of backend %s", getattr(hook, "name", "?"), exc_info=True)
        return None
    return value if isinstance(value, str) and value else None


@dataclass
class SandboxReport:
    """
    What one session did with its sandbox, filled in as it goes; the OpenLineage run facet and the
    consumers read it. Times in seconds.
    """

    backend: str
    conn_id: str | None = None
    image: str | None = None
    network: str = "unknown"
    allowed_egress: list[str] = field(default_factory=list)
    attached: bool = False
    handle: str | None = None
    lifetime_seconds: float | None = None
    exit_code: int | None = None
    timed_out: bool = False
    command_seconds: float | None = None
    exports: list[ExportRecord] = field(default_factory=list)

    @classmethod
    def of(cls, hook: Any, spec: SandboxSpec | None, *, attached: bool) -> SandboxReport:
        """
        The report of a session on ``hook`` provisioning with ``spec`` (or attaching, with None). ``hook``
        may be the id of a connection not looked up yet: the backend is then ``"unknown"``.
        """
        from sandbox_provider.engine.metrics import metric_tags

        network, allowed = network_mode(spec)
        known = not isinstance(hook, str)
        return cls(
            backend=str(hook.name) if known else "unknown",
            conn_id=metric_tags(hook).get("conn_id") if known else hook,
            network=network,
            allowed_egress=allowed,
            attached=attached,
        )

    def provisioned(self, hook: Any, handle: str) -> None:
        """Record a sandbox this session provisioned: its handle, image and lifetime."""
        self.handle = handle
        self.image = image_of(hook)
        expires = getattr(hook, "_known_expiry", {}).get(handle)
        if expires is not None:
            self.lifetime_seconds = round(max(0.0, expires - time.time()), 3)

    def attached_to(self, attached: AttachedSandbox) -> None:
        """Record a sandbox this session attached to: its handle, network and the lifetime it had left."""
        self.handle = attached.handle
        self.lifetime_seconds = attached.remaining_lifetime
        if attached.network is not None:
            self.network, self.allowed_egress = network_mode(attached.network)


# -- hook lineage ---------------------------------------------------------------------------------------------


def _collector() -> Any:
    from airflow.providers.common.compat.lineage.hook import get_hook_lineage_collector

    return get_hook_lineage_collector()


def report_hook_lineage(
    hook: Any, *, inputs: Sequence[str] = (), exports: Sequence[ExportRecord] = (), backend: str | None = None
) -> None:
    """
    Tell Airflow's hook lineage collector that ``hook`` read ``inputs`` (storage URLs) and wrote
    ``exports``, as Assets (a directory by its URL without the trailing ``/``). Without a lineage reader
    installed, the collector drops them; an error is logged, never raised.
    """
    if not inputs and not exports:
        return
    try:
        collector = _collector()
        for url in inputs:
            collector.add_input_asset(context=hook, uri=url.rstrip("/"))
        for record in exports:
            extra = {"bytes": record.size_bytes, "file_count": record.file_count, "backend": backend or hook.name}
            collector.add_output_asset(context=hook, uri=record.url.rstrip("/"), asset_extra=extra)
    except Exception:
        log.debug("Could not report the sandbox's inputs and exports as hook lineage", exc_info=True)
