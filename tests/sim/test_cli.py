"""``qualia`` / ``python -m qualia``: simulate end to end, bad arguments, output paths, memory,
Ctrl-C, the usage line and the honesty of the summary's time rows."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

import qualia
import qualia.cli.main as cli
from qualia.cli.main import main
from qualia.sim import config as preflight
from qualia.sim.timing import ROWS

SMALL_CLI = ["--requests", "16", "--prompt-len", "16,40", "--output-len", "6,16",
             "--system-prompts", "2", "--system-prompt-len", "20", "--share-ratio", "0.8",
             "--arrival-rate", "250", "--num-pages", "32", "--max-num-seqs", "10",
             "--page-tokens", "8", "--logical-pages", "8",
             "--turns", "1", "--no-progress"]


def _no_run(monkeypatch):
    """Make any attempt to build or run an engine fail the test."""
    from qualia.sim import engine as engine_mod

    def refuse(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(engine_mod.Engine, "__init__", refuse)


# -- runs -------------------------------------------------------------------------------------


VLLM_KEYS = ("completed", "duration", "total_input_tokens", "total_output_tokens",
             "request_throughput", "output_throughput", "total_token_throughput",
             *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
               for s in ("mean", "median", "std", "p99")))


def test_cli_simulate_check_json(tmp_path, capsys):
    path = tmp_path / "run.json"
    rc = main(["simulate", *SMALL_CLI, "--check", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "all 16 requests match the dense model" in out
    for label in ("Successful requests:", "Benchmark duration (s):", "Mean TTFT (ms):",
                  "P99 TPOT (ms):", "Median ITL (ms):", "Std E2EL (ms):", "tokens", "steps",
                  "step budget", "prefix cache hit rate", "preemptions", "pool",
                  "scheduler (step API calls)", "backend: PagedModelBackend (numpy)",
                  "engine loop (Python)", "workload generation", "wall time"):
        assert label in out
    assert f"wrote {path}" in out
    data = json.loads(path.read_text())
    for key in VLLM_KEYS:  # vLLM's figures under vLLM's names
        assert isinstance(data[key], (int, float)), key
    assert data["completed"] == 16 and data["total_output_tokens"] > 0
    rows = data["requests"]  # one record per request: arrival, first token, finish, tokens
    assert [r["request_id"] for r in rows] == list(range(16))
    for r in rows:
        assert r["arrival_s"] <= r["first_token_s"] <= r["finish_s"] <= data["duration"]
        assert r["input_tokens"] > 0 and r["output_tokens"] > 0
    assert sum(r["output_tokens"] for r in rows) == data["total_output_tokens"]
    st = data["stats"]
    assert st["requests_completed"] == 16 and st["check_ok"] is True
    assert data["check"]["ok"] is True and data["check"]["checked"] == 16
    assert data["check"]["message"] == "all 16 requests match the dense model"
    assert data["config"]["num_pages"] == 32 and data["config"]["prompt_len"] == [16, 40]
    assert data["config"]["backend"] == "model" and data["config"]["clock"] == "modeled"
    for key in ("tokens_generated", "steps", "prefix_cache_hit_rate", "preemptions",
                "peak_pool_use", "sched_us_per_step_p50", "sched_us_per_step_p99",
                "backend_us_per_step_p50", "backend_us_per_step_p99", "wall_s", "time_s",
                "mean_ttft_steps", "median_tpot_steps", "p99_e2el_steps", "clock"):
        assert key in st
    assert st["median_ttft_steps"] <= st["p99_ttft_steps"] and st["median_ttft_steps"] >= 1
    assert st["preemptions"] > 0 and st["prefix_hits"] > 0
    assert sum(st["time_s"].values()) == pytest.approx(st["wall_s"], rel=1e-9)


def _zero_everywhere(runs):
    """The JSON stats' fields that are zero in every one of ``runs``."""
    keys = set.intersection(*(set(r["stats"]) for r in runs))
    return sorted(k for k in keys if all(r["stats"][k] in (0, 0.0, False) for r in runs))


