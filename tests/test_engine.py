"""The serving engine (qualia.engine) and ``python -m qualia simulate`` end to end."""

from __future__ import annotations

import collections
import json

import pytest

import qualia
from qualia.__main__ import main
from qualia.engine import (
    Engine,
    Request,
    Workload,
    is_exhausted,
    pages_needed,
    reference_generate,
    hash_next_token,
)
from qualia.twin import PyHashBackend

# A pool small enough that prefix eviction, preemption and copy-on-write all happen.
SMALL_WORKLOAD = dict(requests=24, seed=1, prompt_len=(16, 48), output_len=(8, 24),
                      system_prompts=3, system_prompt_len=20, share_ratio=0.8, tenants=2,
                      arrival_rate=2.0)
SMALL_ENGINE = dict(num_blocks=40, max_requests=12, page_tokens=8, logical_pages=12,
                    prefix_entries=4)


def assert_clean_end(engine: Engine, n_requests: int) -> None:
    s = engine.scheduler
    assert sorted(engine.outputs) == sorted(engine._requests)
    assert len(engine.outputs) == n_requests
    assert all(count == 1 for count in engine._completions.values())
    assert s.active_count == 0
    store_pages = collections.Counter(engine.store_pages())
    assert s.free_pages + len(store_pages) == s.num_blocks
    for page, count in store_pages.items():
        assert s.pool.refcount(page) == count


# -- workload ---------------------------------------------------------------------------------


def test_workload_is_seeded_and_well_formed():
    w = Workload(requests=200, seed=7, system_prompts=3, system_prompt_len=12, share_ratio=0.5,
                 tenants=4, arrival_rate=0.5, prompt_len=(8, 40), output_len=(2, 9))
    a, b = w.generate(), Workload(**{**w.__dict__}).generate()
    assert [r.to_dict() for r in a] == [r.to_dict() for r in b]
    other = Workload(requests=200, seed=8).generate()
    assert [r.prompt for r in a] != [r.prompt for r in other]
    assert [r.request_id for r in a] == list(range(200))
    arrivals = [r.arrival_step for r in a]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 100  # ~ 200 / 0.5 steps
    systems = w.system_prompt_tokens()
    shared = [r for r in a if r.system_prompt is not None]
    assert 60 < len(shared) < 140
    for r in a:
        assert 2 <= r.max_new_tokens <= 9
        assert all(0 <= t < w.vocab for t in r.prompt)
        assert r.namespace == f"tenant-{r.tenant}".encode() and 0 <= r.tenant < 4
        if r.system_prompt is None:
            assert r.shared_prefix_len == 0 and 8 <= len(r.prompt) <= 40
        else:
            assert r.shared_prefix_len == 12 and len(r.prompt) > 12
            assert r.prompt[:12] == systems[r.system_prompt]
    assert {r.tenant for r in a} == {0, 1, 2, 3}
    lognormal = Workload(requests=300, length_dist="lognormal", prompt_len=(10, 90)).generate()
    assert all(10 <= len(r.prompt) <= 90 for r in lognormal if r.system_prompt is None)
    no_end = Workload(requests=50, vocab=8, end_token=5, system_prompts=2, system_prompt_len=6)
    assert all(5 not in r.prompt for r in no_end.generate())
    assert any(5 in r.prompt for r in Workload(requests=50, vocab=8).generate())
    with pytest.raises(ValueError):
        Workload(prompt_len=(5, 2))
    with pytest.raises(ValueError):
        Workload(share_ratio=1.5)


def test_reference_rule_matches_the_core():
    for rid, pos, tok in [(0, 0, 0), (7, 100, 31999), (2**64 - 1, 2**32 - 1, 2**32 - 1)]:
        assert hash_next_token(rid, pos, tok) == qualia.hash_next_token(rid, pos, tok)
        assert hash_next_token(rid, pos, tok, 97) == PyHashBackend.next_token(
            rid, pos, tok, 97)


