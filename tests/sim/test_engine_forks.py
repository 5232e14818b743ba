"""The engine and ``qualia simulate`` with forks: ``n > 1`` parallel samples and beam
search through the engine step, the fork counters and the pages saved by sharing, ``--check``
of every member against the dense model (and of every beam group against the dense beam
search), and the options' bad combinations."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.groups import Index, LyingInt

import qualia
from qualia.cli.main import main
from qualia.model import DenseModel, ModelConfig, ModelWeights, SamplingParams
from qualia.sim.check import check_groups
from qualia.sim.engine import Engine
from qualia.sim.report import WIDTH, format_summary
from qualia.sim.workload import Request, Workload

HOT = SamplingParams(temperature=1.0, seed=5)
CONFIG = ModelConfig(vocab=64, layers=1)

SMALL_CLI = ["--requests", "6", "--prompt-len", "12,40", "--output-len", "4,10",
             "--system-prompts", "1", "--system-prompt-len", "9", "--share-ratio", "0.5",
             "--arrival-rate", "3", "--num-pages", "96", "--max-num-seqs", "12",
             "--page-tokens", "8", "--logical-pages", "8", "--turns", "2",
             "--no-progress"]


def _no_run(monkeypatch):
    from qualia.sim import engine as engine_mod

    def refuse(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(engine_mod.Engine, "__init__", refuse)


def _requests(lengths, max_new, vocab=64, seed=0):
    rng = np.random.default_rng(seed)
    return [Request(i, 0, rng.integers(0, vocab, n).tolist(), 0, max_new)
            for i, n in enumerate(lengths)]


# -- end to end through the CLI ----------------------------------------------------------------


def test_simulate_n_check_passes(capsys):
    rc = main(["simulate", *SMALL_CLI, "--n", "4", "--check", "--json", "-"])
    data = json.loads(capsys.readouterr().out)
    st = data["stats"]
    assert rc == 0 and data["check"]["ok"] is True, data["check"]
    assert st["n"] == 4 and st["temperature"] == 1.0
    done = st["requests_completed"]
    assert done == st["requests_submitted"] and st["sequences_completed"] == 4 * done
    assert st["forks"] + st["fork_fallbacks"] == 3 * done
    assert st["peak_unshared_pages"] > st["peak_held_pages"] >= 1
    assert data["config"]["n"] == 4


def test_simulate_beam_check_passes(capsys):
    rc = main(["simulate", *SMALL_CLI, "--beam-width", "3", "--check"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "match the dense beam search" in out
    assert "beam search, width 3" in out and "beams parked" in out
    assert max(len(line) for line in out.splitlines()) <= WIDTH


def test_simulate_n_on_the_c_backend_checks_every_member_against_the_hash_rule(capsys):
    rc = main(["simulate", *SMALL_CLI, "--backend", "c", "--n", "3", "--check"])
    out = capsys.readouterr().out
    assert rc == 0 and "match the pure-Python hash rule" in out, out
    assert "greedy" in out  # the c backend draws by its hash rule, keyed by member


@pytest.mark.parametrize("argv,message", [
    (["--n", "0"], "argument --n: must be >= 1"),
    (["--beam-width", "0"], "argument --beam-width: must be >= 1"),
    (["--n", "2", "--beam-width", "2"], "argument --beam-width: not allowed with --n > 1"),
    (["--max-num-seqs", "4", "--beam-width", "5"], "argument --beam-width: must be <= "
                                                   "--max-num-seqs (4)"),
    (["--max-num-seqs", "3", "--n", "4"], "argument --n: must be <= --max-num-seqs (3)"),
    (["--backend", "c", "--beam-width", "2"], "argument --beam-width: needs --backend model"),
    (["--backend", "c", "--temperature", "1"], "argument --temperature: needs --backend model"),
    (["--beam-width", "2", "--temperature", "1"], "argument --temperature: not allowed with "
                                                  "--beam-width"),
    (["--temperature", "nan"], "argument --temperature: must be a finite number >= 0"),
    (["--replicas", "2", "--n", "2"], "argument --replicas: not supported with --n"),
    (["--replicas", "2", "--beam-width", "2"], "argument --replicas: not supported with"),
])
def test_bad_fork_options_are_argparse_errors(argv, message, monkeypatch, capsys):
    _no_run(monkeypatch)
    for command in ("simulate",) if "--replicas" in argv else ("simulate", "demo"):
        with pytest.raises(SystemExit) as exc:
            main([command, *argv])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert message in err and f"{command}: error:" in err, err


def test_a_beam_group_that_never_fits_the_pool_is_refused_before_the_run(capsys):
    rc = main(["simulate", "--requests", "2", "--prompt-len", "60,60", "--output-len", "40,40",
               "--num-pages", "16", "--page-tokens", "8", "--logical-pages", "16",
               "--beam-width", "4", "--no-progress", "--turns", "1"])
    assert rc == 2
    assert "beams need" in capsys.readouterr().err


# -- the engine ----------------------------------------------------------------------------------


def test_twin_engine_n_groups_equal_their_dense_runs():
    weights = ModelWeights.random(CONFIG)
    from qualia.model import PagedModelBackend

    backend = PagedModelBackend(weights, 64, 4, sampling=HOT)
    engine = Engine(backend, num_pages=64, max_num_seqs=8, page_tokens=4, logical_pages=8,
                    n=3, scheduler="twin")
    reqs = _requests([10, 7, 13], 6)
    result = engine.run(reqs, check=True)
    assert engine.implementation == "twin" and result.check.ok, result.check.describe()
    dense = DenseModel(weights)
    for r in reqs:
        g = result.groups[r.request_id]
        assert g.kind == "n" and len(g.member_ids) == 3 and g.member_ids[0] == r.request_id
        assert g.outputs == [dense.generate(r.prompt, 6, sampling=HOT, request_id=m)
                             for m in g.member_ids]
        assert result.outputs[r.request_id] == g.outputs[0]
    assert len({tuple(o) for g in result.groups.values() for o in g.outputs}) > 3
    assert result.stats["sequences_completed"] == 9
    assert result.stats["tokens_generated"] == sum(len(o) for g in result.groups.values()
                                                   for o in g.outputs)


@pytest.mark.parametrize("implementation", ["auto", "twin"])
def test_beam_groups_equal_the_dense_beam_search(implementation):
    engine = Engine("model", model_config=CONFIG, num_pages=64, max_num_seqs=8,
                    page_tokens=4, logical_pages=8, beam_width=3,
                    scheduler=implementation, eos_token_id=9)
    reqs = _requests([10, 6], 7, seed=3)
    result = engine.run(reqs, check=True)
    assert result.check.ok, result.check.describe()
    dense = DenseModel(engine.weights)
    for r in reqs:
        g = result.groups[r.request_id]
        ref = dense.beam_search(r.prompt, 3, 7, eos_token_id=9)
        assert g.kind == "beam" and g.outputs == [h.tokens for h in ref]
        assert g.scores == pytest.approx([h.logprob for h in ref], rel=1e-9)
    assert result.stats["forks"] > 0


def test_groups_run_on_the_core_scheduler_by_default():
    assert Engine("model", beam_width=2).implementation == "core"
    assert Engine("model", n=2).implementation == "core"


def test_pages_saved_by_sharing_at_the_peak():
    # one request, prompt of 10 tokens (2 full pages of 4 and 2 tokens), 4 members of 6 new
    # tokens: at the last step each member has 15 tokens with K/V = 4 pages of its own without
    # sharing (16); with sharing the 2 full prompt pages once plus 2 pages per member (10)
    engine = Engine("model", model_config=CONFIG, num_pages=64, max_num_seqs=8,
                    page_tokens=4, logical_pages=8, n=4, sampling=HOT)
    result = engine.run(_requests([10], 6), check=True)
    st = result.stats
    assert result.check.ok
    assert st["peak_unshared_pages"] == 16 and st["pages_saved_at_peak"] == 6
    assert st["peak_held_pages"] == 10
    assert st["forks"] == 3 and st["pages_copied"] == 3  # the partial prompt page per child


def test_copies_at_least_forks_when_prompts_end_mid_page():
    engine = Engine("model", model_config=CONFIG, num_pages=96, max_num_seqs=12,
                    page_tokens=4, logical_pages=8, n=4, sampling=HOT)
    result = engine.run(_requests([9, 10, 11, 13, 6], 5, seed=2), check=True)
    st = result.stats
    assert result.check.ok and st["forks"] > 0
    assert st["pages_copied"] >= st["forks"]
    assert st["pages_saved_at_peak"] > 0


def test_long_prompts_save_pages_with_n():
    wl = Workload(requests=4, seed=3, prompt_len=(60, 90), output_len=(4, 8),
                  system_prompts=0, vocab=64, turns=1, arrival_rate=float("inf"))
    engine = Engine("model", model_config=CONFIG, num_pages=128, max_num_seqs=16,
                    page_tokens=8, logical_pages=16, n=4, sampling=HOT)
    st = engine.run(wl, check=True).stats
    assert st["check_ok"]
    # at the peak most of what the members would hold apart is the prompts, held once
    assert st["pages_saved_at_peak"] > st["peak_unshared_pages"] // 2


def test_without_sharing_nothing_is_saved():
    engine = Engine("model", model_config=CONFIG, num_pages=64, max_num_seqs=8,
                    page_tokens=4, logical_pages=8, prefix_caching="off")
    st = engine.run(_requests([10, 7, 13], 6)).stats
    assert st["pages_saved_at_peak"] == 0
    assert st["peak_unshared_pages"] == st["peak_held_pages"] > 0
    # without groups the fork counters, always zero, are left out
    assert not {"forks", "fork_fallbacks", "beams_parked", "pages_copied"} & set(st)


def test_fork_fallbacks_are_counted_and_still_exact():
    # two slots for two groups of 3: some children cannot fork and wait as requests
    engine = Engine("model", model_config=CONFIG, num_pages=64, max_num_seqs=3,
                    page_tokens=4, logical_pages=8, n=3, sampling=HOT)
    result = engine.run(_requests([10, 11, 9], 4, seed=4), check=True)
    st = result.stats
    assert result.check.ok and st["fork_fallbacks"] > 0
    assert st["forks"] + st["fork_fallbacks"] == 6
    assert st["sequences_completed"] == 9


def test_temperature_without_forks_checks_against_the_sampled_dense_run():
    engine = Engine("model", model_config=CONFIG, num_pages=64, max_num_seqs=8,
                    page_tokens=4, logical_pages=8, sampling=HOT)
    reqs = _requests([10, 7], 8)
    result = engine.run(reqs, check=True)
    assert result.check.ok and not result.groups
    dense = DenseModel(engine.weights)
    assert result.outputs[0] == dense.generate(reqs[0].prompt, 8, sampling=HOT, request_id=0)


def test_check_names_the_member_that_differs():
    engine = Engine("model", model_config=CONFIG, num_pages=64, max_num_seqs=8,
                    page_tokens=4, logical_pages=8, n=3, sampling=HOT)
    engine.run(_requests([10, 7], 5))
    g = engine.groups[1]
    g.outputs[2][1] = (g.outputs[2][1] + 1) % 64
    check = engine.check()
    assert not check.ok and check.mismatched == [1]
    assert f"request 1 member 2 (id {g.member_ids[2]}): token 1" in check.describe()


def test_check_names_the_hypothesis_that_differs():
    engine = Engine("model", model_config=CONFIG, num_pages=64, max_num_seqs=8,
                    page_tokens=4, logical_pages=8, beam_width=2)
    engine.run(_requests([10], 5))
    engine.groups[0].outputs.reverse()
    engine.groups[0].scores.reverse()
    check = engine.check()
    assert not check.ok and "request 0 hypothesis 0 (best first)" in check.describe()


@pytest.mark.parametrize("kw,exc,match", [
    (dict(n=0), ValueError, "n must be in"),
    (dict(n=9), ValueError, "max_num_seqs=8"),
    (dict(n=2.0), TypeError, "n must be an int"),
    (dict(n=2, beam_width=2), ValueError, "exclude each other"),
    (dict(beam_width=9), ValueError, "beam_width must be in"),
    (dict(n=5, max_queued=4), ValueError, "max_queued"),
    (dict(sampling="hot"), TypeError, "SamplingParams"),
])
def test_bad_group_arguments(kw, exc, match):
    with pytest.raises(exc, match=match):
        Engine("model", model_config=CONFIG, max_num_seqs=8, **kw)


def test_beam_search_and_sampling_need_the_model():
    with pytest.raises(ValueError, match="beam search needs the model backend"):
        Engine("c", beam_width=2)
    with pytest.raises(ValueError, match="sampling needs the model backend"):
        Engine("c", sampling=HOT)


def test_summary_of_a_fork_run_fits_and_names_the_figures():
    engine = Engine("model", model_config=CONFIG, num_pages=64, max_num_seqs=8,
                    page_tokens=4, logical_pages=8, n=4, sampling=HOT)
    result = engine.run(_requests([10, 7], 5))
    text = format_summary(result.stats)
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    for label in ("groups", "n = 4 samples per request, temperature 1", "8 sequences",
                  "forks", "pages saved by sharing"):
        assert label in text, text


# -- random runs ---------------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=100, deadline=None)
@given(kind=st.sampled_from(["n", "beam"]), width=st.integers(1, 4),
       lengths=st.lists(st.integers(1, 14), min_size=1, max_size=5),
       max_new=st.integers(1, 6), num_pages=st.integers(12, 40),
       max_num_seqs=st.integers(4, 8), budget=st.sampled_from([4, 9, 64]),
       end_token=st.sampled_from([None, 3]), seed=st.integers(0, 3))
def test_random_fork_runs_check_and_keep_their_books(kind, width, lengths, max_new, num_pages,
                                                     max_num_seqs, budget, end_token, seed):
    """Any small pool, budget and slot count (preemption, fork fallbacks, parked beams): every
    group equals its dense reference, every page comes back, and the books agree."""
    kw = dict(n=width) if kind == "n" else dict(beam_width=width)
    engine = Engine("model", model_config=CONFIG, num_pages=num_pages,
                    max_num_seqs=max_num_seqs, page_tokens=3, logical_pages=8,
                    max_num_batched_tokens=budget, eos_token_id=end_token,
                    sampling=HOT if kind == "n" else None, **kw)
    reqs = _requests(lengths, max_new, seed=seed)
    try:
        for r in reqs:
            engine.submit(r)
    except ValueError:  # a beam group that never fits this pool
        assert kind == "beam"
        return
    result = engine.run(check=True)
    st_ = result.stats
    assert result.check.ok, result.check.describe()
    assert st_["requests_completed"] == len(reqs)
    f = engine.facade
    assert f.active_count == 0 and f.free_pages == f.num_pages
    if kind == "n" and width > 1:
        assert st_["sequences_completed"] == width * len(reqs)
        assert st_["forks"] + st_["fork_fallbacks"] == (width - 1) * len(reqs)
    for rid, rec in result.records.items():  # one record per request, a group's included
        if kind == "beam":  # the longest hypothesis, no per-token times
            longest = max(len(o) for o in result.groups[rid].outputs)
            assert rec.output_tokens == longest and rec.token_times_s is None
        else:  # every member's tokens, each at the end of the step that sampled it
            group = result.groups.get(rid)
            outs = group.outputs if group is not None else [result.outputs[rid]]
            assert rec.output_tokens == len(rec.token_times_s) == sum(len(o) for o in outs)
    assert 0 <= st_["pages_saved_at_peak"] <= st_["peak_unshared_pages"]
    assert st_["peak_held_pages"] <= num_pages
    outputs = ([o for g in result.groups.values() for o in g.outputs] if engine.forking
               else list(result.outputs.values()))  # n = 1: plain requests
    assert st_["tokens_generated"] == sum(len(o) for o in outputs)


# -- the engine's counters and its check of n groups, on the hash rule ---------------------------


class RecordingHash:
    """A Python step backend over the hash rule that keeps each plan's sizes."""

    def __init__(self):
        self.hb = qualia.HashBackend(vocab=32000)
        self.plans = []

    def execute_step(self, plan):
        self.plans.append((len(plan.copies), len(plan.logits_indices),
                           len(plan.preempted_request_ids), len(plan.new_request_ids),
                           len(plan.input_ids)))
        return self.hb.execute_step(plan)


