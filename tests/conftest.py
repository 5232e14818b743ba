"""Shared fixtures: every test runs against the compiled core and the pure-Python reference.

``impl`` is a namespace with the implementation's classes (BlockPool, SequenceBlockTable,
PrefixIdentity, PrefixKvStore, RequestScheduler), the reference's PyHashBackend (for both),
the numpy dtypes, and a few state-snapshot helpers used to assert "a failed call changed nothing".
"""

from __future__ import annotations

import os
import pathlib
import types

import pytest

SOURCE_PACKAGE = (pathlib.Path(__file__).resolve().parent.parent / "qualia").resolve()


def _qualia_dir() -> pathlib.Path:
    import qualia

    return pathlib.Path(qualia.__file__).resolve().parent


def pytest_sessionstart(session):
    """The tests exercise the installed package, not the source tree that `python -m pytest` or
    PYTHONPATH would put first on sys.path (QUALIA_TEST_SOURCE=1 allows an in-place build)."""
    if os.environ.get("QUALIA_TEST_SOURCE") == "1":
        return
    try:
        where = _qualia_dir()
    except ImportError as exc:
        pytest.exit(f"qualia is not installed ({exc}); run `pip install '.[test]'` first",
                    returncode=4)
    if where == SOURCE_PACKAGE:
        pytest.exit(
            f"`import qualia` resolved to the source tree {where}; "
            "run the tests from outside the checkout (or with `python -P` / without PYTHONPATH) "
            "so that the installed package is tested.",
            returncode=4,
        )


def pytest_report_header(config):
    try:
        return f"qualia imported from: {_qualia_dir()}"
    except Exception as exc:  # pragma: no cover
        return f"qualia import failed: {exc!r}"


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
    hook = getattr(pool, "_debug_set_refcount", None)
    if hook is None:
        pytest.skip("implementation has no _debug_set_refcount test hook")
    hook(page, count)


def _namespace(name):
    from qualia import twin

    if name == "core":
        import qualia as mod

        if not hasattr(mod, "BlockPool"):
            pytest.skip("qualia.BlockPool is not available yet (compiled core not built)")
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
        RAGGED_BATCH_RECEIPT=getattr(mod, "RAGGED_BATCH_RECEIPT", twin.RAGGED_BATCH_RECEIPT),
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


# Bad integer arguments and the exception each must raise (DESIGN.md "Argument checking").
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
