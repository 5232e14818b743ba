"""``Scheduler.run()``: what it reports (a ring of the last steps' rows, the step count and the
totals) and how it stops on a signal (docs/DESIGN.md, "The loop").

* The rows are those of the last ``stats_rows`` steps, oldest first, equal to the matching rows
  of a run that keeps them all; ``totals`` sums the ``STEP_TOTALS`` fields over every step; the
  twin reports the same.
* With a C step backend the loop runs without the GIL and services signals every few
  milliseconds: a SIGINT sent to a process inside a long ``run()`` raises KeyboardInterrupt
  between two steps, the scheduler is consistent (no plan pending, every applied step kept),
  and resuming gives the outputs of an uninterrupted run.  The process signals its readiness
  through its stdout once another thread sees ``run()`` own the scheduler (BusyError).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import qualia
from qualia.twin import StepScheduler as TwinStepScheduler

HB = qualia.HashBackend(vocab=64)


def workload(s, n=10, seed=3):
    rng = np.random.default_rng(seed)
    for i in range(n):
        prompt = rng.integers(0, 50, size=int(rng.integers(1, 30))).tolist()
        kw = dict(max_new_tokens=int(rng.integers(1, 20)), priority=int(rng.integers(0, 2)))
        if i % 4 == 1:
            kw["n"] = 2
        elif i % 4 == 3:
            kw["beam_width"] = 2
        s.add_request(i, prompt, **kw)


def make(twin=False):
    cls = TwinStepScheduler if twin else qualia.StepScheduler
    s = cls(40, 4, 16, 4, max_num_batched_tokens=16, vocab_size=64, cache_key=b"r" * 16,
            max_queued=32)
    workload(s)
    return s


class PyBackend:
    def execute_step(self, plan):
        return HB.execute_step_topk(plan) if plan.num_topk else HB.execute_step(plan)


def finished_key(finished):
    return [(f.request_id, [o.tolist() for o in f.outputs] if isinstance(f, qualia.FinishedGroup)
             else f.output_tokens.tolist()) for f in finished]


def test_run_keeps_the_rows_of_its_last_steps_and_totals_over_all():
    full = make().run(HB)
    assert full.steps == len(full.stats) > 12     # the whole run fits the default ring
    assert full.totals == {k: int(full.stats[k].sum()) for k in qualia.STEP_TOTALS}
    assert full.totals["num_finished"] == len(full.finished) == 10
    for backend in (HB, PyBackend()):
        for rows in (0, 1, 5, full.steps - 1, full.steps, full.steps + 7):
            r = make().run(backend, stats_rows=rows)
            assert r.steps == full.steps and r.totals == full.totals
            assert finished_key(r.finished) == finished_key(full.finished)
            assert r.stats.dtype == qualia.STEP_STATS
            assert np.array_equal(r.stats, full.stats[full.steps - min(rows, full.steps):])


def test_run_in_pieces_reports_each_piece():
    full = make().run(HB)
    s, got, steps = make(), [], 0
    while s.has_unfinished():
        r = s.run(HB, max_steps=5, stats_rows=3)
        assert r.steps <= 5 and len(r.stats) == min(r.steps, 3)
        assert np.array_equal(r.stats, full.stats[steps + r.steps - len(r.stats):steps + r.steps])
        steps += r.steps
        got += r.finished
    assert steps == full.steps and finished_key(got) == finished_key(full.finished)


def test_the_twin_run_reports_as_the_core_does():
    for rows in (0, 4, qualia.RUN_STATS_ROWS):
        c, t = make().run(PyBackend(), stats_rows=rows), make(twin=True).run(PyBackend(),
                                                                             stats_rows=rows)
        assert np.array_equal(c.stats, t.stats)
        assert (c.steps, c.totals) == (t.steps, t.totals)
        assert finished_key(c.finished) == finished_key(t.finished)


@pytest.mark.parametrize("bad,exc", [(-1, OverflowError), (2**32, OverflowError),
                                     (True, TypeError), (1.0, TypeError)])
def test_run_refuses_a_bad_stats_rows_and_changes_nothing(bad, exc):
    for s in (make(), make(twin=True)):
        with pytest.raises(exc):
            s.run(PyBackend(), stats_rows=bad)
        assert s.has_unfinished() and s.num_waiting == 10 and s.num_running == 0
        assert len(s.run(PyBackend()).finished) == 10


# -- signals ---------------------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import signal, sys, threading, time
    # Ctrl-C raises KeyboardInterrupt even where the parent ignores SIGINT (a shell's background
    # job, nohup), which an interpreter started there inherits
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, sys.argv[1])
    import example_backend
    import qualia
    from qualia.errors import BusyError, StepError

    def make():
        s = qualia.StepScheduler(64, 16, 64, 4, cache_key=b"k" * 16)
        for i in range(4):
            s.add_request(i, [1 + i, 2, 3], max_new_tokens=600)
        return s

    def tokens(finished):
        return sorted((f.request_id, f.output_tokens.tolist()) for f in finished)

    want = tokens(make().run(example_backend.new_step(1000)).finished)

    s = make()
    slow = example_backend.new_step(1000, delay_us=20000)   # 600 steps: 12 s at least

    def watch():
        # ready once run() owns the scheduler: a mutating call gets BusyError
        while True:
            try:
                s.abort(10**9)
            except BusyError:
                print("ready", flush=True)
                return
            except StepError.UnknownRequest:
                time.sleep(0.001)

    threading.Thread(target=watch, daemon=True).start()
    try:
        s.run(slow)
        print("not interrupted", flush=True)
        sys.exit(3)
    except KeyboardInterrupt as err:
        interrupted = err
    done = getattr(interrupted, "finished", None)
    steps = example_backend.step_stats(slow)[0]
    # between two steps: no plan pending, every applied step kept
    plan = s.schedule()
    s.discard_plan()
    lens = [len(s.request_tokens(i)) for i in range(4)]
    assert done == [] and s.has_unfinished() and s.num_running == 4, (done, s.num_running)
    assert lens == [3 + steps] * 4 and 0 < steps < 600, (lens, steps)
    rest = s.run(example_backend.new_step(1000))
    assert tokens(rest.finished) == want
    assert s.free_pages == s.num_pages
    print("consistent", steps, flush=True)
""")


def test_sigint_stops_a_c_backend_run_between_steps(example_backend, tmp_path):
    """SIGINT inside run() with a C step backend: KeyboardInterrupt, the scheduler as after
    some whole steps, and resuming gives an uninterrupted run's outputs."""
    build_dir = os.path.dirname(example_backend.__file__)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, build_dir], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 300)
        assert ready, "the child never reported that run() owns the scheduler"
        line = proc.stdout.readline()
        assert line == "ready\n", (line, proc.stderr.read())
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert out.startswith("consistent "), (out, err)
