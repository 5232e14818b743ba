"""The simulator: a continuous-batching engine on the engine step (:mod:`qualia.sim.engine`),
what it serves (:mod:`~qualia.sim.workload`, :mod:`~qualia.sim.trace`), its configuration and
the one validation made before a run (:mod:`~qualia.sim.config`), the backends it drives
(:mod:`~qualia.sim.adapters`), its books, check, report, timing, plot and memory estimate, a
modeled clock of a step on named model/GPU profiles (:mod:`~qualia.sim.clock`) and vLLM's
serving figures (:mod:`~qualia.sim.figures`)."""

from .check import CheckResult
from .engine import Engine
from .report import EngineResult, GroupOutput
from .trace import Trace, TraceError
from .workload import Request, UnservableRequest, Workload

__all__ = ["Engine", "EngineResult", "GroupOutput", "CheckResult", "Request", "Workload", "Trace",
           "TraceError", "UnservableRequest"]
