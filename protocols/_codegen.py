"""Regenerate the committed protobuf/gRPC stubs from ``murmura.proto``.

The proto is staged as ``murmura/protocols/murmura.proto`` so the generated code imports
``from murmura.protocols import murmura_pb2`` with no rewriting (shared/style.md, 3.3). Run
``python -m murmura.protocols._codegen`` after editing the proto, with the pinned grpcio-tools
of the ``dev`` extra: the generator's version is written into the stubs' headers.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PINNED_GRPCIO_TOOLS = "1.81.1"
HERE = Path(__file__).resolve().parent
PROTO = HERE / "murmura.proto"
OUTPUTS = ("murmura_pb2.py", "murmura_pb2.pyi", "murmura_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Compile the proto into ``out_dir``; return the generated files."""
    from grpc_tools import protoc  # dev-only dependency

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "src" / "murmura" / "protocols"
        staged.mkdir(parents=True)
        shutil.copy(PROTO, staged / PROTO.name)
        gen = Path(tmp) / "gen"
        gen.mkdir()
        include = str(Path(protoc.__file__).parent / "_proto")
        rc = protoc.main(
            [
                "protoc",
                f"-I{Path(tmp) / 'src'}",
                f"-I{include}",
                f"--python_out={gen}",
                f"--pyi_out={gen}",
                f"--grpc_python_out={gen}",
                "murmura/protocols/murmura.proto",
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in OUTPUTS:
            target = out_dir / name
            shutil.copy(gen / "murmura" / "protocols" / name, target)
            written.append(target)
    return written


def installed_generator_version() -> str:
    from importlib.metadata import version

    return version("grpcio-tools")


def main() -> int:
    found = installed_generator_version()
    if found != PINNED_GRPCIO_TOOLS:
        print(
            f"grpcio-tools {found} is installed; the stubs are generated with "
            f"{PINNED_GRPCIO_TOOLS}: pip install grpcio-tools=={PINNED_GRPCIO_TOOLS}",
            file=sys.stderr,
        )
        return 1
    for path in generate(HERE):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
