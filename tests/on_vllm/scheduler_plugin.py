"""pytest plugin for vLLM's own scheduler tests (tools/vllm_tests.py).

With QUALIA_VLLM_TESTS_SCHEDULER=qualia, the schedulers that their helper ``create_scheduler``
builds are ``qualia.vllm.Scheduler`` (for the synchronous and the async tests alike); with
``stock``, vLLM's own.  Tests that build a scheduler for a multimodal model (whose config the
run does not provide) are skipped under both: they are outside the text-only comparison.
"""

from __future__ import annotations

import functools
import os

import pytest

TEXT_MODELS = ("facebook/opt-125m",)


def pytest_sessionstart(session):
    import tests.v1.core.utils as helpers

    original = helpers.create_scheduler

    @functools.wraps(original)
    def create_scheduler(*args, **kwargs):
        model = kwargs.get("model", args[0] if args else "facebook/opt-125m")
        if model not in TEXT_MODELS:
            pytest.skip(f"multimodal model {model}: outside the text-only run")
        return original(*args, **kwargs)

    helpers.create_scheduler = create_scheduler
    if os.environ.get("QUALIA_VLLM_TESTS_SCHEDULER") == "qualia":
        import qualia.vllm

        helpers.Scheduler = qualia.vllm.Scheduler
        helpers.AsyncScheduler = qualia.vllm.Scheduler
