"""Measure a GPU against the modeled accelerator clock (qualia/sim/clock.py).

Needs torch with a CUDA GPU; the modeled side needs no compiled qualia (the clock module is
loaded from its file when ``import qualia`` fails).  On the GPU it finds, with bf16 tensors:

* the rates the roofline multiplies by its fractions: an 8192 x 8192 x 8192 matrix product
  (FLOP/s) and a device-to-device copy of 4 GiB (bytes read + written per second);
* the linear layers of one step of the 8B Llama shape (``llama3.1-8b``: 32 layers of Q/K/V,
  output, gate/up and down projections on random weights, then the LM head on the sampled
  rows), replayed as a CUDA graph, for decode batches (one sampled row per token) and prefill
  chunks (one sampled row);
* attention over a decode batch's contexts (one query token per sequence against 32 layers of
  K/V) and over a causal prefill, with ``torch.nn.functional.scaled_dot_product_attention``
  (grouped-query heads);

and prints each next to the modeled time of the same work on ``--profile`` (default: the 8B on
the GPU's own profile when its name says H100, H200 or A100).  ``--json FILE`` writes the
numbers.  Each timing is the median of ``--reps`` runs after warm-up, with CUDA events.

    python bench/accelerator_check.py [--profile llama3.1-8b-h200] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_clock():
    try:
        from qualia.sim import clock

        return clock
    except ImportError:  # no compiled core here: the clock module needs none
        spec = importlib.util.spec_from_file_location("qualia_sim_clock",
                                                      ROOT / "qualia" / "sim" / "clock.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module


def timed(torch, fn, reps):
    """Median milliseconds of ``fn()`` over ``reps`` runs (after 3 warm-ups), CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def peak_rates(torch, dev, bf, reps):
    """FLOP/s of an 8192^3 bf16 product; bytes/s (read + written) of a 4 GiB copy."""
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=bf)
    b = torch.randn(n, n, device=dev, dtype=bf)
    flops = 2 * n**3 / (timed(torch, lambda: a @ b, reps) / 1e3)
    x = torch.empty(2**31, device=dev, dtype=bf)
    y = torch.empty_like(x)
    bw = 2 * x.numel() * x.element_size() / (timed(torch, lambda: y.copy_(x), reps) / 1e3)
    return flops, bw


def linear_rows(torch, F, dev, bf, m, mc, clock, reps):
    """The model's linear layers and LM head on random weights, as CUDA graphs."""
    h, qd, kvd, inter = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim, m.intermediate
    g = torch.Generator(device=dev).manual_seed(0)

    def w(r, c):
        return torch.randn(r, c, device=dev, dtype=bf, generator=g) * (r ** -0.5)

    layers = [(w(h, qd + 2 * kvd), w(qd, h), w(h, 2 * inter), w(inter, h))
              for _ in range(m.layers)]
    lm_head = w(h, m.vocab)

    def stack(xin, sampled):
        x_ = xin
        for wqkv, wo, wgu, wd in layers:
            qkv = x_ @ wqkv
            x_ = x_ + qkv[:, :qd] @ wo
            gu = x_ @ wgu
            x_ = x_ + (F.silu(gu[:, :inter]) * gu[:, inter:]) @ wd
        return x_[-sampled:] @ lm_head

    rows = []
    cases = [(t, t) for t in (1, 8, 32, 64, 128, 256)] + \
            [(t, 1) for t in (512, 1024, 2048, 4096, 8192)]
    for t, s in cases:
        xin = torch.randn(t, h, device=dev, dtype=bf)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                stack(xin, s)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            stack(xin, s)
        ms = timed(torch, graph.replay, reps)
        work = clock.StepWork(num_seqs=s, prefill_tokens=0 if s == t else t,
                              decode_tokens=t if s == t else 0, context_tokens=t,
                              attention_pairs=t, sampled_tokens=s)
        cost = mc.cost(work)
        rows.append({"kind": "linear", "tokens": t, "sampled": s, "measured_ms": ms,
                     "modeled_ms": cost.linear_s * 1e3, "bound": cost.linear_bound})
    return rows


