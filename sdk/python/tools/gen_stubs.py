#!/usr/bin/env python3
"""Generates the gRPC stubs the package ships (src/dinomo/_proto/) from the repository's
proto/proto/{kv,routing,monitor}.proto, with the pinned grpcio-tools of the `dev` extra.

    python tools/gen_stubs.py [OUT_DIR]

OUT_DIR defaults to src/dinomo/_proto. The proto files are mapped to the virtual path
`dinomo/_proto/` so that the generated `*_pb2_grpc.py` import their messages as
`from dinomo._proto import kv_pb2`, with no rewriting afterwards. `ci.sh` runs this into a
temporary directory and diffs it against the shipped files (the stub-sync check).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

HERE = Path(__file__).resolve().parent
PROTO_DIR = HERE.parent.parent.parent / "proto" / "proto"
PROTOS = ["kv.proto", "routing.proto", "monitor.proto"]
VIRTUAL = "dinomo/_proto"
INIT = '"""Generated gRPC stubs (tools/gen_stubs.py from proto/proto/*.proto): do not edit."""\n'


def generate(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).resolve().parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{VIRTUAL}={PROTO_DIR}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
        ] + [f"{VIRTUAL}/{p}" for p in PROTOS]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed: {' '.join(args)}")
        generated = Path(tmp) / VIRTUAL
        for f in sorted(os.listdir(generated)):
            shutil.copyfile(generated / f, out_dir / f)
    (out_dir / "__init__.py").write_text(INIT)


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE.parent / "src" / "dinomo" / "_proto"
    generate(out)
    print(f"stubs written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
