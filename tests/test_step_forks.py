"""Parallel sampling (n > 1) and beam search over copy-on-write forks at the step level
(qualia.twin_fork, DESIGN.md "Forks at the step level"): every member's tokens equal a dense run
with the same sampling keys, beam search equals a dense beam search of the same width, the
prompt's pages are held once, and misuse is refused changing nothing."""

from __future__ import annotations

import pytest

from qualia import twin_fork as TF
from qualia.errors import StepError
from qualia.model import ModelConfig, ModelWeights

W = ModelWeights.random(ModelConfig(vocab=64, layers=1))
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def world(max_requests=8, num_blocks=64, page_tokens=4, logical_pages=16, **kw):
    s = TF.ForkStepScheduler(max_requests, num_blocks, page_tokens, logical_pages, **kw)
    return s, TF.StepModelBackend(W, num_blocks, page_tokens)


def groups(finished):
    return {f.request_id: f for f in finished if isinstance(f, TF.FinishedGroup)}


@pytest.mark.parametrize("page_tokens,prompt_len", [(4, 10), (4, 8), (1, 5), (3, 10)])
@pytest.mark.parametrize("budget", [2048, 3])
def test_every_child_equals_its_dense_run(page_tokens, prompt_len, budget):
    s, b = world(page_tokens=page_tokens, logical_pages=32, max_num_batched_tokens=budget)
    prompt = PROMPT[:prompt_len]
    s.add_request(1, prompt, max_new_tokens=6, n=4, seed=11)
    s.add_request(2, prompt[:3], max_new_tokens=4, seed=5)
    finished, _, _ = TF.run_forks(s, b)
    g = groups(finished)[1]
    assert g.finish_reasons == ["length"] * 4
    for j, out in enumerate(g.outputs):
        assert out.tolist() == TF.dense_sample(W, prompt, 6, 11 + j)
    plain = [f for f in finished if not isinstance(f, TF.FinishedGroup)][0]
    assert plain.output_tokens.tolist() == TF.dense_sample(W, prompt[:3], 4, 5)
    assert s.forks == 3 and s.fork_fallbacks == 0
    assert s.facade.free_pages == s.facade.num_blocks


