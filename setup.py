"""Build hook: generate the gRPC stubs from proto/ so they are never hand-edited or committed."""
from pathlib import Path

from setuptools import find_namespace_packages, setup
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


# `promptcache` is one import package whose parts live in three top-level folders; map each subpackage to
# its folder explicitly (setuptools cannot merge one namespace from several `where` roots by itself).
SOURCE_ROOTS = ("sidecar", "operator", "proto")
packages, package_dir = [], {}
for root in SOURCE_ROOTS:
    for pkg in find_namespace_packages(where=root, include=["promptcache", "promptcache.*"]):
        if pkg == "promptcache" and root != "sidecar":
            continue
        packages.append(pkg)
        package_dir[pkg] = f"{root}/{pkg.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir, cmdclass={"build_py": BuildWithStubs})