def _reqs(lengths, max_new, seed=0):
    rng = np.random.default_rng(seed)
    return [Request(i, 0, rng.integers(0, 50, k).tolist(), 0, max_new)
            for i, k in enumerate(lengths)]


@settings(max_examples=300, deadline=None)
@given(n=st.integers(2, 4), lengths=st.lists(st.integers(1, 13), min_size=1, max_size=5),
       max_new=st.integers(1, 6), num_blocks=st.integers(10, 30), seqs=st.integers(4, 6),
       budget=st.sampled_from([3, 8, 64]), caching=st.sampled_from(["auto", "off"]))
def test_engine_counters_add_up_to_its_plans(n, lengths, max_new, num_blocks, seqs, budget,
                                             caching):
    rec = RecordingHash()
    engine = Engine(rec, num_pages=num_blocks, max_num_seqs=seqs, page_tokens=3,
                    logical_pages=8, max_num_batched_tokens=budget, prefix_caching=caching, n=n)
    result = engine.run(_reqs(lengths, max_new), check=True)
    st_, plans = result.stats, rec.plans
    assert result.check.ok, result.check.describe()
    copies, rows, preempted, new, tokens = (sum(p[i] for p in plans) for i in range(5))
    assert st_["pages_copied"] == copies
    assert st_["preemptions"] == preempted and st_["admissions"] == new
    assert st_["tokens_scheduled"] == tokens
    # every sampled row is one token of one member, and every member completed
    assert st_["tokens_generated"] == rows == engine.counters.sampled_tokens
    assert st_["forks"] + st_["fork_fallbacks"] == (n - 1) * len(lengths)
    assert st_["forks"] == engine.scheduler.forks
    assert st_["sequences_completed"] == n * len(lengths)
    # every preempted sequence (a forked child too) is resumed once: all of them completed
    assert st_["recomputes"] == st_["preemptions"]
    assert 0 <= st_["pages_saved_at_peak"] <= st_["peak_unshared_pages"]


