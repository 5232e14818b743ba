"""``qualia.engine``: the simulator's engine, :mod:`qualia.sim.engine` (also ``qualia.sim``)."""

from .sim.engine import *  # noqa: F401,F403
from .sim.engine import __all__  # noqa: F401
