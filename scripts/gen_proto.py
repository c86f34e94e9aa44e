#!/usr/bin/env python3
"""Generate (or, with --check, verify) the Python stubs in proto/ from proto/*.proto.

The generated modules import each other as ``gossipgrad.proto.*``; the grpcio-tools version
is pinned in pyproject.toml so that regeneration is byte-identical and CI can check freshness.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent.parent / "proto"
OUTPUTS = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over every proto/*.proto, writing stubs into out_dir; return their paths."""
    from grpc_tools import protoc  # test extra; imported here so --help works without it

    with tempfile.TemporaryDirectory() as tmp:
        # Lay the sources out under gossipgrad/proto/ so generated imports are absolute.
        src_root = Path(tmp) / "src"
        pkg = src_root / "gossipgrad" / "proto"
        pkg.mkdir(parents=True)
        protos = sorted(PROTO_DIR.glob("*.proto"))
        for p in protos:
            shutil.copy(p, pkg / p.name)
        gen_root = Path(tmp) / "gen"
        gen_root.mkdir()
        args = [
            "grpc_tools.protoc",
            f"-I{src_root}",
            f"--python_out={gen_root}",
            f"--pyi_out={gen_root}",
            f"--grpc_python_out={gen_root}",
            *(str(Path("gossipgrad/proto") / p.name) for p in protos),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        written = []
        for f in sorted((gen_root / "gossipgrad" / "proto").iterdir()):
            if f.name.endswith(OUTPUTS):
                shutil.copy(f, out_dir / f.name)
                written.append(out_dir / f.name)
        return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if proto/ stubs are stale")
    args = parser.parse_args()
    if not args.check:
        for path in generate(PROTO_DIR):
            print(f"wrote {path.relative_to(PROTO_DIR.parent)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [
            f.name
            for f in fresh
            if not (PROTO_DIR / f.name).exists() or not filecmp.cmp(f, PROTO_DIR / f.name, False)
        ]
    if stale:
        print(f"stale generated stubs: {', '.join(stale)} -- run `make proto`", file=sys.stderr)
        return 1
    print("generated stubs are fresh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
