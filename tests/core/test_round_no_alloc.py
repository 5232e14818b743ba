"""Steady-state decode rounds on the C-backend path allocate nothing.

After warm-up, ``RequestScheduler.execute_decode_round`` with a C backend and
``qualia.Scheduler.decode`` with a C backend must leave the Python heap exactly as they found it:
``sys.getallocatedblocks()`` and tracemalloc's traced memory do not grow over 1000 rounds, and
the resident set size stays flat over many rounds.  Each probe is compared against the same probe
around an empty loop, so the probe's own bookkeeping (the ints it reads) cancels out.

The stricter property, no transient allocation *inside* a round (tracemalloc's peak stays at the
starting level), holds for the facade.  For ``execute_decode_round`` with numpy scratch arrays it
does not hold yet: see ``test_execute_decode_round_no_transient_allocation``.
"""

from __future__ import annotations

import os
from itertools import repeat

import numpy as np
import pytest
from helpers.memory import ROUNDS, probe

import qualia

PAGE_TOKENS = 16


def decode_world(n=64, pages=8):
    """n requests decoding at `pages` logical pages each (miss + ensure_writable, seeded)."""
    pool = qualia.BlockPool(n * pages + 8)
    store = qualia.PrefixKvStore(1, 1)
    sched = qualia.RequestScheduler(n, pages)
    for rid in range(n):
        sched.admit_with_prefix(1000 + rid, None, store, pool)
        for lp in range(pages):
            sched.ensure_writable(1000 + rid, lp, pool)
        sched.mark_prefill_complete(1000 + rid)
        sched.seed_decode_token(1000 + rid, rid)
    items = np.zeros(n, dtype=qualia.RAGGED_BATCH_ITEM)
    table = np.zeros(n * pages, dtype=np.uint32)
    outputs = np.zeros(n, dtype=qualia.RAGGED_BATCH_OUTPUT)
    return sched, items, table, outputs


def round_runner(sched, backend, items, table, outputs):
    f = sched.execute_decode_round

    def run(k, f=f, b=backend, i=items, t=table, o=outputs):
        for _ in repeat(None, k):
            f(b, i, t, o)
    return run


def facade_runner(n=64, ctx=128, rounds=8 * ROUNDS):
    """qualia.Scheduler with n decoding requests and room for `rounds` more tokens each (a page
    is allocated every 16 rounds: part of the steady state).  ``run.reset()`` finishes and
    re-admits every request; the freed pages are reused, so nothing new is touched."""
    lp = ctx // PAGE_TOKENS + rounds // PAGE_TOKENS + 2
    s = qualia.Scheduler(n, n * lp, PAGE_TOKENS, lp)

    def admit_all():
        for rid in range(n):
            s.admit(rid)
            s.reserve(rid, ctx - 1)
            s.advance(rid, ctx - 1)
            s.complete_prefill(rid, rid)

    def reset():
        for rid in range(n):
            s.finish(rid)
        admit_all()

    admit_all()
    backend = qualia.HashBackend()
    dec = s.decode

    def run(k, dec=dec, b=backend):
        for _ in repeat(None, k):
            dec(b)
    run.reset = reset
    return s, run


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def assert_no_net_allocation(r, what):
    # "== 0 or <= a tiny constant": a constant over 1000 rounds, never per round
    assert r["blocks"] <= 2, (f"{what}: sys.getallocatedblocks() grew by {r['blocks']} over "
                              f"{ROUNDS} rounds\n{r['detail']}")
    assert r["traced"] <= 0, (f"{what}: tracemalloc traced memory grew by {r['traced']} B over "
                              f"{ROUNDS} rounds\n{r['detail']}")


def test_execute_decode_round_c_backend_no_net_allocation():
    sched, items, table, outputs = decode_world()
    run = round_runner(sched, qualia.HashBackend(), items, table, outputs)
    assert_no_net_allocation(probe(run), "execute_decode_round (C backend)")


def test_execute_decode_round_capsule_no_net_allocation():
    sched, items, table, outputs = decode_world()
    cap = qualia.HashBackend().__qualia_backend__
    run = round_runner(sched, cap, items, table, outputs)
    assert_no_net_allocation(probe(run), "execute_decode_round (bare capsule)")


def test_scheduler_decode_c_backend_no_net_allocation():
    s, run = facade_runner()
    r = probe(run)
    assert_no_net_allocation(r, "Scheduler.decode (C backend)")
    assert s.stats()["pages_allocated"] > 64  # the probe crossed page boundaries


def test_scheduler_decode_no_transient_allocation():
    _, run = facade_runner()
    r = probe(run)
    assert r["peak"] <= 0, (f"Scheduler.decode allocated {r['peak']} B transiently within "
                            f"{ROUNDS} rounds")


def test_execute_decode_round_memoryview_scratch_no_transient_allocation():
    # scratch handed over as memoryviews: the buffer export reuses the view's format string
    sched, items, table, outputs = decode_world()
    run = round_runner(sched, qualia.HashBackend(), memoryview(items), memoryview(table),
                       memoryview(outputs))
    r = probe(run)
    assert_no_net_allocation(r, "execute_decode_round (memoryview scratch)")
    assert r["peak"] <= 0, f"{r['peak']} B allocated transiently"


def test_execute_decode_round_no_transient_allocation():
    sched, items, table, outputs = decode_world()
    run = round_runner(sched, qualia.HashBackend(), items, table, outputs)
    r = probe(run)
    assert r["peak"] <= 0, f"{r['peak']} B allocated transiently within {ROUNDS} rounds"


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
@pytest.mark.skipif("asan" in os.environ.get("LD_PRELOAD", ""),
                    reason="under ASan (tools/sanitize.sh) freed memory stays resident in its "
                           "quarantine, so RSS says nothing; the tracemalloc tests still run")
def test_rss_flat_over_many_rounds():
    sched, items, table, outputs = decode_world()
    run = round_runner(sched, qualia.HashBackend(), items, table, outputs)
    _, frun = facade_runner(rounds=4000)
    for what, r in (("execute_decode_round", run), ("Scheduler.decode", frun)):
        r(2000)
        marks = []
        for _ in range(10):
            r(2000)
            marks.append(rss_bytes())
            if hasattr(r, "reset"):
                r.reset()  # keep the facade's tables inside the pages already touched
        growth = max(marks) - min(marks)
        assert growth <= 256 * 1024, f"{what}: RSS moved by {growth} B over 20000 rounds: {marks}"
