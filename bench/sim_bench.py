"""The simulator's own Python per engine step, beside the scheduler's and the backend's time.

    python bench/sim_bench.py [--trace FILE ...] [--repeat N] [--tree DIR ...]

Each scenario is what ``qualia simulate --backend c`` runs (the same parser, checks, sizing,
clock and engine): the synthetic default workload, and each ``--trace`` (an Azure LLM inference
trace CSV; sized from the default GPU profile, as the command line sizes it).  The requests are
submitted first; then ``Engine.run()`` is timed whole (the loop, the books, the records and
vLLM's figures it returns), and

    simulator Python per step = (run's wall time - the scheduler's calls - the backend's calls)
                                / steps

with the scheduler's and the backend's seconds from the engine's stopwatch (its ``scheduler``
and ``backend`` rows).  Every scenario runs ``--repeat`` times (default 3) and the fastest run
is reported: the machines these run on are shared, and another job only ever adds time.

``--tree DIR`` (repeatable) runs the same scenarios against the ``qualia`` package under
``DIR`` (a checkout with its compiled core built in place), each tree in a subprocess, so that
two versions are measured side by side in one run; without it, the installed ``qualia``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def scenarios(traces):
    out = [("synthetic default", [])]
    for path in traces:
        out.append((f"trace {os.path.basename(path)}", ["--trace", path]))
    return out


def measure(argv, repeat):
    """One scenario (``qualia simulate`` options ``argv``), fastest of ``repeat`` runs."""
    from qualia.cli.main import build_parser, sampling_of
    from qualia.sim import config as preflight
    from qualia.sim.engine import Engine
    from qualia.sim.timing import BACKEND, SCHEDULER

    best = None
    for _ in range(repeat):
        args = build_parser().parse_args(["simulate", "--backend", "c", "--no-progress", *argv])
        workload = preflight.check_simulate(args).workload
        engine = Engine(args.backend, preflight.engine_config_of(args),
                        clock=preflight.clock_of(args), sampling=sampling_of(args))
        engine.submit_all(workload)
        gc.collect()
        t0 = time.perf_counter()
        result = engine.run()
        wall = time.perf_counter() - t0
        secs = engine.stopwatch.seconds
        steps = int(result.stats["steps"])
        row = {
            "steps": steps,
            "requests": int(result.stats["requests_completed"]),
            "tokens": int(result.stats["tokens_generated"]),
            "run_s": wall,
            "scheduler_s": secs[SCHEDULER],
            "backend_s": secs[BACKEND],
        }
        row["python_s"] = wall - row["scheduler_s"] - row["backend_s"]
        if best is None or row["python_s"] < best["python_s"]:
            best = row
    return best


def child(traces, repeat):
    import qualia

    out = {"qualia": os.path.dirname(os.path.abspath(qualia.__file__)), "rows": []}
    for name, argv in scenarios(traces):
        row = measure(argv, repeat)
        row["scenario"] = name
        out["rows"].append(row)
    print(json.dumps(out))


def run_tree(tree, traces, repeat):
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.path.abspath(tree) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--repeat", str(repeat)]
    for t in traces:
        cmd += ["--trace", os.path.abspath(t)]
    # from a neutral directory, so that a checkout's root does not shadow the tree asked for
    done = subprocess.run(cmd, env=env, cwd="/" if tree is not None else HERE,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"the run on {tree or 'the installed qualia'} failed")
    return json.loads(done.stdout.strip().splitlines()[-1])


def us(seconds, steps):
    return f"{1e6 * seconds / steps:8.2f}" if steps else "       -"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", action="append", default=[], metavar="FILE")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tree", action="append", default=[], metavar="DIR")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.trace, args.repeat)
        return
    results = [run_tree(t, args.trace, args.repeat) for t in (args.tree or [None])]
    print("us per engine step (fastest of %d runs); python = run wall - scheduler - backend"
          % args.repeat)
    print(f"{'tree':<28} {'scenario':<28} {'steps':>7} {'python':>8} {'sched':>8} "
          f"{'backend':>8} {'run s':>7}")
    for res in results:
        for r in res["rows"]:
            print(f"{res['qualia'][-28:]:<28} {r['scenario'][:28]:<28} {r['steps']:>7} "
                  f"{us(r['python_s'], r['steps'])} {us(r['scheduler_s'], r['steps'])} "
                  f"{us(r['backend_s'], r['steps'])} {r['run_s']:7.2f}")


if __name__ == "__main__":
    main()
