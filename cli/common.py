"""What the ``murmura`` commands share: the ``--config``/``-v``/``-q`` options, logging set from
``-v``/``-q``, and the task and server configs built from the config file and flags."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import TYPE_CHECKING, Any

from murmura.config import build

if TYPE_CHECKING:
    from murmura.server import ServerConfig
    from murmura.tasks import TaskConfig

__all__ = ["CONFIG_HELP", "QUIET_HELP", "VERBOSE_HELP", "add_common", "configure_logging",
           "task_and_server"]

CONFIG_HELP = ("TOML file with [task], [server], [client], [run], [simulation], [gossip] "
               "and [peer] tables, keys as the flags without dashes; flags override it; an "
               "unknown table or key is an error")
VERBOSE_HELP = "more log output (repeat for more: -vv)"
QUIET_HELP = "less output: no start-up or progress lines, only warnings and the result"


def add_common(p: argparse.ArgumentParser) -> None:
    """``--config FILE``, ``-v`` and ``-q``."""
    p.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    p.add_argument("-v", "--verbose", action="count", default=0, help=VERBOSE_HELP)
    p.add_argument("-q", "--quiet", action="count", default=0, help=QUIET_HELP)


def configure_logging(args: argparse.Namespace, default: int) -> None:
    """Log to stderr at ``default``, ten lower per ``-v`` and ten higher per ``-q``."""
    level = default - 10 * args.verbose + 10 * args.quiet
    logging.basicConfig(level=max(level, logging.DEBUG), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def task_and_server(args: argparse.Namespace, toml: dict[str, Any],
                    **overrides: Any) -> tuple[TaskConfig, ServerConfig]:
    """The ``[task]`` and ``[server]`` configs from the file, the flags and ``overrides`` (flat
    server keys); the clients' training seed is the run's seed."""
    from murmura.server import ServerConfig
    from murmura.tasks import TaskConfig

    task = build(TaskConfig, toml.get("task"), args, section="task")
    server = build(ServerConfig, toml.get("server"), args, section="server", overrides=overrides)
    if server.train.seed != server.seed:  # one seed for the run, shared with clients
        server = dataclasses.replace(server, train=dataclasses.replace(server.train,
                                                                       seed=server.seed))
    return task, server
