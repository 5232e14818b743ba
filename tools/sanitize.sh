#!/usr/bin/env bash
# Build qualia._core twice with AddressSanitizer + UndefinedBehaviorSanitizer and run the tests
# under each build, every build in its own throwaway virtual environment; on request, a third
# build with ThreadSanitizer.
#
#   tools/sanitize.sh                             # the whole suite under both builds
#   tools/sanitize.sh tests/differential -x       # these pytest arguments, under both builds
#   QUALIA_SANITIZE_BUILDS=thread tools/sanitize.sh   # the thread tests under ThreadSanitizer
#
# The builds:
#   debug    QUALIA_SANITIZE=1 QUALIA_DEBUG=1: -O0 -g, Cython bounds/wraparound checks on.
#   release  QUALIA_SANITIZE=1 alone: the release directives (no bounds or wraparound checks)
#            and -O3, as shipped.  Bounds checks turn an out-of-bounds index into an
#            IndexError, so the debug build alone cannot see that class of bug; this one lets
#            ASan see the raw access instead.
#   thread   QUALIA_SANITIZE=thread: the release directives, -O3 -g -fsanitize=thread.  Only the
#            extension is instrumented; CPython is not, but ThreadSanitizer intercepts every
#            pthread lock, the GIL's included, so it knows what the GIL orders and reports only
#            races of the extension's own accesses (run()'s GIL-free loop against another
#            thread, the KV event ring).  Without arguments it runs the tests that start
#            threads (THREAD_TESTS below), not the whole suite: its shadow memory makes the
#            test that allocates the largest plans (2**31-token budgets) take tens of GiB.
#            Not in the default: add it to QUALIA_SANITIZE_BUILDS.
# debug and release add -fsanitize=address,undefined -fno-sanitize-recover=undefined (see
# setup.py).
#
# What runs where (no arguments): the whole suite under both builds (about 5 minutes here, see
# below).  QUALIA_SANITIZE_QUICK=1 keeps the whole suite under the release build but runs only the
# facade's edge cases, the ownership, seeded-stress and seed-vs-twin tests under the debug build
# (about 3.7 minutes).
#
# What it does, per build:
#   1. copies the working tree -- the files git tracks plus untracked files it does not ignore
#      (`git ls-files`; outside a git checkout, every file but build outputs) -- with python, to
#      a fresh folder under one mktemp -d work folder, so the build never touches the checkout's
#      qualia/_core.c or build/, and two runs (or two builds) never share a folder;
#   2. creates a venv there with Cython, numpy, pytest, hypothesis and setuptools pinned to the
#      versions of the python that runs this script, and pip-installs the copy into it
#      (--no-build-isolation), then checks that the extension really is instrumented;
#   3. runs pytest from outside the checkout, capturing sys.stdout/stderr only (--capture=sys:
#      a sanitizer report goes to file descriptor 2, which fd capture would swallow when the
#      report aborts the interpreter), with QUALIA_TEST_INSTALLED=1, PYTHONMALLOC=malloc
#      (so that PyMem blocks go through ASan's malloc instead of pymalloc arenas),
#      LD_PRELOAD=$(gcc -print-file-name=libasan.so),
#      ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:strict_string_checks=1:
#                   detect_stack_use_after_return=1:check_initialization_order=1
#      (detect_leaks=0: CPython itself does not free everything at exit; tests/core/test_leaks.py
#      checks the core's own leaks with tracemalloc) and
#      UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1.
#      it runs 2,000 instead of 10,000 cycles here (QUALIA_LEAK_CYCLES) and skips its
#      RSS check (ASan's quarantine keeps freed memory resident).
#   Before the first test run, a preflight checks that ASan, set up exactly this way, aborts the
#   interpreter on an 8-byte PyMem heap overflow.
#   Any ASan/UBSan report aborts the run with a nonzero status.  gcc and libasan/libubsan are
#   installed with apt-get only if they are missing; nothing else is needed (no rsync).
#   The thread build runs with LD_PRELOAD=$(gcc -print-file-name=libtsan.so) instead and
#   TSAN_OPTIONS=halt_on_error=1:report_signal_unsafe=0 (a report aborts the interpreter);
#   it has no preflight (nothing in CPython races on purpose), only the check that the
#   extension is instrumented.  libtsan is installed only if that build is asked for.
#
# Env: PYTHON (interpreter to base the venvs on, default python3), QUALIA_SANITIZE_BUILDS
#      ("release debug" by default; any of release, debug, thread), QUALIA_SANITIZE_QUICK=1,
#      QUALIA_SANITIZE_KEEP=1 (keep the work folder and print where it is).
#
# Time here (2 shared CPU cores, gcc 12, Python 3.11): 307 s in all -- release: 93 s for the venv
# and the build, 83 s for the whole suite (2119 tests); debug: 37 s to build, 92 s for the whole
# suite -- and clean: every test passed, no ASan or UBSan report.  With QUALIA_SANITIZE_QUICK=1:
# 222 s (the debug build runs 91 tests in 19 s).

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
BUILDS="${QUALIA_SANITIZE_BUILDS:-release debug}"
START=$(date +%s)

