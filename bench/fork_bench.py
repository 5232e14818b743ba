"""Copy-on-write forks (issue 15), the compiled core beside its twin.

  f1  fork of a decoding parent of L tokens (L = 128 .. 32k, 16-token pages), automatic prefix
      caching on and off: K forks into free slots per sample, timed together (Python call
      included), per fork.  Nothing is copied at fork time: the cost is one retain per page
      plus a fixed part.  The twin's fork at 2k beside it.
  f2  n = 8 samples of a 2k-token prompt (2048 tokens: whole pages; 2050: a partly filled last
      page), 256 decoded tokens each: pages held by requests at peak, forks (one prefill, 7
      forks) beside 8 independent requests with automatic prefix caching (full pages shared
      through the cache, the partial last page recomputed per request) and without it (nothing
      shared); page copies made.

  f3  a decode round of 8 sequences of a 2050-token prompt (C hash backend, automatic mode):
      8 forks of one parent beside 8 independent requests, per sequence; the forks' first round
      (7 page copies handed to ``copy_pages``) beside their later rounds.

Run: ``python bench/fork_bench.py`` (add ``--quick`` for fewer samples).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import qualia
from qualia import twin_cache

pc = time.perf_counter_ns
PT = 16
K = 32


def decoding_parent(cls, tokens, mode="auto", slots=K + 1, extra_pages=0):
    pages = -(-tokens // PT) + 2
    kw = {} if cls is twin_cache.Scheduler else {"prefix_caching": mode}
    s = cls(slots, pages + extra_pages + 4, PT, pages, **kw)
    s.admit(0, np.arange(tokens, dtype=np.uint32) % 30000)
    s.reserve(0, tokens)
    s.advance(0, tokens)
    s.complete_prefill(0, 7)
    return s


def fork_ns(cls, tokens, mode, samples):
    s = decoding_parent(cls, tokens, mode)
    fork, finish = s.fork, s.finish
    children = range(1, K + 1)
    per = []
    for _ in range(samples):
        t0 = pc()
        for c in children:
            fork(0, c)
        per.append((pc() - t0) / K)
        for c in children:
            finish(c)
    a = np.asarray(per)
    return {"median_ns": float(np.median(a)), "min_ns": float(a.min()),
            "pages": int(len(s.block_table(0)))}


def peak_pages(n, prompt_len, new_tokens, how):
    pages = -(-(prompt_len + new_tokens) // PT) + 1
    mode = "off" if how == "independent_off" else "auto"
    s = qualia.Scheduler(n, n * pages + 8, PT, pages, prefix_caching=mode)
    prompt = np.arange(prompt_len, dtype=np.uint32) % 30000
    backend = qualia.HashBackend(32000)
    if how == "fork":
        s.admit(0, prompt)
        s.reserve(0, prompt_len)
        s.advance(0, prompt_len)
        s.complete_prefill(0, 7)
        for c in range(1, n):
            s.fork(0, c)
    else:
        for r in range(n):
            adm = s.admit(r, prompt)
            rest = prompt_len - adm.prefix_tokens
            s.reserve(r, rest)
            s.advance(r, rest)
            s.complete_prefill(r, 7)
    peak = s.stats()["used_pages"]
    for _ in range(new_tokens):
        s.decode(backend)
        peak = max(peak, s.stats()["used_pages"])
    st = s.stats()
    return {"peak_pages": int(peak), "pages_copied": int(st["pages_copied"]),
            "prompt_pages": -(-prompt_len // PT),
            "tail_pages_each": -(-(prompt_len + new_tokens) // PT) - prompt_len // PT}


class _CopyCounter:
    def __init__(self):
        self.inner = qualia.HashBackend(32000)
        self.copies = 0

    def execute_ragged(self, items, block_table, outputs):
        return self.inner.execute_ragged(items, block_table, outputs)

    def copy_pages(self, copies):
        self.copies += len(copies)
        return len(copies)


def round_ns(how, rounds, prompt_len=2050, n=8):
    pages = -(-(prompt_len + rounds + 2) // PT) + 1
    s = qualia.Scheduler(n, n * pages + 8, PT, pages)
    prompt = np.arange(prompt_len, dtype=np.uint32) % 30000
    if how == "fork":
        s.admit(0, prompt)
        s.reserve(0, prompt_len)
        s.advance(0, prompt_len)
        s.complete_prefill(0, 7)
        for c in range(1, n):
            s.fork(0, c)
    else:
        for r in range(n):
            adm = s.admit(r, prompt)
            s.reserve(r, prompt_len - adm.prefix_tokens)
            s.advance(r, prompt_len - adm.prefix_tokens)
            s.complete_prefill(r, 7)
    backend = qualia.HashBackend(32000)
    counter = _CopyCounter()
    t0 = pc()
    s.decode(counter)               # the first round (the forks copy the shared partial page)
    first = (pc() - t0) / n
    ts = []
    for _ in range(rounds):
        t0 = pc()
        s.decode(backend)
        ts.append((pc() - t0) / n)
    return {"first_round_ns_per_seq": first, "round_ns_per_seq": float(np.median(ts)),
            "first_round_copies": counter.copies}


def main(argv):
    quick = "--quick" in argv
    samples = 200 if quick else 2000
    out = {"f1": {}, "f2": {}}
    print(f"f1: fork of a decoding parent, {PT}-token pages, per fork (median of {samples} "
          f"samples of {K} forks)")
    print(f"{'tokens':>7} {'pages':>6} {'auto ns':>9} {'off ns':>9} {'ns/page':>8}")
    for tokens in (128, 512, 2048, 8192, 32768):
        a = fork_ns(qualia.Scheduler, tokens, "auto", samples)
        o = fork_ns(qualia.Scheduler, tokens, "off", samples)
        out["f1"][tokens] = {"auto": a, "off": o}
        print(f"{tokens:>7} {a['pages']:>6} {a['median_ns']:>9.0f} {o['median_ns']:>9.0f} "
              f"{a['median_ns'] / a['pages']:>8.2f}")
    tw = fork_ns(twin_cache.Scheduler, 2048, "auto", max(samples // 20, 10))
    out["f1"]["twin_2048"] = tw
    print(f"twin fork at 2048 tokens: {tw['median_ns']:.0f} ns "
          f"({tw['median_ns'] / out['f1'][2048]['auto']['median_ns']:.0f}x the core)")
    print("\nf2: n = 8 samples of a prompt, 256 new tokens each: pages held by requests at peak")
    print(f"{'prompt':>7} {'how':>16} {'peak':>6} {'copies':>7} {'vs forks':>9}")
    for prompt_len in (2048, 2050):
        rows = {how: peak_pages(8, prompt_len, 256, how)
                for how in ("fork", "independent_auto", "independent_off")}
        out["f2"][prompt_len] = rows
        for how, r in rows.items():
            print(f"{prompt_len:>7} {how:>16} {r['peak_pages']:>6} {r['pages_copied']:>7} "
                  f"{r['peak_pages'] / rows['fork']['peak_pages']:>8.2f}x")
        f = rows["fork"]
        print(f"{'':>7} expected for forks: prompt {f['prompt_pages']} pages once + 8 tails of "
              f"{f['tail_pages_each']} = "
              f"{prompt_len // PT + 8 * f['tail_pages_each']} pages")
    print("\nf3: decode round of 8 sequences of a 2050-token prompt, per sequence (median)")
    print(f"{'how':>12} {'round ns':>9} {'first round ns':>15} {'first copies':>13}")
    for how in ("fork", "independent"):
        r = round_ns(how, 200 if quick else 1000)
        out.setdefault("f3", {})[how] = r
        print(f"{how:>12} {r['round_ns_per_seq']:>9.0f} {r['first_round_ns_per_seq']:>15.0f} "
              f"{r['first_round_copies']:>13}")
    if "--json" in argv:
        print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
