"""``simulate --plot FILE``: the run over the serving clock, drawn with matplotlib (the ``plot``
extra: ``pip install ".[plot]"`` in the qualia checkout).

Four panels over the serving clock, in seconds (:class:`qualia.sim.report.Timeline`, one point
per step): running and waiting requests; the pool's pages held by requests and the pages only
the prefix cache holds (free to reclaim); the prefix cache's hit rate so far; and the latencies
of every completed request (:class:`qualia.sim.figures.RequestRecord`), at the time it arrived:
its time to first token and its time per output token, in milliseconds.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from .resources import install_hint

__all__ = ["plot_timeline", "matplotlib_problem", "MISSING"]

MISSING = ("--plot needs matplotlib, which is not installed: "
           + install_hint("plot", "matplotlib"))


def matplotlib_problem() -> Optional[str]:
    """Why ``--plot`` cannot run here (matplotlib missing), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return MISSING
    return None


def plot_timeline(timeline, path: str, *, stats: Optional[dict] = None,
                  figures: Optional[Dict[str, Any]] = None,
                  records: Optional[Dict[int, Any]] = None,
                  title: str = "qualia simulate") -> None:
    """Draw ``timeline`` into ``path`` (the format from its extension: png, pdf, svg, ...)
    over the serving clock.  ``stats`` (the run's :func:`~qualia.sim.report.collect_stats`)
    adds the pool size and the clock; ``figures`` (vLLM's) a subtitle; ``records`` (by request
    id) the latency panel.  Raises ``ImportError`` with the install hint when matplotlib is
    missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(MISSING) from exc
    t = timeline.t
    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    try:
        ax = axes[0]
        ax.plot(t, timeline.running, label="running", lw=1)
        ax.plot(t, timeline.waiting, label="waiting", lw=1)
        ax.set_ylabel("requests")
        ax.legend(loc="upper right")
        ax.grid(alpha=0.3)

        ax = axes[1]
        ax.plot(t, timeline.pages_used, label="held by requests", lw=1)
        ax.plot(t, timeline.pages_cached, label="cached only (reclaimable)", lw=1)
        if stats is not None and "num_pages" in stats:
            ax.axhline(int(stats["num_pages"]), color="grey", ls="--", lw=1, label="pool")
        ax.set_ylabel("KV pages")
        ax.legend(loc="upper right")
        ax.grid(alpha=0.3)

        ax = axes[2]
        ax.plot(t, [100.0 * x for x in timeline.hit_rate], lw=1)
        ax.set_ylabel("prefix-cache hit rate\n(% of prompt tokens so far)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)

        ax = axes[3]
        rs = [records[k] for k in sorted(records)] if records else []
        if rs:
            ax.scatter([r.arrival_s for r in rs], [r.ttft_s * 1e3 for r in rs], s=4,
                       label="time to first token")
            tpot = [(r.arrival_s, r.tpot_s * 1e3) for r in rs if r.tpot_s is not None]
            if tpot:
                ax.scatter([a for a, _ in tpot], [v for _, v in tpot], s=4,
                           label="time per output token")
            values = [r.ttft_s for r in rs] + [v / 1e3 for _, v in tpot]
            if min(values) > 0 and max(values) / min(values) > 100:
                ax.set_yscale("log")
            ax.legend(loc="upper right")
        ax.set_ylabel("latency (ms),\nby arrival")
        ax.set_xlabel("serving time (s)")
        ax.grid(alpha=0.3)

        sub = ""
        if figures:
            sub = (f"\n{int(figures.get('completed', 0)):,} requests in "
                   f"{float(figures.get('duration', 0.0)):,.1f} s, "
                   f"{float(figures.get('output_throughput', 0.0)):,.0f} output tokens/s, "
                   f"mean TTFT {float(figures.get('mean_ttft_ms', 0.0)):,.1f} ms, "
                   f"mean TPOT {float(figures.get('mean_tpot_ms', 0.0)):,.1f} ms")
        if stats is not None and "clock" in stats:
            sub += f"\nclock: {stats['clock']}"
        fig.suptitle(title + sub, fontsize=10)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
