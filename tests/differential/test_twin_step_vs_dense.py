"""The pure-Python twin of the engine step on its own: every request of a random workload, run
under page pressure, chunking and preemption, generates exactly the tokens of a dense sequential
run, and every plan's arrays agree with each other."""

import random

import numpy as np
import pytest

from qualia.twin import StepScheduler


def next_token(token, position):
    return (token * 31 + position * 7 + 1) % 1000


class CheckingBackend:
    """Samples next_token(last input, its position) and checks the plan's own consistency."""

    def execute_step(self, plan):
        pt = plan.page_tokens
        for i in range(plan.num_seqs):
            a, b = plan.query_start_loc[i], plan.query_start_loc[i + 1]
            row = plan.block_table[plan.block_table_rows[i]]
            for j in range(a, b):
                p = plan.positions[j]
                assert plan.slot_mapping[j] == row[p // pt] * pt + p % pt
            assert plan.seq_lens[i] == plan.positions[b - 1] + 1
            k0, k1 = plan.kv_indptr[i], plan.kv_indptr[i + 1]
            assert list(plan.kv_indices[k0:k1]) == list(row[:k1 - k0])
            assert 1 <= plan.kv_last_page_len[i] <= pt
        return np.array([next_token(int(plan.input_ids[r]), int(plan.positions[r]))
                         for r in plan.logits_indices], dtype=np.uint32)


@pytest.mark.parametrize("seed", range(20))
def test_twin_generates_the_dense_tokens(seed):
    rng = random.Random(seed)
    s = StepScheduler(rng.randrange(12, 30), 4, 16, rng.randrange(1, 6),
                      max_num_batched_tokens=rng.randrange(1, 20),
                      max_prefill_chunk=rng.choice([None, 3, 8]), max_queued=24)
    want = {}
    for i in range(12):
        prompt = ([1, 2, 3, 4, 5, 6, 7, 8] if i % 2 else []) + \
            [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
        max_new = rng.randrange(1, 12)
        s.add_request(i, prompt, max_new_tokens=max_new, priority=rng.randrange(3))
        out, t, p = [], prompt[-1], len(prompt) - 1
        for _ in range(max_new):
            t = next_token(t, p)
            p += 1
            out.append(t)
        want[i] = out
    result = s.run(CheckingBackend())
    assert sorted(f.request_id for f in result.finished) == list(range(12))
    for f in result.finished:
        assert f.output_tokens.tolist() == want[f.request_id]
        assert f.finish_reason == "length"
    assert not s.has_unfinished()
    assert s.facade.free_pages == s.facade.num_pages
