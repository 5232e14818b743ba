"""A step of more than a thousand rows in the compiled engine step against the twin.

The core lowers a decode's token from the entry's own record and, in a step of 1,024 rows or
more, prefetches each row's block-table entry and arena line ahead of the row; from 2,048 rows
it also prefetches the rows' entries and, ahead of the pages the step fills, what hashing them
reads (docs/DESIGN.md, "In the compiled core").  The stateful machines run steps of a few rows;
this test runs steps of up to 2,400, with plain requests, ``n`` groups and beam groups, aborts
and requests added mid-run, and checks every plan, result, token and counter against the twin,
and every row's input ids against the request's own tokens at the row's positions.
"""

from __future__ import annotations

import numpy as np
from helpers.step_checks import (
    ShadowKV,
    assert_same_plan,
    assert_same_step_counters,
    finished_key,
)

import qualia
from qualia.twin import StepScheduler as TwinStepScheduler

VOCAB = 60
PAGE_TOKENS = 4
SYSTEM = [7, 7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11]   # a shared prefix: cached pages, forks of it


def _add(rng, scheds, rid):
    prompt = SYSTEM[:int(rng.integers(0, 13))] + rng.integers(
        0, VOCAB, size=int(rng.integers(1, 8))).tolist()
    kw = {"max_new_tokens": int(rng.integers(1, 14)), "priority": int(rng.integers(-2, 3)),
          "eos_token_id": [None, 3][int(rng.integers(0, 2))]}
    kind = int(rng.integers(0, 10))
    if kind == 0:
        kw["n"] = int(rng.integers(2, 5))
    elif kind == 1:
        kw["beam_width"] = int(rng.integers(1, 5))
    for s in scheds:
        s.add_request(rid, prompt, **kw)


def test_steps_of_more_than_two_thousand_rows_agree_with_the_twin():
    rng = np.random.default_rng(7)
    kw = {"max_num_batched_tokens": 8192, "max_num_seqs": 2400, "max_queued": 4800,
          "vocab_size": VOCAB, "cache_key": b"s" * 16}
    core = qualia.StepScheduler(12000, PAGE_TOKENS, 12, **kw)
    twin = TwinStepScheduler(12000, PAGE_TOKENS, 12, **kw)
    shadow = ShadowKV(12000, PAGE_TOKENS)
    scheds = (core, twin)
    next_id = 0
    for _ in range(2800):
        _add(rng, scheds, next_id)
        next_id += 1
    large_steps = deep_steps = decode_rows = 0
    for step in range(16):
        a, b = core.schedule(), twin.schedule()
        assert_same_plan(a, b)
        large_steps += len(a.request_ids) >= 1024
        deep_steps += len(a.request_ids) >= 2048
        qsl = a.query_start_loc
        for j, rid in enumerate(a.request_ids.tolist()):
            lo, hi = int(qsl[j]), int(qsl[j + 1])
            tokens = core.request_tokens(rid)
            assert a.input_ids[lo:hi].tolist() == tokens[a.positions[lo:hi]].tolist(), (step, rid)
            decode_rows += hi - lo == 1
        shadow.execute(a, ShadowKV.expect(core, a))
        m = len(a.logits_indices)
        ids = rng.integers(0, VOCAB, size=m).astype(np.uint32)
        if step % 4 == 3:
            for rid in rng.choice(a.request_ids, 3, replace=False).tolist():
                # an n group's child or a beam is not abortable by its own id: both refuse it
                outcome = []
                for s in scheds:
                    try:
                        s.abort(int(rid))
                        outcome.append(None)
                    except qualia.StepError as e:
                        outcome.append(type(e))
                assert outcome[0] == outcome[1], (rid, outcome)
        if a.num_topk:
            k = a.num_topk
            top_ids = np.array([rng.permutation(VOCAB)[:k] for _ in range(m)],
                               dtype=np.uint32).reshape(m, k)
            top_lps = -0.25 * np.sort(rng.integers(0, 8, size=(m, k)), axis=1)
            done = [finished_key(s.update(ids, top_ids, top_lps)) for s in scheds]
        else:
            done = [finished_key(s.update(ids)) for s in scheds]
        assert done[0] == done[1], step
        assert sorted(core.requests()) == sorted(twin.requests())
        for rid in core.requests():
            assert core.request_tokens(rid).tolist() == twin.request_tokens(rid).tolist()
        if step % 3 == 1:
            for _ in range(int(rng.integers(100, 600))):
                _add(rng, scheds, next_id)
                next_id += 1
        assert_same_step_counters(core, twin)
    # the run reached the large steps and their decodes (what the test is for)
    assert large_steps >= 4, large_steps
    assert deep_steps >= 4, deep_steps
    assert decode_rows >= 4 * 2048, decode_rows
