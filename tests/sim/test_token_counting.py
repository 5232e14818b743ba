"""How the simulator counts prefilled and decoded tokens: what the plans say, added up.

A step's plan splits its tokens into ``num_prefill_tokens`` (prompt tokens, and tokens a
preempted request computes again) and ``num_decode_tokens`` (one generated token fed back per
running sequence); the simulator's books add the plans' counts up.  A prompt whose last chunk
is a single token is still a prompt: that token is prefilled, not decoded.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from qualia.cli.main import main
from qualia.sim.config import step_scheduler_class
from qualia.sim.engine import Engine
from qualia.sim.workload import Request


def _plans(kind: str, prompt: int, budget: int, new: int):
    """Every plan of one request of ``prompt`` tokens and ``new`` tokens to generate, on the
    ``kind`` scheduler with a step budget of ``budget`` tokens."""
    s = step_scheduler_class(kind)(4, 16, 16, 8, max_num_batched_tokens=budget)
    s.add_request(0, np.arange(prompt, dtype=np.uint32), max_new_tokens=new)
    plans = []
    while s.has_unfinished():
        plan = s.schedule()
        plans.append((int(plan.num_prefill_tokens), int(plan.num_decode_tokens),
                      len(plan.input_ids)))
        s.update(np.zeros(len(plan.logits_indices), dtype=np.uint32))
    return plans


@pytest.mark.parametrize("kind", ["core", "twin"])
def test_a_prompt_prefilled_in_whole_chunks_counts_every_token_once(kind):
    plans = _plans(kind, prompt=32, budget=16, new=4)
    assert sum(p for p, _, _ in plans) == 32 and sum(d for _, d, _ in plans) == 3
    assert all(p + d == t for p, d, t in plans)


@pytest.mark.parametrize("kind", ["core", "twin"])
def test_a_one_token_final_prompt_chunk_is_prefill_in_the_plan(kind):
    # 33 prompt tokens in steps of 32: the second step computes the 33rd prompt token (and
    # samples the first output token); then 3 decodes feed back the first 3 generated tokens
    plans = _plans(kind, prompt=33, budget=32, new=4)
    assert [(p, d) for p, d, _ in plans] == [(32, 0), (1, 0), (0, 1), (0, 1), (0, 1)]


def test_the_books_add_up_what_the_plans_count():
    engine = Engine("c", page_tokens=16, logical_pages=8, max_num_batched_tokens=32)
    seen = []
    inner = engine.backend.execute_step

    def counting(plan):
        seen.append((int(plan.num_prefill_tokens), int(plan.num_decode_tokens)))
        return inner(plan)

    engine.backend.execute_step = counting
    st = engine.run([Request(0, 0, list(range(1, 41)), 0, 5)]).stats
    assert st["tokens_prefilled"] == sum(p for p, _ in seen) == 40
    assert st["tokens_decoded"] == sum(d for _, d in seen) == 4


def test_the_summary_counts_a_one_token_final_prompt_chunk_as_prefilled(capsys):
    assert main(["simulate", "--backend", "c", "--requests", "1", "--turns", "1",
                 "--prompt-len", "33", "--output-len", "4", "--system-prompts", "0",
                 "--max-num-batched-tokens", "32", "--no-progress", "--json", "-"]) == 0
    st = json.loads(capsys.readouterr().out)["stats"]
    assert (st["tokens_prefilled"], st["tokens_decoded"]) == (33, 3)
