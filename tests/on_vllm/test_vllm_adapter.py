"""qualia.vllm.Scheduler driven directly, as vLLM's engine core drives it (no model): prefix-cache
statistics as vLLM counts them, preempted requests at the head of the queue, pause states, and
the configurations it refuses.  Skipped without vLLM (tools/vllm_env.sh builds an environment
with it)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

import qualia.vllm  # noqa: E402
from qualia.vllm import tiny  # noqa: E402

tiny.engine_env()

import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.interface import PauseState  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


def make_scheduler(model_dir, *, max_num_seqs=16, num_blocks=1000, budget=2048,
                   prefix_caching=True, policy="fcfs", aux_output=False, watermark=0.0,
                   stock=False):
    """qualia's scheduler over a vLLM config of these sizes (stock=True: vLLM's own)."""
    model_config = ModelConfig(model=model_dir, dtype="float32", seed=0,
                               skip_tokenizer_init=True, max_model_len=1024)
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                         max_model_len=1024, enable_chunked_prefill=True,
                         async_scheduling=False, is_encoder_decoder=False, watermark=watermark,
                         policy=policy)
    cc = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto",
                     enable_prefix_caching=prefix_caching)
    cfg = VllmConfig(scheduler_config=sc, model_config=model_config, cache_config=cc)
    if aux_output:
        cfg.aux_output_config.enable_return_routed_experts = True
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32))])
    cc.num_gpu_blocks = num_blocks
    register_all_kvcache_specs(cfg)
    if stock:
        from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
        cls = VllmScheduler
    else:
        cls = qualia.vllm.Scheduler
    return cls(vllm_config=cfg, kv_cache_config=kv, block_size=BLOCK, log_stats=True,
               structured_output_manager=StructuredOutputManager(cfg))


def request(rid, prompt, max_tokens=50, priority=0):
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sp,
                   pooling_params=None, priority=priority)


def runner_output(out, token=7):
    """The model runner's output for ``out``: every request sampled, given ``token``."""
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[token] for _ in ids], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=[])


def step(sched, token=7):
    """One schedule + update_from_output."""
    out = sched.schedule()
    sched.update_from_output(out, runner_output(out, token))
    return out


def all_pages_back(sched):
    core = sched._core
    return core.num_running == 0 and core.free_pages == sched._num_pages


def test_prefix_cache_queries_and_hits_recorded_in_vllms_accumulator(model_dir):
    sched = make_scheduler(model_dir)
    prompt = list(range(3, 3 + 3 * BLOCK + 5))
    sched.add_request(request("a", prompt, max_tokens=2))
    out = sched.schedule()
    stats = sched.kv_cache_manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (1, len(prompt), 0)
    # update_from_output hands the accumulator to the stats and starts a new one
    got = sched.update_from_output(out, runner_output(out)).get(0).scheduler_stats
    assert got.prefix_cache_stats is stats
    step(sched)
    assert not sched.running
    sched.add_request(request("b", prompt, max_tokens=2))
    sched.schedule()
    stats = sched.kv_cache_manager.prefix_cache_stats
    # b reuses a's three full pages: a query of its tokens, 48 of them hits
    assert (stats.requests, stats.queries, stats.hits) == (1, len(prompt), 3 * BLOCK)
    assert stats.preempted_requests == 0


def test_prefix_cache_stats_count_a_resumed_request_as_preempted(model_dir):
    sched = make_scheduler(model_dir)
    req = request("a", list(range(3, 40)))
    sched.add_request(req)
    step(sched)
    sched.reset_prefix_cache(reset_running_requests=True)
    stats = sched.make_stats().prefix_cache_stats
    assert stats.reset
    sched.schedule()
    stats = sched.kv_cache_manager.prefix_cache_stats
    assert (stats.requests, stats.preempted_requests, stats.preempted_queries) == (
        0, 1, req.num_tokens)