def _hash_engine_groups(n=3):
    engine = Engine("c", num_pages=64, max_num_seqs=8, page_tokens=4, logical_pages=8, n=n)
    result = engine.run(_reqs([10, 7], 5), check=True)
    assert result.check.ok
    return engine


def test_check_fails_when_every_member_is_keyed_by_the_parent():
    # a scheduler that named every member after its parent would draw n equal sequences, each
    # the parent's reference: the check must not pass them
    engine = _hash_engine_groups()
    g = engine.groups[1]
    g.member_ids[:] = [1, 1, 1]
    g.outputs[:] = [list(g.outputs[0])] * 3
    check = engine.check()
    assert not check.ok and check.mismatched == [1]
    assert "not 3 distinct ids starting with the request's own" in check.describe()


def test_check_fails_when_the_members_are_out_of_order():
    engine = _hash_engine_groups()
    g = engine.groups[0]
    g.member_ids.reverse()
    g.outputs.reverse()              # each output still matches its own id's reference
    check = engine.check()
    assert not check.ok and check.mismatched == [0]


def test_check_fails_when_one_member_token_is_tampered():
    engine = _hash_engine_groups()
    g = engine.groups[0]
    g.outputs[1][-1] = (g.outputs[1][-1] + 1) % 32000
    check = engine.check()
    assert not check.ok and f"request 0 member 1 (id {g.member_ids[1]})" in check.describe()


