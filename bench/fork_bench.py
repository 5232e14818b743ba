"""Copy-on-write forks, the compiled core beside its twin.

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

  f4  the engine step (a step with forked requests should cost the same per request as without,
      plus the copies): the steady decode step (update + schedule, every plan array
      written; bench/steptime.py, as step_bench.py's s1) of R running requests of a 2050-token
      prompt, R independent requests beside R / 8 groups of add_request(..., n=8), ns per
      request and the ratio groups / independent, for R = 256 and 64.
  f5  the step that holds the copies: every prompt prefilled in one step, then the first decode
      step (update of the prefill's sampled ids, where the groups fork, + schedule of the
      first decode plan, whose plan.copies holds each child's copy of the shared partial last
      page) beside the same step of R independent requests, and the step after it; the groups'
      extra over the independent requests per copy (7 per group), split into update (the
      forks) and schedule (the copies, and each child's block-table row written whole).
      Prefix caching off isolates the forks and copies; with it on ("auto") the update of the
      prompts' last chunk also hashes and caches their pages, 8x as many for the independent
      requests, which swamps the forks there.

Run: ``python bench/fork_bench.py`` (add ``--quick`` for fewer samples; ``--only f4,f5`` for
some sections).
"""

from __future__ import annotations

import gc
import json
import os
import sys

# numpy's BLAS threads spin on an idle core when left at their default; nothing here uses BLAS
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from steptime import KEY, PT, decode_cost, median, pc  # noqa: E402

import qualia  # noqa: E402
from qualia.twin import cache as twin_cache  # noqa: E402

K = 32
N = 8       # members per group in f4 / f5


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


def start_samples(s, n, prompt, fork):
    """n samples of prompt in s, decoding from now on: one prefill forked n - 1 times (fork),
    or n requests each admitted with what the prefix cache holds of the prompt."""
    for r in range(1 if fork else n):
        rest = len(prompt) - s.admit(r, prompt).prefix_tokens
        s.reserve(r, rest)
        s.advance(r, rest)
        s.complete_prefill(r, 7)
    if fork:
        for c in range(1, n):
            s.fork(0, c)


