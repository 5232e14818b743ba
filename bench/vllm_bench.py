"""qualia.vllm.Scheduler against vLLM's own scheduler, side by side in one run.

    python bench/vllm_bench.py [--steps 60] [--sizes 64,256,1024] [--repeat 3] [--generate 256]
                               [--json F] [--extra NAME=FILE.py:CLASS ...]

Needs vLLM (tools/vllm_env.sh).  Two measurements:

1. Scheduler CPU per step: `schedule()` + `update_from_output()` with model-runner outputs built
   as vLLM's scheduler tests build them (a `ModelRunnerOutput` with one sampled token per
   request that samples), at 64 / 256 / 1,024 running requests, for two workloads:
   *decode-heavy* (every running request decodes one token a step) and *mixed* (requests finish
   at random lengths and new ones arrive to keep the count, their prompts prefilled in chunks
   beside the decodes).  Both schedulers see the same requests, the same sampled tokens and the
   same budget; prefix caching is on (vLLM's default).  For qualia's class the time inside the
   compiled core (its `schedule` / `update`) is measured apart, so the rest is the adapter and
   vLLM's Python objects it must build.  Each configuration is measured `--repeat` times, the
   schedulers alternating, and the fastest run of each is kept (the machine's other load only
   ever adds time).  `--extra` measures more scheduler classes beside them, loaded from a file
   (another version of the adapter, say), in the same alternation.
2. Whole `generate` wall time on a tiny random Llama in vLLM's CPU engine, in-process, and the
   live scheduler's own time inside it (`schedule` + `update_from_output` over the run).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time

from qualia.vllm import tiny

tiny.engine_env()

import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

import qualia.vllm  # noqa: E402

BLOCK = 16
MAX_MODEL_LEN = 4096


def make_scheduler(cls, model_dir, max_num_seqs, num_blocks, budget):
    model_config = ModelConfig(model=model_dir, dtype="float32", seed=0,
                               skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN)
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                         max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True,
                         async_scheduling=False, is_encoder_decoder=False, watermark=0.0)
    cc = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto",
                     enable_prefix_caching=True)
    cfg = VllmConfig(scheduler_config=sc, model_config=model_config, cache_config=cc)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32))])
    cc.num_gpu_blocks = num_blocks
    register_all_kvcache_specs(cfg)
    return cls(vllm_config=cfg, kv_cache_config=kv, block_size=BLOCK, log_stats=True,
               structured_output_manager=StructuredOutputManager(cfg))


_hasher = None


def make_request(rid, prompt, max_tokens):
    global _hasher
    if _hasher is None:
        init_none_hash(sha256)
        _hasher = get_request_block_hasher(BLOCK, sha256)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                   pooling_params=None, block_hasher=_hasher)


class CoreTimer:
    """Stands in for qualia's core object: forwards everything, times schedule and update."""

    def __init__(self, core):
        object.__setattr__(self, "_c", core)
        object.__setattr__(self, "t", 0.0)

    def __getattr__(self, name):
        return getattr(self._c, name)

    def schedule(self):
        t = time.perf_counter()
        try:
            return self._c.schedule()
        finally:
            object.__setattr__(self, "t", self.t + time.perf_counter() - t)

    def update(self, toks):
        t = time.perf_counter()
        try:
            return self._c.update(toks)
        finally:
            object.__setattr__(self, "t", self.t + time.perf_counter() - t)


def runner_output(out, rng):
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[rng.randrange(3, 500)] for _ in ids],
                             logprobs=None, prompt_logprobs_dict={}, pooler_output=[])


