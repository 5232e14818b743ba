"""The engine step: the compiled core and its pure-Python twin, call by call.

``helpers.step_machine.StepVsTwin`` drives ``qualia.StepScheduler`` and
``qualia.twin.StepScheduler`` with the same random calls (its docstring lists them) and checks,
after every call, that both agree on every plan, result, queue, page and counter.

Fast profile (default): a few seconds.  Long profile: QUALIA_LONG=1.
"""

from __future__ import annotations

import numpy as np
from helpers.step_checks import assert_same_run, assert_same_step_counters
from helpers.step_machine import SETTINGS, SYSTEM, StepVsTwin

import qualia
from qualia.twin import StepScheduler

TestStepVsTwin = StepVsTwin.TestCase


TestStepVsTwin.settings = SETTINGS


def test_draining_every_request_returns_every_page():
    """A workload run to the end leaves every page free or reclaimable, and the twin agrees."""
    rng = np.random.default_rng(7)
    kw = dict(max_num_batched_tokens=10, max_num_seqs=3, max_queued=20, cache_key=b"d" * 16)
    c = qualia.StepScheduler(16, 4, 12, **kw)
    t = StepScheduler(16, 4, 12, **kw)
    for i in range(12):
        prompt = (SYSTEM if i % 2 else []) + rng.integers(0, 50, size=int(rng.integers(1, 10))
                                                          ).tolist()
        max_new = int(rng.integers(1, 9))
        for s in (c, t):
            s.add_request(i, prompt, max_new_tokens=max_new)

    class Backend:
        def execute_step(self, plan):
            return (plan.input_ids[plan.logits_indices] * 7 + 3) % 50
    rc, rt = c.run(Backend()), t.run(Backend())
    assert_same_run(rc, rt)
    assert_same_step_counters(c, t)
    assert c.free_pages == c.num_pages == t.facade.free_pages