def test_prompt_pages_are_held_once_and_the_partial_page_copied_per_child():
    pt, n, new = 4, 8, 8
    s, b = world(max_requests=8, num_blocks=64, page_tokens=pt, logical_pages=8)
    s.add_request(1, PROMPT, max_new_tokens=new, n=n, seed=1)       # 10 tokens: 2 full + 2
    _, peak, _ = TF.run_forks(s, b)
    assert s.pages_copied == n - 1                 # the shared partial page, once per child
    tail = -(-(len(PROMPT) + new - 1) // pt) - len(PROMPT) // pt    # own pages per member
    assert peak == len(PROMPT) // pt + n * tail
    # n independent requests of the same prompt (no forks) hold more
    s2, b2 = world(max_requests=8, num_blocks=64, page_tokens=pt, logical_pages=8,
                   prefix_caching="auto")
    for r in range(n):
        s2.add_request(10 + r, PROMPT, max_new_tokens=new, seed=1 + r)
    _, peak2, _ = TF.run_forks(s2, b2)
    assert peak2 >= peak


def test_eos_and_stop_tokens_stop_members_independently():
    s, b = world()
    s.add_request(1, PROMPT, max_new_tokens=12, n=6, seed=3, eos_token_id=7,
                  stop_token_ids=[9, 40])
    g = groups(TF.run_forks(s, b)[0])[1]
    for j, out in enumerate(g.outputs):
        ref = TF.dense_sample(W, PROMPT, 12, 3 + j, eos=7, stop=(9, 40))
        assert out.tolist() == ref
        assert g.finish_reasons[j] == ("stop" if ref[-1] in (7, 9, 40) else "length")


def test_children_without_a_free_slot_wait_and_still_match():
    # 2 request slots for a group of 4: two children are queued and admitted later
    s, b = world(max_requests=2, max_num_seqs=2)
    s.add_request(1, PROMPT, max_new_tokens=5, n=2, seed=8)
    s.add_request(2, PROMPT, max_new_tokens=5, n=2, seed=20)
    g = groups(TF.run_forks(s, b)[0])
    for rid, seed in ((1, 8), (2, 20)):
        for j, out in enumerate(g[rid].outputs):
            assert out.tolist() == TF.dense_sample(W, PROMPT, 5, seed + j)
    assert s.fork_fallbacks >= 1
    assert s.facade.free_pages == s.facade.num_blocks


def test_preemption_keeps_every_member_exact():
    s, b = world(max_requests=8, num_blocks=9, page_tokens=2, logical_pages=12)
    s.add_request(1, PROMPT[:6], max_new_tokens=6, n=3, seed=4)
    s.add_request(2, PROMPT[:5], max_new_tokens=5, n=2, seed=9, priority=1)
    finished, _, _ = TF.run_forks(s, b)
    g = groups(finished)
    for rid, prompt, new, seed, n in ((1, PROMPT[:6], 6, 4, 3), (2, PROMPT[:5], 5, 9, 2)):
        assert [o.tolist() for o in g[rid].outputs] == [
            TF.dense_sample(W, prompt, new, seed + j) for j in range(n)]


@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("eos", [None, 0, 5, 17, 39])
def test_beam_search_equals_the_dense_beam_search(width, eos):
    s, b = world()
    s.add_request(1, PROMPT, max_new_tokens=6, beam_width=width, eos_token_id=eos)
    finished, _, _ = TF.run_forks(s, b)
    g = groups(finished)[1]
    got = [(o.tolist(), sc) for o, sc in zip(g.outputs, g.scores)]
    assert got == TF.dense_beam_search(W, PROMPT, width, 6, eos=eos)
    assert g.scores == sorted(g.scores, reverse=True)
    assert s.facade.free_pages == s.facade.num_blocks


def test_beam_search_under_preemption_and_beside_other_requests():
    s, b = world(max_requests=6, num_blocks=12, page_tokens=2, logical_pages=12)
    s.add_request(1, PROMPT[:7], max_new_tokens=5, beam_width=3)
    s.add_request(2, PROMPT[:4], max_new_tokens=5, n=2, seed=2, priority=1)
    g = groups(TF.run_forks(s, b)[0])
    got = [(o.tolist(), sc) for o, sc in zip(g[1].outputs, g[1].scores)]
    assert got == TF.dense_beam_search(W, PROMPT[:7], 3, 5)
    assert [o.tolist() for o in g[2].outputs] == [
        TF.dense_sample(W, PROMPT[:4], 5, 2 + j) for j in range(2)]


@pytest.mark.parametrize("kw,exc", [
    (dict(n=0), ValueError), (dict(n=9), ValueError), (dict(n=True), TypeError),
    (dict(n=2.0), TypeError), (dict(beam_width=0), ValueError),
    (dict(beam_width=2, n=2), ValueError), (dict(beam_width="2"), TypeError),
    (dict(seed=-1), OverflowError),
])
def test_bad_group_arguments_change_nothing(kw, exc):
    s, _ = world()
    with pytest.raises(exc):
        s.add_request(1, PROMPT, max_new_tokens=3, **kw)
    assert not s.has_unfinished() and s.requests() == []
    s.add_request(1, PROMPT, max_new_tokens=3)     # the id was not taken


def test_member_ids_are_reserved_and_aborting_the_group_releases_everything():
    s, b = world()
    s.add_request(1, PROMPT, max_new_tokens=8, n=3)
    child = TF.CHILD_BASE
    with pytest.raises(StepError.DuplicateRequest):
        s.add_request(child, PROMPT, max_new_tokens=3)
    for _ in range(3):
        plan = s.schedule()
        s.update(b.execute_step(plan))
    assert s.forks == 2
    with pytest.raises(StepError.UnknownRequest):
        s.abort(child)                      # a member: abort the group instead
    s.abort(1)
    assert not s.has_unfinished()
    s.facade.clear_cache()
    assert s.facade.free_pages == s.facade.num_blocks


def test_a_beam_plan_needs_its_candidates():
    s, b = world()
    s.add_request(1, PROMPT, max_new_tokens=3, beam_width=2)
    plan = s.schedule()
    assert plan.num_topk == 4
    ids, tids, tlps = b.execute_step(plan)
    with pytest.raises(ValueError):
        s.update(ids)
    with pytest.raises(ValueError):
        s.update(ids, tids[:, :2], tlps[:, :2])
    s.update(ids, tids, tlps)               # the plan was still pending: nothing changed
    assert s.forks == 1


def test_run_drives_groups_and_beams():
    s, b = world()
    s.add_request(1, PROMPT, max_new_tokens=4, n=3, seed=6)
    s.add_request(2, PROMPT[:6], max_new_tokens=4, beam_width=2)
    result = s.run(b)
    g = groups(result.finished)
    assert [o.tolist() for o in g[1].outputs] == [
        TF.dense_sample(W, PROMPT, 4, 6 + j) for j in range(3)]
    assert [(o.tolist(), sc) for o, sc in zip(g[2].outputs, g[2].scores)] == \
        TF.dense_beam_search(W, PROMPT[:6], 2, 4)
    assert len(result.stats) > 0 and not s.has_unfinished()
