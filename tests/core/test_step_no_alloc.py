"""The engine step allocates nothing per step in steady state, and its tables are resident from
construction on.

* ``run()`` with the C HashBackend: the whole schedule -> execute -> update loop runs in C
  without the GIL; the only Python allocations of a call are its result (the STEP_STATS rows, the
  RunResult and its list), so a call's peak traced memory stays within the stats rows plus a
  small constant however many steps it runs, and repeated calls leave the heap as they found it.
* ``schedule()`` + ``update()`` from Python: a plan is a handful of numpy views over buffers
  sized at construction; the previous plan's views are freed, so nothing grows.

The probes are tests/core/test_round_no_alloc.py's (each compared against an empty loop).
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import tracemalloc
from itertools import repeat

import numpy as np
import pytest
from helpers.memory import ROUNDS, assert_no_growth_per_step, probe, rss

import qualia  # noqa: E402


def decoding(n=64, ctx=128, steps=8 * ROUNDS):
    """n requests decoding with room for `steps` more tokens (a page is allocated every 16
    steps: part of the steady state)."""
    lp = (ctx + steps) // 16 + 2
    s = qualia.StepScheduler(n * lp, 16, lp, n, max_num_batched_tokens=n * ctx, max_queued=n,
                             cache_key=b"a" * 16)
    for i in range(n):
        s.add_request(i, np.arange(ctx, dtype=np.uint32) + i, max_new_tokens=steps)
    plan = s.schedule()
    s.update(np.zeros(len(plan.logits_indices), dtype=np.uint32))
    return s


def test_run_c_backend_allocates_only_its_result():
    s = decoding()
    hb = qualia.HashBackend()
    s.run(hb, max_steps=8)                      # warm-up
    rows = 1000
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        r = s.run(hb, max_steps=rows)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        gc.enable()
    assert len(r.stats) == rows and r.stats["num_decode_tokens"].min() == 64
    stats_bytes = rows * qualia.STEP_STATS.itemsize
    assert peak <= stats_bytes + 4096, f"run() of {rows} steps peaked at {peak} B"
    assert s.stats()["pages_allocated"] > 64      # the steps crossed page boundaries


def test_run_memory_stays_flat_however_many_steps_it_runs():
    """run() keeps the rows of its last stats_rows steps (a ring sized when the call starts)
    and running totals: a call of 40,000 steps peaks at the ring, the rotated copy it returns
    and the outputs it finished, not at a row per step (40,000 rows: 1.9 MB)."""
    steps = 40_000
    s = decoding(n=2, ctx=16, steps=steps)
    hb = qualia.HashBackend()
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        r = s.run(hb)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        gc.enable()
    assert r.steps == steps - 1 and not s.has_unfinished()
    assert len(r.stats) == qualia.RUN_STATS_ROWS
    assert r.totals["num_decode_tokens"] == 2 * (steps - 1)
    assert r.stats["num_finished"][-1] == 2 and r.stats["num_finished"][:-1].sum() == 0
    ring_bytes = qualia.RUN_STATS_ROWS * qualia.STEP_STATS.itemsize
    outputs = sum(f.output_tokens.nbytes for f in r.finished)    # 2 x 40,000 tokens
    assert peak <= 2 * ring_bytes + outputs + 16384, f"run() of {steps} steps peaked at {peak} B"


def test_run_c_backend_no_net_allocation():
    s = decoding()
    hb = qualia.HashBackend()
    run = s.run

    def go(k, run=run, hb=hb):
        for _ in repeat(None, k):
            run(hb, max_steps=1)
    assert_no_growth_per_step(probe(go), "Scheduler.run (C backend)")


def test_schedule_update_no_net_allocation():
    s = decoding()
    ids = np.zeros(64, dtype=np.uint32)
    sched, upd = s.schedule, s.update

    def go(k, sched=sched, upd=upd, ids=ids):
        for _ in repeat(None, k):
            sched()
            upd(ids)
    assert_no_growth_per_step(probe(go), "Scheduler.schedule + update")


@pytest.mark.skipif(not sys.platform.startswith("linux")
                    or "san.so" in os.environ.get("LD_PRELOAD", ""),
                    reason="Linux's mapped tables (a sanitizer build takes them from calloc)")
def test_a_schedulers_large_tables_are_resident_once_it_is_constructed():
    # 256 queue entries of 16,384 tokens: a 16 MiB token arena no request has touched yet
    before = rss()
    s = qualia.StepScheduler(1100, 16, 1024, 8, max_queued=256, cache_key=b"a" * 16)
    grown = rss() - before
    assert grown >= 16 * 2**20, grown
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(256):   # every arena row written: no page fault for any of them
        s.add_request(i, np.arange(16000, dtype=np.uint32), max_new_tokens=1)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 64
