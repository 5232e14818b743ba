"""Real traces: qualia.sim.trace.Trace reads the Azure LLM inference trace format and a plain
form, with synthetic token ids that keep the shared prefixes the file describes; malformed files
are refused naming the file and the line."""

from __future__ import annotations

import numpy as np
import pytest

from qualia.sim.engine import Engine
from qualia.sim.trace import Trace, TraceError, parse_timestamp

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.0000000,879,21
"""


def write(tmp_path, text, name="trace.csv"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_azure_form(tmp_path):
    trace = Trace(write(tmp_path, AZURE), vocab=1000)
    assert trace.form == "azure" and len(trace) == trace.requests == 3
    reqs = trace.generate()
    assert [len(r.prompt) for r in reqs] == [374, 396, 879]
    assert [r.max_new_tokens for r in reqs] == [44, 109, 21]
    assert [r.request_id for r in reqs] == [0, 1, 2]
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals[0] == 0.0
    assert arrivals[1] == pytest.approx(50.9951690 - 46.6805900, abs=1e-6)
    assert arrivals[2] == pytest.approx(51.0 - 46.68059, abs=1e-6)
    for r in reqs:
        assert isinstance(r.prompt, np.ndarray) and r.prompt.dtype == np.uint32
        assert int(r.prompt.max()) < 1000 and r.arrival_step == 0 and r.tenant == 0
    assert trace.duration_s == pytest.approx(4.31941, abs=1e-6)


def test_timestamps():
    base = parse_timestamp("2023-11-16 18:15:46")
    assert parse_timestamp("2023-11-16 18:15:46.6805900") - base == pytest.approx(0.68059)
    assert parse_timestamp("2023-11-16T18:15:47Z") - base == pytest.approx(1.0)
    assert parse_timestamp("2023-11-16 19:15:46+01:00") == pytest.approx(base)
    assert parse_timestamp(" 2023-11-16 18:15:46.5 ") - base == pytest.approx(0.5)
    for bad in ("2023-11-16", "18:15:46", "2023-13-16 18:15:46", "yesterday", ""):
        with pytest.raises(ValueError):
            parse_timestamp(bad)


@pytest.mark.parametrize("fraction", ["\u0665", "\uff15"])
def test_a_timestamps_digits_are_ascii(tmp_path, fraction):
    """An Azure date-time's digits are ASCII: another script's 5 in the fraction is refused,
    by parse_timestamp and by the trace's line."""
    with pytest.raises(ValueError, match="expected a date-time"):
        parse_timestamp("2023-11-16 18:15:46." + fraction)
    with pytest.raises(ValueError, match="expected a date-time"):
        parse_timestamp("2023-11-16 18:15:4" + fraction)
    path = write(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.5,5,1\n2023-11-16 18:15:46." + fraction + ",5,1\n")
    with pytest.raises(TraceError, match="expected a date-time") as exc:
        Trace(path)
    assert exc.value.line == 3


def test_plain_form_with_prefix_groups_and_tenants(tmp_path):
    text = ("arrival_s,prompt_tokens,output_tokens,prefix_group,prefix_tokens,tenant\n"
            "0.0,30,4,sys-a,20,0\n"
            "0.5,25,3,sys-b,10,1\n"
            "1.0,40,2,sys-a,20,0\n"
            "\n"
            "1.5,22,5,sys-a,12,1\n"
            "2.0,15,1,,,0\n")
    trace = Trace(write(tmp_path, text), seed=7, vocab=50000)
    assert trace.form == "plain" and trace.groups == 2
    r = trace.generate()
    assert [x.arrival_s for x in r] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert [x.tenant for x in r] == [0, 1, 0, 1, 0]
    assert [x.shared_prefix_len for x in r] == [20, 10, 20, 12, 0]
    # rows of one group share their first prefix_tokens ids; other rows and the rest differ
    assert np.array_equal(r[0].prompt[:20], r[2].prompt[:20])
    assert np.array_equal(r[3].prompt[:12], r[0].prompt[:12])
    assert not np.array_equal(r[0].prompt[20:25], r[2].prompt[20:25])
    assert not np.array_equal(r[1].prompt[:10], r[0].prompt[:10])
    # deterministic from the seed
    again = Trace(write(tmp_path, text, "again.csv"), seed=7, vocab=50000).generate()
    assert all(np.array_equal(a.prompt, b.prompt) for a, b in zip(r, again))
    other = Trace(write(tmp_path, text, "other.csv"), seed=8, vocab=50000).generate()
    assert not np.array_equal(r[0].prompt, other[0].prompt)


def test_rows_are_sorted_by_arrival_and_columns_may_come_in_any_order(tmp_path):
    text = "output_tokens,arrival_s,prompt_tokens\n3,2.5,10\n4,1.0,11\n5,1.0,12\n"
    r = Trace(write(tmp_path, text)).generate()
    assert [(x.arrival_s, len(x.prompt), x.max_new_tokens) for x in r] == [
        (0.0, 11, 4), (0.0, 12, 5), (1.5, 10, 3)]  # ties keep the file order


def test_the_end_token_never_appears_in_a_prompt(tmp_path):
    text = "arrival_s,prompt_tokens,output_tokens\n0,500,1\n"
    r = Trace(write(tmp_path, text), vocab=4, eos_token_id=2).generate()
    assert 2 not in r[0].prompt.tolist() and set(r[0].prompt.tolist()) == {0, 1, 3}


@pytest.mark.parametrize("text, line, match", [
    ("", 0, "empty"),
    ("\n\n", 0, "empty"),
    ("time,prompt,output\n0,1,1\n", 1, "unknown header"),
    ("arrival_s,prompt_tokens,output_tokens,colour\n0,1,1,red\n", 1, "unknown column 'colour'"),
    ("arrival_s,prompt_tokens,output_tokens,prefix_group\n0,1,1,a\n", 1, "come together"),
    ("arrival_s,prompt_tokens,prompt_tokens,output_tokens\n", 1, "twice"),
    ("arrival_s,prompt_tokens,output_tokens\n0,5,1\n1,5\n", 3, "expected 3 fields"),
    ("arrival_s,prompt_tokens,output_tokens\n0,5,1\n1,five,1\n", 3, "prompt_tokens"),
    ("arrival_s,prompt_tokens,output_tokens\n0,0,1\n", 2, "prompt_tokens: must be >= 1"),
    ("arrival_s,prompt_tokens,output_tokens\n0,5,0\n", 2, "output_tokens: must be >= 1"),
    ("arrival_s,prompt_tokens,output_tokens\n0,5,4294967296\n", 2, "2\\*\\*32"),
    ("arrival_s,prompt_tokens,output_tokens\n-1,5,1\n", 2, "arrival_s"),
    ("arrival_s,prompt_tokens,output_tokens\nnan,5,1\n", 2, "arrival_s"),
    ("arrival_s,prompt_tokens,output_tokens\nsoon,5,1\n", 2, "arrival_s"),
    ("arrival_s,prompt_tokens,output_tokens,prefix_group,prefix_tokens\n0,5,1,a,6\n", 2,
     "longer than the prompt"),
    ("arrival_s,prompt_tokens,output_tokens,prefix_group,prefix_tokens\n0,5,1,,3\n", 2,
     "without a prefix_group"),
    ("arrival_s,prompt_tokens,output_tokens,tenant\n0,5,1,-2\n", 2, "tenant"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,5,1\n16/11/2023,5,1\n", 3,
     "date-time"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,5,x\n", 2,
     "GeneratedTokens"),
])
def test_malformed_files_name_the_file_and_the_line(tmp_path, text, line, match):
    path = write(tmp_path, text)
    with pytest.raises(TraceError, match=match) as exc:
        Trace(path)
    assert exc.value.path == path and exc.value.line == line
    assert str(exc.value).startswith(f"{path}:{line}: " if line else f"{path}: ")
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize("row, column", [
    ("1_0,5,1", "arrival_s"), ("0,1_0,1", "prompt_tokens"), ("0,5,1_0", "output_tokens"),
    ("0,\u0665,1", "prompt_tokens"), ("0x1,5,1", "arrival_s"), ("1.5,5.0,1", "prompt_tokens"),
])
def test_a_traces_numbers_are_plain_decimal_digits(tmp_path, row, column):
    """Nothing Python's int() and float() take besides: no digit-group underscores, no other
    scripts' digits."""
    path = write(tmp_path, "arrival_s,prompt_tokens,output_tokens\n" + row + "\n")
    with pytest.raises(TraceError, match=f"{column}: expected") as exc:
        Trace(path)
    assert exc.value.line == 2
    ok = write(tmp_path, "arrival_s,prompt_tokens,output_tokens\n 1e-3 , +5 ,1\n.5,5,1\n",
               name="ok.csv")
    assert [r.arrival_s for r in Trace(ok).generate()] == [0.0, 0.5 - 0.001]  # from the first


def test_unreadable_files(tmp_path):
    with pytest.raises(TraceError, match="No such file"):
        Trace(str(tmp_path / "missing.csv"))
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"arrival_s,prompt_tokens,output_tokens\n\xff\xfe,1,1\n")
    with pytest.raises(TraceError, match="UTF-8"):
        Trace(str(binary))
    with pytest.raises(ValueError, match="seed"):
        Trace(write(tmp_path, AZURE), seed=-1)
    with pytest.raises(ValueError, match="vocab"):
        Trace(write(tmp_path, AZURE), vocab=0)


