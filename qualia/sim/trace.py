"""Real traces: :class:`Trace` replays a CSV file of arrivals with prompt and output lengths (the
public Azure LLM inference trace format, or a plain form), with synthetic token ids that keep the
shared prefixes the file describes."""

from __future__ import annotations

import csv
import datetime
import math
import re
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from .parse import parse_float, parse_int
from .workload import MAX_ARRIVAL_S, Request, unservable_reason

__all__ = ["Trace", "TraceError", "parse_timestamp", "MAX_TRACE_SPAN_S"]


class TraceError(ValueError):
    """A trace file that cannot be read: ``path`` and ``line`` (1-based, the header is line 1;
    0 when the problem is not one line's) say where."""

    def __init__(self, path: str, line: int, message: str) -> None:
        self.path = str(path)
        self.line = int(line)
        where = f"{self.path}:{self.line}" if self.line else self.path
        super().__init__(f"{where}: {message}")


#: The longest span of a trace's arrivals, in seconds (about 31.7 years): the latest arrival a
#: request may have (:data:`qualia.sim.workload.MAX_ARRIVAL_S`; a trace's arrivals start at 0).
#: A trace spanning more is refused by the line of its latest row.
MAX_TRACE_SPAN_S = MAX_ARRIVAL_S

#: The two trace forms, by their three required columns (arrival, prompt tokens, output tokens).
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
PLAIN_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")
#: Optional columns, in either form.
EXTRA_COLUMNS = ("prefix_group", "prefix_tokens", "tenant")

_TIMESTAMP = re.compile(
    r"^(\d{4}-\d{2}-\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,12}))?"
    r"(Z|[+-]\d{2}:?\d{2})?$", re.ASCII)


def parse_timestamp(text: str) -> float:
    """Seconds since the epoch of an ISO date-time such as ``2023-11-16 18:15:46.6805900`` (any
    number of fraction digits, up to 12; an optional ``Z`` or ``+hh:mm`` offset, UTC without
    one), written in ASCII digits (not other scripts').  Raises ``ValueError``."""
    m = _TIMESTAMP.match(text.strip())
    if m is None:
        raise ValueError(f"expected a date-time like 2023-11-16 18:15:46.6805900, got {text!r}")
    date, hh, mm, ss, frac, zone = m.groups()
    tz = "+00:00" if zone in (None, "Z") else zone
    if len(tz) == 5:  # +hhmm
        tz = tz[:3] + ":" + tz[3:]
    dt = datetime.datetime.fromisoformat(f"{date}T{hh}:{mm}:{ss}{tz}")
    return dt.timestamp() + (float("0." + frac) if frac else 0.0)


def _count(text: str, column: str, minimum: int) -> int:
    try:
        v = parse_int(text)
    except ValueError:
        raise ValueError(f"{column}: expected an integer, got {text!r}") from None
    if v < minimum:
        raise ValueError(f"{column}: must be >= {minimum}, got {v}")
    if v > 2**32 - 1:
        raise ValueError(f"{column}: must be < 2**32, got {v}")
    return v


@dataclass
class _Row:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    group: Optional[int]  # index of the prefix group, in order of first appearance
    prefix_tokens: int
    tenant: int
    line: int = 0  # the row's line in the file (1-based; the header is line 1)


