"""qualia.vllm.Scheduler on vLLM's real CPU engine: the same tokens as vLLM's own scheduler and as
Hugging Face ``generate`` (fp32, greedy, tiny random Llamas), in every regime the core decides:
plain decoding, prefix caching over long shared prefixes, chunked prefill, heavy preemption,
aborts, n > 1, and mixed max_tokens / stop ids / min_tokens.  Each engine runs in-process, so the
live scheduler object is checked: qualia's class is in charge, and neither vLLM's own
``Scheduler.schedule`` nor its KV cache manager's ``allocate_slots`` / ``get_computed_blocks``
ran while it was.  Skipped without vLLM (tools/vllm_env.sh builds an environment with it)."""

from __future__ import annotations

import gc
import random

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

import qualia.vllm  # noqa: E402
from qualia.vllm import tiny  # noqa: E402

tiny.engine_env()

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.v1.core import kv_cache_manager as _kvm  # noqa: E402
from vllm.v1.core.sched import scheduler as _sched  # noqa: E402

QUALIA = "qualia.vllm.Scheduler"
BLOCK = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def hf(model_dir):
    return tiny.HFGreedy(model_dir)


@pytest.fixture
def vllm_calls(monkeypatch):
    """Count the calls of vLLM's own scheduling and allocation entry points."""
    counts = {"schedule": 0, "allocate_slots": 0, "get_computed_blocks": 0}

    def counting(cls, name):
        original = getattr(cls, name)

        def wrapper(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    counting(_sched.Scheduler, "schedule")
    counting(_kvm.KVCacheManager, "allocate_slots")
    counting(_kvm.KVCacheManager, "get_computed_blocks")
    return counts


def make_llm(model_dir, scheduler_cls, **kw):
    args = dict(tiny.LLM_ARGS, block_size=BLOCK, max_model_len=1024, max_num_seqs=16,
                max_num_batched_tokens=1024, num_gpu_blocks_override=256,
                enable_prefix_caching=False)
    args.update(kw)
    if scheduler_cls is not None:
        args["scheduler_cls"] = scheduler_cls
    return LLM(model=model_dir, **args)


def live_scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def close(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def random_prompts(seed, count, shared=0, lo=1, hi=80):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, tiny.VOCAB) for _ in range(shared)]
    out = []
    for _ in range(count):
        cut = rng.randrange(shared // 2, shared + 1) if shared else 0
        out.append(prefix[:cut] + [rng.randrange(3, tiny.VOCAB)
                                   for _ in range(rng.randrange(lo, hi))])
    return out


def greedy(max_tokens, **kw):
    kw.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0, detokenize=False, max_tokens=max_tokens, **kw)


def generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def run_both(model_dir, vllm_calls, prompts, params, **kw):
    """Generate with qualia's class, then with vLLM's default: return both outputs and the
    qualia scheduler's figures (checked to be the live scheduler)."""
    llm = make_llm(model_dir, QUALIA, **kw)
    sched = live_scheduler(llm)
    assert isinstance(sched, qualia.vllm.Scheduler)
    mine = generate(llm, prompts, params)
    figures = dict(preemptions=sum(1 for _ in []), core=sched._core)
    assert vllm_calls == {"schedule": 0, "allocate_slots": 0, "get_computed_blocks": 0}
    assert not sched.has_unfinished_requests()
    assert sched._core.num_running == 0 and sched._core.num_waiting == 0
    figures["free_pages"] = sched._core.free_pages
    figures["num_pages"] = sched._num_pages
    figures["stats"] = sched._core.cache_stats()
    figures["scheduler"] = sched
    close(llm)
    llm = make_llm(model_dir, None, **kw)
    assert type(live_scheduler(llm)) is _sched.Scheduler
    theirs = generate(llm, prompts, params)
    assert vllm_calls["schedule"] > 0 and vllm_calls["allocate_slots"] > 0
    close(llm)
    return mine, theirs, figures


