"""What a Flower app brings besides its ClientApp: its ``pyproject.toml``, run config and
initial model.

A Flower app is a directory whose ``pyproject.toml`` names its ``ServerApp`` and ``ClientApp``
(``[tool.flwr.app.components]``) and the values its code reads from ``context.run_config``
(``[tool.flwr.app.config]``). Murmura reads the same file, so the app's run config is what
``flwr run`` would give it, overridable with ``--run-config "k=v k2=v2"`` as in Flower.

A Message-API ``ClientApp`` cannot say what model it trains: in Flower the ``ServerApp``
builds the initial arrays and hands them to ``strategy.start(initial_arrays=...)``.
:func:`probe_server_app` runs the app's ``ServerApp`` against a grid that answers nothing and
captures the first training message it sends: the initial ``ArrayRecord`` and the train
``ConfigRecord`` (say ``{"lr": 0.01}``). The ``ServerApp`` is stopped there, before any round.

The ``ServerApp``'s own loop never runs (Murmura's aggregator replaces it), so the strategy
settings in its run config are mapped by :func:`server_app_settings`: ``fraction-train`` is the
sync cohort fraction; the other strategy keys Murmura knows are named in a one-line notice
with the flag to use instead.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
import sys
import threading

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: How far above an app's module its pyproject.toml may sit (package, app dir, repo root).
_PYPROJECT_LEVELS = 4
#: One KEY=VALUE of --run-config, a value quoted or not (as Flower's parser reads them).
_PAIR = re.compile(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)")
#: One probe at a time (``murmura run --in-process`` loads its clients' apps in threads).
_PROBE_LOCK = threading.Lock()
#: Node ids the probing grid offers, enough for any strategy's ``min_available_nodes``.
_PROBE_NODES = 1024


class FlowerAppError(ValueError):
    """A ``--flower-app`` value that cannot be loaded or used; the message says why."""


def require_flwr() -> None:
    """Fail with one line naming the extra when Flower is not installed."""
    try:
        import flwr  # noqa: F401
    except ImportError:
        raise FlowerAppError("running a Flower app needs Flower: pip install "
                             "'murmura[flower]'") from None


@dataclass
class FlowerProject:
    """A Flower app's ``pyproject.toml``: where it is and what it declares."""

    path: Path | None = None
    serverapp: str = ""
    clientapp: str = ""
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def root(self) -> Path | None:
        """The app directory (what goes on ``sys.path`` for its components to import)."""
        return self.path.parent if self.path is not None else None


