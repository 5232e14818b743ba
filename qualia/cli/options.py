"""The command line's option types: each parses one option's text or raises
``argparse.ArgumentTypeError``, which argparse reports with the option's name ("argument --seed:
must be >= 0, got -1")."""

from __future__ import annotations

import argparse
from typing import Tuple

from ..sim.parse import parse_float, parse_int

__all__ = ["add_option", "U32_MAX", "MIN_ARRIVAL_RATE", "MAX_STEP_MS", "int_in", "pair", "rate",
           "ratio", "path", "step_ms", "finite_non_negative", "profile"]

U32_MAX = 2**32 - 1
#: The smallest --arrival-rate (requests per second) accepted; smaller rates are refused.
MIN_ARRIVAL_RATE = 1e-6

def int_in(minimum: int, maximum: int):
    def parse(text: str) -> int:
        try:
            v = parse_int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {v}")
        if v > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {v}")
        return v

    parse.__name__ = "integer"
    return parse


def pair(text: str) -> Tuple[int, int]:
    parts = text.replace(":", ",").replace("-", ",").split(",")
    try:
        if len(parts) == 1:
            lo = hi = parse_int(parts[0])
        elif len(parts) == 2:
            lo, hi = parse_int(parts[0]), parse_int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX (e.g. 24,96), got {text!r}") from None
    if lo < 1 or hi < lo or hi > U32_MAX:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX <= {U32_MAX}, got {text!r}")
    return lo, hi


def _number(text: str) -> float:
    try:
        return parse_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def rate(text: str) -> float:
    v = _number(text)
    if not v >= MIN_ARRIVAL_RATE:  # also nan
        raise argparse.ArgumentTypeError(
            f"must be >= {MIN_ARRIVAL_RATE:g} requests per second (or inf), got {text!r}")
    return v


def ratio(text: str) -> float:
    v = _number(text)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return v


def path(text: str) -> str:
    """--json, --plot, --trace: a non-empty path."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a file path, got {text!r}")
    return text


#: The longest --step-ms: an hour a step (a serving clock past that says nothing about serving)
MAX_STEP_MS = 3.6e6


#: The shortest --step-ms: a microsecond (qualia.sim.clock.MIN_STEP_S), the shortest step that
#: moves a serving clock at the latest arrival a run may have (1e9 s)
MIN_STEP_MS = 1e-3


def step_ms(text: str) -> float:
    """--step-ms: a number of milliseconds >= MIN_STEP_MS (the clock must move, up to the
    latest arrival a run may have) and <= MAX_STEP_MS."""
    v = _number(text)
    if not MIN_STEP_MS <= v <= MAX_STEP_MS:  # also nan
        raise argparse.ArgumentTypeError(
            f"must be >= {MIN_STEP_MS:.3f} (a microsecond) and <= {MAX_STEP_MS:,.0f} "
            f"(an hour), got {text!r}")
    return v


def profile(text: str) -> str:
    """--profile: the name of a model/GPU profile of :mod:`qualia.sim.clock` (case and
    surrounding spaces ignored); an unknown name is refused with the close matches."""
    from ..sim.clock import get_profile

    try:
        return get_profile(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def finite_non_negative(text: str) -> float:
    """--temperature: a finite number >= 0."""
    v = _number(text)
    if not 0.0 <= v < float("inf"):  # also nan
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def add_option(group, name: str, *aliases: str, **kw) -> None:
    """Add option ``name`` to ``group`` (an argparse parser or group) and, hidden from the help,
    each of ``aliases``: other spellings of the same option (``--max-seqs`` for
    ``--max-num-seqs``).  An error names the spelling given."""
    action = group.add_argument(name, **kw)
    for alias in aliases:
        group.add_argument(alias, dest=action.dest, type=kw.get("type"),
                           metavar=kw.get("metavar"), default=argparse.SUPPRESS,
                           help=argparse.SUPPRESS)
