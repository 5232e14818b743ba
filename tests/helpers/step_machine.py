"""The engine step's stateful differential machine (a helper module: the tests in
differential/ run it and extend it with forks).

``StepVsTwin`` drives ``qualia.StepScheduler`` and ``qualia.twin.StepScheduler`` with the same
random calls, valid and invalid: arrivals of prompts that share prefixes (so admissions hit the
cache), in several namespaces, with priorities, eos and stop tokens; random budgets, sequence
limits, chunk caps and pools small enough to force reclaims and preemptions; aborts in every
state (waiting, running, in the pending plan, unknown); schedule and update with good and bad
sampled ids, and plans discarded after an execution that failed part way.  After every call
both must agree on the result or the exception class; every plan array (physical page numbers
included) and every finished request must be equal; the queues, the free pages, the pool's
reference counts and every request's tokens must agree; and so must every counter either reports
(``step_checks.step_counters``: ``stats()``, ``cache_stats()``, the fork counters), the KV events
drained, and the ``STEP_STATS`` rows, totals and results of ``run()`` (with the C hash backend or a
Python one).  A shadow of the backend's KV (``step_checks.ShadowKV``) executes every plan (the
Python backend's in ``run()`` too): each request must read its own tokens through its pages.

Fast profile (default): a few seconds.  Long profile: QUALIA_LONG=1 (``SETTINGS``).
"""

from __future__ import annotations

import os

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import qualia
from helpers.step_checks import (
    ShadowKV,
    assert_same_plan,
    assert_same_run,
    assert_same_step_counters,
    finished_key,
)
from qualia.errors import QualiaError
from qualia.twin import StepScheduler

LONG = os.environ.get("QUALIA_LONG", "") not in ("", "0")
SETTINGS = settings(
    max_examples=600 if LONG else 150,
    stateful_step_count=100 if LONG else 50,
    deadline=None,
)
ALLOWED = (QualiaError, TypeError, ValueError, OverflowError)
VOCAB = 60
SYSTEM = [7, 7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11]
PREFIXES = [SYSTEM, SYSTEM[:5], [], [], [1, 2, 3, 4, 5, 6, 7, 8]]
# the full int32 range: negative values are served first, and the extremes must not wrap
PRIORITIES = st.integers(-3, 3) | st.sampled_from([-(2**31), 2**31 - 1])


HB = qualia.HashBackend(vocab=VOCAB)


class HashSteps:
    """The hash backend's tokens (and candidates, for beam rows) from Python; ``shadow``, when
    given, executes every plan on the shadow KV first (``sched`` is read for the expected
    tokens)."""

    def __init__(self, sched=None, shadow=None):
        self.sched, self.shadow = sched, shadow

    def execute_step(self, plan):
        if self.shadow is not None:
            self.shadow.execute(plan, ShadowKV.expect(self.sched, plan))
        return HB.execute_step_topk(plan) if plan.num_topk else HB.execute_step(plan)


