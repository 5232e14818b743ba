"""What a run needs and what the machine has: memory, estimated before anything is allocated.

The CLI compares :func:`memory_estimate` (plus the trace's own estimate,
``Workload.memory_estimate``) with :func:`available_memory` and refuses a run the machine cannot
hold, instead of failing with ``MemoryError`` (or being killed) half-way through allocating it.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

__all__ = ["memory_estimate", "available_memory", "format_bytes", "install_hint"]


def memory_estimate(backend="model", *, max_num_seqs: int = 24, num_pages: int = 96,
                    page_tokens: int = 16, logical_pages: int = 16, prefix_entries: int = 6,
                    prefix_pages: Optional[int] = None, model_config=None,
                    prefix_caching: str = "auto") -> Dict[str, int]:
    """Bytes a :class:`qualia.sim.engine.Engine` with these arguments allocates up front, by part (a
    close lower bound: the arrays and C buffers sized in the constructors).  ``backend`` is
    ``"model"``, ``"c"`` or anything else (counted as a backend with no memory of its own).

    Parts: ``"model KV"`` (``num_pages x page_tokens x layers x 2 x heads x head_dim x
    itemsize``) and ``"model weights"`` for the model backend; ``"pool"`` (a refcount and a free
    stack entry per page); ``"block tables"`` (``max_num_seqs x logical_pages`` page ids, held
    twice: the tables and the decode scratch); ``"request slots"``; ``"prefix store"``
    (``prefix_entries x prefix_pages`` page ids); ``"token scratch"`` (``logical_pages x
    page_tokens`` token ids); ``"undo log"``; with ``prefix_caching="auto"``, ``"prefix cache"``
    (a record of ``round_up(48 + 4 x page_tokens, 64)`` bytes and 16 bytes of list links per
    page, the index, namespaces and the event ring) and ``"token streams"`` (``max_num_seqs x
    logical_pages x 24`` bytes: the engine step's streams read its token arena, not a copy)."""
    mr, nb, pt, lp = int(max_num_seqs), int(num_pages), int(page_tokens), int(logical_pages)
    pp = int(prefix_pages) if prefix_pages is not None else max(lp, 1)
    parts = {
        "pool": nb * 8,
        "block tables": 2 * mr * max(lp, 1) * 4,
        "request slots": mr * (40 + 8 + 4 + 32 + 16),
        "prefix store": int(prefix_entries) * (40 + pp * 4 + 16),
        "token scratch": max(lp * pt, 1) * 4,
        "undo log": max(mr, lp, 1) * (20 + 8),
    }
    if prefix_caching == "auto":
        index = 2
        while index < 4 * nb:
            index *= 2
        parts["prefix cache"] = (nb * ((48 + 4 * pt + 63) // 64 * 64 + 16) + 8 * index
                                 + 1024 * (256 + 53) + 4096 * 32)
        parts["token streams"] = mr * max(lp, 1) * 24 + mr * 40
    if backend == "model":
        import numpy as np

        from ..model import ModelConfig

        c = model_config if model_config is not None else ModelConfig()
        item = np.dtype(c.dtype).itemsize
        parts["model KV"] = nb * pt * c.layers * 2 * c.heads * c.head_dim * item
        d, f = c.d_model, c.mlp_hidden
        parts["model weights"] = (2 * c.vocab * d + c.layers * (3 * d * d + d * d + 2 * d * f)
                                  + d * (2 * c.layers + 1)) * item
    return parts


def available_memory() -> Optional[int]:
    """Bytes this process may still allocate: MemAvailable (or the free physical pages), less
    where a cgroup memory limit is tighter; None if unknown."""
    avail = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            pass
    try:  # cgroup v2: the limit of this process's group
        with open("/proc/self/cgroup", encoding="ascii") as f:
            group = next(ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::"))
        base = os.path.join("/sys/fs/cgroup", group.lstrip("/"))
        with open(os.path.join(base, "memory.max"), encoding="ascii") as f:
            limit = f.read().strip()
        if limit != "max":
            with open(os.path.join(base, "memory.current"), encoding="ascii") as f:
                room = max(0, int(limit) - int(f.read()))
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError, StopIteration, IndexError):
        pass
    return avail


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} EiB"  # pragma: no cover


def install_hint(extra: str, packages: str) -> str:
    """How to install an optional part of qualia: its ``extra`` from the qualia checkout (the
    package is not on the package index), or ``packages`` alone."""
    return f'pip install ".[{extra}]" in the qualia checkout (or pip install {packages})'
