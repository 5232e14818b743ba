"""``qualia.workload``: what the simulator serves, :mod:`qualia.sim.workload` and
:mod:`qualia.sim.trace` (also ``qualia.sim``)."""

from .sim.trace import *  # noqa: F401,F403
from .sim.trace import __all__ as _trace_all
from .sim.workload import *  # noqa: F401,F403
from .sim.workload import __all__ as _workload_all

__all__ = _workload_all + _trace_all
