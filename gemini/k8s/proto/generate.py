"""Regenerate the Python modules of the .proto files beside this file (needs grpcio-tools).

    python -m gemini.k8s.proto.generate           write *_pb2.py and *_pb2_grpc.py here
    python -m gemini.k8s.proto.generate --check   exit 1 if the committed modules differ from fresh ones

The generated modules (and their .pyi type stubs, for mypy) are committed, so an installation needs only grpcio
and protobuf at run time. Their imports are made relative (`from . import x_pb2`) so that they work inside this package.
"""
from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = ("deviceplugin_v1beta1.proto", "podresources_v1.proto")


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc   # test/dev dependency only
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    written = []
    for proto in PROTOS:
        rc = protoc.main(["grpc_tools.protoc", f"-I{HERE}", f"-I{include}", f"--python_out={out_dir}",
                          f"--grpc_python_out={out_dir}", f"--pyi_out={out_dir}", str(HERE / proto)])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto} (exit {rc})")
        stem = proto[: -len(".proto")]
        for name in (f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"):
            path = out_dir / name
            text = re.sub(rf"^import {stem}_pb2 as", f"from . import {stem}_pb2 as", path.read_text(), flags=re.M)
            path.write_text(text)
            written.append(path)
    return written


def main(argv: list[str]) -> int:
    if "--check" in argv:
        with tempfile.TemporaryDirectory() as tmp:
            stale = [p.name for p in generate(Path(tmp)) if not (HERE / p.name).exists()
                     or (HERE / p.name).read_text() != p.read_text()]
        if stale:
            print("out of date (run python -m gemini.k8s.proto.generate): " + ", ".join(stale), file=sys.stderr)
            return 1
        return 0
    for path in generate(HERE):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
