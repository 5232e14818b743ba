"""bench/trace_bench.py and its nano-vllm-shaped baseline on small workloads: the three
implementations finish every request with the same tokens (no timing is asserted)."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

import qualia

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import trace_bench as tb  # noqa: E402
from baselines import nanovllm_style as nv  # noqa: E402


def small_workload(n=30, seed=3):
    rng = np.random.default_rng(seed)
    prompts = rng.integers(1, 300, size=n).tolist()
    outputs = rng.integers(1, 40, size=n).tolist()
    return tb.Workload("small", prompts, outputs, seed=seed)


def run_all(w, lim):
    outs, meta = {}, {}
    for name, fn in tb.IMPLS:
        _, outs[name], meta[name] = fn(w, lim)
    return outs, meta


def test_fake_tokens_match_the_hash_backend():
    rng = np.random.default_rng(0)
    r = rng.integers(0, 2**63, 200, dtype=np.uint64)
    p = rng.integers(0, 2**31, 200)
    t = rng.integers(0, 2**32, 200, dtype=np.uint64)
    for vocab in (32000, 2**32 - 1):
        want = [qualia.hash_next_token(int(a), int(b), int(c), vocab) for a, b, c in zip(r, p, t)]
        assert nv.fake_tokens(r, p, t, vocab).tolist() == want


@pytest.mark.parametrize("page_tokens", [4, 16])
def test_three_implementations_finish_every_request_with_the_same_tokens(page_tokens):
    w = small_workload()
    lim = tb.Limits(w, page_tokens, max_num_seqs=8, max_num_batched_tokens=512)
    outs, meta = run_all(w, lim)
    tb.check(w, outs)
    for name, out in outs.items():
        assert sorted(out) == list(range(len(w))), name
        assert [len(out[i]) for i in range(len(w))] == w.output_lens, name
    assert meta["qualia run"]["steps"] == meta["qualia loop"]["steps"]


def test_a_tight_pool_preempts_and_the_outputs_still_agree():
    w = small_workload(seed=5)
    roomy = tb.Limits(w, 4, max_num_seqs=8, max_num_batched_tokens=512)
    tight = tb.Limits(w, 4, max_num_seqs=8, max_num_batched_tokens=512,
                      num_pages=roomy.logical_pages * 2)
    outs, meta = run_all(w, tight)
    tb.check(w, outs)
    assert meta["baseline"]["preempted"] > 0
    assert meta["qualia loop"]["preempted"] > 0


def test_check_rejects_a_missing_request_and_a_changed_token():
    w = small_workload(n=5)
    lim = tb.Limits(w, 16, max_num_seqs=4, max_num_batched_tokens=512)
    outs, _ = run_all(w, lim)
    missing = dict(outs)
    missing["baseline"] = {k: v for k, v in outs["baseline"].items() if k != 0}
    with pytest.raises(AssertionError, match="finished 4 of 5"):
        tb.check(w, missing)
    changed = dict(outs)
    changed["qualia loop"] = dict(outs["qualia loop"])
    toks = np.array(changed["qualia loop"][2], dtype=np.uint32)
    toks[-1] ^= 1
    changed["qualia loop"][2] = toks
    with pytest.raises(AssertionError, match="request 2"):
        tb.check(w, changed)


def test_the_baseline_prefix_cache_hits_a_shared_prefix_block():
    bs = 4
    eng = nv.Engine(64, bs, max_num_seqs=4, max_num_batched_tokens=64, eos=-1)
    prompt = list(range(100, 113))  # three full blocks and one token
    eng.add_request(0, prompt, 2)
    eng.step()  # request 0 prefilled: its three full blocks are indexed
    eng.add_request(1, prompt, 2)
    seqs, is_prefill = eng.scheduler.schedule()
    assert is_prefill and [s.seq_id for s in seqs] == [1]
    assert seqs[0].num_cached_tokens == 3 * bs
    assert seqs[0].block_table[:3] == eng.scheduler.running[0].block_table[:3]


def test_load_trace_reads_lengths_and_stops_at_the_row_count(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:50.99,0,109\n"
                    "2023-11-16 18:15:51.22,879,55\n")
    assert tb.load_trace(str(path), 2) == ([374, 1], [44, 109])