def _toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except (OSError, ValueError) as exc:
        raise FlowerAppError(f"cannot read {str(path)[:80]}: {str(exc)[:80]}") from exc


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested tables as dotted keys, as Flower flattens its run config."""
    out: dict[str, Any] = {}
    for k, v in table.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def read_project(path: Path) -> FlowerProject:
    """The Flower app declared by the ``pyproject.toml`` at ``path``."""
    app = _toml(path).get("tool", {}).get("flwr", {}).get("app", {})
    components = app.get("components", {})
    return FlowerProject(path, str(components.get("serverapp", "")),
                         str(components.get("clientapp", "")),
                         _flatten(dict(app.get("config", {}))))


def find_project(start: Path) -> FlowerProject:
    """The Flower ``pyproject.toml`` at or above ``start`` (a file or directory), or an empty
    project when there is none (the app then has an empty run config)."""
    here = start if start.is_dir() else start.parent
    for d in [here, *here.parents][:_PYPROJECT_LEVELS]:
        candidate = d / "pyproject.toml"
        if candidate.is_file():
            project = read_project(candidate)
            if project.serverapp or project.clientapp or project.config:
                return project
    return FlowerProject()


def parse_run_config(text: str | None) -> dict[str, Any]:
    """``--run-config "k=v k2=v2"`` as Flower reads it: each value is a TOML value (``3``,
    ``0.1``, ``true``, ``"text"``); an unquoted word that is no TOML value is a string."""
    if not text:
        return {}
    out: dict[str, Any] = {}
    pos = 0
    for m in _PAIR.finditer(text):
        between = text[pos:m.start()].strip()
        if between:
            break
        key, raw = m.group(1), m.group(2)
        try:
            out[key] = tomllib.loads(f"v = {raw}")["v"]
        except ValueError:
            out[key] = raw.strip("'\"")
        pos = m.end()
    rest = text[pos:].strip()
    if rest:
        raise FlowerAppError(f"--run-config takes KEY=VALUE pairs separated by spaces, got "
                             f"{rest[:40]!r}")
    return out


def run_config(project: FlowerProject, overrides: str | dict[str, Any] | None) -> dict[str, Any]:
    """The app's run config: its pyproject's ``[tool.flwr.app.config]``, then ``overrides``."""
    extra = parse_run_config(overrides) if isinstance(overrides, str) else dict(overrides or {})
    return {**project.config, **extra}


@contextlib.contextmanager
def on_path(root: Path | None) -> Iterator[None]:
    """``root`` first on ``sys.path`` (left there: an app may import its modules lazily)."""
    if root is not None and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    yield


def import_ref(ref: str, root: Path | None = None) -> Any:
    """The object at ``MODULE:ATTR`` with ``root`` on ``sys.path``."""
    module_ref, sep, attr = ref.rpartition(":")
    if not sep or not module_ref or not attr:
        raise FlowerAppError(f"expected MODULE:ATTR, got {ref[:60]!r}")
    with on_path(root):
        try:
            obj: Any = importlib.import_module(module_ref)
        except Exception as exc:
            raise FlowerAppError(f"importing {module_ref[:60]!r} failed: "
                                 f"{type(exc).__name__}: {str(exc)[:80]}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise FlowerAppError(f"{module_ref[:60]} has no attribute {attr[:40]!r}")
        obj = getattr(obj, part)
    return obj


# -- the ServerApp's own settings -----------------------------------------------------------

#: Run-config keys a ServerApp's strategy reads (Flower's templates and examples name them so)
#: that Murmura has no setting for: each with what to use instead. Murmura's aggregator runs
#: in place of the ServerApp's loop, so nothing reads them.
_IGNORED_SERVER_KEYS: dict[str, str] = {
    "fraction-evaluate": "the server evaluates every version with the app's evaluate "
                         "handler; --client-eval-every N has the clients evaluate too",
    "min-train-nodes": "--min-clients",
    "min-fit-clients": "--min-clients",
    "min-available-nodes": "--min-clients",
    "min-available-clients": "--min-clients",
    "min-evaluate-nodes": "--client-eval-every",
    "min-evaluate-clients": "--client-eval-every",
}
#: Run-config keys for the share of nodes a round trains (FedAvg's ``fraction_train``; older
#: apps call it ``fraction-fit``): Murmura's ``cohort_fraction`` in sync mode.
_FRACTION_KEYS = ("fraction-train", "fraction-fit")


@dataclass(frozen=True)
class ServerAppSettings:
    """What a Flower app's run config says about the server loop, in Murmura's terms."""

    #: Murmura server settings by flat key (``cohort_fraction``), for the caller to apply.
    settings: dict[str, Any]
    #: One line saying which of the ServerApp's settings apply and which are ignored (with the
    #: flag to use instead); empty when the config has none of them.
    notice: str


def server_app_settings(config: dict[str, Any], *, mode: str, given: Iterable[str] = ()
                        ) -> ServerAppSettings:
    """Map the strategy settings in an app's run config to Murmura's server settings.

    ``num-server-rounds``, ``lr`` and ``local-epochs`` are mapped by
    :func:`~murmura.client.flower_load.app_defaults`. This adds ``fraction-train`` (or
    ``fraction-fit``): in ``sync`` mode each round's cohort is that share of the joined
    clients (``cohort_fraction``), as Flower's FedAvg samples ``fraction_train`` of the nodes;
    other modes have no cohorts, so it is ignored there. A setting the user gave (``given``
    holds ``cohort_fraction`` or ``cohort_size``) is kept. The other strategy keys Murmura
    knows (``fraction-evaluate``, ``min-*-nodes``...) are reported as ignored with the flag to
    use; keys it does not know are the app's own and are left alone.
    """
    taken = set(given)
    settings: dict[str, Any] = {}
    used: list[str] = []
    ignored: list[str] = []
    for key in _FRACTION_KEYS:
        if key not in config:
            continue
        value = config[key]
        shown = f"{key}={value!r}"
        if not (isinstance(value, int | float) and not isinstance(value, bool)
                and 0 < value <= 1):
            ignored.append(f"{shown} (not a share in (0, 1]; --cohort-fraction)")
        elif mode != "sync":
            ignored.append(f"{shown} (mode {mode} has no rounds to sample: every joined "
                           f"client trains; --buffer-size sets the updates per version)")
        elif taken & {"cohort_fraction", "cohort_size"}:
            ignored.append(f"{shown} (--cohort-fraction/--cohort-size given)")
        elif "cohort_fraction" not in settings:
            settings["cohort_fraction"] = float(value)
            used.append(f"{shown} -> --cohort-fraction {float(value):g}")
    for key, instead in _IGNORED_SERVER_KEYS.items():
        if key in config:
            ignored.append(f"{key}={config[key]!r} ({instead})")
    parts = []
    if used:
        parts.append("applied " + ", ".join(used))
    if ignored:
        parts.append("ignored, as Murmura runs its own server loop: " + "; ".join(ignored))
    notice = ("the Flower app's ServerApp settings: " + "; ".join(parts)) if parts else ""
    return ServerAppSettings(settings, notice)


# -- the ServerApp's initial arrays ----------------------------------------------------------

class _Captured(Exception):
    """Raised by the probing grid once the first training message is seen."""


def _probe_grid() -> Any:
    from flwr.app import Message
    from flwr.serverapp import Grid

    class ProbeGrid(Grid):
        """A grid with many idle nodes that records the first message and stops the app."""

        def __init__(self) -> None:
            self.first: Any = None

        def set_run(self, run: Any) -> None:
            pass

        @property
        def run(self) -> Any:  # type: ignore[override]
            return None

        def create_message(self, content: Any, message_type: str, dst_node_id: int,
                           group_id: str, ttl: float | None = None) -> Any:
            return Message(content=content, dst_node_id=dst_node_id,
                           message_type=message_type, group_id=group_id, ttl=ttl)

        def get_node_ids(self) -> Iterable[int]:
            return range(1, _PROBE_NODES + 1)

        def _capture(self, messages: Iterable[Any]) -> Any:
            for msg in messages:
                if msg.metadata.message_type.split(".")[0] == "train":
                    self.first = msg
                    raise _Captured
            return []

        def push_messages(self, messages: Iterable[Any]) -> Iterable[str]:
            return self._capture(messages)  # type: ignore[no-any-return]

        def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Any]:
            return []

        def send_and_receive(self, messages: Iterable[Any], *,
                             timeout: float | None = None) -> Iterable[Any]:
            return self._capture(messages)  # type: ignore[no-any-return]

    return ProbeGrid()


#: The private fields of flwr's TaskIdentity (flwr.supercore), saved and restored whole.
_IDENTITY = ("_task_id", "_run_id", "_node_id")


def _task_identity() -> Any:
    """flwr's process-wide task identity, which ``Message(...)`` reads for its run id (set by
    a SuperLink before it runs a ServerApp); None if this flwr has none."""
    try:
        from flwr.supercore.task_identity import TaskIdentity
    except ImportError:  # pragma: no cover - another flwr
        return None
    return TaskIdentity if all(hasattr(TaskIdentity, k) for k in _IDENTITY) else None


@dataclass
class ServerAppStart:
    """What a ServerApp sends in its first training round."""

    arrays: Any            # flwr.app.ArrayRecord
    config: dict[str, Any]  # the train ConfigRecord, without ``server-round``


def probe_server_app(project: FlowerProject, config: dict[str, Any], *, seed: int = 0
                     ) -> ServerAppStart:
    """Run the app's ``ServerApp`` until it sends its first training message and return that
    message's arrays and config. torch (if loaded) and numpy's global generators are seeded
    with ``seed`` and restored after, so a model the app initialises randomly is the same on
    every run."""
    from flwr.serverapp import ServerApp

    where = str(project.path)[:80]
    if not project.serverapp:
        raise FlowerAppError(f"{where} names no serverapp in [tool.flwr.app.components]")
    server_app = import_ref(project.serverapp, project.root)
    if not isinstance(server_app, ServerApp):
        raise FlowerAppError(f"{project.serverapp[:60]} is a {type(server_app).__name__}, not "
                             f"a Flower ServerApp")
    with _PROBE_LOCK:  # flwr's task identity and the global generators are per process
        return _probe(project, server_app, config, seed)


def _probe(project: FlowerProject, server_app: Any, config: dict[str, Any], seed: int
           ) -> ServerAppStart:
    import random

    import numpy as np
    from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

    grid = _probe_grid()
    context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(),
                      run_config=dict(config))
    np_state, py_state = np.random.get_state(), random.getstate()
    torch_mod = sys.modules.get("torch")
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    flwr_log.setLevel(logging.WARNING)  # the strategy's round banners
    identity = _task_identity()
    saved = {k: getattr(identity, k) for k in _IDENTITY} if identity is not None else {}
    try:
        if identity is not None:  # a strategy's messages need a run id; a SuperLink sets it
            for k in _IDENTITY:
                setattr(identity, k, 0)
        np.random.seed(seed % 2**32)
        random.seed(seed)
        fork = torch_mod.random.fork_rng() if torch_mod is not None \
            else contextlib.nullcontext()
        with fork, on_path(project.root):
            if torch_mod is not None:
                torch_mod.manual_seed(seed % 2**63)
            server_app(grid, context)
    except _Captured:
        pass
    except Exception as exc:
        raise FlowerAppError(f"running the ServerApp {project.serverapp[:60]} to learn its "
                             f"initial model failed: {type(exc).__name__}: "
                             f"{str(exc)[:80]}") from exc
    finally:
        for k, v in saved.items():
            setattr(identity, k, v)
        np.random.set_state(np_state)
        random.setstate(py_state)
        flwr_log.setLevel(level)
    first = grid.first
    if first is None:
        raise FlowerAppError(f"the ServerApp {project.serverapp[:60]} sent no training "
                             f"message, so its initial model is unknown")
    arrays = [r for r in first.content.array_records.values()]
    if len(arrays) != 1 or not isinstance(arrays[0], ArrayRecord):
        raise FlowerAppError(f"the ServerApp {project.serverapp[:60]}'s first training "
                             f"message carries {len(arrays)} ArrayRecords; expected 1")
    configs = [c for c in first.content.config_records.values() if isinstance(c, ConfigRecord)]
    train_config = {k: v for c in configs for k, v in c.items() if k != "server-round"}
    return ServerAppStart(arrays[0], train_config)


__all__ = ["FlowerAppError", "FlowerProject", "ServerAppSettings", "ServerAppStart",
           "find_project", "import_ref", "on_path", "parse_run_config", "probe_server_app",
           "read_project", "require_flwr", "run_config", "server_app_settings"]
