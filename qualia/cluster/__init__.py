"""Replicas behind the router."""

from .cluster import *  # noqa: F401,F403
from .cluster import __all__  # noqa: F401