def workload(kind, n, seed):
    """The requests, (id, prompt, max_tokens), endless: the first n start, the rest arrive as
    requests finish (mixed)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(256)]
    i = 0
    while True:
        if kind == "decode":
            prompt = shared[:64] + [rng.randrange(3, 500) for _ in range(64)]
            yield (f"r{i}", prompt, 100000)
        else:
            plen = rng.randrange(32, 512)
            cut = rng.randrange(0, 256)
            prompt = shared[:cut] + [rng.randrange(3, 500) for _ in range(plen)]
            yield (f"r{i}", prompt, rng.randrange(8, 200))
        i += 1


def measure(cls, model_dir, kind, n, steps, seed=0):
    it = workload(kind, n, seed)
    budget = n + (0 if kind == "decode" else 1024)
    budget = max(budget, 2048) if kind == "decode" else budget
    sched = make_scheduler(cls, model_dir, n, num_blocks=n * 48 + 64, budget=budget)
    timer = None
    if hasattr(sched, "_core"):
        timer = CoreTimer(sched._core)
        sched._core = timer
    rng = random.Random(seed + 1)
    for _ in range(n):
        rid, p, mt = next(it)
        sched.add_request(make_request(rid, p, mt))
    # warm up: every request admitted and past its prompt
    for _ in range(200):
        out = sched.schedule()
        outputs = sched.update_from_output(out, runner_output(out, rng))
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    sched.add_request(make_request(*next(it)))
        if len(sched.running) == n and all(r.num_output_tokens > 0 for r in sched.running):
            break
    gc.collect()
    if timer is not None:
        object.__setattr__(timer, "t", 0.0)
    tokens = 0
    wall = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        wall += time.perf_counter() - t0
        tokens += out.total_num_scheduled_tokens
        mro = runner_output(out, rng)  # the model runner's part: not timed
        t0 = time.perf_counter()
        outputs = sched.update_from_output(out, mro)
        wall += time.perf_counter() - t0
        if kind != "decode":
            for eco in outputs.values():
                for o in eco.outputs:
                    if o.finish_reason is not None:
                        sched.add_request(make_request(*next(it)))
    core = timer.t if timer is not None else None
    return dict(us_per_step=wall / steps * 1e6, tokens_per_step=tokens / steps,
                core_us_per_step=None if core is None else core / steps * 1e6,
                running=len(sched.running))


def generate_wall(model_dir, cls, count, max_tokens):
    """Wall time of one generate() and, inside it, the live scheduler's time (its schedule and
    update_from_output) and its step count; and the tokens."""
    from vllm import LLM

    kw = dict(scheduler_cls=cls) if cls else {}
    llm = LLM(model=model_dir, block_size=32, max_model_len=1024, max_num_seqs=64,
              num_gpu_blocks_override=1024, enable_prefix_caching=True, **tiny.LLM_ARGS, **kw)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    spent = {"s": 0.0, "steps": 0}

    def timed(fn, count_step):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent["s"] += time.perf_counter() - t
                spent["steps"] += count_step
        return wrapper

    sched.schedule = timed(sched.schedule, 1)
    sched.update_from_output = timed(sched.update_from_output, 0)
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randrange(16, 128))]}
               for _ in range(count)]
    sp = SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=max_tokens)
    llm.generate(prompts[:4], sp, use_tqdm=False)  # warm
    spent.update(s=0.0, steps=0)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t
    toks = [list(o.outputs[0].token_ids) for o in outs]
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return wall, spent["s"], spent["steps"], toks


def load_class(spec):
    """NAME=FILE.py:CLASS -> (NAME, the class), the file imported as a module of its own."""
    import importlib.util

    name, _, where = spec.partition("=")
    path, _, cls = where.rpartition(":")
    mod_spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return name, getattr(mod, cls)


def fastest(cls, model_dir, kind, n, steps, runs):
    """The fastest of ``runs`` measurements (``runs`` is a list this one is appended to)."""
    r = measure(cls, model_dir, kind, n, steps)
    runs.append(r)
    return min(runs, key=lambda x: x["us_per_step"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--extra", action="append", default=[],
                    help="NAME=FILE.py:CLASS, another scheduler class to measure")
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--generate", type=int, default=256, help="prompts for the generate run "
                    "(0: skip it)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    results = {"scheduler": [], "generate": None}
    with tempfile.TemporaryDirectory() as d:
        model_dir = tiny.make_tiny_llama(os.path.join(d, "tiny"), max_positions=MAX_MODEL_LEN)
        extras = [load_class(e) for e in args.extra]
        print(f"{'workload':8} {'running':>7} {'vLLM us/step':>13} {'qualia us/step':>15} "
              f"{'(core)':>8} {'speedup':>8} {'tokens/step':>11}"
              + "".join(f" {name + ' us/step':>16} {'speedup':>8}" for name, _ in extras))
        for kind in ("decode", "mixed"):
            for n in [int(x) for x in args.sizes.split(",")]:
                vr, qr = [], []
                er = [[] for _ in extras]
                for _ in range(args.repeat):
                    v = fastest(VllmScheduler, model_dir, kind, n, args.steps, vr)
                    q = fastest(qualia.vllm.Scheduler, model_dir, kind, n, args.steps, qr)
                    es = [fastest(cls, model_dir, kind, n, args.steps, runs)
                          for (_, cls), runs in zip(extras, er)]
                row = dict(workload=kind, running=n, vllm=v, qualia=q,
                           speedup=v["us_per_step"] / q["us_per_step"])
                for (name, _), e in zip(extras, es):
                    row[name] = dict(e, speedup=v["us_per_step"] / e["us_per_step"])
                results["scheduler"].append(row)
                print(f"{kind:8} {n:7d} {v['us_per_step']:13.0f} {q['us_per_step']:15.0f} "
                      f"{q['core_us_per_step']:8.0f} {row['speedup']:7.1f}x "
                      f"{v['tokens_per_step']:6.0f}/{q['tokens_per_step']:.0f}"
                      + "".join(f" {e['us_per_step']:16.0f} {row[name]['speedup']:7.1f}x"
                                for (name, _), e in zip(extras, es)))
                sys.stdout.flush()
        if args.generate:
            # the forward passes dominate and vary with the machine's load: the runs alternate
            # and the fastest of each is kept, the scheduler's own time is reported beside it
            runs = {"vllm": [], "qualia": []}
            toks = {}
            for _ in range(args.repeat):
                for name, cls in (("vllm", None), ("qualia", "qualia.vllm.Scheduler")):
                    wall, sched_s, steps, toks[name] = generate_wall(model_dir, cls,
                                                                     args.generate, 64)
                    runs[name].append(dict(wall_s=wall, scheduler_s=sched_s, steps=steps))
            best = {k: min(v, key=lambda r: r["wall_s"]) for k, v in runs.items()}
            least = {k: min(r["scheduler_s"] for r in v) for k, v in runs.items()}
            results["generate"] = dict(prompts=args.generate, max_tokens=64, runs=runs,
                                       same_tokens=toks["vllm"] == toks["qualia"])
            print(f"generate {args.generate} prompts x 64 tokens (fastest of {args.repeat}): "
                  f"vLLM {best['vllm']['wall_s']:.2f} s, qualia {best['qualia']['wall_s']:.2f} s;"
                  f" scheduler inside it: vLLM {least['vllm'] * 1e3:.0f} ms, qualia "
                  f"{least['qualia'] * 1e3:.0f} ms over {best['qualia']['steps']} steps; same "
                  f"tokens: {toks['vllm'] == toks['qualia']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
