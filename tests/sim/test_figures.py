"""vLLM-compatible serving figures (qualia.sim.figures): hand-computed cases, vLLM's own
definitions replayed on random streams, and checked input."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import List

import numpy as np
import pytest

from qualia.sim.figures import (
    RequestRecord,
    request_rows,
    serving_figures,
    summary_lines,
    vllm_result,
)

# A: 3 tokens, B: 1 token, C: 4 tokens (times in seconds)
A = RequestRecord.from_token_times(0, 0.0, 10, [0.1, 0.3, 0.6])
B = RequestRecord.from_token_times(1, 0.2, 20, [0.5])
C = RequestRecord.from_token_times(2, 0.4, 5, [0.7, 0.8, 1.0, 1.1])


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-9)


def test_counts_duration_and_throughputs_by_hand():
    f = serving_figures([A, B, C])
    assert f["completed"] == 3
    assert f["duration"] == approx(1.1)  # earliest arrival (0.0) to the last token (1.1)
    assert (f["total_input_tokens"], f["total_output_tokens"]) == (35, 8)
    assert f["request_throughput"] == approx(3 / 1.1)
    assert f["output_throughput"] == approx(8 / 1.1)
    assert f["total_token_throughput"] == approx(43 / 1.1)


def test_ttft_and_e2el_by_hand():
    f = serving_figures([A, B, C])
    # TTFT 100, 300, 300 ms
    assert f["mean_ttft_ms"] == approx(700 / 3)
    assert f["median_ttft_ms"] == approx(300)
    assert f["std_ttft_ms"] == approx(math.sqrt(((100 - 700 / 3) ** 2 + 2 * (300 - 700 / 3) ** 2)
                                                / 3))
    assert f["p99_ttft_ms"] == approx(300)
    # E2EL 600, 300, 700 ms; p99 interpolates between 600 and 700 at 0.98
    assert f["mean_e2el_ms"] == approx(1600 / 3)
    assert f["median_e2el_ms"] == approx(600)
    assert f["p99_e2el_ms"] == approx(698)


def test_tpot_excludes_the_first_token_and_one_token_answers():
    f = serving_figures([A, B, C])
    # A: (600 - 100) / 2 = 250 ms; C: (700 - 300) / 3 = 133.33 ms; B has one token: no TPOT
    assert f["mean_tpot_ms"] == approx((250 + 400 / 3) / 2)
    assert f["median_tpot_ms"] == approx((250 + 400 / 3) / 2)
    assert f["std_tpot_ms"] == approx((250 - 400 / 3) / 2)
    assert f["p99_tpot_ms"] == approx(400 / 3 + 0.99 * (250 - 400 / 3))
    assert B.tpot_s is None


def test_itl_pools_every_gap_of_every_request():
    f = serving_figures([A, B, C])
    gaps = [200, 300, 100, 200, 100]  # A: 0.1->0.3->0.6, C: 0.7->0.8->1.0->1.1
    assert f["mean_itl_ms"] == approx(np.mean(gaps))
    assert f["median_itl_ms"] == approx(200)
    assert f["std_itl_ms"] == approx(math.sqrt(5600))
    assert f["p99_itl_ms"] == approx(296)


def test_tpot_weighs_requests_and_itl_weighs_tokens():
    slow_short = RequestRecord.from_token_times(0, 0.0, 1, [0.0, 1.0])  # one 1 s gap
    fast_long = RequestRecord.from_token_times(1, 0.0, 1, [0.0, 0.1, 0.2, 0.3, 0.4])
    f = serving_figures([slow_short, fast_long])
    assert f["mean_tpot_ms"] == approx((1000 + 100) / 2)
    assert f["mean_itl_ms"] == approx((1000 + 4 * 100) / 5)


def test_peak_concurrency_and_peak_tokens_per_second_by_hand():
    f = serving_figures([A, B, C])
    assert f["max_concurrent_requests"] == 3  # at 0.4 s: A, B and C
    # seconds from 0: tokens at 0.1 0.3 0.6 0.5 0.7 0.8 in the first, 1.0 1.1 in the second
    assert f["max_output_tokens_per_s"] == 6.0
    back_to_back = [RequestRecord.from_token_times(0, 0.0, 1, [0.5, 1.0]),
                    RequestRecord.from_token_times(1, 1.0, 1, [1.5, 2.0])]
    assert serving_figures(back_to_back)["max_concurrent_requests"] == 1  # half-open


def _peak_tokens_per_s_by_buckets(records):
    """max_output_tokens_per_s by its definition, bucket by bucket: one bucket per whole second
    from the earliest arrival to the last finish, each token in the bucket of its second."""
    t0 = min(r.arrival_s for r in records)
    buckets = [0] * (math.ceil(max(r.finish_s for r in records) - t0) + 1)
    for r in records:
        for t in r.token_times_s:
            buckets[int(t - t0)] += 1
    return float(max(buckets))


@pytest.mark.parametrize("seed", range(6))
def test_the_peak_tokens_per_second_is_the_fullest_whole_second_from_the_first_arrival(seed):
    rng = np.random.default_rng([seed, 7])
    records = []
    for i in range(int(rng.integers(1, 30))):
        arrival = float(rng.uniform(0.3, 20))
        gaps = rng.exponential(float(rng.choice([0.01, 0.3, 2.0])), size=int(rng.integers(1, 40)))
        records.append(RequestRecord.from_token_times(i, arrival, 5,
                                                      (arrival + np.cumsum(gaps)).tolist()))
    assert serving_figures(records)["max_output_tokens_per_s"] == \
        _peak_tokens_per_s_by_buckets(records)
    assert serving_figures(records, start_s=0.0)["max_output_tokens_per_s"] == \
        _peak_tokens_per_s_by_buckets(records)


def test_the_peak_tokens_per_second_takes_memory_in_the_tokens_not_the_span():
    far = [RequestRecord.from_token_times(0, 0.0, 10, [0.01, 0.02]),
           RequestRecord.from_token_times(1, 1e12, 10, [1e12 + 0.5, 1e12 + 0.6, 1e12 + 0.7])]
    f = serving_figures(far)
    assert f["max_output_tokens_per_s"] == 3.0 and f["max_concurrent_requests"] == 1


def test_the_run_start_sets_the_duration():
    f = serving_figures([B, C], start_s=0.0)
    assert f["duration"] == approx(1.1)
    assert serving_figures([B, C])["duration"] == approx(0.9)  # from the earliest arrival
    with pytest.raises(ValueError, match="after the earliest arrival"):
        serving_figures([B, C], start_s=0.3)


def test_records_without_token_times_leave_the_inter_token_figures_out():
    bare = [RequestRecord(r.request_id, r.arrival_s, r.first_token_s, r.finish_s,
                          r.input_tokens, r.output_tokens) for r in (A, B, C)]
    f = serving_figures(bare)
    g = serving_figures([A, B, C])
    assert not any(k.endswith("_itl_ms") for k in f)
    assert "max_output_tokens_per_s" not in f
    for k, v in f.items():
        assert g[k] == v
    assert vllm_result(bare)["itls"] == [[], [], []]


def test_no_request_reports_zeros():
    f = serving_figures([])
    assert f["completed"] == 0 and f["duration"] == 0.0
    assert f["request_throughput"] == f["output_throughput"] == 0.0
    assert f["mean_ttft_ms"] == f["p99_e2el_ms"] == f["mean_itl_ms"] == 0.0
    assert "max_concurrent_requests" not in f


def test_a_run_that_took_no_time_is_refused():
    instant = RequestRecord.from_token_times(0, 1.0, 3, [1.0])
    with pytest.raises(ValueError, match="duration 0 s"):
        serving_figures([instant])


def test_percentiles_are_named_like_vllm():
    f = serving_figures([A, B, C], percentiles=(50, 99.9))
    assert "p50_ttft_ms" in f and "p99.9_e2el_ms" in f and "p99_ttft_ms" not in f
    assert f["p50_e2el_ms"] == f["median_e2el_ms"]
    with pytest.raises(ValueError, match="percentiles"):
        serving_figures([A], percentiles=(101,))


def test_request_rows_and_vllm_result_carry_each_request():
    rows = request_rows([A, B, C])
    assert rows[0] == {"request_id": 0, "arrival_s": 0.0, "first_token_s": 0.1,
                       "finish_s": 0.6, "input_tokens": 10, "output_tokens": 3,
                       "ttft_ms": approx(100), "tpot_ms": approx(250), "e2el_ms": approx(600)}
    assert rows[1]["tpot_ms"] is None
    res = vllm_result([A, B, C], start_s=0.0)
    assert res["input_lens"] == [10, 20, 5] and res["output_lens"] == [3, 1, 4]
    assert res["ttfts"] == [approx(0.1), approx(0.3), approx(0.3)]
    assert res["itls"][1] == [] and len(res["itls"][2]) == 3
    assert res["start_times"] == [0.0, 0.2, 0.4]
    assert res["completed"] == 3
    json.dumps(res)  # plain JSON: no numpy scalars


def test_summary_lines_use_vllm_labels_in_milliseconds_with_separators():
    many = [RequestRecord.from_token_times(i, 0.0, 5000, [1.0 + i, 2.0 + i]) for i in range(3)]
    lines = summary_lines(serving_figures(many))
    text = "\n".join(lines)
    assert lines[0].startswith("=") and "Serving Benchmark Result" in lines[0]
    assert "Total input tokens:" in text and "15,000" in text
    for label in ("Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):", "Mean E2EL (ms):",
                  "Request throughput (req/s):", "Benchmark duration (s):"):
        assert label in text
    assert "e+" not in text and "e-" not in text


@pytest.mark.parametrize("kwargs,match", [
    (dict(arrival_s=1.0, first_token_s=0.5, finish_s=2.0), "arrival_s <= first_token_s"),
    (dict(first_token_s=2.0, finish_s=1.0), "first_token_s <= finish_s"),
    (dict(output_tokens=0), "output_tokens"),
    (dict(input_tokens=-1), "input_tokens"),
    (dict(output_tokens=1, finish_s=2.0), "one output token"),
    (dict(token_times_s=(0.5,)), "1 token times for 2"),
    (dict(token_times_s=(0.6, 2.0)), "start at first_token_s"),
    (dict(output_tokens=3, token_times_s=(0.5, 1.5, 2.0)), None),
    (dict(output_tokens=3, token_times_s=(0.5, 2.5, 2.0)), "must not decrease"),
    (dict(arrival_s=math.nan), "finite"),
])
def test_inconsistent_records_are_refused(kwargs, match):
    base = dict(request_id=7, arrival_s=0.0, first_token_s=0.5, finish_s=2.0, input_tokens=4,
                output_tokens=2)
    base.update(kwargs)
    if match is None:
        RequestRecord(**base)
        return
    with pytest.raises(ValueError, match=match):
        RequestRecord(**base)


def test_bad_record_lists_are_refused():
    with pytest.raises(ValueError, match="request 0: recorded twice"):
        serving_figures([A, A])
    with pytest.raises(TypeError, match="expected RequestRecord"):
        serving_figures([{"request_id": 0}])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="arrival_s must be a number"):
        RequestRecord(0, "0", 1.0, 1.0, 1, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no output token"):
        RequestRecord.from_token_times(0, 0.0, 1, [])


# -- vLLM's own computation, replayed --------------------------------------------------------
# The shape of vllm/benchmarks/serve.py: each request's output carries its start time, TTFT,
# the list of gaps between streamed chunks, its latency (start to the last chunk) and its token
# counts; calculate_metrics pools them with numpy.


@dataclass
class _Output:
    start_time: float
    ttft: float
    itl: List[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    prompt_len: int = 0


def _stream(start, prompt_len, chunk_times):
    out = _Output(start_time=start, ttft=0.0, prompt_len=prompt_len,
                  output_tokens=len(chunk_times))
    recent, first = start, True
    for t in chunk_times:
        if first:
            out.ttft, first = t - start, False
        else:
            out.itl.append(t - recent)
        recent = t
    out.latency = recent - start
    return out


def _vllm_metrics(outputs, dur_s, percentiles):
    ttfts, tpots, itls, e2els = [], [], [], []
    total_in = total_out = 0
    for o in outputs:
        total_in += o.prompt_len
        total_out += o.output_tokens
        if o.output_tokens > 1:
            tpots.append((o.latency - o.ttft) / (o.output_tokens - 1))
        itls += o.itl
        ttfts.append(o.ttft)
        e2els.append(o.latency)
    res = {"completed": len(outputs), "total_input_tokens": total_in,
           "total_output_tokens": total_out, "request_throughput": len(outputs) / dur_s,
           "output_throughput": total_out / dur_s,
           "total_token_throughput": (total_in + total_out) / dur_s}
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        res[f"mean_{name}_ms"] = np.mean(xs or 0) * 1000
        res[f"median_{name}_ms"] = np.median(xs or 0) * 1000
        res[f"std_{name}_ms"] = np.std(xs or 0) * 1000
        for p in percentiles:
            res[f"p{str(int(p)) if int(p) == p else str(p)}_{name}_ms"] = \
                np.percentile(xs or 0, p) * 1000
    return res


@pytest.mark.parametrize("seed", range(5))
def test_figures_equal_vllms_computation_on_random_streams(seed):
    rng = np.random.default_rng(seed)
    records, outputs = [], []
    for i in range(int(rng.integers(1, 40))):
        arrival = float(rng.uniform(0, 5))
        n = int(rng.integers(1, 30))
        times = arrival + np.cumsum(rng.exponential(0.05, size=n)) + float(rng.uniform(0, 1))
        prompt = int(rng.integers(1, 2000))
        records.append(RequestRecord.from_token_times(i, arrival, prompt, times.tolist()))
        outputs.append(_stream(arrival, prompt, times.tolist()))
    ours = serving_figures(records, start_s=0.0, percentiles=(50, 90, 99))
    dur = max(r.finish_s for r in records)
    theirs = _vllm_metrics(outputs, dur, (50, 90, 99))
    for k, v in theirs.items():
        assert ours[k] == pytest.approx(v, rel=1e-9, abs=1e-9), k


def _engine_records():
    from qualia.sim.engine import Engine
    from qualia.sim.workload import Workload

    engine = Engine("c")
    result = engine.run(Workload(requests=12, seed=4, arrival_rate=20.0))
    return [result.records[k] for k in sorted(result.records)]


def test_an_engines_records_equal_records_made_from_their_token_times():
    got = _engine_records()
    made = [RequestRecord.from_token_times(r.request_id, r.arrival_s, r.input_tokens,
                                           r.token_times_s) for r in got]
    assert got == made
    assert all(type(r.token_times_s) is tuple and type(r.token_times_s[0]) is float
               for r in got)


def test_an_engines_figures_equal_those_of_records_made_from_their_token_times():
    got = _engine_records()
    made = [RequestRecord.from_token_times(r.request_id, r.arrival_s, r.input_tokens,
                                           r.token_times_s) for r in _engine_records()]
    assert serving_figures(got) == serving_figures(made)


def test_an_engines_record_survives_pickling_and_replace():
    import dataclasses
    import pickle

    r = _engine_records()[0]
    assert pickle.loads(pickle.dumps(r)) == r
    assert dataclasses.replace(r, input_tokens=r.input_tokens + 1).token_times_s == \
        r.token_times_s


def test_a_records_token_times_default_to_none():
    r = RequestRecord(0, 0.0, 0.5, 0.5, 3, 1)
    assert r.token_times_s is None
    assert RequestRecord.token_times_s is None
