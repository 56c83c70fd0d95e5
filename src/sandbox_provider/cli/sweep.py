"""
What ``airflow sandboxes`` does, as a Python API the CLI, the ``example_sandbox_maintenance`` Dag and
tests share: list what this provider's sandboxes are on every backend a connection reaches, and end
those a sweep's rules choose.

Each backend contributes only :meth:`~sandbox_provider.sandbox.hook.SandboxHook.sandbox_records` (its
sandboxes as uniform :class:`~sandbox_provider.sandbox.leftovers.SandboxRecord` s, built on its
``find_sandboxes``) and ``destroy``; the rules live here, once:

- a sandbox is a leftover when it is past its lifetime; with ``older_than``, when it is older than that;
  with ``orphans``, when the task instance that made it (its stamps) is no longer running according to
  the metadata database;
- a leftover another task holds (attached, the holder stamp) stays unless ``force``;
- a leftover with an owner (kept with ``keep_sandbox=True`` for later tasks) stays unless ``include_owned``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sandbox_provider.sandbox.leftovers import SandboxRecord
from sandbox_provider.sandbox.spec import HOLDER_TAG

if TYPE_CHECKING:
    from sandbox_provider.sandbox.hook import SandboxHook

log = logging.getLogger(__name__)

__all__ = [
    "Leftover",
    "Listing",
    "SweepReport",
    "Target",
    "destroy",
    "list_sandboxes",
    "show",
    "sweep",
    "sweep_partials",
    "targets",
]

#: Task instance states in which the try that made a sandbox may still be using it.
ALIVE_STATES = frozenset({"running", "deferred", "queued", "scheduled", "restarting", "up_for_reschedule"})
#: The name ``airflow sandboxes`` shows for a local backend reached without a connection.
LOCAL_DEFAULTS = "(local defaults)"

#: ``(dag_id, run_id, task_id, map_index) -> (state, try_number)`` of a task instance, ``(None, None)``
#: when the metadata database has none; the orphan rule asks it.
TaskStates = Callable[[str, str, str, int], "tuple[str | None, int | None]"]


@dataclass(frozen=True)
class Target:
    """
    One place sandboxes are looked for: a connection and the hook built from it.

    :param name: the connection id, or ``(local defaults)`` for the local backend without one.
    :param hook: the backend's hook for it.
    """

    name: str
    hook: SandboxHook

    @property
    def backend(self) -> str:
        """The backend's short name: its folder under ``hooks/`` (``local``, ``docker``, ``modal``, ...)."""
        parts = type(self.hook).__module__.split(".")
        return parts[2] if len(parts) > 2 and parts[:2] == ["sandbox_provider", "hooks"] else type(self.hook).__name__


@dataclass(frozen=True)
class Leftover:
    """
    A sandbox a sweep looked at: where, which, and why it was (or would be) removed, kept, or failed.

    :param target: the connection it was found through.
    :param record: what its backend knows of it.
    :param reason: why it was chosen, why it was kept, or why removing it failed.
    """

    target: Target
    record: SandboxRecord
    reason: str

    def row(self) -> dict[str, str]:
        """A flat row for printing: connection, backend, handle, reason, and the task that made it."""
        made = self.record.made_by
        return {
            "conn_id": self.target.name,
            "backend": self.target.backend,
            "handle": self.record.handle,
            "made_by": made_by_text(made),
            "reason": self.reason,
        }


@dataclass
class Listing:
    """
    What :func:`list_sandboxes` found.

    :param found: ``(target, record)`` for each sandbox, in target then handle order.
    :param unlisted: target name -> one line: why it could not be listed, and what bounds its leftovers.
    """

    found: list[tuple[Target, SandboxRecord]] = field(default_factory=list)
    unlisted: dict[str, str] = field(default_factory=dict)

    def rows(self, now: float | None = None) -> list[dict[str, Any]]:
        """One flat dict per sandbox: backend, handle, state, age and lifetime left (seconds), owner, holder, task."""
        now = time.time() if now is None else now
        rows = []
        for target, record in self.found:
            age, left = record.age(now), record.lifetime_left(now)
            rows.append(
                {
                    "conn_id": target.name,
                    "backend": target.backend,
                    "handle": record.handle,
                    "state": record.state or "",
                    "age_seconds": None if age is None else int(age),
                    "lifetime_left_seconds": None if left is None else int(left),
                    "owner": record.owner or "",
                    "holder": record.holder or "",
                    **{name: record.made_by.get(name, "") for name in MADE_BY},
                }
            )
        return rows