# -- the model backend ------------------------------------------------------------------------


def test_model_engine_matches_dense_reference_under_pressure():
    requests = Workload(**SMALL_WORKLOAD).generate()
    engine = Engine("model", **SMALL_ENGINE)
    result = engine.run(requests, check=True)
    st = result.stats
    assert result.check.ok, result.check.describe()
    assert result.check.describe() == "all 24 requests match the dense reference"
    assert_clean_end(engine, 24)
    assert st["requests_completed"] == 24
    assert st["tokens_generated"] == sum(r.max_new_tokens for r in requests)  # no end token
    assert st["preemptions"] > 0 and st["tokens_recomputed"] > 0
    assert st["recompute_mismatches"] == 0  # recomputed prefill reproduced the pending token
    assert st["prefix_hits"] > 0 and 0 < st["prefix_hit_rate"] <= 1
    assert st["pages_copied"] > 0
    assert st["evictions"] > 0 and st["evictions_for_pages"] > 0
    assert st["peak_pages_used"] == SMALL_ENGINE["num_blocks"]
    assert st["decode_rounds"] == engine.backend.inner.rounds
    assert st["backend_s_total"] > 0 and st["sched_s_total"] > 0


def test_model_engine_end_token_and_tenants():
    # find a token the dense model emits often, so that requests stop early on it
    requests = Workload(requests=10, seed=3, prompt_len=(10, 30), output_len=(12, 20),
                        system_prompts=1, system_prompt_len=9, share_ratio=1.0, tenants=1,
                        arrival_rate=float("inf")).generate()
    free_run = Engine("model", num_blocks=64, max_requests=10, page_tokens=4, logical_pages=16)
    free_run.run(requests)
    counts = collections.Counter(t for out in free_run.outputs.values() for t in out[:-1])
    end = counts.most_common(1)[0][0]
    engine = Engine("model", num_blocks=64, max_requests=10, page_tokens=4, logical_pages=16,
                    end_token=end)
    result = engine.run(requests, check=True)
    assert result.check.ok, result.check.describe()
    stopped = [rid for rid, out in engine.outputs.items()
               if len(out) < engine._requests[rid].max_new_tokens]
    assert stopped and all(engine.outputs[rid][-1] == end for rid in stopped)
    # one tenant, one system prompt, everything arriving at once: the first publishes and
    # every later one hits
    assert result.stats["prefix_hits"] == 9 and result.stats["prefixes_published"] == 1
    assert_clean_end(engine, 10)


def test_tenants_do_not_share_prefixes():
    base = Workload(requests=1, prompt_len=(30, 30), system_prompts=1, system_prompt_len=12,
                    share_ratio=1.0).generate()[0]
    reqs = [Request(i, tenant, list(base.prompt[:12]) + [i] * 18, 12, 4, arrival_step=i)
            for i, tenant in enumerate([0, 1, 0, 1, 2])]
    engine = Engine("model", num_blocks=64, max_requests=4, page_tokens=8, logical_pages=8)
    result = engine.run(reqs, check=True)
    assert result.check.ok
    assert result.stats["prefixes_published"] == 3  # one per tenant
    assert result.stats["prefix_hits"] == 2  # the second request of tenants 0 and 1
    assert result.stats["pages_copied"] == 2  # the hits copy the store's half-filled page 1


# -- decode-only backends ---------------------------------------------------------------------


def test_c_backend_engine_matches_the_reference_rule():
    requests = Workload(requests=400, seed=5, prompt_len=(8, 80), output_len=(4, 40),
                        system_prompts=5, system_prompt_len=24, share_ratio=0.7, tenants=3,
                        arrival_rate=4.0, vocab=32000).generate()
    engine = Engine("c", num_blocks=120, max_requests=32, page_tokens=16, logical_pages=8,
                    prefix_entries=8)
    result = engine.run(requests, check=True)
    st = result.stats
    assert result.check.ok, result.check.describe()
    assert "pure-Python reference decode rule" in result.check.describe()
    assert_clean_end(engine, 400)
    assert st["preemptions"] > 0 and st["prefix_hits"] > 0 and st["pages_copied"] > 0
    assert st["evictions"] > 0
    assert isinstance(engine.backend, qualia.HashBackend)
    assert engine.backend.calls == st["decode_rounds"]
    for rid, out in engine.outputs.items():
        req = engine._requests[rid]
        assert out == reference_generate(rid, req.prompt, req.max_new_tokens)


