"""The numpy test transformer."""

from .paged import *  # noqa: F401,F403
from .paged import __all__  # noqa: F401