def test_plain_decoding_matches_vllm_and_hf(model_dir, hf, vllm_calls):
    prompts = random_prompts(1, 10)
    rng = random.Random(2)
    params = [greedy(rng.randrange(1, 40)) for _ in prompts]
    mine, theirs, fig = run_both(model_dir, vllm_calls, prompts, params)
    assert mine == theirs
    for p, sp, out in zip(prompts, params, mine):
        assert out[0] == hf.generate(p, sp.max_tokens)
    assert fig["free_pages"] == fig["num_pages"]


def test_prefix_caching_long_shared_prefixes(model_dir, hf, vllm_calls):
    # two waves: the second finds the first's pages in qualia's cache
    prompts = random_prompts(3, 12, shared=200, lo=1, hi=40)
    params = greedy(12)
    mine, theirs, fig = run_both(model_dir, vllm_calls, prompts, params,
                                 enable_prefix_caching=True, max_num_seqs=4)
    assert mine == theirs
    for p, out in zip(prompts, mine):
        assert out[0] == hf.generate(p, 12)
    stats = fig["stats"]
    assert stats.hit_tokens >= 8 * BLOCK  # most prompts reuse at least one shared page


def test_chunked_prefill_small_budget(model_dir, hf, vllm_calls):
    prompts = random_prompts(4, 8, shared=120, lo=60, hi=300)
    params = greedy(10)
    mine, theirs, _ = run_both(model_dir, vllm_calls, prompts, params,
                               enable_prefix_caching=True, max_num_batched_tokens=64,
                               max_num_seqs=8, long_prefill_token_threshold=0)
    assert mine == theirs
    for p, out in zip(prompts, mine):
        assert out[0] == hf.generate(p, 10)


def test_heavy_preemption(model_dir, hf, vllm_calls, monkeypatch):
    preempted = []
    original = qualia.vllm.Scheduler.schedule

    def watching(self, *a, **k):
        out = original(self, *a, **k)
        preempted.extend(out.preempted_req_ids or ())
        return out

    monkeypatch.setattr(qualia.vllm.Scheduler, "schedule", watching)
    prompts = random_prompts(5, 10, lo=20, hi=70)
    params = greedy(70)
    mine, theirs, fig = run_both(model_dir, vllm_calls, prompts, params,
                                 num_gpu_blocks_override=10, max_num_seqs=6,
                                 max_model_len=256, enable_prefix_caching=True)
    assert mine == theirs
    for p, out in zip(prompts, mine):
        assert out[0] == hf.generate(p, 70)
    assert len(preempted) >= 5


def test_n_greater_than_one(model_dir, vllm_calls):
    # vLLM fans an n > 1 request out into n requests that share the prompt (and, with prefix
    # caching, its pages); seeded sampling makes each member's tokens independent of scheduling
    prompts = random_prompts(6, 4, lo=40, hi=120)
    params = [SamplingParams(temperature=0.9, seed=s, n=n, max_tokens=15, ignore_eos=True,
                             detokenize=False) for s, n in ((7, 3), (8, 2), (9, 4), (10, 2))]
    mine, theirs, _ = run_both(model_dir, vllm_calls, prompts, params,
                               enable_prefix_caching=True, max_num_seqs=6)
    assert mine == theirs
    assert [len(o) for o in mine] == [3, 2, 4, 2]
    assert all(len({tuple(m) for m in o}) > 1 for o in mine)  # the members differ


def test_stops_and_min_tokens(model_dir, hf, vllm_calls):
    prompts = random_prompts(7, 12, lo=5, hi=60)
    rng = random.Random(8)
    params = []
    expect = []
    for p in prompts:
        free = hf.generate(p, 40)
        max_tokens = rng.randrange(5, 40)
        stop = sorted({free[rng.randrange(0, len(free))] for _ in range(rng.randrange(1, 3))})
        min_tokens = rng.choice([0, 0, 3, 8])
        min_tokens = min(min_tokens, max_tokens)
        params.append(greedy(max_tokens, stop_token_ids=stop, min_tokens=min_tokens,
                             ignore_eos=False))
        expect.append(hf.generate(p, max_tokens, stop_ids=stop + [tiny.EOS],
                                  min_new_tokens=min_tokens))
    mine, theirs, _ = run_both(model_dir, vllm_calls, prompts, params)
    assert mine == theirs
    assert [o[0] for o in mine] == expect
    assert any(len(e) < sp.max_tokens for e, sp in zip(expect, params))  # some stop early