class StepVsTwin(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 24), budget=st.integers(1, 24),
                seqs=st.integers(1, 5), chunk=st.sampled_from([None, None, 1, 3, 8]),
                queued=st.sampled_from([None, 6, 12]), page_tokens=st.sampled_from([2, 4]),
                events=st.sampled_from([4096, 4096, 6, 0]))
    def setup(self, num_blocks, budget, seqs, chunk, queued, page_tokens, events):
        kw = dict(max_num_batched_tokens=budget, max_num_seqs=seqs, max_prefill_chunk=chunk,
                  max_queued=20 if queued is None else queued, vocab_size=VOCAB,
                  cache_key=b"s" * 16,
                  event_capacity=events)
        self.core = qualia.StepScheduler(num_blocks, page_tokens, 12, **kw)
        self.twin = StepScheduler(num_blocks, page_tokens, 12, **kw)
        self.next_id = 0
        self.plan = None
        self.shadow = ShadowKV(num_blocks, page_tokens)

    def both(self, fn):
        out = []
        for s in (self.core, self.twin):
            try:
                out.append(("ok", fn(s)))
            except ALLOWED as exc:
                out.append(("err", type(exc)))
        assert out[0][0] == out[1][0], out
        if out[0][0] == "err":
            assert out[0][1] is out[1][1], out
        return out

    @rule(prefix=st.sampled_from(PREFIXES),
          tail=st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=14),
          max_new=st.sampled_from([0, 1, 2, 3, 5, 8, 12]), priority=PRIORITIES,
          eos=st.sampled_from([None, None, 3, 17]), stop=st.sampled_from([(), (), (5,), (9, 2)]),
          ignore_eos=st.booleans(), namespace=st.sampled_from([b"", b"", b"", b"ns"]),
          as_array=st.booleans(), reuse=st.integers(0, 9))
    def add(self, prefix, tail, max_new, priority, eos, stop, ignore_eos, namespace, as_array,
            reuse):
        rid = self.next_id if reuse else max(self.next_id - 1, 0)   # sometimes a duplicate
        self.next_id += 1
        prompt = prefix + tail
        tokens = np.array(prompt, dtype=np.uint32) if as_array else prompt
        self.both(lambda s: s.add_request(rid, tokens, max_new_tokens=max_new, priority=priority,
                                          eos_token_id=eos, stop_token_ids=stop,
                                          ignore_eos=ignore_eos, namespace=namespace))

    @rule(prefix=st.sampled_from(PREFIXES), n=st.integers(2, 5), max_new=st.integers(6, 12),
          priorities=st.lists(PRIORITIES, min_size=5, max_size=5))
    def burst(self, prefix, n, max_new, priorities):
        # several long-running requests at once: pressure on the pool, hence preemptions
        for k in range(n):
            rid = self.next_id
            self.next_id += 1
            prompt = prefix + [rid % VOCAB, k]
            self.both(lambda s: s.add_request(rid, prompt, max_new_tokens=max_new,
                                              priority=priorities[k]))

    @rule(pick=st.integers(0, 40))
    def abort(self, pick):
        rid = pick % (self.next_id + 2)
        self.both(lambda s: s.abort(rid))

    @precondition(lambda self: self.plan is None)
    @rule()
    def schedule(self):
        out = self.both(lambda s: s.schedule())
        if out[0][0] == "ok":
            a, b = out[0][1], out[1][1]
            assert_same_plan(a, b)
            self.plan = a
            self.expected = ShadowKV.expect(self.core, a)
            self.executed = False

    def execute(self):
        # the backend runs the pending plan once, before its first update
        if not self.executed:
            self.shadow.execute(self.plan, self.expected)
            self.executed = True

    @precondition(lambda self: self.plan is not None)
    @rule(seed=st.integers(0, 2**32 - 1), bad=st.sampled_from([None] * 6 + [
        "short", "long", "float", "vocab", "list"]))
    def update(self, seed, bad):
        m = len(self.plan.logits_indices)
        rng = np.random.default_rng(seed)
        ids = rng.integers(0, VOCAB, size=m).astype(np.uint32)
        if bad == "short":
            ids = ids[:-1] if m else np.array([1], dtype=np.uint32)
        elif bad == "long":
            ids = np.append(ids, 1).astype(np.uint32)
        elif bad == "float":
            ids = ids.astype(np.float64)
        elif bad == "vocab" and m:
            ids[0] = VOCAB
        elif bad == "list":
            ids = ids.tolist()
        call = self.update_call(ids, rng, bad)
        self.execute()
        out = self.both(lambda s: finished_key(call(s)))
        if out[0][0] == "ok":
            assert out[0][1] == out[1][1]
            self.plan = None

    @precondition(lambda self: self.plan is None)
    @rule(seed=st.integers(0, 2**32 - 1), abort=st.sampled_from([None, None, None, 0, 1]),
          repeat=st.integers(1, 24))
    def steps(self, seed, abort, repeat):
        # whole steps (schedule, maybe an abort of a planned request, update), a few in a row
        rng = np.random.default_rng(seed)
        for _ in range(repeat):
            self.schedule()
            if self.plan is None:
                return
            if abort is not None and len(self.plan.request_ids) > abort:
                rid = int(self.plan.request_ids[abort])
                self.both(lambda s: s.abort(rid))
            ids = rng.integers(0, VOCAB, size=len(self.plan.logits_indices)).astype(np.uint32)
            call = self.update_call(ids, rng, "steps")
            self.execute()
            out = self.both(lambda s: finished_key(call(s)))
            assert out[0][1] == out[1][1]
            self.plan = None

    def update_call(self, ids, rng, bad):
        """update(ids) for both schedulers (a subclass adds what its plans need)."""
        return lambda s: s.update(ids)

    @precondition(lambda self: self.plan is not None)
    @rule(how=st.sampled_from(["none", "copies", "writes", "full"]),
          seed=st.integers(0, 2**32 - 1))
    def discard(self, how, seed):
        # the backend failed part way through the plan (unless an update already ran it)
        if not self.executed:
            self.shadow.fail(self.plan, how, np.random.default_rng(seed))
        self.both(lambda s: s.discard_plan())
        self.plan = None

    @rule()
    def update_without_plan(self):
        if self.plan is None:
            self.both(lambda s: s.update([]))

    @precondition(lambda self: self.plan is None)
    @rule(max_steps=st.sampled_from([0, 1, 2, 5, 12, None]), rows=st.sampled_from([0, 1, 3, 4096]),
          c_backend=st.booleans())
    def run(self, max_steps, rows, c_backend):
        # the loop: the core's (in C with the C hash backend, else with a Python backend that
        # executes the shadow KV) and the twin's; rows, totals, results and counters agree
        backends = [HB if c_backend else HashSteps(self.core, self.shadow), HashSteps()]
        if c_backend:
            self.shadow.forget()
        out = []
        for s, backend in zip((self.core, self.twin), backends):
            try:
                out.append(("ok", s.run(backend, max_steps, stats_rows=rows)))
            except ALLOWED as exc:
                out.append(("err", type(exc)))
        assert out[0][0] == out[1][0], out
        if out[0][0] == "ok":
            assert_same_run(out[0][1], out[1][1])
        else:
            assert out[0][1] is out[1][1], out

    @rule(size=st.sampled_from([None, None, 0, 1, 4, 64]))
    def drain_events(self, size):
        # the KV events the cache emitted (stored, removed), in order
        if size is None:
            a, b = self.core.drain_events(), self.twin.drain_events()
        else:
            bufs = [np.zeros(size, dtype=qualia.KV_EVENT) for _ in range(2)]
            na, nb = self.core.drain_events(bufs[0]), self.twin.drain_events(bufs[1])
            assert na == nb
            a, b = bufs[0][:na], bufs[1][:nb]
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), (a, b)

    @rule()
    def clear_cache(self):
        # every entry dropped, including those of requests running or in the pending plan:
        # their later pages fill with no parent entry
        out = self.both(lambda s: s.clear_cache())
        assert out[0] == out[1], out

    @rule(mask=st.sampled_from([2**64 - 1, 2**64 - 1, 0, 0x3]), parent_blind=st.booleans())
    def identity_mask(self, mask, parent_blind):
        # a test hook: identities narrowed to force collisions, or blind to the parent, from
        # now on (pages already hashed keep their chain values)
        self.both(lambda s: s._debug_identity_mask(mask, 0 if parent_blind else 2**64 - 1))

    @invariant()
    def agree(self):
        if not hasattr(self, "core"):
            return
        c, t = self.core, self.twin
        assert c.num_waiting == t.num_waiting
        assert c.num_running == t.num_running
        assert c.has_unfinished() == t.has_unfinished()
        assert c.free_pages == t.facade.free_pages
        assert [c.pool.refcount(p) for p in range(c.num_pages)] == \
            [t.facade.pool.refcount(p) for p in range(c.num_pages)]
        assert c.requests() == list(t.requests())
        for rid in c.requests():
            assert c.request_tokens(rid).tolist() == t.request_tokens(rid).tolist()
            assert c.request_pages(rid).tolist() == t.request_pages(rid).tolist()
        assert_same_step_counters(c, t)


