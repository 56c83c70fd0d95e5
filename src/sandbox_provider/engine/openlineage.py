"""
The OpenLineage view of a sandbox job: its inputs and exports as datasets, and a run facet describing
the sandbox.

Only the OpenLineage provider's calls (``get_openlineage_facets_on_start`` and the like) import this
module, so the provider and its client stay optional: without them nothing imports it. The facet
classes come through ``common.compat``; the datasets are named by
:func:`~sandbox_provider.engine.lineage.dataset_name`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.providers.common.compat.openlineage.facet import (
    InputDataset,
    OutputDataset,
    OutputStatisticsOutputDatasetFacet,
    RunFacet,
)
from airflow.providers.openlineage.extractors import OperatorLineage
from attrs import define, field

from sandbox_provider.engine.lineage import SandboxReport, dataset_name
from sandbox_provider.engine.options import is_template

if TYPE_CHECKING:
    from sandbox_provider.engine.transfer import ExportRecord

__all__ = ["RUN_FACET_KEY", "SandboxRunFacet", "operator_lineage"]

#: The key of :class:`SandboxRunFacet` among a run's facets.
RUN_FACET_KEY = "sandbox"
#: Where the facet's JSON schema is: ``engine/facets/SandboxRunFacet.json`` of this package, by its ``$id``.
SCHEMA_URL = "urn:airflow-provider-sandbox:facets:SandboxRunFacet:1-0-0#/$defs/SandboxRunFacet"


@define
class SandboxRunFacet(RunFacet):
    """
    The sandbox a task ran its job in (schema: ``engine/facets/SandboxRunFacet.json``).

    :param backend: the backend's short name (``local``, ``docker``, ...).
    :param connId: the Airflow connection the backend was made from, if any.
    :param image: the image or root filesystem the sandbox started from, where the backend names one.
    :param network: ``blocked``, ``open`` or ``allowlist`` (``unknown`` before an attached sandbox is met).
    :param allowedEgress: with an allowlist, the hosts and address ranges allowed.
    :param attached: the task used a sandbox an earlier task provisioned.
    :param handle: the sandbox's handle, once there is one.
    :param lifetimeSeconds: seconds the sandbox had to live when the task got it.
    :param exitCode: the command's exit status; None when it was killed or has not run.
    :param timedOut: the command was killed at its deadline.
    :param durationSeconds: seconds the command ran.
    """

    backend: str
    connId: str | None = None  # noqa: N815 - OpenLineage facets name their fields in camelCase
    image: str | None = None
    network: str = "unknown"
    allowedEgress: list[str] = field(factory=list)  # noqa: N815
    attached: bool = False
    handle: str | None = None
    lifetimeSeconds: float | None = None  # noqa: N815
    exitCode: int | None = None  # noqa: N815
    timedOut: bool = False  # noqa: N815
    durationSeconds: float | None = None  # noqa: N815

    @staticmethod
    def _get_schema() -> str:
        return SCHEMA_URL

    @classmethod
    def of(cls, report: SandboxReport) -> SandboxRunFacet:
        return cls(
            backend=report.backend,
            connId=report.conn_id,
            image=report.image,
            network=report.network,
            allowedEgress=list(report.allowed_egress),
            attached=report.attached,
            handle=report.handle,
            lifetimeSeconds=report.lifetime_seconds,
            exitCode=report.exit_code,
            timedOut=report.timed_out,
            durationSeconds=report.command_seconds,
        )


def _urls(mapping: Mapping[str, Any]) -> list[str]:
    """The storage URLs of ``{sandbox path: URL}``, leaving out what is still a template; one each."""
    seen: dict[str, None] = {}
    for value in mapping.values():
        if isinstance(value, str) and "://" in value and not is_template(value):
            seen.setdefault(value, None)
    return list(seen)


def _output(record: ExportRecord) -> Any:
    namespace, name = dataset_name(record.url)
    statistics = OutputStatisticsOutputDatasetFacet(size=record.size_bytes, fileCount=record.file_count)
    return OutputDataset(namespace=namespace, name=name, outputFacets={"outputStatistics": statistics})


def operator_lineage(
    *,
    inputs: Mapping[str, Any],
    exports: Mapping[str, Any],
    report: SandboxReport | None,
    exported: Sequence[ExportRecord] = (),
) -> OperatorLineage:
    """
    The ``OperatorLineage`` of a sandbox job: each input URL an input dataset, each export an output
    dataset (one per export entry: a directory or a glob's destination is one dataset), and the run
    facet ``sandbox`` from ``report`` when there is one.

    :param inputs: ``{sandbox path: storage URL}`` (rendered; templates are left out).
    :param exports: ``{sandbox path: storage URL}``: the outputs before anything was exported.
    :param exported: what the export copied; when given, these are the outputs, with the
        ``outputStatistics`` facet (bytes and files).
    """
    input_datasets = [InputDataset(*dataset_name(url)) for url in _urls(inputs)]
    if exported:
        outputs = [_output(record) for record in exported]
    else:
        outputs = [OutputDataset(*dataset_name(url)) for url in _urls(exports)]
    facets = {RUN_FACET_KEY: SandboxRunFacet.of(report)} if report is not None else {}
    return OperatorLineage(inputs=input_datasets, outputs=outputs, run_facets=facets)