def test_check_of_a_group_for_an_unknown_request_is_a_failure_not_a_crash():
    engine = _hash_engine_groups()
    groups = dict(engine.groups)
    groups[99] = groups[0]
    check = check_groups(engine._requests, groups, n=3)
    assert not check.ok and "request 99: a group result for a request never submitted" in \
        check.describe()


@pytest.mark.parametrize("value", [np.int64(3), np.uint16(3), Index(3)],
                         ids=["int64", "uint16", "__index__"])
def test_engine_takes_n_by_index(value):
    engine = Engine("c", num_pages=64, max_num_seqs=8, page_tokens=4, logical_pages=8,
                    n=value)
    assert engine.n == 3 and type(engine.n) is int
    assert engine.run(_reqs([6], 2), check=True).check.ok


@pytest.mark.parametrize("value,exc", [(np.bool_(True), TypeError), (LyingInt(0), ValueError),
                                       (LyingInt(99), ValueError), (2.0, TypeError)])
def test_engine_refuses_bad_n(value, exc):
    with pytest.raises(exc, match="n must be"):
        Engine("c", num_pages=64, max_num_seqs=8, page_tokens=4, logical_pages=8, n=value)


def test_pages_saved_is_never_negative_when_a_forked_child_waits_for_the_budget():
    # n=4 of a one-token prompt, budget 3: after the fork three members decode and copy the
    # shared partial page away; the fourth, in no plan yet, is its last holder, and counts
    # among the pages a non-sharing run would hold (leaving it out would make saved = 3 - 4 = -1)
    for caching in ("auto", "off"):
        engine = Engine(RecordingHash(), num_pages=10, max_num_seqs=4, page_tokens=3,
                        logical_pages=8, max_num_batched_tokens=3, prefix_caching=caching, n=4)
        st_ = engine.run(_reqs([1], 2), check=True).stats
        assert st_["peak_held_pages"] == 4 and st_["peak_unshared_pages"] == 4
        assert st_["pages_saved_at_peak"] == 0


