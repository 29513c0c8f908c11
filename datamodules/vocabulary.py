"""What data and decoders share, below both: the special token ids, batch padding, and the
allowed ranges of options.

`datamodules` builds batches with these tokens and this padding, `decoders` decode with them, and
`tasks.config` checks every option (data, model, train and decoder keys) against a `Range` or a
`Choice` before any work. Nothing here imports the rest of the library.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Mapping

import torch


@dataclass(frozen=True)
class SpecialTokens:
    """Token ids a decoder may need, the tokenizer's and the decoder start token its backbone's
    configuration names."""

    pad: int
    eos: int
    unk: int
    sep: int    # joins subsequences in the flat (sequential / non-autoregressive) layout
    mask: int   # the masked-position token of non-autoregressive training and decoding
    start: int  # decoder start token (`b` in docs/design.md)


COMPARISONS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="),
                "lt": (operator.lt, "<")}


@dataclass(frozen=True)
class Range:
    """The allowed values of one numeric option: `ge`/`gt` and `le`/`lt` bounds (inclusive and
    exclusive), each a number or the name of a sibling option whose value is the bound
    (`Range(ge=1, le="max_new_tokens")`). Stated once, it is read both by the code that takes the value
    and by the configuration check that refuses a bad one before any work (`tasks.config`), so the
    two cannot disagree."""

    ge: float | str | None = None
    gt: float | str | None = None
    le: float | str | None = None
    lt: float | str | None = None
    integer: bool = True     # False: any finite number
    optional: bool = False   # null is allowed too
    note: str = ""           # what a bound means, for the message

    def problem(self, key: str, value: Any, siblings: Mapping[str, Any]) -> str | None:
        """None if `value` is allowed for `key` (e.g. "decoder.delay"); otherwise a message naming
        the key, the allowed values and the value. `siblings` holds the values of the other keys
        of `key`'s group, for bounds that name one."""
        if value is None and self.optional:
            return None
        prefix = key.rpartition(".")[0]
        bounds = [(op, *self._bound(getattr(self, op), prefix, siblings))
                  for op in COMPARISONS if getattr(self, op) is not None]
        if self.integer:
            kind_ok = isinstance(value, Integral) and not isinstance(value, bool)
        else:
            kind_ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
        if kind_ok and all(COMPARISONS[op][0](value, limit) for op, limit, _ in bounds):
            return None
        limits = " and ".join(f"{COMPARISONS[op][1]} {shown}" for op, _, shown in bounds)
        allowed = f"{'an integer' if self.integer else 'a finite number'} {limits}".rstrip()
        if self.optional:
            allowed += " or null"
        if self.note:
            allowed += f" ({self.note})"
        return f"{key} must be {allowed}, got {value!r}"

    @staticmethod
    def _bound(bound: float | str, prefix: str, siblings: Mapping[str, Any]) -> tuple[float, str]:
        """(the bound's value, how a message shows it)."""
        if isinstance(bound, str):
            return siblings[bound], f"{prefix}.{bound} ({siblings[bound]!r})"
        return bound, repr(bound)


@dataclass(frozen=True)
class Choice:
    """The allowed values of a named option (`Choice(("first_empty", "all_end"))`): the
    counterpart of `Range` for options that pick one of a few behaviours by name, with the same
    `problem` check, so an option may be either (`decoders.base.Option`)."""

    values: tuple[str, ...]

    def problem(self, key: str, value: Any, siblings: Mapping[str, Any]) -> str | None:
        """None if `value` is one of `values`; otherwise a message naming the key, the allowed
        values and the value."""
        if value in self.values:
            return None
        return f"{key} must be one of {', '.join(map(repr, self.values))}, got {value!r}"


def pad_batch(rows: list[list[int]], pad_value: int) -> torch.Tensor:
    """Right-pad integer rows to one `(len(rows), longest)` long tensor."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad_value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out
