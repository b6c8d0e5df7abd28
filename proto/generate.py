"""Regenerate the Python modules of the ``.proto`` files in this folder.

``python -m starfed.proto.generate`` rewrites ``codebook_pb2.py`` and ``codebook_pb2.pyi`` next to
this file. protoc derives a module's name and its registered file name from the path the
``.proto`` has under the include root, so the schema is compiled from a temporary
``starfed/proto/`` tree: the classes then report ``__module__ == "starfed.proto.codebook_pb2"``
(pickling and cross-file imports resolve inside the namespace) and the descriptor pool holds
``starfed/proto/codebook.proto`` instead of a bare ``codebook.proto`` that another library could
also register. ``tests/test_proto_generated.py`` checks the committed files are up to date.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PACKAGE_PATH = Path("starfed", "proto")


def generate(out_dir: Path = PROTO_DIR) -> list[Path]:
    """Compile every ``*.proto`` of this folder into ``out_dir``; return the written files."""
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

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
        args = [
            "grpc_tools.protoc",
            f"--proto_path={root / 'src'}",
            f"--python_out={build_dir}",
            f"--pyi_out={build_dir}",
            *(str(PACKAGE_PATH / source.name) for source in sources),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
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