def test_reset_with_running_requests_queues_them_ahead_of_the_waiting(model_dir):
    sched = make_scheduler(model_dir, max_num_seqs=2)
    reqs = [request(r, list(range(3 + i, 30 + i))) for i, r in enumerate("abc")]
    for r in reqs:
        sched.add_request(r)
    step(sched)
    assert [r.request_id for r in sched.running] == ["a", "b"]
    assert sched.reset_prefix_cache(reset_running_requests=True)
    assert [r.request_id for r in sched.waiting] == ["a", "b", "c"]
    assert [r.status for r in reqs[:2]] == [RequestStatus.PREEMPTED] * 2
    out = step(sched)
    # the two preempted requests resume first, with every token they had
    assert out.scheduled_cached_reqs.req_ids == ["a", "b"]
    assert out.scheduled_cached_reqs.resumed_req_ids == {"a", "b"}
    assert out.num_scheduled_tokens == {"a": 28, "b": 28}
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_preempted_requests_keep_the_priority_order(model_dir):
    sched = make_scheduler(model_dir, max_num_seqs=2, policy="priority")
    reqs = [request("a", list(range(3, 30)), priority=1),
            request("b", list(range(4, 31)), priority=0),
            request("c", list(range(5, 32)), priority=0)]
    for r in reqs:
        sched.add_request(r)
    step(sched)
    assert sorted(r.request_id for r in sched.running) == ["b", "c"]
    sched.add_request(request("d", list(range(6, 33)), priority=0))
    assert sched.reset_prefix_cache(reset_running_requests=True)
    out = step(sched)
    # vLLM's priority order (priority, then arrival): b and c (preempted) before d and a
    assert set(out.num_scheduled_tokens) == {"b", "c"}


def test_preempting_a_request_in_flight_drops_its_token_and_requeues_it(model_dir):
    sched = make_scheduler(model_dir, prefix_caching=False)
    a, b = request("a", list(range(3, 20))), request("b", list(range(5, 22)))
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    out = sched.schedule()
    sched.running.remove(a)
    sched._preempt_request(a, 0.0)
    assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    assert list(sched.waiting) == [a]
    ids = list(out.num_scheduled_tokens)
    got = sched.update_from_output(out, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[9] for _ in ids]))
    assert [o.request_id for o in got[0].outputs] == ["b"]
    assert list(a.output_token_ids) == [7]
    out = step(sched)
    assert out.scheduled_cached_reqs.resumed_req_ids == {"a"}
    assert out.num_scheduled_tokens["a"] == a.num_prompt_tokens + 1
    while sched.has_unfinished_requests():
        step(sched)
    assert all_pages_back(sched)


def test_paused_new_admits_nothing_that_waits(model_dir):
    sched = make_scheduler(model_dir)
    a, b = request("a", list(range(3, 20)), max_tokens=4), request("b", list(range(5, 22)))
    sched.add_request(a)
    step(sched)
    sched.add_request(b)
    sched.set_pause_state(PauseState.PAUSED_NEW)
    c = request("c", list(range(7, 24)))
    sched.add_request(c)
    assert sched.get_num_unfinished_requests() == 1
    out = step(sched)
    assert set(out.num_scheduled_tokens) == {"a"}
    while sched.has_unfinished_requests():
        out = step(sched)
        assert set(out.num_scheduled_tokens) <= {"a"}
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert b.status == RequestStatus.WAITING
    sched.set_pause_state(PauseState.UNPAUSED)
    out = step(sched)
    assert set(out.num_scheduled_tokens) == {"b", "c"}