@dataclass
class SweepReport:
    """
    What :func:`sweep` did.

    :param dry_run: nothing was removed; ``removed`` holds what a sweep would remove.
    :param removed: the sandboxes removed (or, in a dry run, to be removed), each with why.
    :param kept: leftovers left in place, each with why (held by a task, owned).
    :param failed: sandboxes (or whole targets, with an empty handle) that could not be removed or
        judged, each with the error.
    :param unlisted: target name -> why it could not be listed and what bounds its leftovers.
    """

    dry_run: bool = False
    removed: list[Leftover] = field(default_factory=list)
    kept: list[Leftover] = field(default_factory=list)
    failed: list[Leftover] = field(default_factory=list)
    unlisted: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when nothing failed."""
        return not self.failed

    def lines(self) -> list[str]:
        """The report as plain lines, one per sandbox and per target that could not be listed."""
        verb = "would remove" if self.dry_run else "removed"
        lines = [f"{verb} {_where(item)}: {item.reason}" for item in self.removed]
        lines += [f"kept {_where(item)}: {item.reason}" for item in self.kept]
        lines += [f"FAILED {_where(item)}: {item.reason}" for item in self.failed]
        lines += [f"not listed {name}: {why}" for name, why in self.unlisted.items()]
        count = len(self.removed)
        lines.append(
            f"{'Dry run: would remove' if self.dry_run else 'Removed'} {count} sandbox{'es' if count != 1 else ''}, "
            f"kept {len(self.kept)}, {len(self.failed)} failed."
        )
        return lines


MADE_BY = ("dag_id", "run_id", "task_id", "map_index", "try_number")


def made_by_text(made: Mapping[str, str]) -> str:
    """``dag/run/task[map] try N`` from a record's ``made_by``, or ``""`` when it carries no task stamps."""
    if not made.get("dag_id"):
        return ""
    index = made.get("map_index", "-1")
    text = "/".join(made.get(name, "?") for name in ("dag_id", "run_id", "task_id"))
    text += f"[{index}]" if index not in ("-1", "") else ""
    return f"{text} try {made['try_number']}" if made.get("try_number") else text


def _where(item: Leftover) -> str:
    made = made_by_text(item.record.made_by)
    return f"{item.target.backend} sandbox {item.record.handle or '(all)'} ({item.target.name}" + (
        f"; made by {made})" if made else ")"
    )


# -- where to look -----------------------------------------------------------------------------------------


def _sandbox_conn_types() -> dict[str, Any]:
    from sandbox_provider.hooks import connection_types

    return connection_types()


def _stored_conn_ids(types: Iterable[str]) -> list[str]:
    """Ids of the metadata database's connections of these types; empty where the database is out of reach (a task)."""
    try:
        from airflow.models import Connection
        from airflow.utils.session import create_session

        with create_session() as session:
            found = session.query(Connection.conn_id).filter(Connection.conn_type.in_(list(types))).all()
        return sorted(row[0] for row in found)
    except Exception as err:  # in a task the database is not reachable: env connections and explicit ids only
        log.debug("Could not list the metadata database's connections: %s", err)
        return []


def _env_conn_ids(types: Iterable[str]) -> list[str]:
    """Ids of ``AIRFLOW_CONN_*`` environment connections of these types."""
    from airflow.models import Connection

    wanted, found = set(types), []
    for key, value in os.environ.items():
        if not key.startswith("AIRFLOW_CONN_") or not value:
            continue
        conn_id = key[len("AIRFLOW_CONN_") :].lower()
        try:
            conn = (
                Connection.from_json(value, conn_id=conn_id)
                if value.lstrip().startswith("{")
                else Connection(conn_id=conn_id, uri=value)
            )
        except Exception:
            continue
        if conn.conn_type in wanted:
            found.append(conn_id)
    return sorted(found)


