"""Build hook: generate the gRPC stubs from proto/ so they are never hand-edited or committed."""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
PROTO_ROOT = ROOT / "proto"


def generate_stubs() -> None:
    from grpc_tools import protoc
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    for proto in sorted(PROTO_ROOT.rglob("*.proto")):
        rel = proto.relative_to(PROTO_ROOT)
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={PROTO_ROOT}",
                f"--pyi_out={PROTO_ROOT}", f"--grpc_python_out={PROTO_ROOT}", str(rel)]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {rel}")


class BuildWithStubs(build_py):
    def run(self):
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
