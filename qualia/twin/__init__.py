"""The pure-Python twin of the compiled core: the same semantics in plain Python, the executable
spec the core is checked against plan for plan (docs/DESIGN.md, "The twin").

* :mod:`qualia.twin.seed`: the seed's types (pool, block table, prefix store, request scheduler)
  and :class:`PyHashBackend`;
* :mod:`qualia.twin.cache`: :class:`Scheduler`, the admit/decode/finish facade with its page
  cache;
* :mod:`qualia.twin.step`: :class:`StepScheduler`, the engine step over that facade, composed
  of request entries, the waiting queue, the running set, the groups of
  :mod:`qualia.twin.groups` (``n`` groups and beam groups) and the plan, with one update.
"""

from .cache import Scheduler
from .seed import *  # noqa: F401,F403 - the seed's types
from .seed import __all__ as _seed_all
from .step import StepPlan, StepScheduler

__all__ = _seed_all + ["Scheduler", "StepScheduler", "StepPlan"]
