#!/usr/bin/env python3
"""Generate (or, with --check, verify) the Python stubs of every .proto in the repository.

Two packages own protos: ``gossipgrad.compression`` (compression/envelope.proto, the codec
library's wire envelope: message stubs only) and ``gossipgrad.proto`` (proto/gossip.proto, the
gossip service: message and gRPC stubs). Each stub is written next to its .proto and imports
others by its absolute ``gossipgrad.*`` module name. The grpcio-tools version is pinned in
pyproject.toml so that regeneration is byte-identical and CI can check freshness.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ProtoPackage:
    """One directory of .proto sources and the stubs generated from them."""

    #: Source directory, relative to the repository root (the stubs are written there too).
    directory: str
    #: Python package the directory installs as.
    package: str
    #: Whether to generate gRPC service stubs (``*_pb2_grpc.py``) as well.
    grpc: bool

    @property
    def path(self) -> Path:
        return ROOT / self.directory

    @property
    def outputs(self) -> tuple[str, ...]:
        return ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py") if self.grpc else ("_pb2.py", "_pb2.pyi")


PACKAGES = (
    ProtoPackage("compression", "gossipgrad.compression", grpc=False),
    ProtoPackage("proto", "gossipgrad.proto", grpc=True),
)


def generate(pkg: ProtoPackage, out_dir: Path) -> list[Path]:
    """Run protoc over ``pkg``'s .proto files, writing stubs into out_dir; return their paths."""
    from grpc_tools import protoc  # test extra; imported here so --help works without it

    with tempfile.TemporaryDirectory() as tmp:
        # Lay the sources out under their package path so generated imports are absolute.
        src_root = Path(tmp) / "src"
        rel = Path(*pkg.package.split("."))
        (src_root / rel).mkdir(parents=True)
        protos = sorted(pkg.path.glob("*.proto"))
        for p in protos:
            shutil.copy(p, src_root / rel / p.name)
        gen_root = Path(tmp) / "gen"
        gen_root.mkdir()
        args = [
            "grpc_tools.protoc",
            f"-I{src_root}",
            f"--python_out={gen_root}",
            f"--pyi_out={gen_root}",
            *([f"--grpc_python_out={gen_root}"] if pkg.grpc else []),
            *(str(rel / p.name) for p in protos),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {pkg.directory}/")
        written = []
        for f in sorted((gen_root / rel).iterdir()):
            if f.name.endswith(pkg.outputs):
                shutil.copy(f, out_dir / f.name)
                written.append(out_dir / f.name)
        return written


def stale_stubs(pkg: ProtoPackage) -> list[str]:
    """Names of ``pkg``'s stubs that are missing or differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(pkg, Path(tmp))
        return [
            f"{pkg.directory}/{f.name}"
            for f in fresh
            if not (pkg.path / f.name).exists() or not filecmp.cmp(f, pkg.path / f.name, False)
        ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if any generated stub is stale")
    args = parser.parse_args()
    if not args.check:
        for pkg in PACKAGES:
            for path in generate(pkg, pkg.path):
                print(f"wrote {path.relative_to(ROOT)}")
        return 0
    stale = [name for pkg in PACKAGES for name in stale_stubs(pkg)]
    if stale:
        print(f"stale generated stubs: {', '.join(stale)} -- run `make proto`", file=sys.stderr)
        return 1
    print("generated stubs are fresh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
