"""The live dashboard: a read-only web page of a running or finished run, served by the process.

:class:`LiveFeed` takes the snapshots a running aggregator posts; :class:`RunDirFeed` reads a
run directory. :class:`DashboardServer` serves either from its own thread (Starlette and
uvicorn: the optional ``ops`` extra); :func:`plan_bind` checks where it may listen.
The page's script and style sheet are package data (``static/``): no CDN, no build step.
"""

from typing import TYPE_CHECKING

from murmura.protocols.lazy import lazy_getattr

if TYPE_CHECKING:
    from murmura.server.dashboard.app import create_app
    from murmura.server.dashboard.feeds import (
        LiveFeed,
        MetricsTail,
        RunDirFeed,
        empty_snapshot,
        post_snapshots,
    )
    from murmura.server.dashboard.runner import DashboardServer, missing_dependency
    from murmura.server.dashboard.security import BindPlan, DashboardError, plan_bind

#: Where each name lives: the feeds and the rules import no web framework, so a command can
#: check its flags (and say what to install) before Starlette is needed.
_LAZY = {
    "create_app": "murmura.server.dashboard.app",
    "LiveFeed": "murmura.server.dashboard.feeds",
    "MetricsTail": "murmura.server.dashboard.feeds",
    "RunDirFeed": "murmura.server.dashboard.feeds",
    "empty_snapshot": "murmura.server.dashboard.feeds",
    "post_snapshots": "murmura.server.dashboard.feeds",
    "DashboardServer": "murmura.server.dashboard.runner",
    "missing_dependency": "murmura.server.dashboard.runner",
    "BindPlan": "murmura.server.dashboard.security",
    "DashboardError": "murmura.server.dashboard.security",
    "plan_bind": "murmura.server.dashboard.security",
}

__all__ = [
    "BindPlan",
    "DashboardError",
    "DashboardServer",
    "LiveFeed",
    "MetricsTail",
    "RunDirFeed",
    "create_app",
    "empty_snapshot",
    "missing_dependency",
    "plan_bind",
    "post_snapshots",
]

__getattr__ = lazy_getattr(__name__, _LAZY, globals())
