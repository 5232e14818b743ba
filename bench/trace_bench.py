"""The whole engine step per generated token, prompt submission included, side by side in one
process: a nano-vllm-shaped baseline (bench/baselines/nanovllm_style.py) against qualia.

    python bench/trace_bench.py --trace CONV.csv [--trace CODE.csv | --synthetic-code]
                                [--requests 2000] [--page-tokens 16 256] [--repeat 3]
                                [--profile]

A workload is the first ``--requests`` rows of an Azure LLM inference trace CSV (columns
``ContextTokens`` and ``GeneratedTokens``; a ``TIMESTAMP`` column is read past: every request
is submitted offline, at t=0).  Prompts are synthesized: seeded random token ids of the row's
context length.  ``--synthetic-code`` adds a code-shaped workload instead of a file: prompt
lengths lognormal around 2,048 tokens (sigma 0.8, clipped to [16, 7,936]), outputs lognormal
around 20 tokens (sigma 0.7, clipped to [6, 512]), mean about 28.

Three implementations run the same workload, the same pool and the same limits
(``max_num_seqs`` 512 and ``max_num_batched_tokens`` 16,384, nano-vllm's defaults, raised to
the longest prompt when one is longer, since nano-vllm prefills a prompt whole):

  baseline     Engine.add_request for every request, then Engine.step until done (prompts
               given as lists of ints, what nano-vllm takes)
  qualia run   StepScheduler.add_request for every request (uint32 arrays), then
               run(HashBackend()): the C backend, the loop in C without the GIL
  qualia loop  the same submission, then schedule() / update() from Python, the tokens from a
               numpy vectorized copy of the hash backend

The fake model is the same function in all three (a hash of request id, position and input
token), so the three must produce the same tokens: the bench checks it.  Its time is measured
and subtracted in the baseline and the Python loop; in ``run()`` the hash backend's C call
stays in (a few ns per sampled row).  Pool: the blocks of every request at its full length,
plus ``max_num_seqs``, so no implementation preempts (nano-vllm admits prompts past
``max_num_seqs``, so a pool sized for ``max_num_seqs`` running requests makes it preempt).
Prefix caching is on in both (qualia "auto"); the synthesized prompts share no prefix, so the
caches index blocks but never hit.

Figures: CPU seconds (time.process_time) per generated token, the fastest of ``--repeat``
timed runs of each implementation after one untimed warm-up run of it (see ``measure``), and
the ratios baseline / qualia.  The engines are built outside the timed region.
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from baselines import nanovllm_style as nv  # noqa: E402

import qualia  # noqa: E402

VOCAB = 32000
EOS = VOCAB  # outside the fake model's range: every request runs to its max_tokens
KEY = bytes(range(16))
pt = time.process_time


def load_trace(path, n):
    """(prompt lengths, output lengths) of the trace's first ``n`` rows."""
    prompts, outputs = [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if len(prompts) == n:
                break
            prompts.append(max(1, int(row["ContextTokens"])))
            outputs.append(max(1, int(row["GeneratedTokens"])))
    if not prompts:
        raise ValueError(f"{path}: no rows")
    return prompts, outputs


def synthetic_code(n, seed=7):
    rng = np.random.default_rng(seed)
    p = np.clip(rng.lognormal(math.log(2048), 0.8, n), 16, 7936).astype(int)
    o = np.clip(rng.lognormal(math.log(20), 0.7, n), 6, 512).astype(int)
    return p.tolist(), o.tolist()


class Workload:
    def __init__(self, name, prompt_lens, output_lens, seed=1):
        self.name = name
        self.output_lens = list(output_lens)
        rng = np.random.default_rng(seed)
        self.arrays = [rng.integers(0, VOCAB, size=p, dtype=np.uint32) for p in prompt_lens]
        self.lists = [a.tolist() for a in self.arrays]
        self.tokens = sum(self.output_lens)

    def __len__(self):
        return len(self.arrays)


class Limits:
    def __init__(self, w, page_tokens, max_num_seqs=512, max_num_batched_tokens=16384,
                 num_pages=None):
        self.page_tokens = page_tokens
        self.max_num_seqs = max_num_seqs
        longest = max(len(a) for a in w.arrays)
        self.max_num_batched_tokens = max(max_num_batched_tokens, longest)
        need = sorted((-(-(len(a) + o) // page_tokens) for a, o in
                       zip(w.arrays, w.output_lens)), reverse=True)
        self.logical_pages = need[0] + 1
        # every request at its full length at once, so no implementation preempts (nano-vllm
        # admits prompts past max_num_seqs: its running set is not bounded by it)
        self.num_pages = sum(need) + max_num_seqs if num_pages is None else num_pages


def run_baseline(w, lim):
    eng = nv.Engine(lim.num_pages, lim.page_tokens, max_num_seqs=lim.max_num_seqs,
                    max_num_batched_tokens=lim.max_num_batched_tokens, eos=EOS, vocab=VOCAB)
    gc.collect()
    t0 = pt()
    for i, (prompt, o) in enumerate(zip(w.lists, w.output_lens)):
        eng.add_request(i, prompt, o)
    out = eng.run()
    t = pt() - t0 - eng.fake_seconds
    return t, out, {"steps": eng.steps, "preempted": eng.scheduler.num_preempted}


def _scheduler(w, lim):
    return qualia.StepScheduler(lim.num_pages, lim.page_tokens, lim.logical_pages,
                                lim.max_num_seqs,
                                max_num_batched_tokens=lim.max_num_batched_tokens,
                                max_queued=max(len(w), lim.max_num_seqs),
                                prefix_caching="auto", cache_key=KEY)


def _submit(s, w):
    for i, (prompt, o) in enumerate(zip(w.arrays, w.output_lens)):
        s.add_request(i, prompt, max_new_tokens=o, eos_token_id=EOS)


def run_qualia_run(w, lim):
    s = _scheduler(w, lim)
    backend = qualia.HashBackend(VOCAB)
    gc.collect()
    t0 = pt()
    _submit(s, w)
    res = s.run(backend)
    t = pt() - t0
    out = {f.request_id: f.output_tokens for f in res.finished}
    return t, out, {"steps": res.steps, "preempted": res.totals["num_preempted"]}


def run_qualia_loop(w, lim):
    s = _scheduler(w, lim)
    fake = nv.fake_tokens
    gc.collect()
    t0 = pt()
    _submit(s, w)
    out = {}
    fake_s = 0.0
    steps = 0
    preempted = 0
    while s.has_unfinished():
        plan = s.schedule()
        li = plan.logits_indices
        rids, pos, ids = plan.sampled_request_ids, plan.positions, plan.input_ids
        preempted += len(plan.preempted_request_ids)
        f0 = pt()
        toks = fake(rids, pos[li], ids[li], VOCAB)
        fake_s += pt() - f0
        for f in s.update(toks):
            out[f.request_id] = f.output_tokens
        steps += 1
    t = pt() - t0 - fake_s
    return t, out, {"steps": steps, "preempted": preempted}


IMPLS = (("baseline", run_baseline), ("qualia run", run_qualia_run),
         ("qualia loop", run_qualia_loop))


def check(w, outs):
    """Every implementation finished every request with the same tokens."""
    want = set(range(len(w)))
    for name, out in outs.items():
        if set(out) != want:
            raise AssertionError(f"{name}: finished {len(out)} of {len(w)} requests")
        n = sum(len(v) for v in out.values())
        if n != w.tokens:
            raise AssertionError(f"{name}: generated {n} tokens, the workload asks {w.tokens}")
    ref_name, ref = next(iter(outs.items()))
    for name, out in outs.items():
        for i in want:
            if list(out[i]) != list(ref[i]):
                raise AssertionError(f"request {i}: {name}'s tokens differ from {ref_name}'s")


def measure(w, lim, repeat):
    """Each implementation: one untimed warm-up run, then ``repeat`` timed runs back to back,
    the fastest kept.  Each run builds its engine outside the timed region (a one-time cost of
    a server); qualia's constructor commits the tables it sizes, so their first touch is part of
    building it, and the warm-up leaves Python's allocator holding the baseline's memory."""
    best = {name: float("inf") for name, _ in IMPLS}
    info, outs = {}, {}
    for name, fn in IMPLS:
        fn(w, lim)
        for _ in range(repeat):
            t, out, meta = fn(w, lim)
            best[name] = min(best[name], t)
        outs[name] = out
        info[name] = meta
        del out
    check(w, outs)
    return best, info


def profile_loop(w, lim):
    """Where the Python loop's time goes: one run with a perf_counter read around every call
    (cProfile does not see the compiled methods).  Returns each part's share of the run's wall
    time, the fake model's left out."""
    pc = time.perf_counter
    s = _scheduler(w, lim)
    fake = nv.fake_tokens
    parts = dict.fromkeys(("add_request", "schedule", "plan arrays", "fake", "update",
                           "loop glue"), 0.0)
    gc.collect()
    t0 = pc()
    for i, (prompt, o) in enumerate(zip(w.arrays, w.output_lens)):
        s.add_request(i, prompt, max_new_tokens=o, eos_token_id=EOS)
    t1 = pc()
    parts["add_request"] = t1 - t0
    while s.has_unfinished():
        a = pc()
        plan = s.schedule()
        b = pc()
        li = plan.logits_indices
        rids, pos, ids = plan.sampled_request_ids, plan.positions, plan.input_ids
        c = pc()
        toks = fake(rids, pos[li], ids[li], VOCAB)
        d = pc()
        s.update(toks)
        e = pc()
        parts["schedule"] += b - a
        parts["plan arrays"] += c - b
        parts["fake"] += d - c
        parts["update"] += e - d
    total = pc() - t0
    parts["loop glue"] = total - sum(parts.values())
    fake_s = parts.pop("fake")
    return {k: v / (total - fake_s) for k, v in parts.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", action="append", default=[], help="Azure trace CSV (repeatable)")
    ap.add_argument("--synthetic-code", action="store_true",
                    help="add the synthesized code-shaped workload")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--page-tokens", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--profile", action="store_true",
                    help="also time the Python loop's parts, once per workload and block size")
    args = ap.parse_args(argv)
    loads = []
    for path in args.trace:
        loads.append((os.path.basename(path), *load_trace(path, args.requests)))
    if args.synthetic_code:
        loads.append(("synthetic code", *synthetic_code(args.requests)))
    if not loads:
        ap.error("give --trace PATH and/or --synthetic-code")
    print(f"baseline block hash: {nv.HASH_NAME}; qualia {qualia.__version__}")
    print("| trace | block | requests | tokens | baseline us/token | qualia run() us/token "
          "| qualia loop us/token | baseline/run | baseline/loop |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    notes = []
    for name, pl, ol in loads:
        w = Workload(name, pl, ol)
        for ptok in args.page_tokens:
            lim = Limits(w, ptok, args.max_num_seqs, args.max_num_batched_tokens)
            best, info = measure(w, lim, args.repeat)
            us = {k: v / w.tokens * 1e6 for k, v in best.items()}
            print(f"| {name} | {ptok} | {len(w)} | {w.tokens} | {us['baseline']:.2f} "
                  f"| {us['qualia run']:.3f} | {us['qualia loop']:.3f} "
                  f"| {us['baseline'] / us['qualia run']:.0f}x "
                  f"| {us['baseline'] / us['qualia loop']:.0f}x |", flush=True)
            notes.append(f"{name}, block {ptok}: pool {lim.num_pages} blocks, "
                         f"max_num_batched_tokens {lim.max_num_batched_tokens}; steps "
                         + ", ".join(f"{k} {v['steps']} (preempted {v['preempted']})"
                                     for k, v in info.items()))
            if args.profile:
                shares = profile_loop(w, lim)
                notes.append(f"{name}, block {ptok}, qualia loop's time (fake left out): "
                             + ", ".join(f"{k} {v:.0%}" for k, v in shares.items()))
    for line in notes:
        print(line)


if __name__ == "__main__":
    main()
