"""The handlers of ``airflow sandboxes``: parse nothing, print what :mod:`sandbox_provider.cli.sweep` returns."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from sandbox_provider.cli import sweep as api

__all__ = ["destroy_command", "list_command", "show_command", "sweep_command", "sweep_partials_command"]


def _print(data: Any, output: str) -> None:
    if output == "json":
        print(json.dumps(data, indent=2, sort_keys=False))
    elif output == "yaml":
        import yaml

        print(yaml.safe_dump(data, sort_keys=False), end="")
    else:
        from airflow.cli.simple_table import AirflowConsole

        rows = data if isinstance(data, list) else [{"field": k, "value": str(v)} for k, v in data.items()]
        AirflowConsole().print_as(data=rows, output="table")


def _fail(message: str) -> None:
    print(message, file=sys.stderr)
    raise SystemExit(1)


def _conn_ids(args: Any) -> Sequence[str] | None:
    return getattr(args, "conn_id", None) or None


def list_command(args: Any) -> None:
    """``airflow sandboxes list``: every sandbox the connections reach, then a line per backend that cannot list."""
    try:
        listing = api.list_sandboxes(_conn_ids(args), backend=args.backend, dag_id=args.dag_id)
    except ValueError as err:
        _fail(str(err))
    rows = listing.rows()
    if args.output == "table":
        _print([{k: "" if v is None else v for k, v in row.items()} for row in rows], "table")
        for name, why in listing.unlisted.items():
            print(f"{name}: {why}")
    else:
        _print({"sandboxes": rows, "not_listed": listing.unlisted}, args.output)


def sweep_command(args: Any) -> None:
    """``airflow sandboxes sweep``: print what was removed, kept and failed; exit 1 if anything failed."""
    try:
        report = api.sweep(
            _conn_ids(args),
            backend=args.backend,
            dag_id=args.dag_id,
            older_than=args.older_than,
            orphans=args.orphans,
            dry_run=args.dry_run,
            include_owned=args.include_owned,
            force=args.force,
        )
    except ValueError as err:
        _fail(str(err))
    for line in report.lines():
        print(line)
    if not report.ok:
        raise SystemExit(1)


def sweep_partials_command(args: Any) -> None:
    """``airflow sandboxes sweep-partials URL``: print each file removed."""
    try:
        removed = api.sweep_partials(args.url, conn_id=args.conn_id, older_than=args.older_than)
    except (ValueError, OSError) as err:
        _fail(f"{type(err).__name__}: {err}")
    for url in removed:
        print(f"removed {url}")
    print(f"Removed {len(removed)} partial file{'s' if len(removed) != 1 else ''}.")


def show_command(args: Any) -> None:
    """``airflow sandboxes show HANDLE``: where the sandbox is, and everything its record holds."""
    try:
        target, record = api.show(args.handle, _conn_ids(args))
    except (LookupError, ValueError) as err:
        _fail(str(err))
    row = next(r for r in api.Listing([(target, record)]).rows())
    _print({**row, "stamps": dict(record.stamps)}, args.output)


def destroy_command(args: Any) -> None:
    """``airflow sandboxes destroy HANDLE --conn-id ID``."""
    from sandbox_provider.sandbox.errors import SandboxError

    try:
        api.destroy(args.handle, args.conn_id, force=args.force)
    except (SandboxError, ValueError) as err:
        _fail(str(err))
    print(f"Destroyed sandbox {args.handle} ({args.conn_id}).")