def test_requests_the_core_preempts_while_paused_new_stay_queued(model_dir):
    # 4 pages: two 31-token prompts take 2 each; the first decode that needs a third page
    # preempts one of them
    sched = make_scheduler(model_dir, num_blocks=5)
    a = request("a", list(range(3, 34)), max_tokens=8)
    b = request("b", list(range(40, 71)), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    sched.set_pause_state(PauseState.PAUSED_NEW)
    step(sched)  # the tokens at position 31: still the second page
    out = step(sched)
    assert out.preempted_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED
    while sched.has_unfinished_requests():
        out = step(sched)
        assert "b" not in out.num_scheduled_tokens
    assert a.is_finished() and list(sched.waiting) == [b]
    sched.set_pause_state(PauseState.UNPAUSED)
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["b"] and b.num_computed_tokens == b.num_tokens


def test_auxiliary_outputs_are_refused(model_dir):
    with pytest.raises(qualia.vllm.UnsupportedByQualia, match="auxiliary outputs"):
        make_scheduler(model_dir, aux_output=True)


def test_a_kv_watermark_is_refused(model_dir):
    with pytest.raises(qualia.vllm.UnsupportedByQualia, match="watermark=0.5"):
        make_scheduler(model_dir, watermark=0.5)


def scripted_run(sched, reqs, script, abort_in_flight=None):
    """Drive ``sched`` until every request is done; the runner samples ``script(rid, n)`` for
    a request's n-th output and lists the requests in the reverse of the plan's order.
    ``abort_in_flight`` = (step, request id): aborted between that step's schedule and its
    update.  Returns each request's outputs as comparable tuples, and the finished ids seen."""
    for r in reqs:
        sched.add_request(r)
    outputs = {r.request_id: [] for r in reqs}
    finished = set()
    counts = {r.request_id: 0 for r in reqs}
    nans_at = {("n", 2)}
    step_no = 0
    while sched.has_requests():
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)[::-1]
        sampled = []
        for rid in ids:
            req = sched.requests[rid]
            if req.num_computed_tokens >= req.num_tokens:
                sampled.append([script(rid, counts[rid])])
            else:
                sampled.append([])
        nans = {rid: 3 for rid in ids if (rid, counts[rid]) in nans_at} or None
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled, num_nans_in_logits=nans)
        if abort_in_flight is not None and abort_in_flight[0] == step_no:
            sched.finish_requests(abort_in_flight[1], RequestStatus.FINISHED_ABORTED)
        for client, eco in sched.update_from_output(out, mro).items():
            finished |= set(eco.finished_requests or ())
            for o in eco.outputs:
                counts[o.request_id] += 1
                ps = o.prefill_stats
                outputs[o.request_id].append((
                    client, list(o.new_token_ids), o.finish_reason, o.stop_reason,
                    o.trace_headers, o.num_nans_in_logits,
                    None if ps is None else (ps.num_prompt_tokens, ps.num_cached_tokens),
                    [e.type for e in o.events or ()]))
        step_no += 1
        assert step_no < 200
    return outputs, finished


def test_outputs_equal_vllms_field_by_field(model_dir):
    # With no prefix caching and room for everything, both schedulers run the same steps: every
    # output field must then be the same (the token, finish and stop reasons, trace headers,
    # NaN counts, prefill stats, events, the client), whichever of the adapter's paths built it
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

    stops = list(range(400, 420))  # 20 stop ids: the last four are checked by the adapter

    def script(rid, n):
        if rid == "s" and n == 3:
            return 419
        if rid == "e" and n == 2:
            return tiny.EOS
        return 5 + n

    def make_reqs():
        reqs = []
        for i, rid in enumerate(["a", "b", "s", "e", "t", "n", "x"]):
            sp = SamplingParams(max_tokens=4 + i, ignore_eos=rid != "e",
                                stop_token_ids=stops if rid == "s" else None)
            sp.update_from_generation_config({}, tiny.EOS)
            reqs.append(Request(
                request_id=rid, prompt_token_ids=list(range(3 + i, 20 + 3 * i)),
                sampling_params=sp, pooling_params=None, client_index=i % 2,
                trace_headers={"tp": rid} if rid == "t" else None))
        return reqs

    got = {}
    for name, cls in (("vllm", VllmScheduler), ("qualia", qualia.vllm.Scheduler)):
        sched = make_scheduler(model_dir, prefix_caching=False, stock=cls is VllmScheduler)
        got[name] = scripted_run(sched, make_reqs(), script, abort_in_flight=(2, "x"))
        if cls is not VllmScheduler:
            assert all_pages_back(sched)
    assert got["qualia"] == got["vllm"]
    outputs = got["qualia"][0]
    assert outputs["s"][-1][2:4] == (FinishReason.STOP, 419)
    assert outputs["e"][-1][2] == FinishReason.STOP
    assert all(o[4] == {"tp": "t"} for o in outputs["t"])
    assert [o[5] for o in outputs["n"]][2:] == [3] * (len(outputs["n"]) - 2)