def test_a_forked_child_preempted_before_its_first_plan_is_counted_as_resumed():
    # the child (forked at step 4) is preempted before any plan names it, then admitted again:
    # a resume by recompute like any other (it was counted as a first admission)
    rec = RecordingHash()
    engine = Engine(rec, num_pages=8, max_num_seqs=5, page_tokens=3, logical_pages=8,
                    max_num_batched_tokens=3, n=2)
    st_ = engine.run(_reqs([13, 8], 5), check=True).stats
    assert st_["preemptions"] == 3 and st_["recomputes"] == 3
    assert st_["tokens_recomputed"] > 0


@pytest.mark.parametrize("implementation", ["auto", "twin"])
def test_pages_saved_counts_a_beam_child_forked_before_its_first_plan(implementation):
    # two one-token prompts, 3 beams each, 5 slots, budget 4: the first selection forks three
    # children (the sixth beam waits, queued); the budget plans four beams, and the child left
    # out is the last holder of its parent's first page, which the planned beams copied away
    # from: 5 pages held, 5 the running beams would hold apart
    engine = Engine("model", model_config=CONFIG, num_pages=12, max_num_seqs=5,
                    page_tokens=3, logical_pages=8, max_num_batched_tokens=4, beam_width=3,
                    scheduler=implementation)
    result = engine.run(_requests([1, 1], 2), check=True)
    st_ = result.stats
    assert result.check.ok and st_["forks"] == 3
    assert st_["peak_held_pages"] == 5 and st_["peak_unshared_pages"] == 5
    assert st_["pages_saved_at_peak"] == 0


