"""Build hooks: generate the gRPC stubs from proto/ so they are never hand-edited or committed, and compile the
connector's layout writer (sidecar/promptcache/client/_layoutc.c)."""
from pathlib import Path

from setuptools import Extension, find_namespace_packages, setup
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

# The vLLM connector's block-layout writer: plain C loaded with ctypes (no Python API, so the one library serves
# vLLM's interpreter too, which runs the checkout's sources). optional: without a C compiler the install goes on
# and vllm_layout.write_chunks copies with numpy (the same bits, about a third of the speed).
LAYOUT_WRITER = Extension("promptcache.client._layoutc", sources=["sidecar/promptcache/client/_layoutc.c"],
                          extra_compile_args=["-O3", "-std=c99"], optional=True)

# The sidecar's finite-values scan of every stored chunk (promptcache.contract.layout.values_finite), likewise.
FINITE_SCAN = Extension("promptcache.contract._scanc", sources=["sidecar/promptcache/contract/_scanc.c"],
                        extra_compile_args=["-O3", "-std=c99"], optional=True)

setup(packages=packages, package_dir=package_dir, cmdclass={"build_py": BuildWithStubs},
      ext_modules=[LAYOUT_WRITER, FINITE_SCAN])
