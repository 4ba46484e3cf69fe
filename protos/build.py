"""Regenerate the Python gRPC code beside the .proto files: `python -m protos.build`.

`generate(out_dir)` writes to another folder so a test can compare a fresh
generation with the committed files.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
ROOT = PROTO_DIR.parent


def generate(out_dir: Path) -> list[Path]:
    """Compile every protos/*.proto into `out_dir`/protos/; returns the files written."""
    protos = sorted(PROTO_DIR.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}"] + [str(p.relative_to(ROOT)) for p in protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted((out_dir / "protos").glob("*_pb2*.py*"))


if __name__ == "__main__":
    written = generate(ROOT)
    print("\n".join(str(p.relative_to(ROOT)) for p in written))
    sys.exit(0)
