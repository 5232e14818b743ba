"""The numpy test model: one batched forward per step against one forward per token, side by side.

    python bench/model_step.py [--requests 32] [--context 256] [--prefill 1024] [--repeat 5]

Runs the same decode round three ways on the same KV cache, asserting equal tokens before timing:
per item through ``forward_token`` (how the round ran before the step runner), the v1 round
``execute_ragged`` (now one batched forward), and ``execute_step`` over the equivalent step
plan; then a prompt prefill one token at a time against one forward over the whole prompt.
Reports the best of ``--repeat`` samples (the machine may be shared) and the ratios.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np

from qualia import COPY_OP, RAGGED_BATCH_ITEM, RAGGED_BATCH_OUTPUT
from qualia.model import DenseModel, ModelConfig, ModelWeights, PagedModelBackend
from qualia.model.paged import _PagedKv


def best(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return min(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    w = ModelWeights.random(ModelConfig())
    n, ctx, pt = a.requests, a.context, a.page_tokens
    lp = ctx // pt + 1
    be = PagedModelBackend(w, n * lp, pt)
    be.kv[:] = np.random.default_rng(0).standard_normal(be.kv.shape)
    table = np.arange(n * lp, dtype=np.int32).reshape(n, lp)
    tokens = np.random.default_rng(1).integers(0, w.config.vocab, n)

    items = np.zeros(n, dtype=RAGGED_BATCH_ITEM)
    for i in range(n):
        items[i] = (i, i, tokens[i], ctx, i * lp, lp, 0)
    outputs = np.zeros(n, dtype=RAGGED_BATCH_OUTPUT)

    def per_item():
        return [int(np.argmax(w.forward_token(int(tokens[i]), ctx,
                                              _PagedKv(be.kv, table[i].astype(np.int64), pt))))
                for i in range(n)]

    def ragged():
        be.execute_ragged(items, table.reshape(-1).astype(np.uint32), outputs)
        return outputs["next_token_id"].tolist()

    plan = SimpleNamespace(
        request_ids=np.arange(n, dtype=np.uint64),
        query_start_loc=np.arange(n + 1, dtype=np.int32),
        seq_lens=np.full(n, ctx + 1, np.int32), input_ids=tokens.astype(np.uint32),
        positions=np.full(n, ctx, np.int32),
        slot_mapping=table[:, ctx // pt].astype(np.int64) * pt + ctx % pt,
        logits_indices=np.arange(n, dtype=np.int32),
        sampled_request_ids=np.arange(n, dtype=np.uint64), block_table=table,
        block_table_rows=np.arange(n, dtype=np.int32), copies=np.zeros(0, COPY_OP))

    def step():
        return be.execute_step(plan).tolist()

    assert per_item() == ragged() == step()
    t_item, t_ragged, t_step = (best(f, a.repeat) for f in (per_item, ragged, step))
    print(f"decode round, {n} requests at context {ctx} (best of {a.repeat}):")
    print(f"  per item (forward_token)   {t_item * 1e3:8.1f} ms")
    print(f"  execute_ragged (batched)   {t_ragged * 1e3:8.1f} ms   {t_item / t_ragged:5.2f}x")
    print(f"  execute_step (step plan)   {t_step * 1e3:8.1f} ms   {t_item / t_step:5.2f}x")

    prompt = np.random.default_rng(2).integers(0, w.config.vocab, a.prefill)
    dense = DenseModel(w)

    def one_by_one():
        seq = dense.sequence(a.prefill)
        for t in prompt[:-1]:
            seq.feed_logits([t])
        return seq.feed_logits(prompt[-1:])

    def one_forward():
        return dense.sequence(a.prefill).feed_logits(prompt)

    assert np.array_equal(one_by_one(), one_forward())
    r = max(1, a.repeat // 2)
    t_tok, t_all = best(one_by_one, r), best(one_forward, r)
    print(f"prefill of {a.prefill} tokens (best of {r}):")
    print(f"  one token per forward      {t_tok:8.2f} s")
    print(f"  one forward                {t_all:8.2f} s   {t_tok / t_all:5.2f}x")


if __name__ == "__main__":
    main()
