"""What the connection forms of the backends with an egress gateway (local, Docker) share: its settings."""

from __future__ import annotations

from sandbox_provider.hooks import egress
from sandbox_provider.sandbox.settings import Setting

#: The settings of the egress gateway (``hooks/egress``), for ``allow_egress_to`` and ``allow_egress_to_cidrs``.
EGRESS_SETTINGS = (
    Setting(
        "egress_ports",
        list,
        egress.DEFAULT_PORTS,
        label="Egress ports of listed hosts",
        help=(
            "The TCP ports the hosts of a spec's allow_egress_to are reached on, as a JSON list such as "
            "[443, 8443]; the ranges of allow_egress_to_cidrs are reached on any port."
        ),
        parse=egress.check_ports,
        items="integer",
    ),
    Setting(
        "egress_pins",
        dict,
        label="Egress pins (hostname to addresses)",
        help=(
            'A JSON object of hostname to address, or to a list of them, such as {"mirror.corp.example": '
            '"10.1.2.3"}: the egress gateway connects a listed name to these addresses instead of resolving it, '
            "and trusts them even in private or loopback ranges (an internal mirror). The name must still be "
            "in the spec's allow_egress_to."
        ),
        default_text="none (every name is resolved, and private answers are refused)",
        parse=egress.host_pins,
    ),
    Setting(
        "egress_max_connections",
        int,
        egress.MAX_CONNECTIONS,
        label="Egress connections at once",
        help=(
            "The most connections one sandbox's egress gateway holds at once; past it a connection is refused "
            "(HTTP 503) and the task log says so."
        ),
        minimum=1,
        maximum=egress.MAX_CONNECTIONS_LIMIT,
    ),
)
