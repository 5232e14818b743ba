"""Build the compiled core.

Release builds use the directives of the hot path (no bounds or wraparound checks).  Set
QUALIA_DEBUG=1 for a debug build: bounds checks on, -O0 -g, assertions on.  QUALIA_OPT (default
-O3) is the release build's optimisation flag.  QUALIA_PROFILE=1 keeps the release build (same
directives and optimisation) with its symbols and debug information, unstripped, for profilers
(perf, valgrind --tool=callgrind).  QUALIA_SANITIZE=1 adds AddressSanitizer and
UndefinedBehaviorSanitizer, QUALIA_SANITIZE=thread ThreadSanitizer (see tools/sanitize.sh).
"""

import glob
import os
import shutil

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("QUALIA_DEBUG", "") not in ("", "0")
PROFILE = os.environ.get("QUALIA_PROFILE", "") not in ("", "0")
SANITIZE = os.environ.get("QUALIA_SANITIZE", "") not in ("", "0")
THREAD_SANITIZE = os.environ.get("QUALIA_SANITIZE", "") == "thread"

# The header lives once, in csrc/; the wheel ships a copy inside the package so that
# qualia.get_include() finds it after installation.
PUBLIC_HEADERS = ["qualia.h"]


def _sync_headers():
    dst = os.path.join(HERE, "qualia", "include")
    os.makedirs(dst, exist_ok=True)
    for name in PUBLIC_HEADERS:
        src = os.path.join(HERE, "csrc", name)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(dst, name))
    init = os.path.join(dst, "__init__.py")
    if not os.path.exists(init):
        with open(init, "w") as f:
            f.write('"""C headers of the qualia ABI (see qualia.get_include())."""\n')


_sync_headers()


class BuildPy(build_py):
    def run(self):
        _sync_headers()
        super().run()


directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "embedsignature": True,
}

# Hidden visibility: the module exports PyInit__core and nothing else (no internal symbol can
# clash with, or be called by, another library).  Release builds are stripped.
extra_compile = ["-fvisibility=hidden"]
# QUALIA_OPT overrides the release optimisation level (tools/plant_bugs.py builds with -O0 to
# rebuild faster; the directives, and so the checks compiled in, stay the release ones)
OPT = os.environ.get("QUALIA_OPT", "-O3")
extra_compile += ["-O0", "-g", "-UNDEBUG"] if DEBUG else [OPT, "-g" if PROFILE else "-g0"]
extra_link = [] if DEBUG or SANITIZE or PROFILE else ["-Wl,--strip-all"]
if THREAD_SANITIZE:
    # ThreadSanitizer sees the extension's accesses and every pthread lock (the GIL included)
    # through its interceptors; CPython itself is not instrumented
    flags = ["-fsanitize=thread", "-fno-omit-frame-pointer"]
    extra_compile += flags + ["-g"]
    extra_link += flags
elif SANITIZE:
    flags = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
             "-fno-sanitize-recover=undefined"]
    extra_compile += flags + ["-g"]
    extra_link += flags

ext = Extension(
    "qualia._core",
    sources=["qualia/_core.pyx", "csrc/blake2b.c", "csrc/hash_backend.c"],
    depends=sorted(glob.glob(os.path.join("qualia", "core", "*", "*.pxi")) + glob.glob("csrc/*.h")),
    include_dirs=["csrc", numpy.get_include()],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
                   ("NPY_TARGET_VERSION", "NPY_1_23_API_VERSION")],
    extra_compile_args=extra_compile,
    extra_link_args=extra_link,
)

setup(
    ext_modules=cythonize([ext], compiler_directives=directives,
                          force=DEBUG or SANITIZE or PROFILE),
    cmdclass={"build_py": BuildPy},
)
