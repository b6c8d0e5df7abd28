"""Regenerate the Python modules of the ``.proto`` files in this folder.

``python -m starfed.proto.generate`` rewrites ``NAME_pb2.py`` and ``NAME_pb2.pyi`` next to this
file for every ``NAME.proto``, and ``NAME_pb2_grpc.py`` (client stub and servicer) for those that
define a ``service``. protoc derives a module's name and its registered file name from the path
the ``.proto`` has under the include root, so the schemas are compiled from a temporary
``starfed/proto/`` tree: the classes then report ``__module__ == "starfed.proto.codebook_pb2"``
(pickling and cross-file imports resolve inside the namespace) and the descriptor pool holds
``starfed/proto/codebook.proto`` instead of a bare ``codebook.proto`` that another library could
also register. ``tests/test_proto_generated.py`` checks the committed files are up to date.

The gRPC stubs check at import that the installed grpcio is at least the grpcio-tools version
that wrote them, which is why ``pyproject.toml`` pins both.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PACKAGE_PATH = Path("starfed", "proto")
_SERVICE = re.compile(r"^\s*service\s+\w+", re.MULTILINE)


def _protoc(args: list[str]) -> None:
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    if protoc.main(["grpc_tools.protoc", *args]) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


def generate(out_dir: Path = PROTO_DIR) -> list[Path]:
    """Compile every ``*.proto`` of this folder into ``out_dir``; return the written files."""
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        source_dir = root / "src" / PACKAGE_PATH
        build_dir = root / "build"
        source_dir.mkdir(parents=True)
        build_dir.mkdir()
        sources = sorted(PROTO_DIR.glob("*.proto"))
        for source in sources:
            shutil.copy(source, source_dir / source.name)
        include = f"--proto_path={root / 'src'}"
        _protoc(
            [
                include,
                f"--python_out={build_dir}",
                f"--pyi_out={build_dir}",
                *(str(PACKAGE_PATH / s.name) for s in sources),
            ]
        )
        services = [s for s in sources if _SERVICE.search(s.read_text())]
        if services:  # the grpc plugin writes a module for every input, so only these
            _protoc(
                [
                    include,
                    f"--grpc_python_out={build_dir}",
                    *(str(PACKAGE_PATH / s.name) for s in services),
                ]
            )
        out_dir.mkdir(parents=True, exist_ok=True)
        for generated in sorted((build_dir / PACKAGE_PATH).iterdir()):
            target = out_dir / generated.name
            shutil.copy(generated, target)
            written.append(target)
    return written


def main() -> int:
    for path in generate():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
