"""Strict parsing of the numbers a user writes (a trace's columns, the command line's options):
ASCII digits, an optional sign, surrounding spaces ignored; nothing else that Python's
``int()`` and ``float()`` take (digit-group underscores such as ``1_0``, other scripts'
digits)."""

from __future__ import annotations

import re

__all__ = ["parse_int", "parse_float"]

_INT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_FLOAT = re.compile(r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
                    r"|inf|infinity|nan)", re.ASCII | re.IGNORECASE)


def parse_int(text: str) -> int:
    """The integer ``text`` writes in decimal (``-12``, ``+7``), else ``ValueError``."""
    s = text.strip()
    if not _INT.fullmatch(s):
        raise ValueError(f"not an integer: {text!r}")
    return int(s)


def parse_float(text: str) -> float:
    """The number ``text`` writes (``12``, ``-0.5``, ``1e-3``, ``.5``, ``inf``, ``nan``), else
    ``ValueError``."""
    s = text.strip()
    if not _FLOAT.fullmatch(s):
        raise ValueError(f"not a number: {text!r}")
    return float(s)