def test_aborts_mid_run(model_dir, hf, vllm_calls):
    prompts = random_prompts(9, 8, lo=10, hi=60)
    results = {}
    for cls in (QUALIA, None):
        llm = make_llm(model_dir, cls, enable_prefix_caching=True, max_num_seqs=4,
                       num_gpu_blocks_override=24, max_model_len=256)
        engine = llm.llm_engine
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, greedy(30))
        got = {}
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id] = list(out.outputs[0].token_ids)
            steps += 1
            if steps == 3:
                engine.abort_request(["1", "6"])  # one running, one waiting
            if steps == 6:
                engine.abort_request(["3"])
        sched = live_scheduler(llm)
        if cls is not None:
            assert vllm_calls["schedule"] == 0 and vllm_calls["allocate_slots"] == 0
            assert not sched.requests and not sched.running and not len(sched.waiting)
            assert sched._core.num_running == 0 and sched._core.num_waiting == 0
            assert sched._core.free_pages == sched._num_pages
        results[cls] = got
        close(llm)
    mine, theirs = results[QUALIA], results[None]
    for i, p in enumerate(prompts):
        full = hf.generate(p, 30)
        rid = str(i)
        if rid in ("1", "3", "6"):
            assert mine.get(rid, []) == full[:len(mine.get(rid, []))]
            continue
        assert mine[rid] == theirs[rid] == full


def test_unsupported_features_are_refused(model_dir):
    from types import SimpleNamespace

    from vllm.sampling_params import RepetitionDetectionParams
    from vllm.v1.request import Request

    from qualia.vllm._scheduler import check_config

    llm = make_llm(model_dir, QUALIA)
    try:
        sched = live_scheduler(llm)
        cfg, kv = sched.vllm_config, sched.kv_cache_config
        check_config(cfg, kv, BLOCK)  # the live configuration is accepted
        for obj, attr, what in (
                (cfg, "speculative_config", "speculative decoding"),
                (cfg, "kv_transfer_config", "KV connectors"),
                (cfg, "ec_transfer_config", "encoder-cache connectors"),
                (cfg, "lora_config", "LoRA"),
                (cfg.scheduler_config, "async_scheduling", "async scheduling")):
            saved = getattr(obj, attr)
            object.__setattr__(obj, attr, True if attr == "async_scheduling" else object())
            try:
                with pytest.raises(qualia.vllm.UnsupportedByQualia, match=what):
                    check_config(cfg, kv, BLOCK)
            finally:
                object.__setattr__(obj, attr, saved)
        group = kv.kv_cache_groups[0]
        with pytest.raises(qualia.vllm.UnsupportedByQualia, match="2 KV-cache groups"):
            check_config(cfg, SimpleNamespace(kv_cache_groups=[group, group]), BLOCK)
        from vllm.v1.kv_cache_interface import SlidingWindowSpec

        spec = group.kv_cache_spec
        swa = SlidingWindowSpec(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                                head_size=spec.head_size, dtype=spec.dtype, sliding_window=64)
        with pytest.raises(qualia.vllm.UnsupportedByQualia, match="SlidingWindowSpec"):
            check_config(cfg, SimpleNamespace(kv_cache_groups=[SimpleNamespace(
                kv_cache_spec=swa)]), BLOCK)

        req = Request("r", [5, 6, 7], SamplingParams(
            max_tokens=4, repetition_detection=RepetitionDetectionParams(
                max_pattern_size=2, min_count=2)), None)
        with pytest.raises(qualia.vllm.UnsupportedByQualia, match="repetition detection"):
            sched.add_request(req)
        assert not sched.requests and sched._core.num_waiting == 0
    finally:
        close(llm)
