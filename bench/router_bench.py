"""The router's index (qualia.PrefixRouterIndex): one routing decision for a 64-page prompt with
1M page identities indexed, beside a Python dict doing the same walk, in one run.

  r1  match_into: the per-replica longest cached prefix of a 64-page prompt whose pages all 16
      replicas hold (the walk never stops early: the worst case), 1M identities spread over the
      replicas at random (a 2M-slot, 32 MiB table: every lookup is a cache miss unless the
      prompt's pages were touched just before; the bench touches 4 MiB of other memory between
      samples to keep them cold)
  r2  the whole decision: ``route`` (match_into + the prefix policy's pick in C: longest
      prefix minus a load cost, over 16 replicas), and the same pick done in Python beside it
  r3  the same walk over a dict {identity: bitset} in Python (the ratio beside r1)
  r4  page_identities of the 1,024-token prompt (what the router computes once per request)
  r5  apply_events: 1M "stored" events in batches of 4,096, per event

Run: ``python bench/router_bench.py`` (``--identities N`` to change the index size).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import qualia

pc = time.perf_counter_ns
PT = 16
PAGES = 64
REPLICAS = 16


def _stats(ts):
    a = np.asarray(ts, dtype=np.float64)
    return float(np.median(a)), float(a.min()), float(np.percentile(a, 99))


def _fmt(ns):
    return f"{ns / 1000:.2f} us" if ns >= 1000 else f"{ns:.0f} ns"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--identities", type=int, default=1_000_000)
    ap.add_argument("--samples", type=int, default=3000)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(7)
    n = args.identities
    idx = qualia.PrefixRouterIndex(n + PAGES, REPLICAS)
    ev = np.zeros(4096, dtype=qualia.KV_EVENT)
    ev["kind"] = qualia._core.KV_STORED_KIND
    ids = rng.integers(0, 2**63, size=n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    owners = rng.integers(0, REPLICAS, size=n)
    applied = 0
    apply_total = 0
    for r in range(REPLICAS):
        mine = ids[owners == r]
        for s in range(0, len(mine), len(ev)):
            chunk = mine[s:s + len(ev)]
            ev["identity"][:len(chunk)] = chunk
            batch = ev[:len(chunk)]
            t0 = pc()
            applied += idx.apply_events(r, batch)
            apply_total += pc() - t0
    apply_ns = apply_total / applied
    # the prompt: 64 pages every replica holds (real identities of a real prompt)
    sched = qualia.Scheduler(1, 4, PT, PAGES + 1, cache_key=bytes(range(16)))
    prompt = np.arange(1, PAGES * PT + 1, dtype=np.uint32)
    pids = sched.page_identities(prompt)
    ev2 = np.zeros(PAGES, dtype=qualia.KV_EVENT)
    ev2["kind"] = qualia._core.KV_STORED_KIND
    ev2["identity"] = pids
    for r in range(REPLICAS):
        idx.apply_events(r, ev2)
    out = np.zeros(REPLICAS, dtype=np.uint32)
    assert idx.match_into(pids, out) == PAGES and out.tolist() == [PAGES] * REPLICAS
    loads = [0.1 * r for r in range(REPLICAS)]
    cost = np.array([8.0 * x for x in loads])
    assert idx.route(pids, cost, out) == 0

    def decide():
        idx.match_into(pids, out)
        best, best_score = 0, -1e18
        m = out.tolist()
        for r in range(REPLICAS):
            score = m[r] - 8.0 * loads[r]
            if score > best_score:
                best, best_score = r, score
        return best

    table = {int(i): 1 << int(o) for i, o in zip(ids[:200_000], owners[:200_000])}
    for p in pids.tolist():
        table[p] = (1 << REPLICAS) - 1
    plist = pids.tolist()

    def dict_walk():
        res = [0] * REPLICAS
        alive = (1 << REPLICAS) - 1
        for k, p in enumerate(plist):
            held = alive & table.get(p, 0)
            gone = alive & ~held
            while gone:
                low = gone & -gone
                res[low.bit_length() - 1] = k
                gone ^= low
            if not held:
                return res
            alive = held
        while alive:
            low = alive & -alive
            res[low.bit_length() - 1] = len(plist)
            alive ^= low
        return res

    assert dict_walk() == [PAGES] * REPLICAS
    junk = np.zeros(4 << 20, dtype=np.uint8)
    results = {}
    for name, fn, cold in (("match_into", lambda: idx.match_into(pids, out), True),
                           ("match_into (warm)", lambda: idx.match_into(pids, out), False),
                           ("decision: route", lambda: idx.route(pids, cost, out), True),
                           ("decision: match_into + pick in Python", decide, True),
                           ("dict walk (Python)", dict_walk, True),
                           ("page_identities", lambda: sched.page_identities(prompt), False)):
        ts = []
        for _ in range(args.samples):
            if cold:
                junk += 1      # evict the prompt's slots from the caches
            t = pc()
            fn()
            ts.append(pc() - t)
        results[name] = _stats(ts)
    print(f"# router index: {n:,} identities over {REPLICAS} replicas, {idx.slots:,} slots "
          f"({idx.slots * 16 / 2**20:.0f} MiB), a {PAGES}-page prompt held by every replica")
    print()
    print("| operation | median | best | p99 |")
    print("|---|---:|---:|---:|")
    for name, (med, best, p99) in results.items():
        print(f"| {name} | {_fmt(med)} | {_fmt(best)} | {_fmt(p99)} |")
    print(f"| apply_events, per stored event | {_fmt(apply_ns)} | | |")
    print()
    print(f"dict walk / match_into (median): "
          f"{results['dict walk (Python)'][0] / results['match_into'][0]:.1f}x; "
          f"target: a decision <= 2 us -> "
          f"{'met' if results['decision: route'][0] <= 2000 else 'NOT met'} "
          f"(median {_fmt(results['decision: route'][0])})")


if __name__ == "__main__":
    main()