def test_c_backend_small_vocab_end_token_and_tiny_pool():
    # vocab 8 makes the end token frequent; one slot page_tokens=1 stresses every path
    requests = Workload(requests=60, seed=2, prompt_len=(1, 12), output_len=(1, 10),
                        system_prompts=2, system_prompt_len=3, share_ratio=0.9, tenants=2,
                        arrival_rate=3.0, vocab=8).generate()
    for max_requests in (1, 5):
        engine = Engine("c", num_blocks=24, max_requests=max_requests, page_tokens=1,
                        logical_pages=24, prefix_entries=2, vocab=8, end_token=3)
        result = engine.run(requests, check=True)
        assert result.check.ok, result.check.describe()
        assert_clean_end(engine, 60)
        assert any(out[-1] == 3 and len(out) < engine._requests[rid].max_new_tokens
                   for rid, out in engine.outputs.items())


def test_python_decode_only_backend():
    backend = PyHashBackend(vocab=1000)
    requests = Workload(**{**SMALL_WORKLOAD, "vocab": 1000}).generate()
    engine = Engine(backend, **SMALL_ENGINE)
    result = engine.run(requests, check=True)
    assert result.check.ok and result.stats["preemptions"] > 0
    assert backend.pages_copied == result.stats["pages_copied"] > 0  # prefill and decode copies
    assert_clean_end(engine, 24)


# -- rejection and bad input ------------------------------------------------------------------


def test_oversize_request_is_rejected_at_submission():
    engine = Engine("c", num_blocks=8, max_requests=2, page_tokens=4, logical_pages=16)
    assert pages_needed(30, 3, 4) == 8
    engine.submit(Request(0, 0, list(range(30)), 0, 3))  # 32 positions = 8 pages: fits
    with pytest.raises(ValueError, match="whole pool has only 8 pages"):
        engine.submit(Request(1, 0, list(range(30)), 0, 4))
    with pytest.raises(ValueError, match="logical_pages=16"):
        engine.submit(Request(2, 0, list(range(60)), 0, 10))
    with pytest.raises(ValueError, match="duplicate"):
        engine.submit(Request(0, 0, [1, 2], 0, 1))
    with pytest.raises(ValueError, match="empty"):
        engine.submit(Request(3, 0, [], 0, 1))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.submit(Request(4, 0, [1], 0, 0))
    result = engine.run()  # the accepted request is still served
    assert result.stats["requests_completed"] == 1
    model = Engine("model", num_blocks=8, max_requests=2, page_tokens=4, logical_pages=8)
    with pytest.raises(ValueError, match="token ids"):
        model.submit(Request(0, 0, [1, 512], 0, 1))
    with pytest.raises(ValueError):
        Engine("gpu")


def test_is_exhausted():
    assert is_exhausted(qualia.DecodeRoundError.Scheduler(
        qualia.SchedulerError.Table(qualia.TableError.Exhausted())))
    assert not is_exhausted(qualia.SchedulerError.Table(qualia.TableError.OutOfRange()))
    assert not is_exhausted(RuntimeError("Exhausted"))


# -- the CLI ----------------------------------------------------------------------------------

SMALL_CLI = ["--requests", "16", "--prompt-len", "16,40", "--output-len", "6,16",
             "--system-prompts", "2", "--system-prompt-len", "20", "--share-ratio", "0.8",
             "--arrival-rate", "2", "--num-blocks", "32", "--max-requests", "10",
             "--page-tokens", "8", "--logical-pages", "8", "--prefix-entries", "3",
             "--no-progress"]


