"""
The ``airflow sandboxes`` commands, registered through the provider info's ``cli`` entry (Airflow
3.2 and later): ``list``, ``sweep``, ``sweep-partials``, ``show`` and ``destroy``.

Airflow imports this module and calls :func:`get_cli_commands` for every ``airflow`` command line,
``airflow --help`` included, so it imports only Airflow's own CLI definitions: the handlers
(:mod:`sandbox_provider.cli.commands`) and the backends load when a ``sandboxes`` command runs. The
Python API under them is :mod:`sandbox_provider.cli.sweep`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["get_cli_commands"]

_HANDLERS = "sandbox_provider.cli.commands."


def get_cli_commands() -> list[Any]:
    """The ``sandboxes`` command group, as Airflow's CLI parser takes it."""
    from airflow.cli.cli_config import ActionCommand, Arg, GroupCommand, lazy_load_command

    conn_ids = Arg(
        ("--conn-id",),
        action="append",
        dest="conn_id",
        metavar="ID",
        help="A connection to look through (repeat for more). Default: every connection of a sandbox type, "
        "plus the local backend's defaults.",
    )
    backend = Arg(("--backend",), metavar="NAME", help="Only this backend's connections: local, docker, modal, ...")
    dag_id = Arg(("--dag-id",), metavar="DAG_ID", help="Only sandboxes a task of this Dag made (or it owns).")
    output = Arg(
        ("-o", "--output"),
        choices=("table", "json", "yaml"),
        default="table",
        metavar="(table, json, yaml)",
        help="Output format (default: table).",
    )
    older_than = Arg(
        ("--older-than",),
        type=float,
        metavar="SECONDS",
        help="Also remove sandboxes older than this, whatever lifetime they have left.",
    )
    dry_run = Arg(("--dry-run",), action="store_true", help="Remove nothing; print what would be removed.")
    force = Arg(("--force",), action="store_true", help="Also remove sandboxes a task holds (attached) now.")
    handle = Arg(("handle",), metavar="HANDLE", help="The sandbox's handle (airflow-sandbox-...).")
    commands = (
        ActionCommand(
            name="list",
            help="List the sandboxes this provider made, on every backend the connections reach",
            func=lazy_load_command(_HANDLERS + "list_command"),
            args=(conn_ids, backend, dag_id, output),
        ),
        ActionCommand(
            name="sweep",
            help="End leftover sandboxes: past their lifetime, older than --older-than, or --orphans",
            func=lazy_load_command(_HANDLERS + "sweep_command"),
            args=(
                conn_ids,
                backend,
                dag_id,
                older_than,
                Arg(
                    ("--orphans",),
                    action="store_true",
                    help="Also remove sandboxes whose creating task instance is no longer running "
                    "(read from the metadata database).",
                ),
                dry_run,
                Arg(
                    ("--include-owned",),
                    action="store_true",
                    help="Also remove owned sandboxes (kept with keep_sandbox=True for later tasks).",
                ),
                force,
            ),
        ),
        ActionCommand(
            name="sweep-partials",
            help="Remove the .partial files exports left at a storage URL",
            func=lazy_load_command(_HANDLERS + "sweep_partials_command"),
            args=(
                Arg(("url",), metavar="URL", help="A directory (file:///data/out/, s3://bucket/prefix/) or a file."),
                Arg(("--conn-id",), dest="conn_id", metavar="ID", help="The connection for the URL's store."),
                Arg(
                    ("--older-than",),
                    type=float,
                    default=3600.0,
                    metavar="SECONDS",
                    help="Leave files modified less than this long ago (default: 3600).",
                ),
            ),
        ),
        ActionCommand(
            name="show",
            help="Show one sandbox: where it is, its stamps, state and lifetime",
            func=lazy_load_command(_HANDLERS + "show_command"),
            args=(handle, conn_ids, output),
        ),
        ActionCommand(
            name="destroy",
            help="End one sandbox",
            func=lazy_load_command(_HANDLERS + "destroy_command"),
            args=(
                handle,
                Arg(("--conn-id",), dest="conn_id", metavar="ID", required=True, help="The connection reaching it."),
                force,
            ),
        ),
    )
    return [
        GroupCommand(
            name="sandboxes",
            help="List and sweep the sandboxes of the sandbox provider",
            subcommands=commands,
        )
    ]