def test_a_trace_is_served_and_its_groups_hit_the_cache(tmp_path):
    rows = ["arrival_s,prompt_tokens,output_tokens,prefix_group,prefix_tokens"]
    rows += [f"{0.01 * i:.2f},{40 + i},{2 + i % 3},g{i % 2},32" for i in range(10)]
    trace = Trace(write(tmp_path, "\n".join(rows) + "\n"), vocab=32000)
    engine = Engine("c", page_tokens=8, logical_pages=16, step_seconds=0.005)
    result = engine.run(trace, check=True)
    st = result.stats
    assert result.check.ok and st["requests_completed"] == 10
    # the first row of each group computes its 32 shared tokens (4 pages); every later row of
    # the group arrives after that and finds them cached
    assert st["prefix_hits"] == 8 and st["cache_hit_tokens"] == 8 * 32
    assert result.figures["duration"] >= 0.09 and result.figures["completed"] == 10


def test_a_trace_may_span_at_most_max_trace_span_s(tmp_path):
    from qualia.sim.trace import MAX_TRACE_SPAN_S

    ok = write(tmp_path, f"arrival_s,prompt_tokens,output_tokens\n{MAX_TRACE_SPAN_S:.0f},8,2\n"
                         "0,8,2\n")
    assert Trace(ok).duration_s == MAX_TRACE_SPAN_S
    far = write(tmp_path, "arrival_s,prompt_tokens,output_tokens\n5,8,2\n1e308,8,2\n4,8,2\n")
    with pytest.raises(TraceError) as exc:
        Trace(far)
    assert exc.value.line == 3 and "at most 1e+09 s" in str(exc.value)


def test_unservable_rows_are_found_by_their_lengths_without_drawing(tmp_path, monkeypatch):
    trace = Trace(write(tmp_path, "arrival_s,prompt_tokens,output_tokens\n2,8,2\n1,4000,1\n"
                                  "0,3000,9\n"))
    monkeypatch.setattr(np.random, "default_rng", None)   # drawing anything fails
    bad = trace.unservable_row(page_tokens=16, num_pages=100, logical_pages=64)
    assert bad.line == 3 and "request 1 can never be served" in str(bad)   # row 2 arrives 2nd
    assert trace.unservable_row(page_tokens=16, num_pages=300, logical_pages=300) is None
