"""Finding and loading a Flower app as a Murmura trainer, and ``murmura client --flower-app``.

:func:`load_flower_client` resolves what the user names (``MODULE:ATTR``, ``FILE.py:ATTR`` or
a Flower app directory whose ``pyproject.toml`` names the ``clientapp``), imports it, builds
the ``Context`` Flower's simulation would give partition ``i`` of N (with the app's run
config), and wraps what it finds in the matching trainer of :mod:`murmura.client.flower`
(NumPyClient, ``client_fn``, legacy ``ClientApp``) or :mod:`murmura.client.flower_message`
(Message-API ``ClientApp``). A client with no initial model takes it from the app's
``ServerApp`` (:func:`~murmura.client.flower_app.probe_server_app`).

``murmura client --flower-app`` asks the app once for its properties (its ``@app.query()``
handler, or a NumPyClient's ``get_properties``: :func:`query_properties`), logs them, and
sends them in its Join's device profile as ``flwr.<name>`` entries (:func:`profile_extra`).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any

from murmura.client.flower import (
    FlowerTrainer,
    _ClientAppDriver,
    _Driver,
    _numpy_client,
    _NumPyDriver,
)
from murmura.client.flower_app import (
    FlowerAppError,
    FlowerProject,
    find_project,
    import_ref,
    on_path,
    probe_server_app,
    read_project,
    require_flwr,
    run_config,
)
from murmura.client.flower_message import MessageAppTrainer, is_message_app
from murmura.client.trainer import Trainer

log = logging.getLogger(__name__)


# -- loading MODULE:ATTR ---------------------------------------------------------------------

def _package_root(path: Path) -> tuple[Path, str] | None:
    """(the folder above the package, the dotted module name) for a file inside a package (a
    Flower app's ``pkg/client_app.py``, whose ``from pkg.task import ...`` needs that folder
    on ``sys.path``), else None."""
    parts = [path.stem]
    folder = path.resolve().parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return (folder, ".".join(parts)) if len(parts) > 1 else None


def _import(module_ref: str) -> Any:
    if module_ref.endswith(".py") or "/" in module_ref:
        path = Path(module_ref)
        if not path.is_file():
            raise FlowerAppError(f"no such file {module_ref[:60]!r}")
        packaged = _package_root(path)
        if packaged is not None:  # imported by its dotted name, its package's root on the path
            with on_path(packaged[0]):
                return _import(packaged[1])
        name = f"_murmura_flower_app_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise FlowerAppError(f"cannot import {module_ref[:60]!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        sys.path.insert(0, str(path.resolve().parent))  # its sibling modules import
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(name, None)
            raise FlowerAppError(f"importing {module_ref[:60]!r} failed: "
                                 f"{type(exc).__name__}: {str(exc)[:80]}") from exc
        finally:
            sys.path.remove(str(path.resolve().parent))
        return module
    try:
        return importlib.import_module(module_ref)
    except ModuleNotFoundError as exc:
        if exc.name and module_ref.startswith(exc.name):
            raise FlowerAppError(f"no module named {module_ref[:60]!r} (give an importable "
                                 f"module or a path to a .py file)") from None
        raise FlowerAppError(f"importing {module_ref[:60]!r} failed: {str(exc)[:80]}") from exc
    except Exception as exc:
        raise FlowerAppError(f"importing {module_ref[:60]!r} failed: "
                             f"{type(exc).__name__}: {str(exc)[:80]}") from exc


def _context(client_index: int, num_clients: int, config: dict[str, Any] | None = None
             ) -> Any:
    from flwr.app import Context, RecordDict

    return Context(run_id=0, node_id=client_index + 1,
                   node_config={"partition-id": client_index, "num-partitions": num_clients},
                   state=RecordDict(), run_config=dict(config or {}))


def app_defaults(config: dict[str, Any], train_config: dict[str, Any]) -> dict[str, Any]:
    """Server settings a Flower app's own files suggest, by Murmura's flat key: ``lr`` from
    the ServerApp's train config or ``lr`` in the run config, ``local_epochs`` from
    ``local-epochs``, ``max_versions`` from ``num-server-rounds``. The command line uses them
    where the user gave no value, so an app runs with the settings it was written for."""
    out: dict[str, Any] = {}
    lr = train_config.get("lr", config.get("lr"))
    if isinstance(lr, int | float) and not isinstance(lr, bool) and lr > 0:
        out["lr"] = float(lr)
    for key, name in (("local-epochs", "local_epochs"), ("num-server-rounds", "max_versions")):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            out[name] = value
    return out


def _resolve(ref: str) -> tuple[str, FlowerProject | None]:
    """``ref`` as MODULE:ATTR, reading a Flower app directory's ``pyproject.toml`` for its
    ``clientapp`` (the directory's project is returned with it)."""
    path = Path(ref)
    if ":" not in ref and path.is_dir():
        if not (path / "pyproject.toml").is_file():
            raise FlowerAppError(f"{ref[:60]} is a directory without a pyproject.toml")
        project = read_project(path / "pyproject.toml")
        if not project.clientapp:
            raise FlowerAppError(f"{ref[:60]}/pyproject.toml names no clientapp in "
                                 f"[tool.flwr.app.components]")
        return project.clientapp, project
    return ref, None


def load_flower_client(ref: str, *, client_index: int = 0, num_clients: int = 1,
                       run_config_overrides: str | dict[str, Any] | None = None,
                       seed: int = 0) -> FlowerTrainer | MessageAppTrainer:
    """Load ``MODULE:ATTR`` (MODULE importable, or a path to a ``.py`` file) or a Flower app
    directory as a trainer for partition ``client_index`` of ``num_clients``.

    ``run_config_overrides`` (``"k=v k2=v2"`` or a dict) update the run config from the app's
    ``pyproject.toml``; ``seed`` seeds the ServerApp run that gives the initial model when the
    app has no ``get_parameters``. Raises :class:`FlowerAppError` with a one-line reason for
    a malformed reference, a missing module or attribute, or an object that is no Flower
    client.
    """
    import inspect

    require_flwr()
    from flwr.client import NumPyClient
    from flwr.clientapp import ClientApp

    ref, project = _resolve(ref)
    module_ref, sep, attr = ref.rpartition(":")
    if not sep or not module_ref or not attr:
        raise FlowerAppError(f"--flower-app must be MODULE:ATTR, FILE.py:ATTR or an app "
                             f"directory, got {ref[:60]!r}")
    if project is not None:
        obj: Any = import_ref(ref, project.root)
        module = sys.modules[module_ref]
    else:
        module = _import(module_ref)
        obj = module
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise FlowerAppError(f"{module_ref[:60]} has no attribute {attr[:40]!r}")
            obj = getattr(obj, part)
        where = getattr(module, "__file__", None)
        project = find_project(Path(where)) if where else FlowerProject()
    config = run_config(project, run_config_overrides)
    context = _context(client_index, num_clients, config)

    def from_server_app(why: str) -> Any:
        if project is None or not project.serverapp:
            raise FlowerAppError(f"{ref[:60]}: {why}, and no pyproject.toml with a serverapp "
                                 f"in [tool.flwr.app.components] was found next to it to "
                                 f"take the initial model from")
        return probe_server_app(project, config, seed=seed)

    if isinstance(obj, ClientApp) and is_message_app(obj):
        start = from_server_app("a ClientApp with @app.train() handlers has no model of its "
                                "own")
        trainer: FlowerTrainer | MessageAppTrainer = MessageAppTrainer(
            obj, context, start.arrays, name=f"ClientApp {attr[:40]}",
            train_config=start.config)
        trainer.app_defaults = app_defaults(config, start.config)
        trainer.run_config = config
        return trainer
    if isinstance(obj, ClientApp):
        driver: _Driver = _ClientAppDriver(obj, context)
    else:
        made = obj
        if isinstance(obj, type) and issubclass(obj, NumPyClient):
            made = obj()
        elif callable(obj) and _numpy_client(obj) is None:
            try:
                n_args = len(inspect.signature(obj).parameters)
            except (TypeError, ValueError):
                n_args = 1
            try:
                made = obj(context) if n_args >= 1 else obj()
            except Exception as exc:
                raise FlowerAppError(f"calling {attr[:40]}({'context' if n_args else ''}) "
                                     f"failed: {type(exc).__name__}: {str(exc)[:80]}") from exc
        client = _numpy_client(made)
        if client is None:
            raise FlowerAppError(f"{attr[:40]!r} is a {type(obj).__name__}; expected a Flower "
                                 f"NumPyClient, a client_fn(context) returning one, or a "
                                 f"ClientApp")
        driver = _NumPyDriver(client)
    template = driver.get_parameters()
    train_config: dict[str, Any] = {}
    if not template:  # NumPyClient's default get_parameters returns no arrays
        start = from_server_app("the client's get_parameters gives no arrays")
        template = list(start.arrays.to_numpy_ndarrays())
        train_config = start.config
    trainer = FlowerTrainer(driver, template)
    trainer.app_defaults = app_defaults(config, train_config)
    trainer.run_config = config
    return trainer


def app_project(ref: str) -> FlowerProject:
    """The ``pyproject.toml`` of the app at ``ref`` (as :func:`load_flower_client` finds it),
    without importing the app's module (a ``MODULE:ATTR`` is located with
    ``importlib.util.find_spec``, which imports its parent packages only). An empty project
    when there is none or ``ref`` cannot be located: loading the app says why."""
    try:
        path = Path(ref)
        if ":" not in ref and path.is_dir():
            return _resolve(ref)[1] or FlowerProject()
        module_ref = ref.rpartition(":")[0]
        if module_ref.endswith(".py") or "/" in module_ref:
            file = Path(module_ref)
            return find_project(file) if file.is_file() else FlowerProject()
        spec = importlib.util.find_spec(module_ref) if module_ref else None
        if spec is not None and spec.origin:
            return find_project(Path(spec.origin))
    except (FlowerAppError, ImportError, ValueError, OSError):
        pass
    return FlowerProject()


def app_run_config(ref: str, overrides: str | dict[str, Any] | None = None) -> dict[str, Any]:
    """The run config the app at ``ref`` runs with (its pyproject's, then ``overrides``),
    read without loading the app: what a server needs before it builds its core."""
    return run_config(app_project(ref), overrides)


#: Profile entries a client's properties may fill at most (the server takes 16 in all).
MAX_PROPERTY_ENTRIES = 12
#: The prefix of those entries' keys in the join profile's ``extra``.
PROPERTY_PREFIX = "flwr."


def query_properties(trainer: Any, who: str = "the Flower client") -> dict[str, Any]:
    """Ask the app for its properties once (its ``@app.query()`` handler, or a NumPyClient's
    ``get_properties``) and log them in one line; ``{}`` when it has neither. A handler that
    fails is logged as a warning and the client carries on: Murmura asks on its own, and an
    app written for its ServerApp's queries may expect other config keys."""
    query = getattr(trainer, "query", None)
    if query is None:
        return {}
    try:
        props = query()
    except FlowerAppError as exc:
        log.warning("%s: asking the app for its properties failed (ignored): %s", who, exc)
        return {}
    if props is None:
        return {}
    log.info("%s properties (its query handler): %s", who,
             ", ".join(f"{k}={v!r}" for k, v in sorted(props.items())) or "none")
    return dict(props)


def profile_extra(props: dict[str, Any]) -> dict[str, str]:
    """Properties as join-profile entries (``DeviceProfile.extra``): ``flwr.<name>`` = the
    value as text, within the server's limits (keys up to 64 characters, values up to 256,
    printable; at most :data:`MAX_PROPERTY_ENTRIES`, by name)."""
    out: dict[str, str] = {}
    for k in sorted(props)[:MAX_PROPERTY_ENTRIES]:
        v = props[k]
        text = ("true" if v else "false") if isinstance(v, bool) else str(v)
        key = "".join(c for c in f"{PROPERTY_PREFIX}{k}" if c.isprintable())[:64]
        out[key] = "".join(c for c in text if c.isprintable())[:256]
    return out


def run_flower_client(cfg: Any, ref: str, *, identity: Any = None,
                      run_config_overrides: str | dict[str, Any] | None = None) -> Any:
    """``murmura client --flower-app REF``: join ``cfg.server`` with the Flower client as the
    trainer (partition ``cfg.client_index`` of ``cfg.num_clients``) until the server says
    stop; returns the runtime's stats."""
    import torch

    from murmura.client.runtime import ClientRuntime, RetryPolicy
    from murmura.client.status import StatusTrainer
    from murmura.client.transport import GrpcTransport
    from murmura.protocols import DeviceProfile
    from murmura.protocols.tls import channel_credentials

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if identity is None:
        identity = cfg.node_key()  # a bad key file fails before the app is loaded
    tls = cfg.tls()
    if tls is not None:
        channel_credentials(tls)
    trainer: Trainer = load_flower_client(ref, client_index=cfg.client_index,
                                          num_clients=cfg.num_clients,
                                          run_config_overrides=run_config_overrides)
    log.info("Flower client %s: %d arrays, %d values", ref[:60], len(trainer.spec.tensors),
             trainer.spec.size)
    # the app's properties travel in the join's device profile (the server keeps them with
    # the client's session), as a ServerApp would have asked for them with a query message
    props = query_properties(trainer, f"Flower client {cfg.client_index}")
    profile = DeviceProfile(extra=profile_extra(props))
    running = StatusTrainer(trainer, cfg.status_file) if cfg.status_file else trainer
    transport = GrpcTransport(cfg.server, tls=tls, insecure=cfg.insecure)
    try:
        runtime = ClientRuntime(transport, running, client_id=cfg.client_id, identity=identity,
                                profile=profile, token=cfg.token, codec=cfg.codec,
                                wait_s=cfg.wait_s,
                                retry=RetryPolicy(give_up_after_s=cfg.give_up_after_s),
                                give_up_unreached_s=cfg.give_up_unreached_s)
        log.info("client id %s", runtime.client_id)
        return runtime.run(max_tasks=cfg.max_tasks)
    finally:
        transport.close()


__all__ = ["MAX_PROPERTY_ENTRIES", "PROPERTY_PREFIX", "app_defaults", "app_project",
           "app_run_config", "load_flower_client", "profile_extra", "query_properties",
           "run_flower_client"]