def _target(place: str | SandboxHook) -> Target:
    from sandbox_provider.hooks import get_sandbox_hook

    if isinstance(place, str):
        return Target(place, get_sandbox_hook(place))
    hook = get_sandbox_hook(place)
    return Target(str(getattr(hook, hook.conn_name_attr, None) or LOCAL_DEFAULTS), hook)


def targets(conn_ids: Sequence[str | SandboxHook] | None = None, *, backend: str | None = None) -> list[Target]:
    """
    The places to look: a hook for each connection id given (or the hook itself, when given one), or
    by default for every connection of a sandbox backend's type (in the metadata database and
    ``AIRFLOW_CONN_*``), plus the local backend with its defaults (``sandbox_local_default`` when it
    exists) when no such connection is among them; a connection found by default whose hook cannot be
    built is left out (:func:`list_sandboxes` and :func:`sweep` report it).

    :param backend: only targets of this backend (``local``, ``docker``, ``modal``, ``kubernetes``, ...).
    :raises ValueError: for a connection id given that no sandbox backend handles, or an unknown backend name.
    """
    return _discover(conn_ids, backend)[0]


def _discover(conn_ids: Sequence[str | SandboxHook] | None, backend: str | None) -> tuple[list[Target], dict[str, str]]:
    """:func:`targets`, and ``{connection id: why}`` for those found by default that could not be used."""
    problems: dict[str, str] = {}
    if conn_ids:
        found = [_target(place) for place in dict.fromkeys(conn_ids)]
    else:
        types = _sandbox_conn_types()
        ids = sorted(set(_stored_conn_ids(types)) | set(_env_conn_ids(types)))
        found = []
        for conn_id in ids:
            try:
                found.append(_target(conn_id))
            except Exception as err:  # one broken connection must not hide the others' sandboxes
                problems[conn_id] = f"could not use the connection: {type(err).__name__}: {err}"
        if "sandbox_local_default" not in ids:
            from sandbox_provider.hooks.local import LocalSandboxHook

            found.insert(0, Target(LOCAL_DEFAULTS, LocalSandboxHook()))
    if backend is not None:
        names = {path.split(":")[0].split(".")[-1] for path in _backend_paths()}
        if backend not in names:
            raise ValueError(f"Unknown backend {backend!r}: use one of {', '.join(sorted(names))}.")
        found = [target for target in found if target.backend == backend]
    return found, problems


def _backend_paths() -> Iterable[str]:
    from sandbox_provider.hooks import HOOK_CLASSES

    return HOOK_CLASSES


# -- listing -----------------------------------------------------------------------------------------------


def _made_in(record: SandboxRecord, dag_id: str | None) -> bool:
    """Whether a task of Dag ``dag_id`` made it, or its owner belongs to that Dag (always, for None)."""
    return dag_id is None or record.made_by.get("dag_id") == dag_id or (record.owner or "").startswith(dag_id + "/")


def _records(target: Target, dag_id: str | None = None) -> list[SandboxRecord]:
    """The target's records (of Dag ``dag_id``), each with its holder read from the sandbox where the listing lacks it."""
    hook = target.hook
    records = [record for record in hook.sandbox_records() if _made_in(record, dag_id)]
    if not hook.attachable:
        return records
    result = []
    for record in records:
        if HOLDER_TAG not in record.stamps:
            try:
                holder = hook.read_tags(record.handle).get(HOLDER_TAG)  # type: ignore[attr-defined]
            except Exception:  # ended meanwhile, or a stamp store that cannot be read: no holder known
                holder = None
            if holder:
                record = SandboxRecord(
                    record.handle, {**record.stamps, HOLDER_TAG: holder}, record.state, record.created_at
                )
        result.append(record)
    return result


def _cannot_list(target: Target, err: NotImplementedError) -> str:
    bound = target.hook.leftovers_bound
    return f"the {target.hook.display_name} backend cannot list its sandboxes; {bound}" if bound else str(err)


