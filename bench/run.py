#!/usr/bin/env python
"""qualia benchmark suite: the compiled core against the pure-Python reference, side by side.

    python bench/run.py [--quick] [--json PATH] [--plot out.png] [--markdown PATH]

Every scenario builds the same state in ``qualia`` (compiled core) and ``qualia.twin``
(pure Python) with the same public calls, asserts that both give equal results, then times each
side in the same process.  Times are ``time.perf_counter_ns`` over many repetitions with the
cyclic GC disabled; a *sample* is ``k`` back-to-back operations (``k`` chosen so a sample lasts at
least ~20 us, 1 for slow operations) and median / p99 are over the per-operation means of the
samples.  Every time includes the Python call from the benchmark loop (a bound method call,
~50-90 ns here; see ``call_overhead_ns`` in the JSON).

Scenarios
  a  decode round, built-in C backend (``RequestScheduler.execute_decode_round`` with
     ``qualia.HashBackend()``; reference twin: ``PyHashBackend``), batch x context grid,
     with the copy floor (bytes the round must write / copy bandwidth measured in this run)
  b  the same rounds through a Python buffer-protocol backend (numpy echo of request_id/slot)
  c  admission with a prefix hit + finish, pool sizes 1k / 64k / 1M blocks
  d  admit/finish churn at full capacity
  e  ``PrefixIdentity.of_tokens`` per 16-token block
  f  the facade ``qualia.Scheduler.decode(qualia.HashBackend())`` (absolute, no twin)
  g  steady-state allocations (tracemalloc, sys.getallocatedblocks) and RSS over 100k rounds
  h  automatic prefix caching beside its twin (bench/cache_bench.py): identity + lookup +
     verification per page, admission of a 1,024-token prompt with 64 cached pages at 1k / 64k /
     1M pages, list conversion, steady-state reclaim, zero allocations (--cache-only: just h)

Only numpy is required; matplotlib is imported lazily for --plot.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import sys
import time
import tracemalloc
from itertools import repeat

import numpy as np

import qualia
from qualia import twin as ref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cache_bench  # noqa: E402  (scenario h, beside this file)

pc = time.perf_counter_ns
PAGE_TOKENS = 16
VOCAB = 32000

# ---------------------------------------------------------------------------------------------
# machine info and timing helpers


def machine_info():
    cpu = platform.processor() or "unknown"
    cache = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                elif line.split(":")[0].strip() in ("cpu family", "model", "cpu MHz",
                                                    "stepping"):
                    cache.setdefault(line.split(":")[0].strip(), line.split(":", 1)[1].strip())
                elif line.startswith("cache size") and "cache size" not in cache:
                    cache["cache size"] = line.split(":", 1)[1].strip()
    except OSError:
        pass
    caches = {}
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for idx in sorted(os.listdir(base)):
            d = os.path.join(base, idx)
            try:
                lvl = open(os.path.join(d, "level")).read().strip()
                typ = open(os.path.join(d, "type")).read().strip()
                size = open(os.path.join(d, "size")).read().strip()
                caches[f"L{lvl} {typ}"] = size
            except OSError:
                continue
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "cpu_family_model_stepping_mhz": [cache.get(k) for k in ("cpu family", "model",
                                                                  "stepping", "cpu MHz")],
        "caches_per_core": caches,
        "python": sys.version.split()[0],
        "python_impl": platform.python_implementation(),
        "numpy": np.__version__,
        "qualia": getattr(qualia, "__version__", "?"),
        "qualia_path": os.path.dirname(qualia.__file__),
    }


def stats(ts):
    a = np.asarray(ts, dtype=np.float64)
    return {
        "median_ns": float(np.median(a)),
        "p99_ns": float(np.percentile(a, 99)),
        "mean_ns": float(a.mean()),
        "min_ns": float(a.min()),
        "samples": int(a.size),
    }


class Budget:
    def __init__(self, quick):
        self.quick = quick
        self.per_side_ns = int((0.06 if quick else 0.35) * 1e9)  # time spent timing one side
        self.min_sample_ns = 20_000
        self.min_samples = 15 if quick else 40
        self.max_samples = 400 if quick else 2000


def timeit(run, budget, *, per_side_ns=None, min_samples=None, max_samples=None, k=None):
    """``run(k)`` performs k operations.  Returns stats of per-operation ns plus k."""
    per_side_ns = per_side_ns or budget.per_side_ns
    min_samples = min_samples or budget.min_samples
    max_samples = max_samples or budget.max_samples
    t0 = pc()
    run(1)
    est = [pc() - t0]
    for _ in range(2 if est[0] < 5_000_000 else 1):
        t0 = pc()
        run(1)
        est.append(pc() - t0)
    e = max(1, min(est))
    if k is None:
        k = max(1, math.ceil(budget.min_sample_ns / e))
    n = int(per_side_ns // (k * e))
    n = max(min_samples, min(max_samples, n))
    ts = []
    gc.disable()
    try:
        if k > 1 or e < 5_000_000:
            run(k)  # warm at the chosen k
        for _ in range(n):
            t0 = pc()
            run(k)
            ts.append((pc() - t0) / k)
    finally:
        gc.enable()
    s = stats(ts)
    s["k"] = k
    return s


def fmt_ns(x):
    if x is None:
        return "-"
    if x >= 1e9:
        return f"{x / 1e9:.2f} s"
    if x >= 1e6:
        return f"{x / 1e6:.2f} ms"
    if x >= 1e4:
        return f"{x / 1e3:.1f} us"
    if x >= 1e3:
        return f"{x / 1e3:.2f} us"
    if x >= 100:
        return f"{x:.0f} ns"
    return f"{x:.1f} ns"


def fmt_x(x):
    if x is None:
        return "-"
    return f"{x:.0f}x" if x >= 100 else f"{x:.1f}x"


def table(headers, rows, title=None):
    cols = list(zip(*([headers] + rows))) if rows else [[h] for h in headers]
    widths = [max(len(str(c)) for c in col) for col in cols]
    out = []
    if title:
        out.append(title)
    out.append("  ".join(str(h).rjust(w) for h, w in zip(headers, widths)))
    out.append("  ".join("-" * w for w in widths))
    for r in rows:
        out.append("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
    return "\n".join(out)


def md_table(headers, rows):
    out = ["| " + " | ".join(map(str, headers)) + " |",
           "|" + "|".join("---:" for _ in headers) + "|"]
    for r in rows:
        out.append("| " + " | ".join(map(str, r)) + " |")
    return "\n".join(out)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def call_overhead(budget):
    """A bound C method with four arguments from the same kind of loop (the floor of any
    Python-level call the scenarios make)."""
    d = {}
    f = d.get

    def run(k, f=f):
        for _ in repeat(None, k):
            f(1, None)
    return timeit(run, budget)["median_ns"]

# ---------------------------------------------------------------------------------------------
# copy bandwidth (the floor of scenario a)


class CopyFloor:
    """Time of ``numpy.copyto`` of S bytes (source and destination warm, like the round's slot
    tables and scratch), minus the fixed cost of a 64-byte copyto.  Sizes under 16 KiB use the
    16 KiB bandwidth (the fixed cost swamps the copy there)."""

    SMALL = 16 * 1024

    def __init__(self, budget):
        self.budget = budget
        self.cache = {}
        self.overhead_ns = self._copy_ns(64, raw=True)

    def _copy_ns(self, nbytes, raw=False):
        src = np.ones(nbytes, dtype=np.uint8)
        dst = np.zeros(nbytes, dtype=np.uint8)
        np.copyto(dst, src)
        cp = np.copyto

        def run(k, cp=cp, dst=dst, src=src):
            for _ in repeat(None, k):
                cp(dst, src)
        s = timeit(run, self.budget, per_side_ns=self.budget.per_side_ns // 3)
        return s["median_ns"]

    def bandwidth(self, nbytes):
        """bytes/ns for copying nbytes."""
        size = max(nbytes, self.SMALL)
        if size not in self.cache:
            t = self._copy_ns(size) - self.overhead_ns
            self.cache[size] = size / max(t, 1e-3)
        return self.cache[size]

    def floor_ns(self, nbytes):
        return nbytes / self.bandwidth(nbytes)

# ---------------------------------------------------------------------------------------------
# optional null C backend (scheduler-only cost): built with the system C compiler if there is one

_NULL_BACKEND_C = r"""
#include "qualia.h"
static int32_t null_execute(void *ctx, const qualia_batch_item *items, uint32_t n,
                            const uint32_t *block_table, uint32_t n_table,
                            qualia_batch_output *out, qualia_batch_receipt *rec)
{
    (void)ctx; (void)block_table; (void)n_table;
    for (uint32_t i = 0; i < n; i++) {
        out[i].request_id = items[i].request_id;
        out[i].slot = items[i].slot;
        out[i].next_token_id = items[i].token_id;
    }
    rec->batch_size = n;
    rec->backend_launches = 1;
    return 0;
}
static int32_t null_copy(void *ctx, const qualia_copy_op *ops, uint32_t n)
{
    (void)ctx; (void)ops; (void)n;
    return 0;
}
static qualia_backend iface = {QUALIA_BACKEND_ABI_VERSION, sizeof(qualia_backend), 0,
                               null_execute, null_copy};
