"""Shared fixtures: every test runs against the compiled core and the pure-Python twin.

``impl`` is a namespace with the implementation's classes (BlockPool, SequenceBlockTable,
PrefixIdentity, PrefixKvStore, RequestScheduler), the twin's PyHashBackend (for both),
the numpy dtypes, and a few state-snapshot helpers used to assert "a failed call changed nothing".
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
import types

import pytest
from hypothesis import Phase, settings

# tools/plant_bugs.py runs the tests with this profile: a planted bug has only to be found, and
# shrinking its example to the smallest (and explaining it) can take minutes a bug
settings.register_profile("plant_bugs", phases=[p for p in Phase
                                                if p not in (Phase.shrink, Phase.explain)])

CHECKOUT = pathlib.Path(__file__).resolve().parent.parent
SOURCE_PACKAGE = CHECKOUT / "qualia"
# What the compiled core of an in-place (editable) build is made from.
CORE_SOURCES = ("qualia/*.pyx", "qualia/*.pxd", "qualia/*.pxi", "qualia/core/*/*.pxi",
                "csrc/*.c", "csrc/*.h")


def _qualia_dir() -> pathlib.Path:
    import qualia

    return pathlib.Path(qualia.__file__).resolve().parent


def _stale_sources(core: pathlib.Path) -> list:
    built = core.stat().st_mtime
    return sorted(str(p.relative_to(CHECKOUT)) for pattern in CORE_SOURCES
                  for p in CHECKOUT.glob(pattern) if p.stat().st_mtime > built)


def pytest_sessionstart(session):
    """The tests need a compiled qualia: an installed one (`pip install ".[test]"`), or this
    checkout built in place (`pip install -e ".[test]"`).  A source tree without its compiled core
    that shadows the installed package (`python -m pytest` in the checkout puts the current
    directory first on sys.path) gets qualia's own explanation of what to do."""
    try:
        where = _qualia_dir()
    except ModuleNotFoundError as exc:
        if exc.name != "qualia":
            raise
        pytest.exit(f"qualia is not installed: run `python -m pip install \".[test]\"` in "
                    f"{CHECKOUT} (or `python -m pip install -e \".[test]\"` to develop)",
                    returncode=4)
    except ImportError as exc:
        pytest.exit(f"cannot import qualia:\n{exc}", returncode=4)
    if where == SOURCE_PACKAGE:  # an editable install or an in-place build: is it current?
        from qualia._source_tree import compiled_core

        stale = _stale_sources(pathlib.Path(compiled_core(str(where))))
        if stale:
            pytest.exit(f"the compiled core in {where} is older than {', '.join(stale[:3])}"
                        f"{' ...' if len(stale) > 3 else ''}: rebuild it with "
                        f"`python -m pip install -e \".[test]\"` in {CHECKOUT}", returncode=4)


def pytest_report_header(config):
    try:
        return f"qualia imported from: {_qualia_dir()}"
    except Exception as exc:  # pragma: no cover
        return f"qualia import failed: {exc!r}"


# -- out-of-tree backends, compiled against the installed package --------------------------------

EXAMPLES = CHECKOUT / "examples"


def build_example(folder: str, module: str, out: pathlib.Path):
    """Run examples/<folder>/build.py's build() into `out` and import the module it made."""
    script = EXAMPLES / folder / "build.py"
    spec = importlib.util.spec_from_file_location(f"_build_{folder}", script)
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    builder.build(str(out))
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(out))


@pytest.fixture(scope="session")
def example_backend(tmp_path_factory):
    """examples/c_backend: a C extension that includes only qualia.h (qualia.get_include())."""
    return build_example("c_backend", "example_backend", tmp_path_factory.mktemp("c_backend"))


@pytest.fixture(scope="session")
def cython_backend(tmp_path_factory):
    """examples/cython_backend: a Cython extension that cimports only qualia/_abi.pxd."""
    return build_example("cython_backend", "cython_backend",
                         tmp_path_factory.mktemp("cython_backend"))


# -- state snapshots --------------------------------------------------------------------------


def pool_state(pool):
    return (pool.free_count, tuple(pool.refcount(p) for p in range(pool.num_blocks)))


def table_state(table):
    return (len(table), tuple(table.entries()))


def store_state(store):
    return (
        len(store),
        store.hits,
        store.misses,
        tuple((i.hex(), tuple(store.pages_of(i)), store.tokens_of(i)) for i in store.identities()),
    )


def sched_state(sched):
    views = sched.runnable().tolist()
    per_request = tuple(
        (v[0], tuple(sched.block_table(v[0])), sched.pending_token(v[0])) for v in views
    )
    return (sched.active_count(), tuple(views), per_request)


def _set_refcount(pool, page, count):
    pool._debug_set_refcount(page, count)  # a test hook of both implementations


def _namespace(name):
    from qualia import twin

    if name == "core":
        import qualia as mod
    else:
        mod = twin
    return types.SimpleNamespace(
        name=name,
        BlockPool=mod.BlockPool,
        SequenceBlockTable=mod.SequenceBlockTable,
        PrefixIdentity=mod.PrefixIdentity,
        PrefixKvStore=mod.PrefixKvStore,
        RequestScheduler=mod.RequestScheduler,
        PyHashBackend=twin.PyHashBackend,
        RAGGED_BATCH_ITEM=mod.RAGGED_BATCH_ITEM,
        RAGGED_BATCH_OUTPUT=mod.RAGGED_BATCH_OUTPUT,
        RAGGED_BATCH_RECEIPT=mod.RAGGED_BATCH_RECEIPT,
        REQUEST_VIEW=mod.REQUEST_VIEW,
        COPY_OP=mod.COPY_OP,
        pool_state=pool_state,
        table_state=table_state,
        store_state=store_state,
        sched_state=sched_state,
        set_refcount=_set_refcount,
    )


@pytest.fixture(scope="session", params=["core", "twin"])
def impl(request):
    # stateless namespace: session scope keeps hypothesis' function-scoped-fixture check quiet
    return _namespace(request.param)


# Bad integer arguments and the exception each must raise (DESIGN.md "Bad input").
BAD_U32 = [
    (-1, OverflowError),
    (2**32, OverflowError),
    (2**64, OverflowError),
    (1.0, TypeError),
    ("1", TypeError),
    (None, TypeError),
    (True, TypeError),
    (False, TypeError),
]
BAD_U64 = [
    (-1, OverflowError),
    (2**64, OverflowError),
    (2**70, OverflowError),
    (0.0, TypeError),
    ("0", TypeError),
    (None, TypeError),
    (True, TypeError),
]


def pytest_generate_tests(metafunc):
    if "bad_u32" in metafunc.fixturenames:
        metafunc.parametrize("bad_u32", BAD_U32, ids=[repr(v) for v, _ in BAD_U32])
    if "bad_u64" in metafunc.fixturenames:
        metafunc.parametrize("bad_u64", BAD_U64, ids=[repr(v) for v, _ in BAD_U64])