def test_the_json_carries_no_field_that_is_always_zero(tmp_path, capsys):
    runs = []
    for extra in ([], ["--backend", "c", "--prefix-caching", "off", "--turns", "1"],
                  ["--n", "2", "--max-num-seqs", "4", "--eos-token-id", "7"],
                  ["--beam-width", "2"],
                  ["--arrival-rate", "inf", "--num-pages", "12", "--max-num-seqs", "6"]):
        assert main(["simulate", *SMALL_CLI, "--requests", "6", *extra, "--json", "-"]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    # counters a simulation can move: in some runs, not in every one
    assert _zero_everywhere(runs) == []


def test_cli_c_backend_json_stdout(capsys):
    rc = main(["simulate", "--backend", "c", "--requests", "200", "--arrival-rate", "inf",
               "--check", "--json", "-", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0
    data = json.loads(captured.out)
    # 200 conversations of the default 2 turns, automatic prefix caching
    assert data["stats"]["requests_completed"] == 400
    assert data["stats"]["follow_up_turns"] == 200
    assert data["stats"]["prefix_caching"] == "auto" and data["stats"]["cache_hit_tokens"] > 0
    assert data["stats"]["backend"] == "HashBackend (C)"
    assert data["check"]["ok"] and data["config"]["arrival_rate"] == "inf"


def test_cli_rejects_what_cannot_fit(capsys):
    rc = main(["simulate", "--requests", "4", "--prompt-len", "100,120", "--logical-pages", "4",
               "--no-progress", "--backend", "c"])
    assert rc == 2
    err = capsys.readouterr().err
    # the options in the words of the command line, not the scheduler's keywords
    assert "can never be served" in err and "(--logical-pages)" in err
    assert "logical_pages" not in err and "max_new_tokens" not in err
    with pytest.raises(SystemExit):
        main(["simulate", "--prompt-len", "9,3"])


def test_cli_quiet_and_demo(capsys):
    assert main(["simulate", *SMALL_CLI, "--backend", "c", "--quiet"]) == 0
    assert capsys.readouterr().out == ""
    assert main(["demo", "--no-progress", "--backend", "c"]) == 0
    # 12 conversations of 2 turns
    assert "all 24 requests match the pure-Python hash rule" in capsys.readouterr().out


def test_cli_exit_status_on_failed_check(monkeypatch, capsys):
    from qualia.sim import engine as engine_mod
    from qualia.sim.check import CheckResult

    def bad_check(self, on_checked=None):
        return CheckResult(False, len(self.outputs), [0], "pure-Python hash rule")

    monkeypatch.setattr(engine_mod.Engine, "check", bad_check)
    assert main(["simulate", *SMALL_CLI, "--backend", "c", "--check"]) == 1
    assert "DIFFER" in capsys.readouterr().out
    assert main(["simulate", *SMALL_CLI, "--backend", "c", "--check", "--quiet"]) == 1
    assert "check FAILED" in capsys.readouterr().err


# -- the summary is honest about time ---------------------------------------------------------


def test_cli_rows_add_up_to_a_wall_time_that_includes_the_workload(monkeypatch, tmp_path,
                                                                   capsys):
    from qualia.sim.workload import Workload

    slept = [0.0]
    generate = Workload.generate

    def slow_generate(self):
        t0 = time.perf_counter()
        time.sleep(0.3)
        slept[0] += time.perf_counter() - t0
        return generate(self)

    monkeypatch.setattr(Workload, "generate", slow_generate)
    path = tmp_path / "run.json"
    t0 = time.perf_counter()
    rc = main(["simulate", *SMALL_CLI, "--backend", "c", "--check", "--json", str(path)])
    elapsed = time.perf_counter() - t0
    assert rc == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines() if not line.startswith("wrote ")) <= 80
    st = json.loads(path.read_text())["stats"]
    t = st["time_s"]
    assert set(t) == set(ROWS)
    assert t["workload"] >= slept[0] >= 0.3  # generation is in the run, in its own row
    assert t["check"] == st["check_s"] > 0
    # every second in exactly one row: the rows add up to the wall time, which holds the
    # workload's generation and lies within the command's own time
    assert sum(t.values()) == pytest.approx(st["wall_s"], rel=1e-9)
    assert slept[0] <= st["wall_s"] <= elapsed


# -- bad arguments: each message names its own option, exit 2 -------------------------------

INT_OPTIONS = {  # option: (below its minimum, above its maximum)
    "--requests": ("-1", str(2**63)),
    "--seed": ("-1", str(2**64)),
    "--system-prompts": ("-1", str(2**32)),
    "--system-prompt-len": ("0", str(2**32)),
    "--tenants": ("0", str(2**32)),
    "--eos-token-id": ("-1", str(2**32)),
    "--num-pages": ("0", str(2**32)),
    "--max-num-seqs": ("0", "65537"),
    "--page-tokens": ("0", str(2**32)),
    "--logical-pages": ("0", str(2**32)),
    "--max-num-batched-tokens": ("0", str(2**32)),
    "--max-prefill-chunk": ("0", str(2**32)),
}


@pytest.mark.parametrize("option", sorted(INT_OPTIONS))
def test_integer_bounds_name_their_option(option, capsys):
    for value in (*INT_OPTIONS[option], "x"):
        with pytest.raises(SystemExit) as exc:
            main(["simulate", option, value])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {option}:" in err, err
        others = [o for o in INT_OPTIONS if o != option and o not in option]
        assert not any(o in err.split("error:")[-1] for o in others), err


def test_seed_minus_one_names_seed(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--seed", "-1"])
    err = capsys.readouterr().err
    message = err.split("error:")[-1]
    assert "argument --seed: must be >= 0, got -1" in message and "--num-pages" not in message


def test_end_token_outside_the_vocabulary(capsys):
    assert main(["simulate", "--eos-token-id", "512", "--no-progress"]) == 2
    assert "--eos-token-id" in capsys.readouterr().err
    assert main(["simulate", "--eos-token-id", "511", "--requests", "2", "--no-progress",
                 "-q"]) == 0


@pytest.mark.parametrize("rate", ["1e-300", "5e-324", "0", "-1", "nan", "-inf", "1e-7"])
def test_arrival_rate_bounds(rate, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", f"--arrival-rate={rate}", "--backend", "c"])
    assert exc.value.code == 2
    assert "argument --arrival-rate: must be >= 1e-06" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--arrival-rate", "-inf"], "argument --arrival-rate: must be >= 1e-06"),
    (["--arrival-rate", "-1e5"], "argument --arrival-rate: must be >= 1e-06"),
    (["--arrival-rate", "-NaN"], "argument --arrival-rate: must be >= 1e-06"),
    (["--step-ms", "-1e-3"], "argument --step-ms: must be >= 0.001"),
    (["--temperature", "-inf"], "argument --temperature: must be a finite number >= 0"),
    (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
])
def test_a_negative_number_after_a_space_is_the_options_value(argv, says, capsys):
    """``--option -inf`` reads as ``--option=-inf``: its type refuses it, not argparse as a
    missing value."""
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--backend", "c", *argv])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("argv, option", [
    (["--requests", "1_0"], "--requests"), (["--arrival-rate", "1_0"], "--arrival-rate"),
    (["--output-len", "1_0,20"], "--output-len"), (["--seed", "\u0661"], "--seed"),
])
def test_numbers_on_the_command_line_are_plain_decimal_digits(argv, option, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--backend", "c", *argv])
    assert exc.value.code == 2
    assert f"argument {option}: expected" in capsys.readouterr().err


def test_smallest_arrival_rate_runs(capsys):
    assert main(["simulate", "--arrival-rate", "1e-6", "--requests", "3", "--backend", "c",
                 "--turns", "1", "--json", "-", "--no-progress"]) == 0
    st = json.loads(capsys.readouterr().out)["stats"]
    # 3 requests about a million seconds apart: the serving clock jumps the gaps
    assert st["requests_completed"] == 3 and st["idle_s"] > 10**5 and st["steps"] < 1000


# -- output paths are checked before the run --------------------------------------------------


def test_json_path_checked_before_the_run(tmp_path, monkeypatch, capsys):
    _no_run(monkeypatch)
    a_file = tmp_path / "file"
    a_file.write_text("")
    bad = {
        "/nonexistent/x.json": "does not exist",
        str(tmp_path): "is a directory",
        str(a_file / "x.json"): "is not a directory",
    }
    for path, why in bad.items():
        assert main(["simulate", "--backend", "c", "--no-progress", "--json", path]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--json" in err and why in err, err
        assert "Traceback" not in err


def test_json_path_in_a_read_only_directory(tmp_path, monkeypatch, capsys):
    _no_run(monkeypatch)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if getattr(os, "geteuid", lambda: -1)() == 0:  # root writes anywhere: deny it here
        access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: (
            os.path.abspath(path) != str(ro) and access(path, mode, **kw)))
    try:
        assert main(["simulate", "--backend", "c", "--json", str(ro / "x.json")]) == 2
        assert "not writable" in capsys.readouterr().err
    finally:
        ro.chmod(0o700)


# -- memory is estimated before it is committed -----------------------------------------------


def test_huge_pools_are_refused_before_allocating(monkeypatch, capsys):
    _no_run(monkeypatch)
    # a model pool of 2**32 - 1 pages needs ~128 TiB of KV: no machine holds it
    assert main(["simulate", "--num-pages", "4294967295", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "memory" in err and "--num-pages" in err and err.count("\n") == 1
    # page tokens x logical pages sizes the token scratch: 2**64 tokens
    assert main(["simulate", "--backend", "c", "--page-tokens", "4294967295",
                 "--logical-pages", "4294967295"]) == 2
    assert "--logical-pages x --page-tokens" in capsys.readouterr().err
    # the C backend's pool of 2**32 - 1 pages is 32 GiB: refused on a machine with 8 GiB free
    monkeypatch.setattr(preflight, "available_memory", lambda: 8 * 2**30)
    assert main(["simulate", "--backend", "c", "--num-pages", "4294967295",
                 "--prefix-caching", "off"]) == 2
    err = capsys.readouterr().err
    assert "32.0 GiB" in err and "8.0 GiB available" in err and "--num-pages" in err
    # with automatic caching, the cache's page records are the largest part
    assert main(["simulate", "--backend", "c", "--num-pages", "4294967295"]) == 2
    err = capsys.readouterr().err
    assert "prefix cache" in err and "--num-pages x --page-tokens" in err
    assert main(["simulate", "--backend", "c", "--requests", str(10**9)]) == 2
    assert "--requests" in capsys.readouterr().err


def test_system_prompts_are_counted_before_they_are_drawn(monkeypatch, capsys):
    # K system prompts are drawn before the run whatever --requests is: the preflight counts
    # them and names their options
    _no_run(monkeypatch)
    assert main(["simulate", "--backend", "c", "--requests", "4", "--turns", "1",
                 "--system-prompts", "4294967295", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "system prompts" in err and "--system-prompts x --system-prompt-len" in err
    assert err.count("\n") == 1


def test_memory_error_is_a_clean_exit_2(monkeypatch, capsys):
    from qualia.sim import engine as engine_mod

    def oom(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(engine_mod.Engine, "__init__", oom)
    assert main(["simulate", "--backend", "c"]) == 2
    err = capsys.readouterr().err
    assert "out of memory" in err and "Traceback" not in err


def test_the_estimate_counts_the_model_kv():
    from qualia.model import ModelConfig
    from qualia.sim.resources import memory_estimate

    c = ModelConfig()
    parts = memory_estimate("model", num_pages=1000, page_tokens=16)
    assert parts["model KV"] == 1000 * 16 * c.layers * 2 * c.heads * c.head_dim * 8
    assert "model KV" not in memory_estimate("c", num_pages=1000)
    assert preflight.available_memory() is None or preflight.available_memory() > 0


# -- usage, version, help ---------------------------------------------------------------------


def _run(args, **kwargs):
    return subprocess.run(args, capture_output=True, text=True, timeout=120, **kwargs)


def test_usage_names_how_it_was_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert qualia.__version__ in capsys.readouterr().out
    assert cli.build_parser("qualia").format_usage().startswith("usage: qualia ")
    r = _run([sys.executable, "-m", "qualia", "--help"], cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m qualia ")
    assert "demo" in r.stdout and "simulate" in r.stdout
    script = shutil.which("qualia", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the console script is not installed beside this interpreter")
    r = _run([script, "--help"], cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("usage: qualia "), r.stdout
    r = _run([script, "simulate", "--seed", "-1"], cwd=tmp_path)
    assert r.returncode == 2 and "usage: qualia simulate" in r.stderr


# -- Ctrl-C -----------------------------------------------------------------------------------


def _cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process")
def test_ctrl_c_stops_cleanly(tmp_path):
    # a long run: one slot, long outputs, so that the interrupt lands in the middle of it
    args = [sys.executable, "-m", "qualia", "simulate", "--backend", "c", "--requests", "50",
            "--prompt-len", "4,8", "--output-len", "20000,40000", "--max-num-seqs", "1",
            "--num-pages", "4096", "--logical-pages", "4096", "--no-progress"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        if os.path.exists(f"/proc/{proc.pid}/stat"):  # past start-up: into the run itself
            while _cpu_seconds(proc.pid) < 1.0 and time.monotonic() < deadline:
                assert proc.poll() is None, proc.communicate()
                time.sleep(0.05)
        else:  # pragma: no cover
            time.sleep(3)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # pragma: no cover
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, (out, err)
    assert err == "qualia: interrupted\n" and out == ""


def test_cli_multi_turn_auto_caching_check(tmp_path, capsys):
    """The default: conversations of several turns, automatic prefix caching, checked against
    the dense model; the summary shows the cached-token hit rate, reclaims and events."""
    path = tmp_path / "run.json"
    small = [a for a in SMALL_CLI if a not in ("--turns", "1")]
    rc = main(["simulate", *small, "--turns", "3", "--logical-pages", "16", "--check",
               "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0
    for label in ("prefix cache hit rate", "of prompt tokens", "reclaims", "KV events",
                  "conversations", "16 conversations x 3 turns = 48 requests"):
        assert label in out
    st = json.loads(path.read_text())["stats"]
    assert st["check_ok"] is True and st["follow_up_turns"] > 0
    assert st["requests_completed"] == 16 + st["follow_up_turns"]
    assert st["cache_hit_tokens"] > 0 and st["cache_reclaims"] > 0
    assert st["kv_events_stored"] > 0 and st["kv_events_dropped"] == 0


def test_cli_prefix_caching_off(capsys):
    assert main(["simulate", *SMALL_CLI, "--prefix-caching", "off", "--check"]) == 0
    out = capsys.readouterr().out
    assert "prefix caching          off" in out and "cached tokens" not in out


# -- the step budget, traces, plots -----------------------------------------------------------


def test_cli_step_budget_and_chunk(capsys):
    rc = main(["simulate", *SMALL_CLI, "--backend", "c", "--max-num-batched-tokens", "24",
               "--max-num-seqs", "6", "--max-prefill-chunk", "8", "--check", "--json", "-"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    st = data["stats"]
    assert data["check"]["ok"]
    assert st["max_num_batched_tokens"] == 24 and st["max_num_seqs"] == 6
    assert st["max_prefill_chunk"] == 8
    assert 0 < st["max_step_tokens"] <= 24 and st["max_step_seqs"] <= 6
    assert st["mixed_steps"] > 0  # decodes and prefill chunks in one step
    assert data["config"]["max_prefill_chunk"] == 8
    assert data["config"]["max_num_batched_tokens"] == 24


@pytest.mark.parametrize("new, old", [
    ("--max-num-seqs", "--max-seqs"), ("--max-num-seqs", "--max-requests"),
    ("--max-num-batched-tokens", "--max-batched-tokens"), ("--max-prefill-chunk", "--chunk"),
    ("--num-pages", "--num-blocks"), ("--eos-token-id", "--end-token")])
def test_older_option_spellings_are_hidden_aliases(new, old, capsys):
    parser = cli.build_parser("qualia")
    dest = new[2:].replace("-", "_")
    assert getattr(parser.parse_args(["simulate", old, "7"]), dest) == 7
    assert getattr(parser.parse_args(["simulate", new, "7"]), dest) == 7
    sim = parser._subparsers._group_actions[0].choices["simulate"]
    text = sim.format_help()
    assert new in text and old not in text
    with pytest.raises(SystemExit):
        parser.parse_args(["simulate", old, "0" if new != "--eos-token-id" else "-1"])
    assert f"argument {old}: must be >= " in capsys.readouterr().err


def test_cli_prefix_caching_explicit_is_gone(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--prefix-caching", "explicit"])
    assert exc.value.code == 2


def _write(path, text):
    path.write_text(text)
    return str(path)


def test_cli_trace_plain_form_check_json(tmp_path, capsys):
    rows = ["arrival_s,prompt_tokens,output_tokens,prefix_group,prefix_tokens"]
    rows += [f"{i * 0.002:.3f},{20 + i},{3 + i % 4},{'sys' if i % 2 else ''},"
             f"{16 if i % 2 else ''}" for i in range(12)]
    trace = _write(tmp_path / "t.csv", "\n".join(rows) + "\n")
    rc = main(["simulate", "--trace", trace, "--backend", "c", "--page-tokens", "8",
               "--step-ms", "1", "--check", "--json", "-", "--no-progress"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    st = data["stats"]
    assert data["check"]["ok"] and st["requests_completed"] == 12
    assert data["config"]["trace"] == trace and data["config"]["trace_form"] == "plain"
    assert st["prefix_hits"] >= 5  # every later row of the group finds its 16 tokens cached
    assert st["tokens_generated"] == sum(3 + i % 4 for i in range(12))
    assert data["duration"] >= 11 * 0.002  # the clock reached the last arrival
    assert data["config"]["clock"] == "fixed" and st["clock"] == "fixed: 1 ms per step"


def test_cli_trace_azure_form(tmp_path, capsys):
    trace = _write(tmp_path / "azure.csv",
                   "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                   "2023-11-16 18:15:46.6805900,40,5\n"
                   "2023-11-16 18:15:46.6905900,30,4\n"
                   "2023-11-16 18:15:47.0000000,50,6\n")
    rc = main(["simulate", "--trace", trace, "--step-ms", "1", "--check", "--json", "-",
               "--no-progress"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["check"]["ok"] and data["stats"]["requests_completed"] == 3
    assert data["config"]["trace_form"] == "azure"
    assert data["duration"] == pytest.approx(0.32, abs=0.05)  # the arrivals span 0.3194 s


def test_cli_trace_errors_name_file_and_line(tmp_path, capsys):
    _ = tmp_path
    bad = _write(tmp_path / "bad.csv", "arrival_s,prompt_tokens,output_tokens\n0,10,2\n1,x,2\n")
    assert main(["simulate", "--trace", bad, "--backend", "c", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:3:" in err and "prompt_tokens" in err and err.count("\n") == 1
    missing = str(tmp_path / "nope.csv")
    assert main(["simulate", "--trace", missing, "--backend", "c", "--no-progress"]) == 2
    assert missing in capsys.readouterr().err
    big = _write(tmp_path / "big.csv", "arrival_s,prompt_tokens,output_tokens\n0,1000,2\n")
    assert main(["simulate", "--trace", big, "--num-pages", "32", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--trace {big}:2: request 0 can never be served" in err
    assert "the pool has only 32 pages (--num-pages)" in err


def test_cli_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "run.png"
    assert main(["simulate", *SMALL_CLI, "--backend", "c", "--plot", str(path), "-q"]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plot_without_matplotlib_is_refused_before_the_run(tmp_path, monkeypatch, capsys):
    _no_run(monkeypatch)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["simulate", "--backend", "c", "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and 'pip install ".[plot]"' in err and "Traceback" not in err
    assert main(["simulate", "--backend", "c", "--plot", "/nonexistent/x.png"]) == 2
    assert "--plot" in capsys.readouterr().err


# -- every mistake is refused before the run, in one line -----------------------------------------


def _refused(argv, capsys):
    """Run ``qualia simulate argv`` (argparse's own refusals included); exit status and stderr."""
    try:
        rc = main(["simulate", "--no-progress", *argv])
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def test_a_trace_row_is_refused_by_its_line_before_its_prompt_is_drawn(tmp_path, monkeypatch,
                                                                        capsys):
    from qualia.sim.trace import Trace

    _no_run(monkeypatch)

    def no_draw(self):
        raise AssertionError("a prompt was drawn")

    monkeypatch.setattr(Trace, "generate", no_draw)
    trace = _write(tmp_path / "t.csv",
                   "arrival_s,prompt_tokens,output_tokens\n0,10,2\n\n0,4294967295,1\n")
    rc, err = _refused(["--trace", trace, "--backend", "c"], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert f"--trace {trace}:4: request 1 can never be served" in err
    assert "4294967295 tokens" in err and "--num-pages" in err


def test_a_header_only_trace_is_refused(tmp_path, monkeypatch, capsys):
    _no_run(monkeypatch)
    trace = _write(tmp_path / "t.csv", "arrival_s,prompt_tokens,output_tokens\n\n")
    rc, err = _refused(["--trace", trace, "--backend", "c"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "no requests to serve" in err and trace in err


@pytest.mark.parametrize("argv, option", [(["--requests", "0"], "--requests"),
                                          (["--json", ""], "--json"),
                                          (["--plot", ""], "--plot"),
                                          (["--trace", " "], "--trace")])
def test_nothing_to_do_and_empty_paths_are_refused(argv, option, monkeypatch, capsys):
    _no_run(monkeypatch)
    rc, err = _refused(argv, capsys)
    assert rc == 2 and f"argument {option}:" in err


def test_the_plot_format_is_checked_before_the_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    _no_run(monkeypatch)
    for name, why in (("out.txt", "does not write .txt files"),
                      ("out", "needs an extension")):
        rc, err = _refused(["--backend", "c", "--plot", str(tmp_path / name)], capsys)
        assert rc == 2 and err.count("\n") == 1 and "--plot" in err and why in err, err
        assert "png" in err and "svg" in err


def test_a_trace_of_more_tenants_than_namespace_ids_runs(tmp_path, capsys):
    rows = ["arrival_s,prompt_tokens,output_tokens,tenant"]
    rows += [f"{i * 0.001:.3f},{20 + i % 30},{2 + i % 3},{i}" for i in range(1100)]
    trace = _write(tmp_path / "t.csv", "\n".join(rows) + "\n")
    rc = main(["simulate", "--backend", "c", "--trace", trace, "--num-pages", "4096",
               "--step-ms", "1", "--check", "--json", "-", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    data = json.loads(captured.out)
    assert data["check"]["ok"] and data["stats"]["requests_completed"] == 1100


def _closed_pipe(args, cwd):
    """Run ``python -m qualia args`` in ``cwd`` (outside the checkout, whose source folder would
    hide the installed package) with its stdout a pipe whose reader has already gone (as
    ``| head -1`` leaves it); the exit status and stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "qualia", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd)
    proc.stdout.close()
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # pragma: no cover
            proc.kill()
    return proc.returncode, err


@pytest.mark.parametrize("extra", [[], ["--json", "-"],
                                   ["--replicas", "2", "--local", "--json", "-"]])
def test_output_into_a_closed_pipe_ends_quietly(extra, tmp_path):
    rc, err = _closed_pipe(["simulate", "--backend", "c", "--requests", "4", "--no-progress",
                            *extra], tmp_path)
    assert rc == cli.EXIT_BROKEN_PIPE == 141
    assert err == ""


def test_both_paths_share_one_validation(monkeypatch, capsys):
    from qualia.sim import config as preflight

    def refuse(args, clock=None):
        raise preflight.Refused("checked once, here")

    monkeypatch.setattr(preflight, "check_simulate", refuse)
    for extra in ([], ["--replicas", "2", "--local"]):
        rc, err = _refused(["--backend", "c", *extra], capsys)
        assert (rc, err) == (2, "error: checked once, here\n")


def test_plot_and_json_into_one_file_are_refused(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    _no_run(monkeypatch)
    path = str(tmp_path / "run.png")
    rc, err = _refused(["--backend", "c", "--json", path, "--plot", path], capsys)
    assert rc == 2 and "argument --plot" in err and "--json" in err and err.count("\n") == 1


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e308", "3600000.1", "5e-324"])
def test_step_ms_moves_the_clock_by_at_most_an_hour(value, monkeypatch, capsys):
    _no_run(monkeypatch)
    rc, err = _refused(["--backend", "c", f"--step-ms={value}"], capsys)
    assert rc == 2 and "argument --step-ms: must be >= 0.001 (a microsecond) and <= 3,600,000" \
        in err


@pytest.mark.parametrize("value", ["1e-320", "1e-12", "0.0009"])
def test_a_step_shorter_than_a_microsecond_is_refused_as_it_cannot_move_the_clock(
        value, monkeypatch, capsys):
    from qualia.sim.clock import FixedClock, serving_clock
    from qualia.sim.engine import Engine

    seconds = float(value) / 1e3
    with pytest.raises(ValueError, match="seconds must be in"):
        FixedClock(seconds)
    with pytest.raises(ValueError, match="seconds must be in"):
        serving_clock(seconds)
    with pytest.raises(ValueError, match="step_seconds must be a finite number >= 0.000001"):
        Engine("c", step_seconds=seconds)
    # the shortest step still moves a clock at the latest arrival a run may have
    assert 1e9 + FixedClock(1e-6).step_time(None, 0.0) > 1e9
    _no_run(monkeypatch)
    rc, err = _refused(["--backend", "c", f"--step-ms={value}"], capsys)
    assert rc == 2 and "argument --step-ms: must be >= 0.001 (a microsecond)" in err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("extra", [[], ["--json", "-"], ["--replicas", "2", "--local"]])
def test_output_that_cannot_be_written_is_one_error_line(extra, tmp_path):
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "qualia", "simulate", "--backend", "c",
                            "--requests", "4", "--no-progress", *extra], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 1
    assert r.stderr == "error: cannot write the output: No space left on device\n"


def test_a_failed_run_is_one_error_line_and_exit_1(monkeypatch, capsys):
    from qualia.errors import PrefixCacheError
    from qualia.sim import engine as engine_mod

    for exc, says in ((RuntimeError("engine stuck: 65 steps"), "engine stuck: 65 steps"),
                      (PrefixCacheError.NamespaceTableFull(None, "x"), "NamespaceTableFull")):
        def fail(self, *args, _exc=exc, **kwargs):
            raise _exc

        monkeypatch.setattr(engine_mod.Engine, "run", fail)
        rc, err = _refused(["--backend", "c"], capsys)
        assert rc == 1 and err.startswith("error: the run failed: ") and says in err
        assert err.count("\n") == 1


# -- the serving clock, the figures, sizing a trace from the profile ---------------------------


def _json_run(argv, capsys):
    assert main(["simulate", "--no-progress", *argv, "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_modeled_clock_is_the_default_and_is_deterministic(capsys):
    argv = [*SMALL_CLI, "--backend", "c"]
    a, b = _json_run(argv, capsys), _json_run(argv, capsys)
    assert a["stats"]["clock"].startswith("modeled llama3.1-8b on one H100")
    assert a["config"]["clock"] == "modeled" and a["config"]["profile"] == "llama3.1-8b-h100"
    for key in VLLM_KEYS:
        assert a[key] == b[key], key
    assert a["requests"] == b["requests"]


@pytest.mark.parametrize("argv, says", [
    (["--profile", "llama3.2-1b-a100"], "modeled llama3.2-1b on one A100 SXM 80GB"),
    (["--clock", "measured"], "measured: each step's time on this machine's CPU"),
    (["--step-ms", "2"], "fixed: 2 ms per step")])
def test_the_summary_names_the_clock(argv, says, capsys):
    assert main(["simulate", *SMALL_CLI, "--backend", "c", *argv]) == 0
    out = capsys.readouterr().out
    clock = next(line for line in out.splitlines() if line.startswith("clock "))
    assert says in clock


@pytest.mark.parametrize("seconds, says", [
    (3600.0, "fixed: 3,600,000 ms per step"), (1e-6, "fixed: 0.001 ms per step"),
    (0.017, "fixed: 17 ms per step"), (12.3456789, "fixed: 12,345.6789 ms per step"),
    (1e-5 / 3, "fixed: 0.00333333333333 ms per step")])
def test_the_fixed_clock_is_described_without_scientific_notation(seconds, says, capsys):
    from qualia.sim.clock import FixedClock, plain_number

    assert FixedClock(seconds).describe() == says
    assert plain_number(1e-12) == "0.000000000001" and plain_number(2.5e21) == \
        "2,500,000,000,000,000,000,000"
    if seconds == 3600.0:
        assert main(["simulate", *SMALL_CLI, "--backend", "c", "--step-ms", "3600000"]) == 0
        assert "fixed: 3,600,000 ms per step" in capsys.readouterr().out


def test_a_faster_gpu_profile_serves_the_same_requests_sooner(capsys):
    argv = [*SMALL_CLI, "--backend", "c", "--arrival-rate", "inf"]
    h100 = _json_run([*argv, "--profile", "llama3.1-8b-h100"], capsys)
    a100 = _json_run([*argv, "--profile", "llama3.1-8b-a100"], capsys)
    assert h100["total_output_tokens"] == a100["total_output_tokens"]
    assert h100["duration"] < a100["duration"]
    assert h100["mean_tpot_ms"] < a100["mean_tpot_ms"]


def test_a_mistyped_profile_names_the_close_matches(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--profile", "llama3.1-8b-h10"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --profile: unknown profile 'llama3.1-8b-h10'" in err
    assert "did you mean 'llama3.1-8b-h100'" in err


def test_step_ms_is_a_clock_of_its_own(monkeypatch, capsys):
    _no_run(monkeypatch)
    rc, err = _refused(["--backend", "c", "--step-ms", "1", "--clock", "measured"], capsys)
    assert rc == 2 and "argument --step-ms: not with --clock measured" in err


def test_arrival_rate_counts_requests_per_second(capsys):
    data = _json_run(["--backend", "c", "--requests", "40", "--turns", "1", "--arrival-rate",
                      "10", "--seed", "3"], capsys)
    arrivals = [r["arrival_s"] for r in data["requests"]]
    # 40 Poisson arrivals at 10 a second: about 4 s, whatever a step takes
    assert 2.0 < max(arrivals) < 8.0
    assert data["config"]["arrival_rate"] == 10.0


def test_the_output_says_up_front_how_many_requests_turns_make(capsys):
    assert main(["simulate", *SMALL_CLI, "--backend", "c", "--requests", "12", "--turns",
                 "2", "--logical-pages", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = next(i for i, line in enumerate(lines) if "Serving Benchmark Result" in line)
    head = "\n".join(lines[:table])
    assert "12 conversations x 2 turns = 24 requests" in head
    assert next(line for line in lines if line.startswith("Successful requests:")).split()[-1] \
        == "24"


AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _azure_trace(tmp_path, rows=40, seed=0):
    """An Azure-format trace of ``rows`` conversation-like requests, 0.2 s apart, prompts of
    hundreds to thousands of tokens."""
    import random

    rng = random.Random(seed)
    lines = [f"2023-11-16 18:{15 + i // 300:02d}:{(i * 0.2) % 60:010.7f},"
             f"{rng.randint(200, 4000)},{rng.randint(20, 400)}" for i in range(rows)]
    return _write(tmp_path / "azure.csv", AZURE_HEADER + "\n".join(lines) + "\n")


def test_a_trace_runs_with_no_sizing_options(tmp_path, capsys):
    from qualia.sim.clock import get_profile

    trace = _azure_trace(tmp_path)
    assert main(["simulate", "--trace", trace, "--no-progress"]) == 0
    out = capsys.readouterr().out
    head = out[:out.index("Serving Benchmark Result")]
    assert "40 requests of the trace azure.csv, azure form" in head
    assert "HashBackend (C) on the core scheduler, the default for --trace" in " ".join(
        head.split())
    profile = get_profile("llama3.1-8b-h100")
    pages = profile.kv_pages(16)
    assert f"{pages:,} pages of 16 tokens: the GPU's KV memory" in head
    assert "8,192 tokens and 256 sequences a step" in head
    data = _json_run(["--trace", trace], capsys)
    st, config = data["stats"], data["config"]
    assert data["completed"] == 40 and config["backend"] == "c"
    assert (st["num_pages"], st["max_num_batched_tokens"], st["max_num_seqs"]) == (
        pages, profile.max_num_batched_tokens, profile.max_num_seqs)
    assert config["sized_by"]["num_pages"] == "the llama3.1-8b-h100 profile"
    assert config["sized_by"]["logical_pages"] == "the trace's longest request"
    longest = max(r["input_tokens"] + r["output_tokens"] for r in data["requests"])
    assert st["logical_pages"] == -(-longest // 16)
    # an 8B model on one H100: tens of milliseconds to the first token, ~10 ms per token
    assert 5 < data["median_ttft_ms"] < 1000 and 5 < data["median_tpot_ms"] < 50


def test_explicit_sizes_override_the_profile(tmp_path, capsys):
    trace = _azure_trace(tmp_path, rows=10)
    data = _json_run(["--trace", trace, "--num-pages", "5000", "--max-num-seqs", "8",
                      "--logical-pages", "400"], capsys)
    st = data["stats"]
    assert (st["num_pages"], st["max_num_seqs"], st["logical_pages"]) == (5000, 8, 400)
    assert set(data["config"]["sized_by"]) == {"page_tokens", "max_num_batched_tokens"}


def test_a_trace_on_the_model_backend_is_asked_for(tmp_path, capsys):
    trace = _write(tmp_path / "t.csv", "arrival_s,prompt_tokens,output_tokens\n0,12,3\n")
    data = _json_run(["--trace", trace, "--backend", "model", "--num-pages", "64"], capsys)
    assert data["stats"]["backend"] == "PagedModelBackend (numpy)"


# -- the plot ---------------------------------------------------------------------------------


def test_the_plot_draws_the_latencies_over_seconds_and_says_where_it_wrote(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "run.svg"
    assert main(["simulate", *SMALL_CLI, "--backend", "c", "--plot", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"wrote {path}"
    svg = path.read_text()
    assert "serving time (s)" in svg and "latency (ms)" in svg and "time to first token" in svg
    assert main(["simulate", *SMALL_CLI, "--backend", "c", "--plot", str(path), "-q"]) == 0
    assert capsys.readouterr().out == ""  # quiet: nothing


# -- the command line itself ------------------------------------------------------------------


def test_no_arguments_shows_the_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and "simulate" in out and "demo" in out


def test_dash_capital_v_prints_the_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["-V"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.split()[-1] == qualia.__version__


@pytest.mark.parametrize("argv, says", [
    (["simulate", "--max-num-sqs", "4"], "--max-num-sqs: did you mean --max-num-seqs?"),
    (["simulate", "--arival-rate=3"], "--arival-rate: did you mean --arrival-rate?"),
    (["simulat"], "did you mean 'simulate'?"),
    (["simulate", "--prefix-caching", "autoo"], "did you mean 'auto'?"),
    (["simulate", "--backend", "cc"], "did you mean 'c'?")])
def test_a_mistyped_option_names_the_close_match(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert says in err and err.count("error:") == 1, err


def test_the_prefix_caching_help_describes_every_mode():
    sim = cli.build_parser("qualia")._subparsers._group_actions[0].choices["simulate"]
    action = next(a for a in sim._actions if "--prefix-caching" in a.option_strings)
    for mode in action.choices:
        assert f"'{mode}'" in action.help
    assert "automatic prefix caching" in action.help and "no cache" in action.help


def test_install_hints_name_the_local_checkout():
    from qualia.sim.plot import MISSING
    from qualia.sim.resources import install_hint

    assert 'pip install ".[plot]" in the qualia checkout' in MISSING
    assert install_hint("cluster", "ray") == \
        'pip install ".[cluster]" in the qualia checkout (or pip install ray)'
    help_text = cli.build_parser("qualia")._subparsers._group_actions[0].choices[
        "simulate"].format_help()
    assert "qualia[" not in help_text and '".[plot]"' in " ".join(help_text.split())


def test_no_value_of_the_summary_is_split_over_two_lines(tmp_path, capsys):
    trace = _azure_trace(tmp_path, rows=10)
    for argv in ([*SMALL_CLI, "--backend", "c"], ["--trace", trace],
                 [*SMALL_CLI, "--backend", "c", "--clock", "measured"]):
        assert main(["simulate", "--no-progress", *argv]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert max(len(line) for line in lines) <= 80
        # a row continued on the next line ends with a separator: the break is between values
        for line, following in zip(lines, lines[1:]):
            if re.match(r" {24}\S", following):  # a continued row
                assert line.rstrip().endswith(","), (line, following)
        text = "\n".join(lines)
        assert "e+" not in text and "e-0" not in text  # no scientific notation
