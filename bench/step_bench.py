"""The engine step: the compiled core beside its pure-Python twin, in one run.

  s1  decode-only step at 256 running requests of 2k context: schedule + update (every metadata
      array of the plan written), ns per request; the twin beside it
  s2  the same per-request cost at 64 .. 4,096 running requests (512-token context)
  s3  the same at context 128 .. 32k (128 running requests): the dense table is written only
      where it changes, the CSR form (kv_indices) is rewritten every step, so it grows with
      the context
  s4  a mixed step: 64 decodes plus 2,048 prefill-chunk tokens, ns per prefill token over the
      decode-only step of the same 64 requests
  s5  add_request of 4,096-token prompts from a numpy uint32 array and from a list, ns per token
  s6  run() with the built-in C HashBackend (the whole loop in C without the GIL) against a
      Python loop of schedule / HashBackend.execute_step / update, and the twin's run: generated
      tokens per second

Run: ``python bench/step_bench.py`` (``--quick`` for smaller sizes).  Figures are medians of
repeated timings; the ratios are what to compare across machines.
"""

from __future__ import annotations

import argparse
import os
import time

# numpy's BLAS threads spin on an idle core when left at their default; nothing here uses BLAS
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from steptime import KEY, PT, decode_cost, median, pc, time_steps  # noqa: E402

import qualia  # noqa: E402
from qualia.twin import StepScheduler  # noqa: E402


def s1(quick):
    core = decode_cost(qualia.StepScheduler, 256, 2048, 50 if quick else 200)
    twin = decode_cost(StepScheduler, 256, 2048, 3)
    return {"core_ns_per_request": core, "twin_ns_per_request": twin, "twin_over_core": twin / core}


def s2(quick):
    sizes = [64, 256, 1024] if quick else [64, 256, 1024, 4096]
    return {n: decode_cost(qualia.StepScheduler, n, 512, 30 if quick else 60) for n in sizes}


def s3(quick):
    ctxs = [128, 2048, 8192] if quick else [128, 1024, 4096, 16384, 32768]
    return {c: decode_cost(qualia.StepScheduler, 128, c, 30 if quick else 60) for c in ctxs}


def mixed_cost(quick, mode):
    """(mixed step ns, decode-only step ns of the same 64 requests, prefill tokens per step)"""
    n, chunk = 64, 2048
    lp = 512 // PT + 40

    def build():
        s = qualia.StepScheduler((n + 4) * 600, PT, 600, n + 1, cache_key=KEY, prefix_caching=mode,
                                 max_num_batched_tokens=n + chunk, max_queued=n + 64)
        rng = np.random.default_rng(1)
        for i in range(n):
            s.add_request(i, rng.integers(0, 30000, size=512, dtype=np.uint32),
                          max_new_tokens=lp * PT - 600)
        while True:
            plan = s.schedule()
            s.update(np.zeros(len(plan.logits_indices), dtype=np.uint32))
            if plan.num_prefill_tokens == 0:
                return s, rng
    mixed, rng = build()
    for i in range(40):   # each is done at its last chunk (max_new_tokens=1): the next follows
        mixed.add_request(1000 + i, rng.integers(0, 30000, size=8192, dtype=np.uint32),
                          max_new_tokens=1)
    ts, pre = [], []
    for _ in range(10 if quick else 40):
        t0 = pc()
        plan = mixed.schedule()
        mixed.update(np.zeros(len(plan.logits_indices), dtype=np.uint32))
        ts.append(pc() - t0)
        pre.append(plan.num_prefill_tokens)
    base, _ = build()
    base.schedule()
    t_dec = time_steps(base, 40, np.zeros(n, dtype=np.uint32))
    return median(ts), t_dec, median(pre)


def s4(quick):
    # 64 decoding requests plus 8k-token prompts that keep a 2,048-token chunk in every step
    out = {}
    for mode in ("auto", "off"):
        t_mix, t_dec, p = mixed_cost(quick, mode)
        out[f"{mode}_mixed_step_ns"] = t_mix
        out[f"{mode}_decode_only_step_ns"] = t_dec
        out[f"{mode}_ns_per_prefill_token"] = (t_mix - t_dec) / p
    return out


def s5(quick):
    n, reps = 4096, 16 if quick else 64
    arr = np.arange(n, dtype=np.uint32)
    lst = arr.tolist()
    out = {}
    for name, cls in (("core", qualia.StepScheduler), ("twin", StepScheduler)):
        for kind, prompt in (("numpy", arr), ("list", lst)):
            s = cls(8 * 300, PT, 300, 8, cache_key=KEY, max_queued=reps)
            k = reps if name == "core" else 4
            t0 = pc()
            for i in range(k):
                s.add_request(i, prompt, max_new_tokens=8)
            out[f"{name}_{kind}_ns_per_token"] = (pc() - t0) / (k * n)
    return out


def s6(quick):
    n_req, prompt, new = (64, 256, 64) if quick else (256, 512, 128)

    def fill(s):
        rng = np.random.default_rng(6)
        for i in range(n_req):
            s.add_request(i, rng.integers(0, 30000, size=prompt, dtype=np.uint32),
                          max_new_tokens=new, ignore_eos=True)
    lp = -(-(prompt + new) // PT)
    kw = dict(cache_key=KEY, max_num_batched_tokens=4096)
    hb = qualia.HashBackend()
    out = {}
    s = qualia.StepScheduler(64 * lp + 8, PT, lp, 64, max_queued=n_req, **kw)
    fill(s)
    t0 = pc()
    r = s.run(hb)
    t = pc() - t0
    tokens = sum(len(f.output_tokens) for f in r.finished)
    out["core_run_c_tokens_per_s"] = tokens / t * 1e9
    out["steps"] = r.steps
    s = qualia.StepScheduler(64 * lp + 8, PT, lp, 64, max_queued=n_req, **kw)
    fill(s)
    t0 = pc()
    tokens = 0
    while s.has_unfinished():
        plan = s.schedule()
        tokens += sum(len(f.output_tokens) for f in s.update(hb.execute_step(plan)))
    out["core_python_loop_tokens_per_s"] = tokens / (pc() - t0) * 1e9
    tw = StepScheduler(64 * lp + 8, PT, lp, 64, max_queued=n_req, **kw)
    fill(tw)
    t0 = pc()
    r = tw.run(qualia.twin.PyHashBackend() if hasattr(qualia.twin, "PyHashBackend") else hb)
    out["twin_run_tokens_per_s"] = sum(len(f.output_tokens) for f in r.finished) / (pc() - t0) \
        * 1e9
    out["run_c_over_python_loop"] = out["core_run_c_tokens_per_s"] / \
        out["core_python_loop_tokens_per_s"]
    out["run_c_over_twin"] = out["core_run_c_tokens_per_s"] / out["twin_run_tokens_per_s"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="s1,s2,s3,s4,s5,s6")
    args = ap.parse_args()
    import qualia.twin  # noqa: F401 - PyHashBackend for the twin's run
    for name in args.only.split(","):
        t0 = time.time()
        res = globals()[name](args.quick)
        print(f"{name} ({time.time() - t0:.1f} s):")
        for k, v in res.items():
            print(f"    {k}: {v:.1f}" if isinstance(v, float) else f"    {k}: {v}")


if __name__ == "__main__":
    main()