def list_sandboxes(
    conn_ids: Sequence[str | SandboxHook] | None = None, *, backend: str | None = None, dag_id: str | None = None
) -> Listing:
    """
    Every sandbox this provider made that the connections reach (see :func:`targets`), in any state.

    :param dag_id: only those a task of this Dag made, or whose owner belongs to it.

    :returns: a :class:`Listing`; a target that cannot list (or be reached) is in ``unlisted`` with why.
    :raises ValueError: for a connection id no sandbox backend handles.
    """
    found, problems = _discover(conn_ids, backend)
    listing = Listing(unlisted=dict(problems))
    for target in found:
        try:
            listing.found += [(target, record) for record in _records(target, dag_id)]
        except NotImplementedError as err:
            listing.unlisted[target.name] = _cannot_list(target, err)
        except Exception as err:
            listing.unlisted[target.name] = f"could not list: {type(err).__name__}: {err}"
    return listing


def show(handle: str, conn_ids: Sequence[str | SandboxHook] | None = None) -> tuple[Target, SandboxRecord]:
    """
    The sandbox ``handle`` and where it was found.

    :raises LookupError: if no target lists it.
    """
    listing = list_sandboxes(conn_ids)
    for target, record in listing.found:
        if record.handle == handle:
            return target, record
    where = ", ".join(sorted({t.name for t, _ in listing.found} | set(listing.unlisted))) or "no connection"
    raise LookupError(f"No sandbox {handle!r} found through {where}. Name its connection with --conn-id.")


def destroy(handle: str, conn_id: str, *, force: bool = False) -> None:
    """
    End the sandbox ``handle`` that connection ``conn_id`` reaches.

    :param force: end it even while a task holds it.
    :raises SandboxError: if a task holds it and ``force`` is not set, or the backend fails.
    """
    from sandbox_provider.sandbox.errors import SandboxError

    target = targets([conn_id])[0]
    handle = target.hook.check_handle(handle)
    if not force and target.hook.attachable:
        try:
            holder = target.hook.read_tags(handle).get(HOLDER_TAG)  # type: ignore[attr-defined]
        except Exception:
            holder = None
        if holder:
            raise SandboxError(f"Sandbox {handle} is held by {holder}; pass --force to destroy it anyway.")
    target.hook.destroy(handle, reason="an operator destroyed it with 'airflow sandboxes destroy'")


# -- sweeping ----------------------------------------------------------------------------------------------


def database_task_states(dag_id: str, run_id: str, task_id: str, map_index: int) -> tuple[str | None, int | None]:
    """
    A task instance's state and try number from the metadata database; inside a task (where the
    database is out of reach) its state through the Task SDK, with no try number.
    """
    try:
        from airflow.models.taskinstance import TaskInstance
        from airflow.utils.session import create_session

        with create_session() as session:
            row = (
                session.query(TaskInstance.state, TaskInstance.try_number)
                .filter_by(dag_id=dag_id, run_id=run_id, task_id=task_id, map_index=map_index)
                .one_or_none()
            )
        return (None, None) if row is None else (str(row[0]) if row[0] else "none", row[1])
    except Exception as err:
        from airflow.sdk import get_current_context

        try:
            ti = get_current_context()["ti"]
        except Exception:
            raise err from None
        found = ti.get_task_states(dag_id=dag_id, task_ids=[task_id], run_ids=[run_id], map_index=map_index)
        state = (found.get(run_id) or {}).get(task_id)
        return (str(state) if state else None), None


def _orphaned(record: SandboxRecord, task_states: TaskStates) -> str | None:
    """Why the task instance that made ``record`` no longer runs, or None while it may (or it carries no stamps)."""
    made = record.made_by
    if not all(made.get(name) for name in ("dag_id", "run_id", "task_id")):
        return None
    index = int(made.get("map_index") or -1)
    state, try_number = task_states(made["dag_id"], made["run_id"], made["task_id"], index)
    made_try = int(made.get("try_number") or 0)
    if state is None:
        return "the task instance that made it is no longer in the metadata database"
    if try_number is not None and made_try and try_number != made_try:
        return f"try {made_try} that made it is over (the task instance is at try {try_number}, {state})"
    if state in ALIVE_STATES:
        return None
    return f"the task instance that made it is {state}"