apt_install() {
    echo "sanitize.sh: installing $*" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
}
command -v gcc >/dev/null 2>&1 || apt_install gcc
GCC_MAJOR="$(gcc -dumpversion | cut -d. -f1)"
[ -e "$(gcc -print-file-name=libasan.so)" ] || apt_install "libasan${GCC_MAJOR}" "libgcc-${GCC_MAJOR}-dev"
[ -e "$(gcc -print-file-name=libubsan.so)" ] || apt_install libubsan1 "libgcc-${GCC_MAJOR}-dev"
LIBASAN="$(gcc -print-file-name=libasan.so)"
[ -e "$LIBASAN" ] || { echo "sanitize.sh: libasan not found ($LIBASAN)" >&2; exit 2; }
LIBTSAN=""
if [[ " $BUILDS " == *" thread "* ]]; then
    [ -e "$(gcc -print-file-name=libtsan.so)" ] || apt_install libtsan2 "libgcc-${GCC_MAJOR}-dev"
    LIBTSAN="$(gcc -print-file-name=libtsan.so)"
    [ -e "$LIBTSAN" ] || { echo "sanitize.sh: libtsan not found ($LIBTSAN)" >&2; exit 2; }
fi

WORK="$(mktemp -d /tmp/qualia-sanitize.XXXXXX)"
cleanup() {
    if [ "${QUALIA_SANITIZE_KEEP:-0}" = 1 ]; then
        echo "sanitize.sh: kept $WORK" >&2
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT

# copy_tree DEST: the checkout's source files (what git tracks or would track), with python
copy_tree() {
    "$PYTHON" - "$ROOT" "$1" <<'EOF'
import os, shutil, subprocess, sys
root, dest = sys.argv[1], sys.argv[2]
SKIP_DIRS = {".git", "build", "dist", "__pycache__", ".hypothesis", ".pytest_cache"}
try:
    out = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others",
                          "--exclude-standard"], check=True, capture_output=True).stdout
    files = [f for f in out.decode().split("\0") if f]
except (OSError, subprocess.CalledProcessError):
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.endswith(".egg-info")]
        files += [os.path.relpath(os.path.join(d, n), root) for n in names]
for f in files:
    if f.endswith((".so", ".o", ".pyc")) or f == os.path.join("qualia", "_core.c"):
        continue
    src = os.path.join(root, f)
    if not os.path.isfile(src):  # deleted in the working tree but still in the index
        continue
    os.makedirs(os.path.dirname(os.path.join(dest, f)) or dest, exist_ok=True)
    shutil.copy2(src, os.path.join(dest, f))
EOF
}

# the venvs: the same versions of the build and test tools as $PYTHON has
PINS=$("$PYTHON" - <<'EOF'
from importlib.metadata import version, PackageNotFoundError
out = []
for name in ("Cython", "numpy", "pytest", "hypothesis", "setuptools", "wheel"):
    try:
        out.append(f"{name}=={version(name)}")
    except PackageNotFoundError:
        out.append(name)
print(" ".join(out))
EOF
)

ASAN_OPTS="detect_leaks=0:halt_on_error=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1"
UBSAN_OPTS="halt_on_error=1:print_stacktrace=1"
TSAN_OPTS="halt_on_error=1:report_signal_unsafe=0"
# the thread build's default selection: every test file that starts threads
THREAD_TESTS=(tests/robustness/test_ownership.py tests/robustness/test_facade_edge_cases.py
              tests/robustness/test_step_edge_cases.py tests/robustness/test_seeded_stress.py
              tests/abi/test_round_backends.py tests/forks/test_n_groups.py
              -k "not largest_int32_sizes")

