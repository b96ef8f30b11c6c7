"""Structure rules: one-way layer dependencies, every Python folder a package, fresh stubs."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "murmura"
# layer -> the other layers it may import. Nothing imports simulation, examples or benchmarks.
MAY_IMPORT: dict[str, set[str]] = {
    "protocols": set(),
    "aggregation": set(),
    "tasks": set(),
    "client": {"protocols", "aggregation", "tasks", "edge"},
    "edge": {"protocols"},
    # server/leaf.py: a leaf aggregator's upstream link is a ClientRuntime
    "server": {"protocols", "aggregation", "tasks", "client"},
    # gossip mode: peers reuse the client's trainers and transport errors; no server
    "gossip": {"protocols", "aggregation", "tasks", "client", "edge"},
    "simulation": {"protocols", "aggregation", "tasks", "client", "server", "edge", "gossip"},
    "cli": {"protocols", "aggregation", "tasks", "client", "server", "edge", "simulation",
            "gossip"},
}
FORBIDDEN = {"aggregation": {"grpc", "google"}, "tasks": {"grpc", "google"}}


def _imports(source: str, package: list[str]) -> Iterator[tuple[int, str]]:
    """(line, module) of every import in ``source``, a module of ``package``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def _problems(source: str, layer: str, relative: Path, where: str) -> list[str]:
    """The layer rules ``source`` (the file ``relative`` inside ``layer``'s folder) breaks."""
    package = [PKG, *relative.parent.parts] if layer == "cli" else \
        [PKG, layer, *relative.parent.parts]
    problems = []
    for lineno, module in _imports(source, package):
        top, *rest = module.split(".")
        at = f"{where}:{lineno}"
        if top == PKG and rest and rest[0] not in MAY_IMPORT and rest[0] not in (
                "examples", "benchmarks"):
            rest = ["cli", *rest]  # the root package is cli/: murmura.config is the cli layer
        if top in MAY_IMPORT and top != "cli":
            problems.append(f"{at}: bare `{module}`, write `{PKG}.{module}`")
        elif top == PKG and rest and rest[0] in MAY_IMPORT and rest[0] != layer \
                and rest[0] not in MAY_IMPORT[layer]:
            problems.append(f"{at}: {layer}/ may not import {module}")
        elif top == PKG and rest and rest[0] in ("examples", "benchmarks"):
            problems.append(f"{at}: nothing may import {module}")
        elif top in FORBIDDEN.get(layer, ()):
            problems.append(f"{at}: {layer}/ may not import {module}")
    return problems


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_layer_dependencies_point_one_way(layer: str) -> None:
    problems = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        relative = path.relative_to(ROOT / layer)
        problems += _problems(path.read_text(), layer, relative, str(path.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("layer", "source", "bad"), [
    ("simulation", "from murmura.config import build", True),   # root modules are cli/
    ("simulation", "from murmura import simulate", True),
    ("server", "from .config import ServerConfig", False),       # murmura.server.config
    ("server", "from ..config import build", True),              # murmura.config: cli
    ("cli", "from murmura.config import build", False),
    ("cli", "from .simulate import add_parser", False),
    ("aggregation", "from murmura.protocols import Codec", True),
    ("aggregation", "import grpc", True),
    ("client", "from murmura.server import core", True),
])
def test_the_layer_rules_catch_what_they_should(layer: str, source: str, bad: bool) -> None:
    assert bool(_problems(source, layer, Path("x.py"), "x.py")) is bad


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_every_python_folder_is_a_package(layer: str) -> None:
    folders = {p.parent for p in (ROOT / layer).rglob("*.py")}
    missing = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists())
    assert not missing, f"add __init__.py to: {missing}"


def test_committed_stubs_match_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) regenerates the stubs")
    from murmura.protocols import _codegen

    found = _codegen.installed_generator_version()
    assert found == _codegen.PINNED_GRPCIO_TOOLS, (
        f"install the pinned generator: pip install grpcio-tools=={_codegen.PINNED_GRPCIO_TOOLS}"
        f" (found {found})"
    )
    committed_dir = Path(_codegen.__file__).parent
    for fresh in _codegen.generate(tmp_path):
        committed = committed_dir / fresh.name
        assert committed.read_bytes() == fresh.read_bytes(), (
            f"{fresh.name} is stale: run `python -m murmura.protocols._codegen`"
        )


def test_stub_drift_check_notices_a_changed_proto(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) regenerates the stubs")
    from murmura.protocols import _codegen

    edited = tmp_path / "murmura.proto"
    edited.write_text(_codegen.PROTO.read_text() + "\nmessage Extra { int32 x = 1; }\n")
    monkeypatch.setattr(_codegen, "PROTO", edited)
    fresh = {p.name: p.read_bytes() for p in _codegen.generate(tmp_path / "out")}
    committed = (Path(_codegen.__file__).parent / "murmura_pb2.py").read_bytes()
    assert fresh["murmura_pb2.py"] != committed
