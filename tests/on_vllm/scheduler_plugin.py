"""pytest plugin for vLLM's own scheduler tests (tools/vllm_tests.py): with
QUALIA_VLLM_TESTS_SCHEDULER=qualia, the schedulers their helper ``create_scheduler`` builds are
``qualia.vllm.Scheduler`` (synchronous and async alike); with ``stock``, vLLM's own."""

from __future__ import annotations

import os


def pytest_sessionstart(session):
    if os.environ.get("QUALIA_VLLM_TESTS_SCHEDULER") != "qualia":
        return
    import tests.v1.core.utils as helpers

    import qualia.vllm

    helpers.Scheduler = qualia.vllm.Scheduler
    helpers.AsyncScheduler = qualia.vllm.Scheduler