# build NAME: copy, venv, instrumented install; sets $VENV
build() {
    local name="$1" t0 src
    t0=$(date +%s)
    src="$WORK/src-$name"
    VENV="$WORK/venv-$name"
    mkdir -p "$src"
    copy_tree "$src"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q $PINS
    if [ "$name" = debug ]; then
        (cd "$src" && QUALIA_SANITIZE=1 QUALIA_DEBUG=1 \
            "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps "$src")
    elif [ "$name" = thread ]; then
        (cd "$src" && env -u QUALIA_DEBUG QUALIA_SANITIZE=thread \
            "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps "$src")
    else
        (cd "$src" && env -u QUALIA_DEBUG QUALIA_SANITIZE=1 \
            "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps "$src")
    fi
    local so
    so="$(ls "$VENV"/lib/python*/site-packages/qualia/_core*.so)"
    if [ "$name" = thread ]; then
        if ! nm -D "$so" | grep -q __tsan_init; then
            echo "sanitize.sh: $so ($name) is not built with ThreadSanitizer" >&2
            exit 2
        fi
    elif ! nm -D "$so" | grep -q __asan_init || ! nm -D "$so" | grep -q __ubsan_handle; then
        echo "sanitize.sh: $so ($name) is not built with ASan + UBSan" >&2
        exit 2
    fi
    echo "sanitize.sh: $name build ready in $(( $(date +%s) - t0 )) s ($PINS)" >&2
}

preflight() {
    # under this very setup, an 8-byte PyMem block overrun must abort the interpreter
    local pre
    set +e
    { (cd / && env PYTHONMALLOC=malloc LD_PRELOAD="$LIBASAN" ASAN_OPTIONS="$ASAN_OPTS" \
        "$VENV/bin/python" -c '
import ctypes, qualia
m = ctypes.pythonapi.PyMem_Malloc
m.restype, m.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
ctypes.memset(m(8), 0, 64)
') >/dev/null 2>"$WORK/preflight.log"; } 2>/dev/null  # (the expected abort, quietly)
    pre=$?
    set -e
    if ! grep -q "ERROR: AddressSanitizer: heap-buffer-overflow" "$WORK/preflight.log"; then
        echo "sanitize.sh: preflight failed: ASan did not catch a heap overflow (exit $pre)" >&2
        cat "$WORK/preflight.log" >&2
        exit 2
    fi
    echo "sanitize.sh: preflight ok (ASan aborts on a heap overflow)" >&2
}

# run_tests NAME PYTEST-ARGS...: pytest under the sanitizers, from outside the checkout
run_tests() {
    local name="$1" t0 run_dir st=0
    shift
    t0=$(date +%s)
    run_dir="$WORK/run-$name"
    mkdir -p "$run_dir"
    local preload="$LIBASAN"
    [ "$name" != thread ] || preload="$LIBTSAN"
    (cd "$run_dir" && env QUALIA_TEST_INSTALLED=1 QUALIA_LEAK_CYCLES="${QUALIA_LEAK_CYCLES:-2000}" \
        PYTHONMALLOC=malloc PYTHONFAULTHANDLER=1 \
        LD_PRELOAD="$preload" \
        ASAN_OPTIONS="$ASAN_OPTS" UBSAN_OPTIONS="$UBSAN_OPTS" TSAN_OPTIONS="$TSAN_OPTS" \
        "$VENV/bin/python" -m pytest -p no:cacheprovider -q --capture=sys --rootdir="$ROOT" \
        "$@") 2>&1 | tee "$run_dir/pytest.log" || st=$?
    echo "sanitize.sh: $name build: pytest exit status $st in $(( $(date +%s) - t0 )) s" >&2
    if grep -qE "ERROR: AddressSanitizer|runtime error:|WARNING: ThreadSanitizer|Fatal Python error" \
            "$run_dir/pytest.log"; then
        echo "sanitize.sh: $name build: a sanitizer report or a crash (see above)" >&2
        [ $st -ne 0 ] || st=3
    fi
    return $st
}

# the test selection of each build
if [ $# -gt 0 ]; then
    # relative test paths are relative to the checkout
    args=()
    for a in "$@"; do
        if [[ "$a" != -* && -e "$ROOT/$a" ]]; then args+=("$ROOT/$a"); else args+=("$a"); fi
    done
    SEL_release=("${args[@]}")
    SEL_debug=("${args[@]}")
    SEL_thread=("${args[@]}")
else
    SEL_thread=()
    for a in "${THREAD_TESTS[@]}"; do
        if [[ "$a" == tests/* ]]; then SEL_thread+=("$ROOT/$a"); else SEL_thread+=("$a"); fi
    done
    SEL_release=("$ROOT/tests")
    if [ "${QUALIA_SANITIZE_QUICK:-0}" = 1 ]; then
        SEL_debug=("$ROOT/tests/robustness/test_facade_edge_cases.py"
                   "$ROOT/tests/robustness/test_ownership.py"
                   "$ROOT/tests/robustness/test_seeded_stress.py"
                   "$ROOT/tests/differential/test_seed_vs_twin.py")
    else
        SEL_debug=("$ROOT/tests")
    fi
fi

status=0
first=1
for name in $BUILDS; do
    case "$name" in
        release) sel=("${SEL_release[@]}") ;;
        debug) sel=("${SEL_debug[@]}") ;;
        thread) sel=("${SEL_thread[@]}") ;;
        *) echo "sanitize.sh: unknown build '$name' (release, debug or thread)" >&2; exit 2 ;;
    esac
    build "$name"
    if [ $first = 1 ] && [ "$name" != thread ]; then
        preflight
        first=0
    fi
    # pytest exit 1 = some tests failed (reported above); an ASan/UBSan report aborts the
    # interpreter (usually exit status 134; ASan's nested-error path exits 1), and the log is
    # searched for reports so that either way the run says which happened.
    run_tests "$name" "${sel[@]}" || { st=$?; [ $status -ne 0 ] || status=$st; }
done
echo "sanitize.sh: builds '$BUILDS': exit status $status, $(( $(date +%s) - START )) s in all" >&2
exit $status
