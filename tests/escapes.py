"""
Ways a command leaves processes running after it ends, for the tests of backends that promise nothing a
command started outlives it: each escape ends in ``&`` or ``;``, so a tail can follow it.
"""

from __future__ import annotations

import pytest

#: Daemons by setsid, nohup and a double fork that ignores SIGTERM and SIGHUP.
DAEMON_ESCAPES = pytest.mark.parametrize(
    "escape",
    [
        "setsid sh -c 'sleep 300' > /dev/null 2>&1 &",
        "nohup sh -c 'sleep 300' > /dev/null 2>&1 &",
        "(setsid sh -c 'trap \"\" TERM HUP; (setsid sleep 300 &); sleep 300' &);",
    ],
    ids=["setsid", "nohup", "double-fork"],
)
#: The command ends by itself, or its deadline ends it.
COMMAND_ENDS = pytest.mark.parametrize("ends", ["by-itself", "at-deadline"])