def attention_rows(torch, F, dev, bf, m, mc, clock, reps):
    """Decode attention (one query per sequence) and causal prefill attention, every layer."""
    nq, nkv, d = m.heads, m.kv_heads, m.head_dim
    rows = []
    for batch, ctx in ((16, 2048), (64, 2048), (64, 4096)):
        q = torch.randn(batch, nq, 1, d, device=dev, dtype=bf)
        kv = [(torch.randn(batch, nkv, ctx, d, device=dev, dtype=bf),
               torch.randn(batch, nkv, ctx, d, device=dev, dtype=bf)) for _ in range(m.layers)]

        def decode_attn(q=q, kv=kv):
            for k_, v_ in kv:
                F.scaled_dot_product_attention(q, k_, v_, enable_gqa=True)

        ms = timed(torch, decode_attn, reps)
        cost = mc.cost(clock.StepWork.from_lens([1] * batch, [ctx] * batch))
        rows.append({"kind": "decode attention", "tokens": batch, "context": ctx,
                     "measured_ms": ms, "modeled_ms": cost.attention_s * 1e3,
                     "bound": cost.attention_bound})
        q = kv = None
        torch.cuda.empty_cache()
    for t in (1024, 4096, 8192):
        q = torch.randn(1, nq, t, d, device=dev, dtype=bf)
        k_ = torch.randn(1, nkv, t, d, device=dev, dtype=bf)
        v_ = torch.randn(1, nkv, t, d, device=dev, dtype=bf)

        def prefill_attn(q=q, k_=k_, v_=v_):
            for _ in range(m.layers):
                F.scaled_dot_product_attention(q, k_, v_, is_causal=True, enable_gqa=True)

        ms = timed(torch, prefill_attn, reps)
        cost = mc.cost(clock.StepWork.from_lens([t], [t]))
        rows.append({"kind": "prefill attention", "tokens": t, "context": t, "measured_ms": ms,
                     "modeled_ms": cost.attention_s * 1e3, "bound": cost.attention_bound})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    clock = load_clock()
    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU")
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(0)
    total = torch.cuda.get_device_properties(0).total_memory
    gpu = next((k for k in ("h200", "h100", "a100") if k in name.lower()), "h100")
    prof = clock.get_profile(args.profile or f"llama3.1-8b-{gpu}")
    acc, m = prof.accelerator, prof.model
    mc = clock.ModeledClock(prof)
    bf = torch.bfloat16
    out = {"device": name, "total_memory_bytes": total, "profile": prof.name}
    print(f"{name}: {total / 2**20:,.0f} MiB; modeled profile {prof.name}")

    # -- peak rates -------------------------------------------------------------------------
    flops, bw = peak_rates(torch, dev, bf, args.reps)
    out["gemm_flops"], out["copy_bytes_per_s"] = flops, bw
    print(f"bf16 8192^3 GEMM: {flops / 1e12:,.0f} TFLOP/s = {flops / acc.peak_flops:.2f} of "
          f"the profile's peak ({acc.peak_flops / 1e12:,.0f}); modeled fraction "
          f"{acc.compute_efficiency:g}")
    print(f"4 GiB copy: {bw / 1e12:.2f} TB/s = {bw / acc.memory_bandwidth:.2f} of the profile's "
          f"peak ({acc.memory_bandwidth / 1e12:.2f}); modeled fraction "
          f"{acc.bandwidth_efficiency:g}")
    rows = linear_rows(torch, F, dev, bf, m, mc, clock, args.reps)
    torch.cuda.empty_cache()
    rows += attention_rows(torch, F, dev, bf, m, mc, clock, args.reps)
    print(f"\n{'work':<18} {'tokens':>7} {'context':>8} {'measured ms':>12} {'modeled ms':>11} "
          f"{'ratio':>6}  bound")
    for r in rows:
        ratio = r["modeled_ms"] / r["measured_ms"]
        print(f"{r['kind']:<18} {r['tokens']:>7,} {r.get('context', ''):>8} "
              f"{r['measured_ms']:>12.3f} {r['modeled_ms']:>11.3f} {ratio:>6.2f}  {r['bound']}")
    out["rows"] = rows
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
