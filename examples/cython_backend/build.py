"""Build the Cython example backend against an installed qualia: `python build.py [build_dir]`.

A Cython backend needs two things from qualia: the folder of `qualia.h` (qualia.get_include())
for the C compiler, and the folder that holds the installed `qualia/_abi.pxd` for Cython's
`cimport qualia._abi`.  The generated C file goes to build_dir too, not next to the .pyx.
"""

import os
import sys

from Cython.Build import cythonize
from setuptools import Distribution, Extension

import qualia

HERE = os.path.dirname(os.path.abspath(__file__))


def build(build_dir: str) -> str:
    """Compile cython_backend into build_dir and return that folder (add it to sys.path)."""
    pxd_root = os.path.dirname(os.path.dirname(os.path.abspath(qualia.__file__)))
    ext = Extension(
        "cython_backend",
        sources=[os.path.join(HERE, "cython_backend.pyx")],
        include_dirs=[qualia.get_include()],
        extra_compile_args=["-O2"],
    )
    modules = cythonize([ext], include_path=[pxd_root], build_dir=os.path.join(build_dir, "c"),
                        quiet=True, compiler_directives={"language_level": 3})
    dist = Distribution({"name": "cython_backend", "ext_modules": modules})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib = build_dir
    cmd.build_temp = os.path.join(build_dir, "tmp")
    cmd.ensure_finalized()
    cmd.run()
    return build_dir


if __name__ == "__main__":
    out = build(sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "build"))
    print(out)
