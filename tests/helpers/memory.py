"""Memory probes shared by the leak and no-allocation tests (a helper module).

``measure`` runs a create/use/destroy cycle many times after a warm-up and returns how much the
memory traced by tracemalloc and the resident set grew; ``probe`` runs a loop ``ROUNDS`` times and
returns how many blocks and traced bytes it left behind, net of the same probe around an empty
loop (so the probe's own bookkeeping cancels out).
"""

from __future__ import annotations

import gc
import os
import sys
import tracemalloc
from itertools import repeat

CYCLES = int(os.environ.get("QUALIA_LEAK_CYCLES", "10000"))
WARMUP = 300
SLACK = 64 * 1024
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def measure(cycle, cycles=CYCLES, warmup=WARMUP):
    """(traced growth, rss growth) in bytes over `cycles` calls of cycle(i), after a warm-up."""
    gc.collect()
    tracemalloc.start()
    try:
        for i in range(warmup):
            cycle(i)
        gc.collect()
        traced0 = tracemalloc.get_traced_memory()[0]
        rss0 = rss()
        for i in range(cycles):
            cycle(i)
        gc.collect()
        traced1 = tracemalloc.get_traced_memory()[0]
        rss1 = rss()
    finally:
        tracemalloc.stop()
    return traced1 - traced0, rss1 - rss0

# the calls a no-allocation probe runs
ROUNDS = 1000


def _noop(k):
    for _ in repeat(None, k):
        pass


def _measure(run, rounds=ROUNDS):
    run(rounds)  # warm-up: caches, specialised bytecode, first-touch of scratch pages
    gc.collect()
    gc.disable()
    try:
        b0 = sys.getallocatedblocks()
        run(rounds)
        b1 = sys.getallocatedblocks()
        tracemalloc.start(25)
        try:
            ballast = bytearray(1 << 16)  # traced sizes stay in the same int range as the baseline
            run(4)
            s0 = tracemalloc.take_snapshot()
            c0 = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            run(rounds)
            c1, p1 = tracemalloc.get_traced_memory()
            s1 = tracemalloc.take_snapshot()
            del ballast
        finally:
            tracemalloc.stop()
    finally:
        gc.enable()
    return {"blocks": b1 - b0, "traced": c1 - c0, "peak": p1 - c0, "s0": s0, "s1": s1}


def probe(run, rounds=ROUNDS):
    _measure(_noop, rounds)  # (the process's first probe traces 56 B less on CPython 3.13)
    base = _measure(_noop, rounds)
    got = _measure(run, rounds)
    grown = [st for st in got["s1"].compare_to(got["s0"], "traceback") if st.size_diff > 0]
    detail = "\n".join(
        f"  +{st.size_diff} B in {st.count_diff} blocks at "
        + " <- ".join(f"{f.filename}:{f.lineno}" for f in st.traceback)
        for st in grown[:8])
    return {
        "blocks": got["blocks"] - base["blocks"],
        "traced": got["traced"] - base["traced"],
        "peak": got["peak"] - base["peak"],
        "detail": detail,
    }


def assert_no_growth_per_step(r, what):
    # over ROUNDS calls: a growth of a few dozen bytes (numpy's and the interpreter's own caches
    # settling) is a constant; one allocation kept per call would be ROUNDS blocks
    assert r["blocks"] <= 32, (f"{what}: sys.getallocatedblocks() grew by {r['blocks']} over "
                               f"{ROUNDS} calls\n{r['detail']}")
    assert r["traced"] <= 1024, (f"{what}: tracemalloc traced memory grew by {r['traced']} B "
                                 f"over {ROUNDS} calls\n{r['detail']}")
