"""n groups and beam groups side by side in the compiled core and the twin (a helper module of
the fork tests): the two schedulers, snapshots of everything a refused call must leave as it was
(``state``, ``group_snapshot``), driving them with the hash backend's candidates, and a plan with
beam rows."""

from __future__ import annotations

import qualia
from helpers.step_checks import assert_same_plan, finished_key
from qualia.errors import StepError
from qualia.model import DenseModel, ModelConfig, ModelWeights, SamplingParams
from qualia.twin import StepScheduler as TwinStepScheduler
from qualia.twin.groups import CHILD_BASE

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


V = 64


HB = qualia.HashBackend(vocab=V)


def both(*args, **kw):
    kw.setdefault("vocab_size", V)
    return qualia.StepScheduler(*args, **kw), TwinStepScheduler(*args, **kw)


def state(s, groups=()):
    """Everything a refused call must leave as it was (core or twin)."""
    core = isinstance(s, qualia.StepScheduler)
    f = s if core else s.facade
    reqs = sorted(s.requests())
    members = {}
    for g in groups:
        try:
            members[g] = s.group_members(g)
        except StepError.UnknownRequest:
            members[g] = None
    return (reqs, {r: s.request_tokens(r).tolist() for r in reqs}, s.num_waiting,
            s.num_running, f.free_pages, [f.pool.refcount(p) for p in range(f.num_pages)],
            members, s.parked, s.forks, s.fork_fallbacks, s.has_unfinished())


def execute(plan, hb=HB):
    return hb.execute_step_topk(plan) if plan.num_topk else (hb.execute_step(plan),)


def step(s):
    plan = s.schedule()
    return plan, s.update(*execute(plan))


def drain(s, limit=500):
    done = []
    while s.has_unfinished() and limit:
        done += step(s)[1]
        limit -= 1
    assert not s.has_unfinished()
    return done


def lockstep(c, t, limit=500, hb=HB):
    """Drive core and twin to the end with the hash backend's candidates; plans, states and
    results agree at every step."""
    fc, ft = [], []
    while (c.has_unfinished() or t.has_unfinished()) and limit:
        pc, pt = c.schedule(), t.schedule()
        assert_same_plan(pc, pt)
        assert pc.num_topk == pt.num_topk
        fc += c.update(*execute(pc, hb))
        ft += t.update(*execute(pt, hb))
        assert state(c) == state(t)
        limit -= 1
    assert finished_key(fc) == finished_key(ft)
    return fc


def all_pages_back(c):
    c.clear_cache()
    assert c.free_pages == c.num_pages


def beam_plan():
    c, t = both(64, 4, 16, 8)
    for s in (c, t):
        s.add_request(1, PROMPT, max_new_tokens=4, beam_width=3)
        s.add_request(2, PROMPT[:4], max_new_tokens=4)
    pc, pt = c.schedule(), t.schedule()
    assert pc.num_topk == pt.num_topk == 3 and len(pc.logits_indices) == 2
    return c, t, pc


def GOOD(r, j):
    return (7 * r + j) % V, -0.5 * j


CHILD = CHILD_BASE

# user ids at the start of the internal child ids' range and at the top of the u64 range
IDS = [0, 1, 2, 3, CHILD, CHILD + 1, CHILD + 2, CHILD + 3, 2**64 - 1, 2**64 - 2]


def group_snapshot(s):
    """Everything a refused call must leave as it was (core or twin)."""
    f = getattr(s, "facade", s)
    reqs = list(s.requests())
    groups = {}
    for rid in IDS + list(range(0, 64)):
        try:
            groups[rid] = list(s.group_members(rid))
        except StepError.UnknownRequest:
            pass
    return (s.num_waiting, s.num_running, s.has_unfinished(), f.free_pages,
            sorted(reqs), {r: s.request_tokens(r).tolist() for r in reqs}, groups,
            [f.pool.refcount(p) for p in range(f.num_pages)], s.forks, s.fork_fallbacks)


W = ModelWeights.random(ModelConfig(vocab=64, layers=1))


DENSE = DenseModel(W)


HOT = SamplingParams(temperature=1.0, seed=11)


class Index:
    def __init__(self, value, effect=None):
        self.value, self.effect = value, effect

    def __index__(self):
        if self.effect is not None:
            self.effect()
        return self.value


class LyingInt(int):
    """An int whose comparisons say it is in any range."""

    def __ge__(self, other):
        return True

    def __le__(self, other):
        return True