def test_cli_simulate_check_json(tmp_path, capsys):
    path = tmp_path / "run.json"
    rc = main(["simulate", *SMALL_CLI, "--check", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "all 16 requests match the dense reference" in out
    for label in ("requests completed", "tokens generated", "decode rounds", "prefix hit rate",
                  "pages copied", "evictions", "preemptions", "peak pool use",
                  "scheduler time / round", "backend time / round", "wall time"):
        assert label in out
    data = json.loads(path.read_text())
    st = data["stats"]
    assert st["requests_completed"] == 16 and st["check_ok"] is True
    assert data["check"]["ok"] is True and data["check"]["checked"] == 16
    assert data["check"]["message"] == "all 16 requests match the dense reference"
    assert data["config"]["num_blocks"] == 32 and data["config"]["prompt_len"] == [16, 40]
    assert data["config"]["backend"] == "model"
    for key in ("tokens_generated", "decode_rounds", "prefix_hit_rate", "pages_copied",
                "evictions", "preemptions", "peak_pool_use", "sched_us_per_round_p50",
                "sched_us_per_round_p99", "backend_us_per_round_p50",
                "backend_us_per_round_p99", "wall_s"):
        assert key in st
    assert st["preemptions"] > 0 and st["prefix_hits"] > 0


def test_cli_c_backend_json_stdout(capsys):
    rc = main(["simulate", "--backend", "c", "--requests", "200", "--arrival-rate", "inf",
               "--check", "--json", "-", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0
    data = json.loads(captured.out)
    assert data["stats"]["requests_completed"] == 200
    assert data["check"]["ok"] and data["config"]["arrival_rate"] == "inf"


def test_cli_rejects_what_cannot_fit(capsys):
    rc = main(["simulate", "--requests", "4", "--prompt-len", "100,120", "--logical-pages", "4",
               "--no-progress", "--backend", "c"])
    assert rc == 2
    assert "can never be served" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "--prompt-len", "9,3"])
    with pytest.raises(SystemExit):
        main([])


def test_cli_quiet_and_demo(capsys):
    assert main(["simulate", *SMALL_CLI, "--backend", "c", "--quiet"]) == 0
    assert capsys.readouterr().out == ""
    assert main(["demo", "--no-progress", "--backend", "c"]) == 0
    assert "all 12 requests match" in capsys.readouterr().out


class _OffByOne(PyHashBackend):
    """Deviates from the reference rule for request 3 only."""

    def execute_ragged(self, items, block_table, outputs):
        receipt = super().execute_ragged(items, block_table, outputs)
        for i in range(len(items)):
            if items["request_id"][i] == 3:
                outputs["next_token_id"][i] = (outputs["next_token_id"][i] + 1) % self.vocab
        return receipt


def test_check_reports_a_mismatch():
    requests = Workload(requests=6, prompt_len=(4, 8), output_len=(3, 5),
                        system_prompts=0).generate()
    engine = Engine(_OffByOne(), num_blocks=16, max_requests=4, page_tokens=4, logical_pages=4)
    result = engine.run(requests, check=True)
    assert not result.check.ok and result.check.mismatched == [3]
    assert "1 of 6 requests DIFFER" in result.check.describe()
    assert result.stats["check_ok"] is False


def test_cli_exit_status_on_failed_check(monkeypatch, capsys):
    from qualia import engine as engine_mod

    def bad_check(self, on_checked=None):
        return engine_mod.CheckResult(False, len(self.outputs), [0], "dense reference")

    monkeypatch.setattr(engine_mod.Engine, "check", bad_check)
    assert main(["simulate", *SMALL_CLI, "--backend", "c", "--check"]) == 1
    assert "DIFFER" in capsys.readouterr().out
    assert main(["simulate", *SMALL_CLI, "--backend", "c", "--check", "--quiet"]) == 1
    assert "check FAILED" in capsys.readouterr().err