@pytest.mark.parametrize("implementation,caching", [("auto", "off"), ("auto", "auto"),
                                                    ("twin", "auto")])
def test_pages_saved_leaves_out_a_copy_source_only_the_plan_holds(implementation, caching):
    # a pool of 4 pages, n=2: prompts of 3 tokens (one full page) and 1 token (a partial page
    # its fork shares).  The next schedule gives request 0 a new page and copies request 1's
    # shared page away, which fills the pool, so both children are preempted; the copy owed
    # holds that page until the plan is applied, yet no request does: 3 pages held, not 4
    engine = Engine("c", num_pages=4, max_num_seqs=4, page_tokens=3, logical_pages=8, n=2,
                    prefix_caching=caching, scheduler=implementation)
    st_ = engine.run([Request(0, 0, [7, 7, 7], 0, 2), Request(1, 0, [8], 0, 2)],
                     check=True).stats
    assert st_["check_ok"] and st_["preemptions"] == 2 and st_["pages_copied"] == 1
    assert st_["peak_held_pages"] == 3 and st_["peak_unshared_pages"] == 3
    assert st_["pages_saved_at_peak"] == 0


@pytest.mark.parametrize("implementation", ["auto", "twin"])
def test_pages_saved_keeps_the_running_beams_when_a_preemption_parks_one(implementation):
    # three slots for groups of 3 beams, a 4-token budget, 12 pages: a preemption parks a
    # computed beam while a beam of its group that waits for a sibling (in no plan) and another
    # request's beam keep running; the next step, which admits another beam, is the peak: 17
    # pages the running beams would hold apart, 12 held, though two of them are in no plan
    engine = Engine("model", model_config=CONFIG, num_pages=12, max_num_seqs=3,
                    page_tokens=3, logical_pages=8, max_num_batched_tokens=4, beam_width=3,
                    eos_token_id=3, scheduler=implementation)
    result = engine.run(_requests([7, 13, 12, 4], 4), check=True)
    st_ = result.stats
    assert result.check.ok and st_["beams_parked"] > 0 and st_["preemptions"] > 0
    assert st_["peak_unshared_pages"] == 17 and st_["pages_saved_at_peak"] == 5
    assert st_["peak_held_pages"] == 12