void *qualia_bench_null_backend(void) { return &iface; }
"""

_KEEP = []
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _where(filename):
    """A source file as results may name it: relative to the checkout, or to its package folder
    (no machine's absolute paths in saved results)."""
    path = os.path.abspath(filename)
    if path.startswith(_ROOT + os.sep):
        return os.path.relpath(path, _ROOT)
    parts = path.split(os.sep)
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1:])
    if len(parts) >= 2 and parts[-2].startswith("python3"):
        return "<stdlib>/" + parts[-1]
    return os.path.basename(path)


def null_c_backend():
    """A PyCapsule of a C backend that only echoes identities (no token arithmetic), or None
    (with the reason) when no C compiler is available.  Isolates the scheduler's own cost from
    the built-in HashBackend's hash."""
    import ctypes
    import shutil
    import subprocess
    import tempfile
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler"
    try:
        # dlopen keeps the library mapped after its file is gone: build it in a temporary folder
        # that is removed at once, so that no run leaves anything behind
        with tempfile.TemporaryDirectory(prefix="qualia-bench-") as d:
            src, so = os.path.join(d, "null.c"), os.path.join(d, "null.so")
            with open(src, "w") as f:
                f.write(_NULL_BACKEND_C)
            subprocess.run([cc, "-O2", "-shared", "-fPIC", "-I", qualia.get_include(), src, "-o",
                            so], check=True, capture_output=True, timeout=60)
            lib = ctypes.CDLL(so)
        lib.qualia_bench_null_backend.restype = ctypes.c_void_p
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        name = ctypes.create_string_buffer(qualia.BACKEND_CAPSULE_NAME.encode())
        cap = new(lib.qualia_bench_null_backend(), ctypes.cast(name, ctypes.c_char_p), None)
        _KEEP.extend([lib, name])  # the capsule's name and code must outlive it
        return cap, None
    except Exception as exc:  # noqa: BLE001 - optional section
        return None, f"could not build the null backend: {exc}"

# ---------------------------------------------------------------------------------------------
# scenario a/b: decode rounds


class NumpyEchoBackend:
    """The cheapest useful Python backend: copy each item's identity into its output with numpy
    (next_token_id is left as the scratch holds it) and report one launch."""

    def __init__(self, max_n):
        self._receipts = [qualia.RaggedBatchReceipt(n, 1) for n in range(max_n + 1)]

    def execute_ragged(self, items, block_table, outputs):
        outputs["request_id"] = items["request_id"]
        outputs["slot"] = items["slot"]
        return self._receipts[len(items)]