def _choose(
    record: SandboxRecord,
    *,
    now: float,
    older_than: float | None,
    orphans: bool,
    task_states: TaskStates,
) -> str | None:
    if record.expired(now):
        return f"past its lifetime ({int(now - (record.expires_at or now))}s ago)"
    age = record.age(now)
    if older_than is not None and age is not None and age >= older_than:
        return f"{int(age)}s old, older than {older_than:g}s"
    if orphans:
        return _orphaned(record, task_states)
    return None


def sweep(
    conn_ids: Sequence[str | SandboxHook] | None = None,
    *,
    backend: str | None = None,
    dag_id: str | None = None,
    older_than: float | None = None,
    orphans: bool = False,
    dry_run: bool = False,
    include_owned: bool = False,
    force: bool = False,
    now: float | None = None,
    task_states: TaskStates | None = None,
) -> SweepReport:
    """
    End this provider's leftover sandboxes on every target (see :func:`targets`).

    :param conn_ids: the connections to sweep; None: every connection of a sandbox type, plus the
        local backend's defaults.
    :param backend: only this backend's connections (``local``, ``docker``, ...).
    :param dag_id: only sandboxes a task of this Dag made, or whose owner belongs to it.
    :param older_than: also remove sandboxes older than this many seconds (where the backend knows
        when a sandbox was made), whatever lifetime they have left.
    :param orphans: also remove sandboxes whose creating task instance (their stamps) is no longer
        running according to the metadata database.
    :param dry_run: remove nothing; report what would be removed.
    :param include_owned: also remove owned sandboxes (kept with ``keep_sandbox=True``).
    :param force: also remove sandboxes a task holds now.
    :param now: Unix time (seconds) to judge lifetimes and ages by; default the current time.
    :param task_states: how the orphan rule reads a task instance's state; default the metadata database.
    :returns: a :class:`SweepReport`; it never raises for one sandbox or target, it reports it.
    :raises ValueError: for a bad argument or a connection id no sandbox backend handles.
    """
    from sandbox_provider.engine import metrics

    if older_than is not None and not older_than >= 0:
        raise ValueError(f"older_than must be a number of seconds >= 0, got {older_than!r}.")
    now = time.time() if now is None else now
    states = task_states or database_task_states
    found, problems = _discover(conn_ids, backend)
    report = SweepReport(dry_run=dry_run, unlisted=dict(problems))
    for target in found:
        try:
            records = _records(target, dag_id)
        except NotImplementedError as err:
            report.unlisted[target.name] = _cannot_list(target, err)
            continue
        except Exception as err:
            report.failed.append(Leftover(target, SandboxRecord(""), f"could not list: {type(err).__name__}: {err}"))
            continue
        removed = 0
        for record in records:
            try:
                reason = _choose(record, now=now, older_than=older_than, orphans=orphans, task_states=states)
            except Exception as err:
                report.failed.append(Leftover(target, record, f"could not judge: {type(err).__name__}: {err}"))
                continue
            if reason is None:
                continue
            if record.holder and not force:
                report.kept.append(Leftover(target, record, f"{reason}, but held by {record.holder} (--force)"))
                continue
            if record.owner and not include_owned:
                report.kept.append(Leftover(target, record, f"{reason}, but owned by {record.owner} (--include-owned)"))
                continue
            if not dry_run:
                try:
                    target.hook.destroy(record.handle, reason=f"a sweep removed it: {reason}")
                except Exception as err:
                    report.failed.append(Leftover(target, record, f"{type(err).__name__}: {err}"))
                    log.warning("Could not remove sandbox %s (%s)", record.handle, target.name, exc_info=True)
                    continue
                removed += 1
                log.info("Removed %s sandbox %s (%s): %s", target.backend, record.handle, target.name, reason)
            report.removed.append(Leftover(target, record, reason))
        metrics.count_leftovers_swept(target.hook, removed)
    return report


def sweep_partials(url: str, *, conn_id: str | None = None, older_than: float = 3600.0) -> list[str]:
    """
    Remove the ``.partial`` files exports left at ``url`` (a directory, or one destination file).

    :param older_than: leave files modified less than this many seconds ago; default one hour.
    :returns: the URLs removed. :raises ValueError: for a URL that is not a storage URL.
    """
    from sandbox_provider.engine.transfer import remove_stale_partials

    return remove_stale_partials(url, conn_id=conn_id, older_than=older_than)