class Trace:
    """Requests replayed from a CSV file (``python -m qualia simulate --trace FILE``).

    The header names the form:

    * the public Azure LLM inference trace: ``TIMESTAMP,ContextTokens,GeneratedTokens``, with
      ``TIMESTAMP`` an ISO date-time (``2023-11-16 18:15:46.6805900``); a request arrives at
      the seconds since the earliest row (the first, in a sorted file);
    * a plain form: ``arrival_s,prompt_tokens,output_tokens``, arrival in seconds >= 0.

    Either form may add the columns ``prefix_group,prefix_tokens`` (the rows of one non-empty
    group share their first ``prefix_tokens`` token ids: a system prompt, a conversation's
    history) and ``tenant`` (an integer >= 0, the prefix-cache namespace; 0 without it).
    Columns may come in any order; blank lines are skipped.  The arrivals may span at most
    :data:`MAX_TRACE_SPAN_S` seconds.  The requests are sorted by arrival (ties in file order) and
    numbered from ``first_request_id``.

    Token ids are synthetic, drawn from ``[0, vocab)`` (never ``eos_token_id``) and deterministic
    from ``seed``: a group's shared ids come from the group's own stream, a row's other ids
    from the row's.  A prompt is a uint32 numpy array.  Bad input raises :class:`TraceError`
    (a ``ValueError``) naming the file and the line."""

    turns = 1

    def __init__(self, path: str, *, seed: int = 0, vocab: int = 32000,
                 eos_token_id: Optional[int] = None, first_request_id: int = 0) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if vocab < 1 or (eos_token_id is not None and (vocab < 2 or not 0 <= eos_token_id < vocab)):
            raise ValueError("vocab must be >= 1 (>= 2 with an end token, which must be below it)")
        self.path = str(path)
        self.seed = seed
        self.vocab = int(vocab)
        self.eos_token_id = eos_token_id
        self.first_request_id = int(first_request_id)
        self.form, self._rows, self.groups = self._read()
        self.requests = len(self._rows)

    # -- reading ------------------------------------------------------------------------------

    def _read(self) -> Tuple[str, List[_Row], int]:
        path = self.path
        try:
            f = open(path, newline="", encoding="utf-8-sig")
        except OSError as exc:
            raise TraceError(path, 0, exc.strerror or str(exc)) from None
        with f:
            try:
                return self._parse(csv.reader(f))
            except UnicodeDecodeError as exc:
                raise TraceError(path, 0, f"not UTF-8 text ({exc.reason})") from None
            except csv.Error as exc:
                raise TraceError(path, 0, f"not a CSV file ({exc})") from None

    def _parse(self, reader: Iterator[List[str]]) -> Tuple[str, List[_Row], int]:
        path = self.path
        header: Optional[List[str]] = None
        for fields in reader:
            if any(x.strip() for x in fields):
                header = [x.strip() for x in fields]
                break
        if header is None:
            raise TraceError(path, 0, "empty: expected a header line, "
                             f"{','.join(AZURE_COLUMNS)} or {','.join(PLAIN_COLUMNS)}")
        header_line = getattr(reader, "line_num", 1)
        names = {h.lower(): i for i, h in enumerate(header)}
        if len(names) != len(header):
            raise TraceError(path, header_line, f"a column appears twice in the header {header}")
        form = ""
        for candidate, cols in (("azure", AZURE_COLUMNS), ("plain", PLAIN_COLUMNS)):
            if all(c.lower() in names for c in cols):
                form = candidate
                required = cols
        if not form:
            raise TraceError(path, header_line,
                             f"unknown header {','.join(header)!r}: expected "
                             f"{','.join(AZURE_COLUMNS)} (the Azure LLM inference trace) or "
                             f"{','.join(PLAIN_COLUMNS)}, optionally with "
                             f"{','.join(EXTRA_COLUMNS)}")
        known = {c.lower() for c in required + EXTRA_COLUMNS}
        unknown = [h for h in header if h.lower() not in known]
        if unknown:
            raise TraceError(path, header_line,
                             f"unknown column {unknown[0]!r} (the optional columns are "
                             f"{', '.join(EXTRA_COLUMNS)})")
        if ("prefix_tokens" in names) != ("prefix_group" in names):
            raise TraceError(path, header_line,
                             "prefix_group and prefix_tokens come together")
        i_arr, i_prompt, i_out = (names[c.lower()] for c in required)
        i_group, i_ptok = names.get("prefix_group"), names.get("prefix_tokens")
        i_tenant = names.get("tenant")
        groups: Dict[str, int] = {}
        rows: List[_Row] = []
        for fields in reader:
            line = getattr(reader, "line_num", 0)
            if not any(x.strip() for x in fields):
                continue
            if len(fields) != len(header):
                raise TraceError(path, line, f"expected {len(header)} fields "
                                 f"({','.join(header)}), got {len(fields)}")
            try:
                if form == "azure":
                    arrival = parse_timestamp(fields[i_arr])
                else:
                    text = fields[i_arr].strip()
                    try:
                        arrival = parse_float(text)
                    except ValueError:
                        raise ValueError(f"arrival_s: expected a number of seconds, got "
                                         f"{text!r}") from None
                    if not 0.0 <= arrival < math.inf:
                        raise ValueError(f"arrival_s: must be a finite number >= 0, got {text!r}")
                prompt = _count(fields[i_prompt], required[1], 1)
                output = _count(fields[i_out], required[2], 1)
                group: Optional[int] = None
                ptok = 0
                if i_group is not None and i_ptok is not None:
                    label = fields[i_group].strip()
                    ptok = _count(fields[i_ptok], "prefix_tokens", 0) if label or \
                        fields[i_ptok].strip() else 0
                    if ptok and not label:
                        raise ValueError("prefix_tokens without a prefix_group")
                    if ptok > prompt:
                        raise ValueError(f"prefix_tokens ({ptok}) is longer than the prompt "
                                         f"({prompt})")
                    if label:
                        group = groups.setdefault(label, len(groups))
                tenant = _count(fields[i_tenant], "tenant", 0) if i_tenant is not None else 0
            except ValueError as exc:
                raise TraceError(path, line, str(exc)) from None
            rows.append(_Row(arrival, prompt, output, group, ptok, tenant, line))
        if rows:
            start = min(r.arrival_s for r in rows)
            for r in rows:
                r.arrival_s -= start
            last = max(rows, key=lambda r: r.arrival_s)
            if last.arrival_s > MAX_TRACE_SPAN_S:
                raise TraceError(path, last.line,
                                 f"arrives {last.arrival_s:.6g} s after the first row; a trace "
                                 f"may span at most {MAX_TRACE_SPAN_S:g} s")
            order = sorted(range(len(rows)), key=lambda i: rows[i].arrival_s)
            rows = [rows[i] for i in order]
        return form, rows, len(groups)

    # -- requests -----------------------------------------------------------------------------

    def _tokens(self, rng: np.random.Generator, n: int) -> np.ndarray:
        toks = rng.integers(0, self.vocab, size=n, dtype=np.uint32)
        if self.eos_token_id is not None:  # prompts never hold the end token
            toks[toks == self.eos_token_id] = (self.eos_token_id + 1) % self.vocab
        return toks

    def generate(self) -> List[Request]:
        """The requests, in arrival order (the same for the same file and seed)."""
        prefix_len = [0] * self.groups
        for r in self._rows:
            if r.group is not None:
                prefix_len[r.group] = max(prefix_len[r.group], r.prefix_tokens)
        shared = [self._tokens(np.random.default_rng([self.seed, 1, g]), n)
                  for g, n in enumerate(prefix_len)]
        rng = np.random.default_rng([self.seed, 0])
        out = []
        for i, r in enumerate(self._rows):
            rest = self._tokens(rng, r.prompt_tokens - r.prefix_tokens)
            if r.group is not None and r.prefix_tokens:
                prompt = np.concatenate([shared[r.group][:r.prefix_tokens], rest])
            else:
                prompt = rest
            out.append(Request(
                request_id=self.first_request_id + i,
                tenant=r.tenant,
                prompt=prompt,
                shared_prefix_len=r.prefix_tokens,
                max_new_tokens=r.output_tokens,
                arrival_step=0,
                arrival_s=r.arrival_s,
            ))
        return out

    def unservable_row(self, *, page_tokens: int, num_pages: int, logical_pages: int,
                       beam_width: Optional[int] = None,
                       options: bool = False) -> Optional[TraceError]:
        """The first row (in file order) that a scheduler of that shape can never serve, as a
        :class:`TraceError` naming its line, or None (``options``: the message names the
        command line's options).  Reads the rows' lengths only: nothing is drawn, so a row
        asking for 2**32-1 prompt tokens is refused at once."""
        worst: Optional[Tuple[int, str]] = None
        for i, r in enumerate(self._rows):
            if worst is not None and r.line > worst[0]:
                continue
            why = unservable_reason(f"request {self.first_request_id + i}", r.prompt_tokens,
                                    r.output_tokens, page_tokens=page_tokens,
                                    num_pages=num_pages, logical_pages=logical_pages,
                                    beam_width=beam_width, options=options)
            if why is not None:
                worst = (r.line, why)
        return None if worst is None else TraceError(self.path, worst[0], worst[1])

    def memory_estimate(self) -> int:
        """Rough bytes the requests take once generated and served (uint32 prompts, outputs as
        Python lists, per-request bookkeeping)."""
        return sum(4 * r.prompt_tokens + 52 * r.output_tokens + 900 for r in self._rows)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens one request holds: its prompt and its output (0 for no row)."""
        return max((r.prompt_tokens + r.output_tokens for r in self._rows), default=0)

    @property
    def duration_s(self) -> float:
        """Seconds from the first arrival to the last."""
        return self._rows[-1].arrival_s if self._rows else 0.0

    __call__ = generate

    def __iter__(self):
        return iter(self.generate())

    def __len__(self) -> int:
        return len(self._rows)
