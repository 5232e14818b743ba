"""Build the example backend against an installed qualia: `python build.py [build_dir]`.

This is all a C engine needs: qualia.get_include() for the header, nothing else from qualia.
"""

import os
import sys

from setuptools import Distribution, Extension

import qualia

HERE = os.path.dirname(os.path.abspath(__file__))


def build(build_dir: str) -> str:
    """Compile example_backend into build_dir and return that folder (add it to sys.path)."""
    ext = Extension(
        "example_backend",
        sources=[os.path.join(HERE, "example_backend.c")],
        include_dirs=[qualia.get_include()],
        extra_compile_args=["-O2", "-std=c11", "-Wall", "-Werror"],
    )
    dist = Distribution({"name": "example_backend", "ext_modules": [ext]})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib = build_dir
    cmd.build_temp = os.path.join(build_dir, "tmp")
    cmd.ensure_finalized()
    cmd.run()
    return build_dir


if __name__ == "__main__":
    out = build(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "build"))
    print(out)
