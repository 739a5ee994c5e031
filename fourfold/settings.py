"""A config field's valid range, declared next to its docstring: `lr: float = setting(3e-3, gt=0)`.

`Range` holds bounds and choices and says them in words; fourfold.config checks every field against its
range in one loop and `fourfold config` prints the words.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Range:
    """The values a setting accepts: bounds (ge/gt below, le/lt above) and/or a tuple of choices."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple | None = None

    def accepts(self, value: Any) -> bool:
        """True when `value` is inside the bounds and among the choices (a non-finite float never is)."""
        if self.choices is not None:
            return value in self.choices
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def text(self) -> str:
        """The range for people: 'at least 1', 'greater than 0', 'in [0, 1)', 'blocks or model'."""
        if self.choices is not None:
            return either(self.choices)
        ge, gt, le, lt = (_number(v) for v in (self.ge, self.gt, self.le, self.lt))
        low = (f"[{ge}" if ge is not None else f"({gt}") if (ge, gt) != (None, None) else None
        high = (f"{le}]" if le is not None else f"{lt})") if (le, lt) != (None, None) else None
        if low and high:
            return f"in {low}, {high}"
        if low:
            return f"at least {ge}" if ge is not None else f"greater than {gt}"
        if high:
            return f"at most {le}" if le is not None else f"less than {lt}"
        return "any value"


def _number(v: float | None) -> str | None:
    """A bound as text; large powers of two as 2^k."""
    if isinstance(v, int) and v > 2**16 and v & (v - 1) == 0:
        return f"2^{v.bit_length() - 1}"
    return None if v is None else str(v)


def either(choices) -> str:
    """'a', 'a or b', 'a, b or c'."""
    words = [str(c) for c in choices]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def setting(default: Any, *, ge=None, gt=None, le=None, lt=None, choices=None):
    """A dataclass field whose valid range sits next to its docstring; `validate` checks it, `describe` shows it."""
    return field(default=default, metadata={"range": Range(ge, gt, le, lt, tuple(choices) if choices else None)})


def field_docs(src: str) -> dict[str, str]:
    """Map field name -> the string literal that follows its declaration in a dataclass body."""
    tree = ast.parse(src)
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = str(b.value.value)
    return docs
