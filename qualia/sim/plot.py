"""``simulate --plot FILE``: the run over time, drawn with matplotlib (the ``plot`` extra:
``pip install 'qualia[plot]'``).

Three panels over the engine's steps (:class:`qualia.sim.report.Timeline`): running and waiting
requests; the pool's pages held by requests and the pages only the prefix cache holds (free to
reclaim); the prefix cache's hit rate so far (cached tokens over tokens looked up).
"""

from __future__ import annotations

from typing import Optional

__all__ = ["plot_timeline", "matplotlib_problem", "MISSING"]

MISSING = ("--plot needs matplotlib, which is not installed: pip install 'qualia[plot]' "
           "(or pip install matplotlib)")


def matplotlib_problem() -> Optional[str]:
    """Why ``--plot`` cannot run here (matplotlib missing), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return MISSING
    return None


def plot_timeline(timeline, path: str, *, stats: Optional[dict] = None,
                  title: str = "qualia simulate", x: str = "step") -> None:
    """Draw ``timeline`` into ``path`` (the format from its extension: png, pdf, svg, ...)
    over its steps (``x="step"``) or over the serving clock (``x="time"``, seconds).
    ``stats`` (the run's summary figures) adds the pool size and a subtitle.  Raises
    ``ImportError`` with the install hint when matplotlib is missing."""
    if x not in ("step", "time"):
        raise ValueError(f"x must be 'step' or 'time', not {x!r}")
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(MISSING) from exc
    steps = timeline.step if x == "step" else timeline.t
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    try:
        ax = axes[0]
        ax.plot(steps, timeline.running, label="running", lw=1)
        ax.plot(steps, timeline.waiting, label="waiting", lw=1)
        ax.set_ylabel("requests")
        ax.legend(loc="upper right")
        ax.grid(alpha=0.3)

        ax = axes[1]
        ax.plot(steps, timeline.pages_used, label="held by requests", lw=1)
        ax.plot(steps, timeline.pages_cached, label="cached only (reclaimable)", lw=1)
        if stats is not None and "num_pages" in stats:
            ax.axhline(int(stats["num_pages"]), color="grey", ls="--", lw=1, label="pool")
        ax.set_ylabel("pages")
        ax.legend(loc="upper right")
        ax.grid(alpha=0.3)

        ax = axes[2]
        ax.plot(steps, [100.0 * x for x in timeline.hit_rate], lw=1)
        ax.set_ylabel("prefix-cache hit rate\n(% of tokens so far)")
        ax.set_ylim(0, 100)
        ax.set_xlabel("step" if x == "step" else "serving time (s)")
        ax.grid(alpha=0.3)

        sub = ""
        if stats is not None:
            sub = (f"\n{stats.get('backend', '')}: {stats.get('requests_completed', 0)} "
                   f"requests, {float(stats.get('throughput_tokens_per_s', 0.0)):.0f} tokens/s,"
                   f" TTFT p50 {float(stats.get('ttft_s_p50', 0.0)) * 1e3:.1f} ms")
        fig.suptitle(title + sub)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