class TableWatch:
    """A step scheduler whose every ``schedule()`` also reads every request's block table:
    the pages the running sequences hold (each page once) and the sum of their tables'
    lengths, what they would hold with nothing shared."""

    def __init__(self, s):
        self._s = s
        self.held = self.unshared = -1  # right after the last schedule

    def __getattr__(self, name):
        return getattr(self._s, name)

    def schedule(self):
        plan = self._s.schedule()
        tables = [self._s.request_pages(rid).tolist() for rid in set(self._s.requests())]
        self.held = len({p for t in tables for p in t})
        self.unshared = sum(map(len, tables))
        return plan


@settings(max_examples=200, deadline=None, derandomize=True)
@given(kind=st.sampled_from(["n", "beam"]), width=st.integers(2, 4),
       lengths=st.lists(st.integers(1, 14), min_size=1, max_size=4),
       max_new=st.integers(1, 5), num_pages=st.integers(4, 24), spare_seqs=st.integers(0, 2),
       budget=st.sampled_from([3, 4, 9, 64]), end_token=st.sampled_from([None, 3]),
       implementation=st.sampled_from(["auto", "twin"]))
def test_pages_saved_is_the_block_tables_at_the_peak(kind, width, lengths, max_new, num_pages,
                                                     spare_seqs, budget, end_token,
                                                     implementation):
    """After every step the page figures equal the running sequences' block tables read right
    after each schedule so far: the most held, the most unshared, and at the first step with
    that most the difference, never negative (preemption, copies, fork fallbacks, parked
    beams)."""
    kw = dict(n=width) if kind == "n" else dict(beam_width=width)
    engine = Engine("model", model_config=CONFIG, num_pages=num_pages,
                    max_num_seqs=width + spare_seqs, page_tokens=3, logical_pages=8,
                    max_num_batched_tokens=budget, eos_token_id=end_token,
                    sampling=HOT if kind == "n" else None, scheduler=implementation, **kw)
    try:
        for r in _requests(lengths, max_new):
            engine.submit(r)
    except ValueError:  # a request or beam group that never fits this pool
        return
    watch = engine.scheduler = TableWatch(engine.scheduler)
    c = engine.counters
    peak_held = peak_unshared = saved = 0
    while engine.pending:
        engine.step()
        peak_held = max(peak_held, watch.held)
        if watch.unshared > peak_unshared:
            peak_unshared, saved = watch.unshared, watch.unshared - watch.held
        assert (c.peak_held_pages, c.peak_unshared_pages, c.pages_saved_at_peak) == \
            (peak_held, peak_unshared, saved)
        assert saved >= 0
