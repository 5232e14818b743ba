"""The modeled accelerator clock (qualia.sim.clock): units, exact values of a hand-computed
case, monotonicity, the roofline regimes, the KV pool from memory, and checked input."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from qualia.sim import clock
from qualia.sim.clock import (
    ACCELERATORS,
    DEFAULT_PROFILE,
    MODELS,
    PROFILES,
    Accelerator,
    ModeledClock,
    ModelShape,
    Profile,
    StepWork,
    causal_pairs,
    get_profile,
    make_profile,
)

MiB, GiB = 1 << 20, 1 << 30

# A tiny model and machine with round numbers, for values computed by hand.
TINY = ModelShape("tiny", layers=1, hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=8,
                  vocab=10, dtype_bytes=2, tied_embeddings=False, max_model_len=64)
SLOW = Accelerator("slow", peak_flops=1000.0, memory_bandwidth=100.0, memory_bytes=10_000,
                   compute_efficiency=0.5, bandwidth_efficiency=0.5, step_overhead_s=0.25)
TINY_PROFILE = Profile("tiny-slow", TINY, SLOW, activation_reserve_bytes=500,
                       memory_utilization=0.9)


def test_tiny_model_sizes_by_hand():
    # one layer: Q 4x4 + K, V 4x2 each + O 4x4 + MLP 3 x 4x8 = 16 + 16 + 16 + 96
    assert TINY.layer_linear_params == 144
    assert TINY.linear_params == 144 + 10 * 4  # + the LM head
    # + norms (2 per layer + the final one) of 4 + embedding and LM head of 40 each
    assert TINY.params == 144 + 3 * 4 + 2 * 40
    assert TINY.weight_bytes == 2 * 236
    assert TINY.step_weight_bytes == 2 * 184
    assert TINY.kv_bytes_per_token == 1 * 2 * 1 * 2 * 2


def test_llama_shapes_give_the_published_parameter_counts():
    # the model cards: Llama-3.1-8B 8.03B, Llama-3.2-1B 1.24B (tied embeddings)
    assert MODELS["llama3.1-8b"].params == 8_030_261_248
    assert MODELS["llama3.2-1b"].params == 1_235_814_400
    # vLLM logs 14.96 GiB of weights for the 8B in bf16
    assert MODELS["llama3.1-8b"].weight_bytes / GiB == pytest.approx(14.9575, abs=1e-4)
    # K and V of 32 layers x 8 heads x 128 dims in bf16: 128 KiB a token
    assert MODELS["llama3.1-8b"].kv_bytes_per_token == 128 * 1024


def test_step_time_of_a_hand_computed_mixed_step():
    # request A decodes one token of a 5-token context, request B prefills 3 fresh tokens
    work = StepWork.from_lens([1, 3], [5, 3])
    assert (work.num_seqs, work.tokens, work.context_tokens) == (2, 4, 8)
    assert work.attention_pairs == (1 * 4 + 1) + (0 + 6)
    assert (work.prefill_tokens, work.decode_tokens, work.sampled_tokens) == (3, 1, 2)
    cost = ModeledClock(TINY_PROFILE).cost(work)
    # linear: 2 x 144 x 4 + 2 x 40 x 2 = 1312 FLOPs at 500 FLOP/s; 368 weight bytes at 50 B/s
    assert cost.linear_compute_s == pytest.approx(1312 / 500, rel=1e-12)
    assert cost.linear_memory_s == pytest.approx(368 / 50, rel=1e-12)
    # attention: 4 x 1 layer x 2 heads x 2 dims x 11 pairs = 176 FLOPs; K/V 8 B x (8 + 4)
    assert cost.attention_compute_s == pytest.approx(176 / 500, rel=1e-12)
    assert cost.attention_memory_s == pytest.approx(96 / 50, rel=1e-12)
    assert cost.overhead_s == 0.25 and cost.copy_s == 0.0
    assert (cost.linear_bound, cost.attention_bound) == ("memory", "memory")
    assert cost.seconds == pytest.approx(0.25 + 7.36 + 1.92, rel=1e-12)


def test_step_time_of_a_hand_computed_long_prefill_is_compute_bound():
    cost = ModeledClock(TINY_PROFILE).cost(StepWork.from_lens([100], [100]))
    # 2 x 144 x 100 + 2 x 40 = 28880 FLOPs; 5050 pairs x 4 x 2 heads x 2 dims = 80800 FLOPs
    assert cost.linear_compute_s == pytest.approx(57.76, rel=1e-12)
    assert cost.attention_compute_s == pytest.approx(161.6, rel=1e-12)
    assert cost.attention_memory_s == pytest.approx(8 * 200 / 50, rel=1e-12)
    assert (cost.linear_bound, cost.attention_bound) == ("compute", "compute")
    assert cost.seconds == pytest.approx(0.25 + 57.76 + 161.6, rel=1e-12)


def test_copied_pages_cost_a_read_and_a_write_of_each_page():
    work = StepWork.from_lens([1], [5], copied_pages=3, page_tokens=4)
    cost = ModeledClock(TINY_PROFILE).cost(work)
    assert cost.copy_s == pytest.approx(2 * 3 * 4 * 8 / 50, rel=1e-12)
    assert cost.seconds == pytest.approx(
        ModeledClock(TINY_PROFILE).seconds(StepWork.from_lens([1], [5])) + cost.copy_s)


def test_an_empty_step_costs_the_overhead_only():
    cost = ModeledClock(TINY_PROFILE).cost(StepWork.from_lens([], []))
    assert cost.seconds == 0.25
    assert cost.linear_s == cost.attention_s == 0.0


def test_causal_pairs_count_each_new_token_against_its_prefix():
    assert causal_pairs(1, 1) == 1
    assert causal_pairs(1, 10) == 10  # a decode token sees the whole context
    assert causal_pairs(4, 4) == 1 + 2 + 3 + 4
    assert causal_pairs(2, 6) == 5 + 6  # a chunk after 4 computed tokens
    brute = sum(s - q + j + 1 for q, s in [(3, 7)] for j in range(q))
    assert causal_pairs(3, 7) == brute


def test_step_time_grows_with_tokens_requests_and_context():
    c = ModeledClock()
    decode = [c.seconds(StepWork.from_lens([1] * b, [1000] * b)) for b in (1, 8, 64, 256, 512)]
    assert all(a < b for a, b in zip(decode, decode[1:]))
    longer = [c.seconds(StepWork.from_lens([1] * 32, [ctx] * 32)) for ctx in (100, 1000, 8000)]
    assert all(a < b for a, b in zip(longer, longer[1:]))
    prefill = [c.seconds(StepWork.from_lens([t], [t])) for t in (256, 512, 2048, 8192)]
    assert all(a < b for a, b in zip(prefill, prefill[1:]))


def test_decode_is_memory_bound_and_a_long_prefill_compute_bound():
    c = ModeledClock()
    decode = c.cost(StepWork.from_lens([1] * 16, [2000] * 16))
    assert (decode.linear_bound, decode.attention_bound) == ("memory", "memory")
    prefill = c.cost(StepWork.from_lens([4096], [4096]))
    assert (prefill.linear_bound, prefill.attention_bound) == ("compute", "compute")


def test_batch_one_decode_of_the_8b_on_an_h100_is_the_weights_over_bandwidth():
    p = get_profile(DEFAULT_PROFILE)
    cost = ModeledClock(p).cost(StepWork.from_lens([1], [1]))
    expected = 15_009_316_864 / (3.35e12 * 0.7)
    assert cost.linear_memory_s == pytest.approx(expected, rel=1e-12)
    assert cost.seconds * 1e3 == pytest.approx(7.40, abs=0.01)  # milliseconds


def test_step_seconds_are_seconds_not_milliseconds():
    # the same work costs proportionally less on a machine with more bandwidth and FLOP/s
    p = get_profile("llama3.1-8b-h100")
    fast = make_profile(p.model, Accelerator(
        "twice", peak_flops=2 * p.accelerator.peak_flops,
        memory_bandwidth=2 * p.accelerator.memory_bandwidth,
        memory_bytes=p.accelerator.memory_bytes, step_overhead_s=0.0))
    slow = make_profile(p.model, Accelerator(
        "once", peak_flops=p.accelerator.peak_flops,
        memory_bandwidth=p.accelerator.memory_bandwidth,
        memory_bytes=p.accelerator.memory_bytes, step_overhead_s=0.0))
    work = StepWork.from_lens([1] * 4 + [300], [500] * 4 + [300])
    assert ModeledClock(fast).seconds(work) == pytest.approx(
        ModeledClock(slow).seconds(work) / 2, rel=1e-12)
    assert 1e-3 < ModeledClock(slow).seconds(work) < 1.0


def test_work_of_a_plan_reads_its_lengths_rows_and_copies():
    plan = SimpleNamespace(query_start_loc=np.array([0, 1, 4], np.int32),
                           seq_lens=np.array([5, 3], np.int32),
                           logits_indices=np.array([0, 3], np.int32),
                           copies=np.zeros((2, 2), np.int32), num_prefill_tokens=3,
                           num_decode_tokens=1, page_tokens=4)
    work = StepWork.from_plan(plan)
    assert work == StepWork.from_lens([1, 3], [5, 3], copied_pages=2, page_tokens=4)
    assert ModeledClock(TINY_PROFILE).plan_seconds(plan) == pytest.approx(
        ModeledClock(TINY_PROFILE).seconds(work))


def test_work_of_a_real_plan_matches_its_token_counts():
    import qualia

    s = qualia.StepScheduler(64, 16, 16, 8, max_num_batched_tokens=64)
    s.add_request(0, np.arange(40, dtype=np.uint32), max_new_tokens=4)
    s.add_request(1, np.arange(7, dtype=np.uint32), max_new_tokens=4)
    plan = s.schedule()
    work = StepWork.from_plan(plan)
    assert work.tokens == len(plan.input_ids)
    assert work.context_tokens == int(np.asarray(plan.seq_lens).sum())
    assert work.num_seqs == len(plan.request_ids)
    assert work.sampled_tokens == len(plan.logits_indices)


def test_a_plan_whose_token_counts_disagree_is_refused():
    plan = SimpleNamespace(query_start_loc=np.array([0, 2]), seq_lens=np.array([2]),
                           logits_indices=np.array([1]), copies=np.zeros((0, 2)),
                           num_prefill_tokens=1, num_decode_tokens=0, page_tokens=16)
    with pytest.raises(ValueError, match="num_prefill_tokens"):
        StepWork.from_plan(plan)


def _random_plan(rng, seqs, decodes, copies):
    """A plan of ``decodes`` one-token rows, then ``seqs - decodes`` prefill chunks."""
    q = np.concatenate([np.ones(decodes, np.int64), rng.integers(2, 300, seqs - decodes)])
    seq_lens = q + rng.integers(0, 4000, seqs)
    return SimpleNamespace(query_start_loc=np.concatenate([[0], np.cumsum(q)]).astype(np.int32),
                           seq_lens=seq_lens.astype(np.int32),
                           logits_indices=np.arange(seqs - 1, dtype=np.int32),
                           copies=np.zeros((copies, 2), np.int32),
                           num_prefill_tokens=int(q[decodes:].sum()), num_decode_tokens=decodes,
                           page_tokens=16)


@pytest.mark.parametrize("seqs", [1, 5, 63, 64, 300])
@pytest.mark.parametrize("decodes", ["all", "some", "none"])
def test_step_time_of_a_plan_is_its_plan_seconds_bit_for_bit(seqs, decodes):
    clock = ModeledClock()
    rng = np.random.default_rng(seqs)
    d = {"all": seqs, "some": seqs // 2, "none": 0}[decodes]
    for copies in (0, 3):
        plan = _random_plan(rng, seqs, d, copies)
        assert clock.step_time(plan, 0.0) == clock.plan_seconds(plan)


def test_work_seconds_of_a_decode_step_are_its_plan_seconds_bit_for_bit():
    clock = ModeledClock()
    plan = _random_plan(np.random.default_rng(0), 40, 40, 2)
    context = int(plan.seq_lens.sum())
    assert clock.work_seconds(40, context, context, 39, 2, 16) == clock.plan_seconds(plan)


def test_step_time_refuses_a_plan_whose_token_counts_disagree():
    plan = SimpleNamespace(query_start_loc=np.array([0, 2]), seq_lens=np.array([2]),
                           logits_indices=np.array([1]), copies=np.zeros((0, 2)),
                           num_prefill_tokens=1, num_decode_tokens=0, page_tokens=16)
    with pytest.raises(ValueError, match="num_prefill_tokens"):
        ModeledClock().step_time(plan, 0.0)


def test_kv_pool_is_memory_times_utilisation_less_weights_and_reserve_over_page_bytes():
    # 10000 x 0.9 - 472 bytes of weights - 500 reserve = 8028 bytes; a 16-token page is 128
    assert TINY_PROFILE.kv_budget_bytes() == 8028
    assert TINY_PROFILE.page_bytes(16) == 128
    assert TINY_PROFILE.kv_pages(16) == 62
    assert TINY_PROFILE.kv_tokens(16) == 62 * 16
    assert TINY_PROFILE.kv_pages(16, memory_utilization=0.5) == (5000 - 972) // 128


def test_kv_pool_of_the_8b_on_an_h100():
    p = get_profile("llama3.1-8b-h100")
    budget = int(81559 * MiB * 0.9) - 8_030_261_248 * 2 - 3 * GiB
    assert p.kv_pages(16) == budget // (16 * 128 * 1024) == 27507
    assert p.kv_tokens(16) == 440_112


def test_a_model_that_does_not_fit_is_refused_with_the_sizes():
    small = Accelerator("small", peak_flops=1e12, memory_bandwidth=1e11, memory_bytes=8 * GiB)
    p = make_profile("llama3.1-8b", small)
    with pytest.raises(ValueError, match=r"no memory for the KV cache.*weights take 14.96 GiB"):
        p.kv_pages(16)


def test_every_named_profile_sizes_a_pool_and_costs_a_step():
    assert DEFAULT_PROFILE in PROFILES
    assert set(PROFILES) == {f"{m}-{a}" for m in MODELS for a in ACCELERATORS}
    for name, p in PROFILES.items():
        assert p.name == name
        assert p.kv_pages(16) > 1000
        assert 0 < ModeledClock(p).seconds(StepWork.from_lens([1], [100])) < 0.05
    assert PROFILES["llama3.1-8b-a100"].max_num_batched_tokens == 2048
    assert PROFILES["llama3.1-8b-h100"].max_num_batched_tokens == 8192


def test_unknown_profile_names_are_refused_with_close_matches():
    with pytest.raises(ValueError, match=r"unknown profile 'llama3.1-8b-h10'; did you mean "
                                         r"'llama3.1-8b-h100'"):
        get_profile("llama3.1-8b-h10")
    with pytest.raises(ValueError, match=r"the profiles: llama3.1-8b-h100"):
        get_profile("gpt-4")
    with pytest.raises(ValueError, match="unknown accelerator 'h10'; did you mean 'h100'"):
        make_profile("llama3.1-8b", "h10")
    with pytest.raises(ValueError, match="unknown model"):
        make_profile("llama-9b", "h100")
    with pytest.raises(TypeError):
        get_profile(3)  # type: ignore[arg-type]
    assert get_profile("  LLAMA3.1-8B-H100 ") is PROFILES["llama3.1-8b-h100"]
    assert get_profile(TINY_PROFILE) is TINY_PROFILE


@pytest.mark.parametrize("field,value,err", [
    ("layers", 0, ValueError), ("hidden", -4, ValueError), ("heads", 2.5, TypeError),
    ("kv_heads", True, TypeError), ("vocab", "10", TypeError),
])
def test_bad_model_dimensions_are_refused(field, value, err):
    kw = dict(name="m", layers=1, hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=8,
              vocab=10)
    kw[field] = value
    with pytest.raises(err, match=field):
        ModelShape(**kw)


def test_query_heads_must_group_over_kv_heads():
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        ModelShape("m", layers=1, hidden=4, heads=3, kv_heads=2, head_dim=2, intermediate=8,
                   vocab=10)


@pytest.mark.parametrize("field,value", [
    ("peak_flops", 0.0), ("memory_bandwidth", -1.0), ("compute_efficiency", 1.5),
    ("bandwidth_efficiency", 0.0), ("step_overhead_s", -1e-3), ("peak_flops", math.inf),
    ("peak_flops", math.nan),
])
def test_bad_accelerator_numbers_are_refused(field, value):
    kw = dict(name="a", peak_flops=1.0, memory_bandwidth=1.0, memory_bytes=1)
    kw[field] = value
    with pytest.raises(ValueError, match=field):
        Accelerator(**kw)


def test_bad_profile_serving_numbers_are_refused():
    with pytest.raises(ValueError, match="memory_utilization"):
        Profile("p", TINY, SLOW, 0, memory_utilization=1.2)
    with pytest.raises(ValueError, match="activation_reserve_bytes"):
        Profile("p", TINY, SLOW, -1)
    with pytest.raises(TypeError, match="model must be a ModelShape"):
        Profile("p", SLOW, SLOW, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="page_tokens"):
        TINY_PROFILE.kv_pages(0)


def test_inconsistent_step_work_is_refused():
    with pytest.raises(ValueError, match="no sequence"):
        StepWork(0, 3, 0, 3, 6, 0)
    with pytest.raises(ValueError, match="context_tokens"):
        StepWork(1, 3, 0, 2, 6, 1)
    with pytest.raises(ValueError, match="attention_pairs"):
        StepWork(1, 3, 0, 3, 2, 1)
    with pytest.raises(ValueError, match="differ in length"):
        StepWork.from_lens([1, 2], [3])
    with pytest.raises(ValueError, match="at most its seq_len"):
        StepWork.from_lens([4], [3])
    with pytest.raises(ValueError, match="exceeds"):
        StepWork.from_lens([2], [3], prefill_tokens=5)
    with pytest.raises(TypeError, match="work must be a StepWork"):
        ModeledClock(TINY_PROFILE).cost((1, 2))  # type: ignore[arg-type]


def test_describe_names_the_model_the_gpu_and_the_fractions():
    line = ModeledClock().describe()
    assert "llama3.1-8b" in line and "H100" in line and "0.6" in line and "0.7" in line
    assert repr(ModeledClock()) == "ModeledClock('llama3.1-8b-h100')"


def test_clock_module_has_no_dependency_on_the_rest_of_the_simulator():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(clock))
    imported = {node.module for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for a in node.names}
    assert imported <= {"__future__", "difflib", "math", "operator", "dataclasses", "typing",
                        "numpy", "numpy.typing"}