def decode_world(mod, n, pages):
    """n decoding requests of `pages` logical pages each: a published prefix of pages-1 full
    pages, attached on admission (prefix hit), plus one private page allocated by
    ensure_writable; then seeded.  Same calls for the core and the reference."""
    prefix_pages = pages - 1
    pool = mod.BlockPool(prefix_pages + n + 8)
    store = mod.PrefixKvStore(1, max(prefix_pages, 1))
    sched = mod.RequestScheduler(n, pages)
    shared = [pool.allocate() for _ in range(prefix_pages)]
    tokens = [(7 * i + 3) % VOCAB for i in range(prefix_pages * PAGE_TOKENS)]
    ident = mod.PrefixIdentity.of_tokens(tokens)
    store.publish(ident, shared, prefix_pages * PAGE_TOKENS, pool)
    for p in shared:
        pool.release(p)  # the store holds the only reference
    for r in range(n):
        rid = 10_000 + 7 * r
        adm = sched.admit_with_prefix(rid, ident, store, pool)
        assert adm.prefix_hit and adm.prefix_tokens == prefix_pages * PAGE_TOKENS
        sched.ensure_writable(rid, prefix_pages, pool)
        sched.seed_decode_token(rid, (rid * 31) % VOCAB)
    items = np.zeros(n, dtype=qualia.RAGGED_BATCH_ITEM)
    tab = np.zeros(n * pages, dtype=np.uint32)
    outs = np.zeros(n, dtype=qualia.RAGGED_BATCH_OUTPUT)
    return {"pool": pool, "store": store, "sched": sched, "items": items, "table": tab,
            "outputs": outs}


def round_runner(w, backend):
    f = w["sched"].execute_decode_round
    items, tab, outs = w["items"], w["table"], w["outputs"]

    def run(k, f=f, b=backend, i=items, t=tab, o=outs):
        for _ in repeat(None, k):
            f(b, i, t, o)
    return run


def assert_same_round(wq, wr, bq, br, n, pages):
    rq = wq["sched"].execute_decode_round(bq, wq["items"], wq["table"], wq["outputs"])
    rr = wr["sched"].execute_decode_round(br, wr["items"], wr["table"], wr["outputs"])
    assert tuple(rq) == tuple(rr) == (n, 1), (rq, rr)
    assert wq["items"][:n].tobytes() == wr["items"][:n].tobytes(), "items differ"
    assert wq["table"][:n * pages].tobytes() == wr["table"][:n * pages].tobytes(), "tables differ"
    assert wq["outputs"][:n].tobytes() == wr["outputs"][:n].tobytes(), "outputs differ"


def bench_decode(budget, floor, batches, contexts, skip, null_cap):
    rows = []
    for ctx in contexts:
        pages = ctx // PAGE_TOKENS
        for n in batches:
            if (n, ctx) in skip:
                continue
            t_setup = time.perf_counter()
            wq = decode_world(qualia, n, pages)
            t_q_setup = time.perf_counter() - t_setup
            wr = decode_world(ref, n, pages)
            t_r_setup = time.perf_counter() - t_setup - t_q_setup
            cb, pyb = qualia.HashBackend(), ref.PyHashBackend()
            echo = NumpyEchoBackend(n)
            # equal results before any timing: 3 C-backend rounds, 2 Python-backend rounds
            for _ in range(3):
                assert_same_round(wq, wr, cb, pyb, n, pages)
            for _ in range(2):
                assert_same_round(wq, wr, echo, echo, n, pages)
            nbytes = n * qualia.RAGGED_BATCH_ITEM.itemsize + n * pages * 4
            fl = floor.floor_ns(nbytes)
            res = {"batch": n, "context": ctx, "pages": pages, "bytes_written": nbytes,
                   "floor_ns": fl, "copy_bandwidth_GBps": floor.bandwidth(nbytes),
                   "setup_s": {"qualia": t_q_setup, "reference": t_r_setup}}
            # reference rounds can take ~0.4 s at 4096 x 32k: time at least 3, never skip
            ref_budget = dict(per_side_ns=budget.per_side_ns, min_samples=3)
            for name, bq, br in (("c_backend", cb, pyb), ("py_backend", echo, echo)):
                sq = timeit(round_runner(wq, bq), budget)
                sr = timeit(round_runner(wr, br), budget, **ref_budget)
                res[name] = {
                    "qualia": sq, "reference": sr,
                    "qualia_ns_per_request": sq["median_ns"] / n,
                    "reference_ns_per_request": sr["median_ns"] / n,
                    "ratio_ref_over_qualia": sr["median_ns"] / sq["median_ns"],
                    "qualia_x_floor": sq["median_ns"] / fl,
                }
            if null_cap is not None:
                sn = timeit(round_runner(wq, null_cap), budget)
                res["null_c_backend"] = {"qualia": sn, "qualia_ns_per_request": sn["median_ns"] / n,
                                         "qualia_x_floor": sn["median_ns"] / fl}
            # the Python backend's own body on the same views (what the round adds around it)
            iv, tv, ov = wq["items"][:n], wq["table"][:n * pages], wq["outputs"][:n]
            body = echo.execute_ragged

            def run_body(k, f=body, i=iv, t=tv, o=ov):
                for _ in repeat(None, k):
                    f(i, t, o)
            res["py_backend"]["backend_body_ns"] = timeit(run_body, budget)["median_ns"]
            rows.append(res)
            c = res["c_backend"]
            log(f"  a/b  n={n:5d} ctx={ctx:6d}: C {fmt_ns(c['qualia']['median_ns'])} "
                f"({c['qualia_ns_per_request']:.1f} ns/req, {c['qualia_x_floor']:.1f}x floor) "
                f"ref {fmt_ns(c['reference']['median_ns'])}; "
                f"py-backend {fmt_ns(res['py_backend']['qualia']['median_ns'])}; "
                f"setup q {t_q_setup:.2f}s r {t_r_setup:.2f}s")
            del wq, wr
            gc.collect()
    return rows