def peak_pages(n, prompt_len, new_tokens, how):
    pages = -(-(prompt_len + new_tokens) // PT) + 1
    mode = "off" if how == "independent_off" else "auto"
    s = qualia.Scheduler(n, n * pages + 8, PT, pages, prefix_caching=mode)
    start_samples(s, n, np.arange(prompt_len, dtype=np.uint32) % 30000, how == "fork")
    backend = qualia.HashBackend(32000)
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
    start_samples(s, n, np.arange(prompt_len, dtype=np.uint32) % 30000, how == "fork")
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


def step_pair(r, ctx, steps, builds):
    """f4: the steady decode step, ns per request, of r independent requests and of r / N
    groups of n = N: median over `builds` schedulers built alternately."""
    ind, grp = [], []
    for _ in range(builds):
        ind.append(decode_cost(qualia.StepScheduler, r, ctx, steps))
        grp.append(decode_cost(qualia.StepScheduler, r, ctx, steps, group=N))
    return {"independent_ns": median(ind), "groups_ns": median(grp),
            "ratio": median(grp) / median(ind)}


def first_step(r, ctx, group, mode):
    """f5: r requests (r / group prompts of n = group) of ctx-token prompts prefilled in one
    step, prefix caching `mode`; ns of the first decode step's update and schedule, of the step
    after it, and the first decode plan's copies."""
    tokens = r // group * ctx
    lp = -(-ctx // PT) + 2
    s = qualia.StepScheduler(2 * r * lp + 8, PT, lp, r, cache_key=KEY, max_queued=r,
                             max_num_batched_tokens=tokens + r, prefix_caching=mode)
    rng = np.random.default_rng(r + ctx + group)
    fork = {} if group == 1 else {"n": group}
    for rnd in range(2):   # two rounds of such requests: the first (run to its end) touches
        for i in range(r // group):   # the scheduler's memory, the second is timed
            s.add_request(rnd * r + i, rng.integers(0, 30000, size=ctx, dtype=np.uint32),
                          max_new_tokens=8, **fork)
        while rnd == 0 and s.has_unfinished():
            plan = s.schedule()
            s.update(np.zeros(len(plan.logits_indices), dtype=np.uint32))
    plan = s.schedule()
    assert plan.num_prefill_tokens == tokens, (plan.num_prefill_tokens, tokens)
    first_ids = np.zeros(len(plan.logits_indices), dtype=np.uint32)
    ids = np.zeros(r, dtype=np.uint32)
    gc.disable()
    try:
        t0 = pc()
        s.update(first_ids)      # the groups fork here
        t1 = pc()
        plan = s.schedule()      # the first decode plan: the children's copies
        t2 = pc()
        copies = len(plan.copies)
        assert plan.num_decode_tokens == r, (plan.num_decode_tokens, r)
        t3 = pc()
        s.update(ids)
        s.schedule()
        t4 = pc()
    finally:
        gc.enable()
    return {"update_ns": t1 - t0, "schedule_ns": t2 - t1, "next_step_ns": t4 - t3,
            "copies": copies}


def copy_step(r, ctx, reps, mode):
    """f5 for one r: medians over `reps` fresh schedulers built alternately, groups beside
    independent requests, and the groups' extra per copy."""
    runs = {"independent": [], "groups": []}
    for _ in range(reps):
        runs["independent"].append(first_step(r, ctx, 1, mode))
        runs["groups"].append(first_step(r, ctx, N, mode))
    out = {how: {k: median([x[k] for x in xs]) for k in xs[0]} for how, xs in runs.items()}
    g, i = out["groups"], out["independent"]
    copies = g["copies"]
    assert copies == r // N * (N - 1) and i["copies"] == 0, (copies, i["copies"])
    out["extra_update_ns_per_copy"] = (g["update_ns"] - i["update_ns"]) / copies
    out["extra_schedule_ns_per_copy"] = (g["schedule_ns"] - i["schedule_ns"]) / copies
    out["extra_step_ns_per_copy"] = (out["extra_update_ns_per_copy"]
                                     + out["extra_schedule_ns_per_copy"])
    return out


CTX = 2050   # f4 / f5: prompts of 128 full pages and 2 tokens (a shared partial last page)


def f4(quick, out):
    ctx, steps = CTX, 50 if quick else 200
    print(f"\nf4: steady decode step (update + schedule), {ctx}-token prompts, ns per request "
          f"(median of {steps} steps, median of {3 if quick else 5} builds each)")
    print(f"{'R':>5} {'independent':>12} {f'R/{N} x n={N}':>12} {'groups/ind':>11}")
    for r in (256, 64):
        row = step_pair(r, ctx, steps, 3 if quick else 5)
        out.setdefault("f4", {})[r] = row
        print(f"{r:>5} {row['independent_ns']:>12.1f} {row['groups_ns']:>12.1f} "
              f"{row['ratio']:>10.2f}x")


def f5(quick, out):
    ctx, reps = CTX, 5 if quick else 21
    print(f"\nf5: the first decode step after a one-step prefill of {ctx}-token prompts, ns "
          f"(median of {reps} builds); prefix caching off, then auto (where the update of a "
          f"prompt's last chunk also hashes and caches its pages: once per group, once per "
          f"independent request)")
    print(f"{'mode':>4} {'R':>5} {'how':>12} {'update':>9} {'schedule':>9} {'step':>9} "
          f"{'next step':>10} {'copies':>7}")
    for mode in ("off", "auto"):
        for r in (256, 64):
            row = copy_step(r, ctx, reps, mode)
            out.setdefault("f5", {}).setdefault(mode, {})[r] = row
            for how in ("independent", "groups"):
                x = row[how]
                print(f"{mode:>4} {r:>5} {how:>12} {x['update_ns']:>9.0f} "
                      f"{x['schedule_ns']:>9.0f} {x['update_ns'] + x['schedule_ns']:>9.0f} "
                      f"{x['next_step_ns']:>10.0f} {x['copies']:>7.0f}")
            print(f"{'':>10} groups - independent, per copy: "
                  f"{row['extra_step_ns_per_copy']:.0f} ns (update: "
                  f"{row['extra_update_ns_per_copy']:.0f}; schedule: "
                  f"{row['extra_schedule_ns_per_copy']:.0f})")


def beam_run_ns(groups, width, new_tokens, loop, reps):
    """Whole runs of `groups` beam groups of `width` (512-token prompts, `new_tokens` each) to
    their end with qualia.HashBackend: loop="c" is run() (the GIL-free C loop), loop="python"
    drives schedule / execute_step_topk / update from Python; also n groups of the same width
    through run().  Returns (median ns per run, steps, sequences finished)."""
    times, steps, seqs = [], 0, 0
    rng = np.random.default_rng(groups * width)
    prompts = [rng.integers(0, 30000, size=512, dtype=np.uint32) for _ in range(groups)]
    for _ in range(reps):
        s = qualia.StepScheduler(groups * (32 + width * 8) + 8, PT, 64, groups * width,
                                 max_num_batched_tokens=8192, max_queued=groups * width)
        kw = {"n": width} if loop == "n" else {"beam_width": width}
        for i, p in enumerate(prompts):
            s.add_request(i, p, max_new_tokens=new_tokens, ignore_eos=True, **kw)
        hb = qualia.HashBackend(vocab=32000)
        gc.disable()
        t0 = pc()
        if loop == "python":
            steps = 0
            fin = []
            while s.has_unfinished():
                plan = s.schedule()
                if plan.num_topk:
                    fin += s.update(*hb.execute_step_topk(plan))
                else:
                    fin += s.update(hb.execute_step(plan))
                steps += 1
        else:
            r = s.run(hb)
            fin, steps = r.finished, r.steps
        times.append(pc() - t0)
        gc.enable()
        seqs = sum(len(g.outputs) for g in fin)
    return median(times), steps, seqs


def f6(quick, out):
    groups, width, new = 16, 4, 64
    reps = 3 if quick else 9
    print(f"\nf6: {groups} beam groups of width {width} (512-token prompts, {new} new tokens "
          f"each) run to their end with HashBackend; n={width} groups beside them (median of "
          f"{reps} runs)")
    print(f"{'how':>22} {'us/run':>9} {'steps':>6} {'us/step':>8} {'ns/seq-step':>12}")
    for how, loop in (("beams, run() in C", "c"), ("beams, Python loop", "python"),
                      (f"n={width}, run() in C", "n")):
        ns, steps, seqs = beam_run_ns(groups, width, new, loop, reps)
        out.setdefault("f6", {})[loop] = {"ns": ns, "steps": steps, "sequences": seqs}
        print(f"{how:>22} {ns / 1e3:>9.0f} {steps:>6} {ns / 1e3 / steps:>8.1f} "
              f"{ns / steps / (groups * width):>12.1f}")


def main(argv):
    quick = "--quick" in argv
    only = argv[argv.index("--only") + 1].split(",") if "--only" in argv else \
        ["f1", "f2", "f3", "f4", "f5", "f6"]
    samples = 200 if quick else 2000
    out = {"f1": {}, "f2": {}}
    if "f1" in only:
        f1(samples, out)
    if "f2" in only:
        f2(out)
    if "f3" in only:
        f3(quick, out)
    if "f4" in only:
        f4(quick, out)
    if "f5" in only:
        f5(quick, out)
    if "f6" in only:
        f6(quick, out)
    if "--json" in argv:
        print(json.dumps(out, indent=1))
    return out


def f1(samples, out):
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


def f2(out):
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


def f3(quick, out):
    print("\nf3: decode round of 8 sequences of a 2050-token prompt, per sequence (median)")
    print(f"{'how':>12} {'round ns':>9} {'first round ns':>15} {'first copies':>13}")
    for how in ("fork", "independent"):
        r = round_ns(how, 200 if quick else 1000)
        out.setdefault("f3", {})[how] = r
        print(f"{how:>12} {r['round_ns_per_seq']:>9.0f} {r['first_round_ns_per_seq']:>15.0f} "
              f"{r['first_round_copies']:>13}")


if __name__ == "__main__":
    main(sys.argv[1:])