def test_block_ids_given_to_the_runner_are_each_requests_pages(model_dir):
    # chunked prefills that pass into several new pages in one step, decodes that pass into
    # one: the block ids the runner has been given always equal the request's pages (qualia
    # page p is vLLM block p + 1) covering its computed tokens
    sched = make_scheduler(model_dir, budget=100, prefix_caching=False)
    for i in range(4):
        sched.add_request(request(f"r{i}", list(range(3 + i, 3 + i + 90 + 7 * i)), max_tokens=40))
    given = {}
    steps = 0
    while sched.has_requests():
        out = sched.schedule()
        for new in out.scheduled_new_reqs:
            given[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for rid, ids in zip(cached.req_ids, cached.new_block_ids):
            if ids is not None:
                given[rid] = (given[rid] if rid not in cached.resumed_req_ids else []) + ids[0]
        for rid in out.num_scheduled_tokens:
            req = sched.requests[rid]
            pages = sched._core.request_pages(sched._qid[rid])
            want = (pages[:-(-req.num_computed_tokens // BLOCK)] + 1).tolist()
            assert given[rid] == want
        sched.update_from_output(out, runner_output(out))
        steps += 1
    assert steps > 10 and all_pages_back(sched)


@pytest.mark.parametrize("tokens", [[], [7, 8]])
def test_a_runner_output_without_exactly_one_token_is_refused(model_dir, tokens):
    sched = make_scheduler(model_dir)
    a, b = request("a", list(range(3, 20))), request("b", list(range(5, 22)))
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    out = sched.schedule()
    mro = runner_output(out)
    mro.sampled_token_ids[mro.req_id_to_index["b"]] = tokens
    with pytest.raises(RuntimeError, match=f"returned {len(tokens)} tokens for request 'b'"):
        sched.update_from_output(out, mro)
    # nothing was applied: no token appended, and the core plans the same step again
    assert [a.num_output_tokens, b.num_output_tokens] == [1, 1]
    assert sched._core.schedule().request_ids.tolist() == [sched._qid["a"], sched._qid["b"]]


def test_a_request_that_can_never_fit_is_refused_at_add_on_every_path(model_dir):
    # 7 pages of 16 tokens: 100 prompt tokens and 28 more need 8.  The core's queue holds 4
    # requests (max_num_seqs=1), so a fifth waits in the adapter; paused, every one does
    sched = make_scheduler(model_dir, max_num_seqs=1, num_blocks=8, prefix_caching=False)

    def big():
        return request("big", list(range(3, 103)), max_tokens=28)

    with pytest.raises(ValueError, match="can never run"):
        sched.add_request(big())  # straight into the core
    small = [request(f"s{i}", [5, 6, 7 + i], max_tokens=1) for i in range(5)]
    for r in small[:4]:
        sched.add_request(r)
    assert sched._core.num_waiting == 4
    with pytest.raises(ValueError, match="can never run"):
        sched.add_request(big())  # into the backlog
    sched.add_request(small[4])
    assert "big" not in sched.requests and [r.request_id for r in sched.waiting] == [
        r.request_id for r in small]
    finished = []
    steps = 0
    while sched.has_requests():
        out = sched.schedule()
        for eco in sched.update_from_output(out, runner_output(out)).values():
            finished += [o.request_id for o in eco.outputs if o.finish_reason is not None]
        steps += 1
        assert steps < 20
    assert finished == [r.request_id for r in small] and all_pages_back(sched)
    sched.set_pause_state(PauseState.PAUSED_NEW)
    with pytest.raises(ValueError, match="can never run"):
        sched.add_request(big())  # held while paused
    sched.set_pause_state(PauseState.UNPAUSED)
    assert not sched.has_requests() and not sched._backlog


def test_a_failed_update_leaves_every_request_as_before_the_discarded_schedule(model_dir):
    # the runner's output lacks an admitted request: update_from_output raises, the core
    # discards the plan, and the adapter is as it was before that schedule(); the next
    # schedule() plans the same step again
    sched = make_scheduler(model_dir)
    a, b = request("a", list(range(3, 40)), max_tokens=4), request("b", list(range(5, 30)), 4)
    sched.add_request(a)
    step(sched)
    sched.add_request(b)
    stats = sched.kv_cache_manager.prefix_cache_stats

    def state():
        return ([r.request_id for r in sched.running], [r.request_id for r in sched.waiting],
                a.status, b.status, a.num_computed_tokens, b.num_computed_tokens,
                len(b.events), (stats.requests, stats.queries, stats.hits))

    before = state()
    out = sched.schedule()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["b"]
    bad = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[[9]])
    with pytest.raises(RuntimeError):
        sched.update_from_output(out, bad)
    assert state() == before
    again = sched.schedule()
    assert again.num_scheduled_tokens == out.num_scheduled_tokens
    assert [n.req_id for n in again.scheduled_new_reqs] == ["b"]
    assert again.scheduled_new_reqs[0].num_computed_tokens == 0
    assert again.scheduled_cached_reqs.req_ids == ["a"]
    assert again.scheduled_cached_reqs.num_computed_tokens == [a.num_prompt_tokens]
    assert not again.scheduled_cached_reqs.resumed_req_ids
    assert [r.request_id for r in sched.running] == ["a", "b"]
    assert (stats.requests, stats.queries) == (before[-1][0] + 1, before[-1][1] + b.num_tokens)
    sched.update_from_output(again, runner_output(again))
    while sched.has_requests():
        step(sched)
    assert a.num_output_tokens == b.num_output_tokens == 4 and all_pages_back(sched)


def test_logprobs_by_token_ids_and_prompt_token_id_logprobs_are_passed_on_as_vllm_does(model_dir):
    # sample logprobs asked for with logprob_token_ids (logprobs unset) and the scores of
    # prompt_logprob_token_ids: every output carries what vLLM's scheduler hands on
    import numpy as np
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
    from vllm.v1.outputs import LogprobsLists

    def run(cls):
        sched = make_scheduler(model_dir, prefix_caching=False, stock=cls is VllmScheduler)
        reqs = []
        for rid, kw in (("ids", dict(logprob_token_ids=[5, 6],
                                     prompt_logprob_token_ids=[[5, 6]] * 3)),
                        ("count", dict(logprobs=2)), ("none", {})):
            sp = SamplingParams(max_tokens=2, ignore_eos=True, **kw)
            reqs.append(Request(request_id=rid, prompt_token_ids=[3, 4, 5, 6],
                                sampling_params=sp, pooling_params=None))
            sched.add_request(reqs[-1])
        got = []
        for _ in range(2):
            out = sched.schedule()
            ids = list(out.num_scheduled_tokens)
            lp = LogprobsLists(np.array([[9, 5, 6]] * 3),
                               np.array([[-0.1, -2.0, -3.0]] * 3, dtype=np.float32),
                               np.array([1] * 3))
            ptl = {"ids": torch.full((3, 2), -1.5)} if out.scheduled_new_reqs else {}
            mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                    sampled_token_ids=[[9]] * 3, logprobs=lp,
                                    prompt_logprobs_dict={}, prompt_token_id_logprobs_dict=ptl)
            for o in sched.update_from_output(out, mro)[0].outputs:
                got.append((o.request_id, o.new_logprobs is not None and
                            o.new_logprobs.logprob_token_ids.tolist(),
                            None if o.prompt_token_id_logprobs is None
                            else o.prompt_token_id_logprobs.tolist()))
        return sorted(got, key=lambda g: g[0])

    want = run(VllmScheduler)
    assert run(qualia.vllm.Scheduler) == want
    assert ("ids", [[9, 5, 6]], [[-1.5, -1.5]] * 3) in want


def test_priority_order_holds_across_the_requests_waiting_in_the_adapter(model_dir):
    # max_num_seqs=2: the core's queue holds 8 requests, the rest wait in the adapter.  A
    # high-priority request that arrives last is admitted first, as vLLM's scheduler does
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

    def admissions(cls):
        sched = make_scheduler(model_dir, max_num_seqs=2, prefix_caching=False,
                               policy="priority", stock=cls is VllmScheduler)
        for i in range(10):
            sched.add_request(request(f"low{i}", [3 + i] * 20, max_tokens=3, priority=5))
        sched.add_request(request("high", [9] * 20, max_tokens=3, priority=0))
        order = []
        while sched.has_requests():
            out = step(sched)
            if not order:  # while the first two run
                sched.add_request(request("mid", [8] * 20, max_tokens=3, priority=1))
            order += [n.req_id for n in out.scheduled_new_reqs]
        return order

    order = admissions(qualia.vllm.Scheduler)
    assert order == admissions(VllmScheduler)
    assert order[:4] == ["high", "low0", "mid", "low1"]