def bench_sparse(budget):
    """Extra: one decoding request in schedulers of growing capacity (cost of idle slots)."""
    out = []
    for cap in (1, 64, 1024, 4096, 65536):
        pool = qualia.BlockPool(64)
        store = qualia.PrefixKvStore(1, 8)
        sched = qualia.RequestScheduler(cap, 8)
        sched.admit_with_prefix(cap - 1, None, store, pool)  # slot 0
        sched.ensure_writable(cap - 1, 0, pool)
        sched.mark_prefill_complete(cap - 1)
        sched.seed_decode_token(cap - 1, 1)
        w = {"sched": sched, "items": np.zeros(1, qualia.RAGGED_BATCH_ITEM),
             "table": np.zeros(8, np.uint32), "outputs": np.zeros(1, qualia.RAGGED_BATCH_OUTPUT)}
        s = timeit(round_runner(w, qualia.HashBackend()), budget)
        out.append({"max_requests": cap, "active": 1, "round": s})
    return out

def bench_scratch_kinds(budget, null_cap):
    """Extra: the same round with the scratch handed over as numpy arrays (each round exports
    three buffers; numpy rebuilds a structured dtype's format string on every export) or as
    memoryviews of them (the export reuses the view's format)."""
    out = []
    for n, ctx in ((1, 128), (256, 2048)):
        w = decode_world(qualia, n, ctx // PAGE_TOKENS)
        row = {"batch": n, "context": ctx}
        mv = dict(w, items=memoryview(w["items"]), table=memoryview(w["table"]),
                  outputs=memoryview(w["outputs"]))
        for bname, be in (("c_backend", qualia.HashBackend()), ("null_c_backend", null_cap)):
            if be is None:
                continue
            row[bname] = {"ndarray": timeit(round_runner(w, be), budget),
                          "memoryview": timeit(round_runner(mv, be), budget)}
        out.append(row)
    return out

# ---------------------------------------------------------------------------------------------
# scenario c: prefix-hit admission + finish


def prefix_world(mod, blocks, n_prefixes, seed=1):
    pool = mod.BlockPool(blocks)
    for _ in range(blocks):  # a busy pool: every page allocated (held by "other requests")
        pool.allocate()
    store = mod.PrefixKvStore(n_prefixes, 8)
    stride = blocks // (n_prefixes * 8)
    idents = []
    for j in range(n_prefixes):
        pages = [(j * 8 + i) * stride for i in range(8)]
        ident = mod.PrefixIdentity.of_tokens(list(range(j * 128, j * 128 + 128)))
        store.publish(ident, pages, 128, pool)
        for p in pages:
            pool.release(p)  # the store holds the only reference
        idents.append(ident)
    sched = mod.RequestScheduler(256, 64)
    for r in range(128):  # other requests, in prefill
        sched.admit_with_prefix(r, None, store, pool)
    order = list(range(n_prefixes))
    random.Random(seed).shuffle(order)
    return pool, store, sched, [idents[i] for i in order]


def bench_prefix(budget, sizes):
    rows = []
    for blocks in sizes:
        n_pref = min(4096, blocks // 16)
        t0 = time.perf_counter()
        wq = prefix_world(qualia, blocks, n_pref)
        wr = prefix_world(ref, blocks, n_pref)
        setup = time.perf_counter() - t0
        # equal results: the same 2 * n_pref admissions (every prefix twice)
        res_q, res_r = [], []
        for w, res in ((wq, res_q), (wr, res_r)):
            pool, store, sched, idents = w
            for i in range(2 * n_pref):
                res.append(tuple(sched.admit_with_prefix(1_000_000, idents[i % n_pref], store,
                                                         pool)))
                sched.finish(1_000_000, pool)
        assert res_q == res_r, "admissions differ"
        assert all(r[1] and r[2] == 128 for r in res_q)
        assert (wq[1].hits, wq[1].misses, wq[0].free_count) == \
               (wr[1].hits, wr[1].misses, wr[0].free_count)
        probe = [p for j in range(0, n_pref, max(1, n_pref // 16))
                 for p in wq[1].pages_of(wq[3][j])]
        assert [wq[0].refcount(p) for p in probe] == [wr[0].refcount(p) for p in probe]
        out = {"pool_blocks": blocks, "prefixes": n_pref, "prefix_pages": 8, "setup_s": setup}
        for name, w in (("qualia", wq), ("reference", wr)):
            pool, store, sched, idents = w
            cyc = idents * max(1, math.ceil(4096 / len(idents)))
            adm, fin = sched.admit_with_prefix, sched.finish
            state = {"i": 0}

            def run(k, adm=adm, fin=fin, store=store, pool=pool, cyc=cyc, state=state):
                i = state["i"]
                if i + k > len(cyc):
                    i = 0
                for ident in cyc[i:i + k]:
                    adm(1_000_000, ident, store, pool)
                    fin(1_000_000, pool)
                state["i"] = i + k
            out[name] = timeit(run, budget, k=min(len(cyc), 256) if name == "qualia" else None)
        out["ratio_ref_over_qualia"] = out["reference"]["median_ns"] / out["qualia"]["median_ns"]
        rows.append(out)
        log(f"  c    pool={blocks:8d}: qualia {fmt_ns(out['qualia']['median_ns'])}  "
            f"ref {fmt_ns(out['reference']['median_ns'])}")
        del wq, wr
        gc.collect()
    return rows

# ---------------------------------------------------------------------------------------------
# scenario d: admit/finish churn at full capacity


def churn_world(mod, cap):
    pool = mod.BlockPool(16)
    store = mod.PrefixKvStore(1, 1)
    sched = mod.RequestScheduler(cap, 8)
    for rid in range(cap):
        sched.admit_with_prefix(rid, None, store, pool)
    return pool, store, sched


def bench_churn(budget, caps):
    rows = []
    for cap in caps:
        wq, wr = churn_world(qualia, cap), churn_world(ref, cap)
        outs = []
        for pool, store, sched in (wq, wr):
            got = []
            for rid in range(cap, cap + 2 * cap):
                sched.finish(rid - cap, pool)
                got.append(tuple(sched.admit_with_prefix(rid, None, store, pool)))
            assert sched.active_count() == cap
            outs.append(got)
        assert outs[0] == outs[1], "churn admissions differ"
        out = {"max_requests": cap}
        for name, (pool, store, sched) in (("qualia", wq), ("reference", wr)):
            adm, fin = sched.admit_with_prefix, sched.finish
            state = {"next": 3 * cap}

            def run(k, adm=adm, fin=fin, store=store, pool=pool, state=state, cap=cap):
                a = state["next"]
                for rid in range(a, a + k):
                    fin(rid - cap, pool)
                    adm(rid, None, store, pool)
                state["next"] = a + k
            out[name] = timeit(run, budget)
        out["ratio_ref_over_qualia"] = out["reference"]["median_ns"] / out["qualia"]["median_ns"]
        rows.append(out)
        log(f"  d    cap={cap:6d}: qualia {fmt_ns(out['qualia']['median_ns'])}  "
            f"ref {fmt_ns(out['reference']['median_ns'])}")
    return rows

# ---------------------------------------------------------------------------------------------
# scenario e: prefix identity hashing


def bench_identity(budget):
    rows = []
    rng = np.random.default_rng(5)
    for ntok in (16, 2048):
        arr = rng.integers(0, VOCAB, ntok, dtype=np.uint32)
        lst = arr.tolist()
        for kind, tokens in (("list", lst), ("np.uint32", arr)):
            dq = qualia.PrefixIdentity.of_tokens(tokens).digest
            dr = ref.PrefixIdentity.of_tokens(tokens).digest
            assert dq == dr, "digests differ"
            out = {"tokens": ntok, "blocks": ntok // 16, "input": kind}
            for name, mod in (("qualia", qualia), ("reference", ref)):
                f = mod.PrefixIdentity.of_tokens

                def run(k, f=f, t=tokens):
                    for _ in repeat(None, k):
                        f(t)
                out[name] = timeit(run, budget)
                out[name + "_ns_per_block"] = out[name]["median_ns"] / (ntok // 16)
            out["ratio_ref_over_qualia"] = (out["reference"]["median_ns"]
                                            / out["qualia"]["median_ns"])
            rows.append(out)
    # the hash alone: namespace-free BLAKE2b-128 over the same bytes via hashlib (C), for scale
    import hashlib
    b = rng.integers(0, VOCAB, 2048, dtype=np.uint32).astype("<u4").tobytes()
    pre = (0).to_bytes(4, "little")

    def run_h(k, b=b, pre=pre, h=hashlib.blake2b):
        for _ in repeat(None, k):
            x = h(pre, digest_size=16)
            x.update(b)
            x.digest()
    s = timeit(run_h, budget)
    log(f"  e    identity: 2048 tokens qualia "
        f"{rows[-1]['qualia_ns_per_block']:.1f} ns/block (np.uint32 input)")
    return rows, {"hashlib_blake2b_2048_tokens": s, "ns_per_block": s["median_ns"] / 128}

# ---------------------------------------------------------------------------------------------
# scenario f: the facade


class FacadeWorld:
    """qualia.Scheduler with `n` requests decoding at context `ctx`; every `epoch` rounds the
    requests are finished and re-admitted (outside the timed region) so tables never fill."""

    def __init__(self, n, ctx, epoch):
        self.n, self.ctx, self.epoch = n, ctx, epoch
        lp = ctx // PAGE_TOKENS + epoch // PAGE_TOKENS + 2
        self.s = qualia.Scheduler(n, n * lp, PAGE_TOKENS, lp)
        self.rounds = 0
        self.next_rid = 0
        self.rids = []
        self.reset()

    def reset(self):
        for rid in self.rids:
            self.s.finish(rid)
        self.rids = []
        for _ in range(self.n):
            rid = self.next_rid
            self.next_rid += 1
            self.s.admit(rid)
            self.s.reserve(rid, self.ctx - 1)
            self.s.advance(rid, self.ctx - 1)
            self.s.complete_prefill(rid, rid % VOCAB)
            self.rids.append(rid)
        self.rounds = 0

    def runner(self, backend):
        dec = self.s.decode

        def run(k, dec=dec, b=backend, self=self):
            if self.rounds + k > self.epoch:
                self.reset()
            for _ in repeat(None, k):
                dec(b)
            self.rounds += k
        return run


def bench_facade(budget, batches, ctx=2048):
    rows = []
    for n in batches:
        w = FacadeWorld(n, ctx, epoch=2048 if n <= 256 else 512)
        be = qualia.HashBackend()
        s = timeit(w.runner(be), budget, max_samples=min(budget.max_samples, 200))
        st = w.s.stats()
        rows.append({"batch": n, "context": ctx, "round": s,
                     "ns_per_request": s["median_ns"] / n,
                     "pages_allocated": st["pages_allocated"],
                     "decode_rounds": st["decode_rounds"]})
        log(f"  f    facade n={n:5d}: {fmt_ns(s['median_ns'])} ({s['median_ns'] / n:.1f} ns/req)")
    return rows

# ---------------------------------------------------------------------------------------------
# scenario g: allocations and RSS


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def alloc_probe(run, rounds=1000, frames=25):
    """Allocations over `rounds` operations after warm-up: sys.getallocatedblocks delta (without
    tracemalloc), tracemalloc traced-memory delta and peak over the start, each minus the same
    probe around an empty loop, plus tracebacks of whatever the snapshots say grew."""

    def noop(k):
        for _ in repeat(None, k):
            pass

    def measure(fn):
        fn(rounds)  # warm
        gc.collect()
        gc.disable()
        try:
            b0 = sys.getallocatedblocks()
            fn(rounds)
            b1 = sys.getallocatedblocks()
            tracemalloc.start(frames)
            ballast = bytearray(1 << 16)  # keep traced sizes in the same int range
            fn(8)
            s0 = tracemalloc.take_snapshot()
            c0 = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            fn(rounds)
            c1, p1 = tracemalloc.get_traced_memory()
            s1 = tracemalloc.take_snapshot()
            tracemalloc.reset_peak()
            c2 = tracemalloc.get_traced_memory()[0]
            fn(1)
            c3, p3 = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            del ballast
        finally:
            gc.enable()
        return b1 - b0, c1 - c0, p1 - c0, p3 - c2, c3 - c2, s0, s1

    base = measure(noop)
    got = measure(run)
    lines = {ln for _, _, ln in measure.__code__.co_lines() if ln is not None}
    here = os.path.abspath(__file__)
    grown = []
    for st in got[6].compare_to(got[5], "traceback"):
        if st.size_diff <= 0:
            continue
        fr = st.traceback[0]
        if os.path.abspath(fr.filename) == here and fr.lineno in lines:
            continue  # the probe's own bookkeeping
        grown.append({"size_diff": st.size_diff, "count_diff": st.count_diff,
                      "traceback": [f"{_where(f.filename)}:{f.lineno}" for f in st.traceback]})
    return {
        "rounds": rounds,
        "allocated_blocks_delta": got[0] - base[0],
        "traced_bytes_delta": got[1] - base[1],
        "transient_peak_bytes_over_rounds": got[2] - base[2],
        "transient_peak_bytes_one_round": got[3] - base[3],
        "grown": grown[:5],
    }


def rss_probe(run, rounds, every):
    run(every)
    gc.collect()
    marks = []
    done = 0
    gc.disable()
    try:
        while done < rounds:
            run(every)
            done += every
            marks.append(_rss_bytes())
    finally:
        gc.enable()
    return {"rounds": rounds, "rss_start": marks[0], "rss_end": marks[-1],
            "rss_max_minus_min": max(marks) - min(marks), "rss_samples": marks}


def bench_alloc(rss_rounds):
    out = {}
    wq = decode_world(qualia, 64, 8)
    cb = qualia.HashBackend()
    run = round_runner(wq, cb)
    out["execute_decode_round"] = alloc_probe(run)
    out["execute_decode_round"]["rss"] = rss_probe(run, rss_rounds, rss_rounds // 10)
    # the probe makes ~3000 rounds: one epoch of 4096 holds them, so no re-admission (which
    # allocates results) falls inside the probe; the RSS run crosses epochs (re-admission is
    # outside the decode calls, and must not grow the process either)
    fw = FacadeWorld(64, 128, epoch=4096)
    run = fw.runner(qualia.HashBackend())
    fw.reset()
    out["Scheduler.decode"] = alloc_probe(run, rounds=1000)

    def run_epochs(k, run=run):
        while k > 0:
            step = min(k, 500)
            run(step)
            k -= step
    out["Scheduler.decode"]["rss"] = rss_probe(run_epochs, rss_rounds, rss_rounds // 10)
    for name, r in out.items():
        log(f"  g    {name}: blocks {r['allocated_blocks_delta']:+d}, traced "
            f"{r['traced_bytes_delta']:+d} B over {r['rounds']} rounds; transient peak "
            f"{r['transient_peak_bytes_one_round']} B/round; RSS drift "
            f"{r['rss']['rss_max_minus_min'] / 1024:.0f} KiB over {r['rss']['rounds']} rounds")
    return out

# ---------------------------------------------------------------------------------------------
# targets


def evaluate(results):
    t = []
    a = {(r["batch"], r["context"]): r for r in results.get("decode", [])}
    r = a.get((256, 2048))
    if r:
        c = r["c_backend"]
        t.append(("C-backend round 256 x 2k <= 20 ns/request",
                  c["qualia_ns_per_request"] <= 20, f"{c['qualia_ns_per_request']:.1f} ns/request"))
        t.append(("C-backend round 256 x 2k within 3x of the copy floor",
                  c["qualia_x_floor"] <= 3, f"{c['qualia_x_floor']:.2f}x floor "
                  f"({fmt_ns(c['qualia']['median_ns'])} vs floor {fmt_ns(r['floor_ns'])})"))
        nb = r.get("null_c_backend")
        if nb:
            t.append(("(scheduler only, null C backend) 256 x 2k <= 20 ns/request and <= 3x floor",
                      nb["qualia_ns_per_request"] <= 20 and nb["qualia_x_floor"] <= 3,
                      f"{nb['qualia_ns_per_request']:.1f} ns/request, {nb['qualia_x_floor']:.2f}x"))
    for ctx in sorted({k[1] for k in a}):
        vals = [(n, a[(n, ctx)]["c_backend"]["qualia_ns_per_request"])
                for n in sorted({k[0] for k in a}) if (n, ctx) in a and 64 <= n <= 4096]
        if len(vals) >= 2:
            v = [x for _, x in vals]
            med = float(np.median(v))
            ok = all(0.7 * med <= x <= 1.3 * med for x in v)
            t.append((f"per-request cost flat (+-30% of median) 64..{vals[-1][0]} at ctx {ctx}", ok,
                      ", ".join(f"{n}: {x:.1f}" for n, x in vals) + " ns/req"))
            fx = [a[(n, ctx)]["c_backend"]["qualia_x_floor"] for n, _ in vals]
            t.append((f"  (same, as multiple of the copy floor) ctx {ctx}",
                      all(0.7 * np.median(fx) <= x <= 1.3 * np.median(fx) for x in fx),
                      ", ".join(f"{n}: {x:.2f}x" for (n, _), x in zip(vals, fx))))
    if results.get("prefix"):
        v = [(r["pool_blocks"], r["qualia"]["median_ns"]) for r in results["prefix"]]
        t.append(("prefix-hit admit+finish <= 1 us", all(x <= 1000 for _, x in v),
                  ", ".join(f"{b}: {fmt_ns(x)}" for b, x in v)))
        xs = [x for _, x in v]
        t.append(("prefix-hit admit+finish flat (+-30%) from 1k to 1M blocks",
                  max(xs) <= 1.3 * min(xs), f"max/min = {max(xs) / min(xs):.2f}"))
    if results.get("identity"):
        for r in results["identity"]:
            t.append((f"of_tokens <= 0.1 us per 16-token block ({r['tokens']} tokens, "
                      f"{r['input']})", r["qualia_ns_per_block"] <= 100,
                      f"{r['qualia_ns_per_block']:.1f} ns/block"))
    if results.get("alloc"):
        for name, r in results["alloc"].items():
            t.append((f"{name}: zero net allocations over {r['rounds']} rounds",
                      r["allocated_blocks_delta"] <= 2 and r["traced_bytes_delta"] <= 0,
                      f"blocks {r['allocated_blocks_delta']:+d}, "
                      f"traced {r['traced_bytes_delta']:+d} B"))
            t.append((f"{name}: zero transient allocations per round",
                      r["transient_peak_bytes_one_round"] <= 0,
                      f"peak {r['transient_peak_bytes_one_round']} B above start within a round"))
            t.append((f"{name}: flat RSS over {r['rss']['rounds']} rounds",
                      r["rss"]["rss_max_minus_min"] <= 256 * 1024,
                      f"max-min {r['rss']['rss_max_minus_min'] / 1024:.0f} KiB"))
    if results.get("cache"):
        t.extend(cache_bench.evaluate(results["cache"]))
    return [{"target": a_, "met": bool(b_), "measured": c_} for a_, b_, c_ in t]

# ---------------------------------------------------------------------------------------------
# report


def render(results, md=False):
    tb = md_table if md else (lambda h, r: table(h, r))
    parts = []

    def sec(title, headers, rows):
        if md:
            parts.append(f"### {title}\n\n{tb(headers, rows)}\n")
        else:
            parts.append(table(headers, rows, title=f"\n== {title}"))

    if results.get("cache"):
        for title, headers, rows in cache_bench.render_rows(results["cache"], fmt_ns):
            sec(title, headers, rows)
    if "decode" not in results:  # --cache-only
        sec("targets", ["target", "met", "measured"],
            [[t["target"], "yes" if t["met"] else "NO", t["measured"]]
             for t in results["targets"]])
        return "\n".join(parts)
    for key, title in (("c_backend", "a. decode round, built-in C backend "
                                     "(RequestScheduler.execute_decode_round)"),
                       ("py_backend", "b. decode round, Python numpy-echo backend "
                                      "(crossing = round - backend body - null-C round, "
                                      "rounds < 100 us)")):
        rows = []
        for r in results["decode"]:
            c = r[key]
            row = [r["batch"], r["context"], fmt_ns(c["qualia"]["median_ns"]),
                   fmt_ns(c["qualia"]["p99_ns"]), f"{c['qualia_ns_per_request']:.1f}",
                   fmt_ns(c["reference"]["median_ns"]), fmt_ns(c["reference"]["p99_ns"]),
                   f"{c['reference_ns_per_request']:.0f}", fmt_x(c["ratio_ref_over_qualia"])]
            if key == "c_backend":
                row += [fmt_ns(r["floor_ns"]), f"{c['qualia_x_floor']:.1f}x"]
                nb = r.get("null_c_backend")
                row += ([fmt_ns(nb["qualia"]["median_ns"]), f"{nb['qualia_ns_per_request']:.1f}",
                         f"{nb['qualia_x_floor']:.1f}x"] if nb else ["-", "-", "-"])
            else:
                nb = r.get("null_c_backend")
                # a difference of two medians: only meaningful while the round is short
                cross = (fmt_ns(c["qualia"]["median_ns"] - c["backend_body_ns"]
                                - nb["qualia"]["median_ns"])
                         if nb and nb["qualia"]["median_ns"] < 100_000 else "-")
                row += [fmt_ns(c["backend_body_ns"]), cross]
            rows.append(row)
        headers = ["batch", "ctx", "qualia med", "p99", "ns/req", "ref med", "p99", "ns/req",
                   "ref/q"]
        headers += (["floor", "x floor", "null-C med", "ns/req", "x floor"] if key == "c_backend"
                    else ["backend body", "crossing"])
        sec(title, headers, rows)
    if results.get("sparse"):
        sec("a'. one decoding request, scheduler capacity varied (idle-slot cost)",
            ["max_requests", "round med", "p99"],
            [[r["max_requests"], fmt_ns(r["round"]["median_ns"]), fmt_ns(r["round"]["p99_ns"])]
             for r in results["sparse"]])
    if results.get("scratch_kinds"):
        rows = []
        for r in results["scratch_kinds"]:
            for b in ("c_backend", "null_c_backend"):
                if b in r:
                    rows.append([r["batch"], r["context"], b,
                                 fmt_ns(r[b]["ndarray"]["median_ns"]),
                                 fmt_ns(r[b]["memoryview"]["median_ns"]),
                                 fmt_ns(r[b]["ndarray"]["median_ns"]
                                        - r[b]["memoryview"]["median_ns"])])
        sec("a''. scratch as numpy arrays vs memoryviews of them (cost of numpy's buffer export)",
            ["batch", "ctx", "backend", "ndarray med", "memoryview med", "difference"], rows)
    sec("c. prefix-hit admit_with_prefix + finish (8-page prefix)",
        ["pool blocks", "prefixes", "qualia med", "p99", "ref med", "p99", "ref/q"],
        [[r["pool_blocks"], r["prefixes"], fmt_ns(r["qualia"]["median_ns"]),
          fmt_ns(r["qualia"]["p99_ns"]), fmt_ns(r["reference"]["median_ns"]),
          fmt_ns(r["reference"]["p99_ns"]), fmt_x(r["ratio_ref_over_qualia"])]
         for r in results["prefix"]])
    sec("d. churn at full capacity: finish one + admit one (no prefix)",
        ["max_requests", "qualia med", "p99", "ref med", "p99", "ref/q"],
        [[r["max_requests"], fmt_ns(r["qualia"]["median_ns"]), fmt_ns(r["qualia"]["p99_ns"]),
          fmt_ns(r["reference"]["median_ns"]), fmt_ns(r["reference"]["p99_ns"]),
          fmt_x(r["ratio_ref_over_qualia"])] for r in results["churn"]])
    sec("e. PrefixIdentity.of_tokens",
        ["tokens", "input", "qualia med", "ns/block", "ref med", "ns/block", "ref/q"],
        [[r["tokens"], r["input"], fmt_ns(r["qualia"]["median_ns"]),
          f"{r['qualia_ns_per_block']:.1f}", fmt_ns(r["reference"]["median_ns"]),
          f"{r['reference_ns_per_block']:.1f}", fmt_x(r["ratio_ref_over_qualia"])]
         for r in results["identity"]])
    sec("f. facade qualia.Scheduler.decode(HashBackend()) (no reference twin)",
        ["batch", "ctx", "round med", "p99", "ns/req"],
        [[r["batch"], r["context"], fmt_ns(r["round"]["median_ns"]),
          fmt_ns(r["round"]["p99_ns"]), f"{r['ns_per_request']:.1f}"]
         for r in results["facade"]])
    if results.get("alloc"):
        sec("g. steady-state allocations (C backend, 64 requests)",
            ["path", "rounds", "blocks delta", "traced delta", "transient peak/round",
             "RSS rounds", "RSS max-min"],
            [[name, r["rounds"], f"{r['allocated_blocks_delta']:+d}",
              f"{r['traced_bytes_delta']:+d} B", f"{r['transient_peak_bytes_one_round']} B",
              r["rss"]["rounds"], f"{r['rss']['rss_max_minus_min'] / 1024:.0f} KiB"]
             for name, r in results["alloc"].items()])
    sec("targets", ["target", "met", "measured"],
        [[t["target"], "yes" if t["met"] else "NO", t["measured"]] for t in results["targets"]])
    return "\n".join(parts)


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("--plot needs matplotlib, which is not installed (pip install matplotlib); "
            "no plot written")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, key, title in ((axes[0], "c_backend", "C backend"),
                           (axes[1], "py_backend", "Python numpy-echo backend")):
        for ci, ctx in enumerate(sorted({r["context"] for r in results["decode"]})):
            color = f"C{ci}"
            rs = [r for r in results["decode"] if r["context"] == ctx]
            xs = [r["batch"] for r in rs]
            ax.plot(xs, [r[key]["qualia_ns_per_request"] for r in rs], "o-", color=color,
                    label=f"qualia, ctx {ctx}")
            ax.plot(xs, [r[key]["reference_ns_per_request"] for r in rs], "s--", color=color,
                    alpha=0.6, label=f"reference, ctx {ctx}")
            if key == "c_backend":
                ax.plot(xs, [r["floor_ns"] / r["batch"] for r in rs], ":", color=color,
                        label=f"copy floor, ctx {ctx}")
        ax.legend(fontsize=7, ncol=1 if key == "c_backend" else 2)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("active decoding requests (batch)")
        ax.set_title(f"decode round: {title}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("ns per request per round")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller grid, shorter timing (< 1 min)")
    ap.add_argument("--json", metavar="PATH", help="write machine-readable results")
    ap.add_argument("--plot", metavar="PNG", help="plot ns/request vs batch (needs matplotlib)")
    ap.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown")
    ap.add_argument("--cache-only", action="store_true",
                    help="run only scenario h (automatic prefix caching)")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    budget = Budget(args.quick)
    batches = [1, 16, 64, 256, 1024, 4096]
    contexts = [128, 2048, 32768]
    if args.quick:
        # trim the largest combos: 4096 requests, and 32k context past 64 requests
        skip = {(4096, c) for c in contexts} | {(n, 32768) for n in batches if n > 64}
    else:
        skip = set()
    results = {"machine": machine_info(), "command": " ".join([os.path.basename(sys.argv[0])]
                                                               + (argv or sys.argv[1:])),
               "quick": args.quick}
    log(f"qualia bench on {results['machine']['cpu_model']} "
        f"({results['machine']['cpu_count']} CPUs), python {results['machine']['python']}, "
        f"numpy {results['machine']['numpy']}{' [quick]' if args.quick else ''}")
    results["call_overhead_ns"] = call_overhead(budget)
    if args.cache_only:
        results["cache"] = cache_bench.run(args.quick, log)
        return _finish(results, args, t_start)
    floor = CopyFloor(budget)
    results["copy_overhead_ns"] = floor.overhead_ns
    null_cap, why = null_c_backend()
    results["null_c_backend"] = "built" if null_cap is not None else why
    if null_cap is None:
        log(f"  (null C backend skipped: {why})")
    results["decode"] = bench_decode(budget, floor, batches, contexts, skip, null_cap)
    results["copy_bandwidth_GBps"] = {str(k): v for k, v in sorted(floor.cache.items())}
    results["sparse"] = bench_sparse(budget)
    results["scratch_kinds"] = bench_scratch_kinds(budget, null_cap)
    results["prefix"] = bench_prefix(budget, [1 << 10, 1 << 16, 1 << 20])
    results["churn"] = bench_churn(budget, [256, 1024] if args.quick else [256, 4096])
    results["identity"], results["hashlib_scale"] = bench_identity(budget)
    results["facade"] = bench_facade(budget, [1, 16, 256] if args.quick else [1, 16, 256, 1024])
    results["alloc"] = bench_alloc(20_000 if args.quick else 100_000)
    results["cache"] = cache_bench.run(args.quick, log)
    return _finish(results, args, t_start)


def _finish(results, args, t_start):
    results["targets"] = evaluate(results)
    results["wall_s"] = time.perf_counter() - t_start

    print(render(results))
    print(f"\nwall time {results['wall_s']:.1f} s; timing: median/p99 of per-op means over samples "
          f"of k ops, gc disabled; Python call overhead ~{results['call_overhead_ns']:.0f} ns "
          f"per call included")
    rc = 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(render(results, md=True) + "\n")
    if args.plot and not plot(results, args.plot):
        rc = 3
    return rc


if __name__ == "__main__":
    sys.exit(main())
