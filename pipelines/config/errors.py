"""The one error type of configuration problems: ``ConfigError(field, message)``, and pydantic's errors in plain
words.

``str(e)`` is ``"<field>: <what is wrong>"``; a document with several problems carries the others in ``e.more``.
The CLI prints ``config error: <that>`` as one line per problem (at most :data:`MAX_SHOWN`) and exits 2.
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable

__all__ = ["ConfigError", "FieldError", "MAX_SHOWN", "did_you_mean", "plain_problem"]

#: The most problems of one document printed, one line each; the rest are counted on one more line.
MAX_SHOWN = 10


class ConfigError(ValueError):
    """One bad field.  ``str(e)`` is ``"<field>: <what is wrong>"``; the CLI prints ``config error: <that>``.

    ``more``: further problems found in the same document (each a :class:`ConfigError`), printed after this one."""

    def __init__(self, field_path: str, message: str, *, more: Iterable[ConfigError] = ()):
        self.field = field_path
        self.problem = message
        self.more: tuple[ConfigError, ...] = tuple(more)
        super().__init__(f"{field_path}: {message}" if field_path else message)

    def lines(self, limit: int = MAX_SHOWN) -> list[str]:
        """Every problem as one line (``<field>: <problem>``), at most ``limit``, then how many were left out."""
        every = [self, *self.more]
        out = [" ".join(str(e).split()) for e in every[:limit]]
        if len(every) > limit:
            rest = len(every) - limit
            out.append(f"{rest} more problem{'s' if rest > 1 else ''} not shown (fix these and run again)")
        return out


class FieldError(ValueError):
    """Raised inside a validator: ``path`` is relative to the validated object (``"params.margin"``)."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(message)


def did_you_mean(name: Any, known: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``known`` to a mistyped ``name`` (``""`` when none is close)."""
    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name, list(known), n=2, cutoff=0.6)
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?"


#: What a value of each pydantic type is called in a message ("expected an integer, got 'five'").
_TYPE_WORDS = {
    "int": "an integer",
    "int_from_float": "an integer",
    "float": "a number",
    "string": "a string",
    "bool": "true or false",
    "dict": "a mapping",
    "model": "a mapping",
    "model_attributes": "a mapping",
    "list": "a list",
    "tuple": "a list",
    "set": "a list",
    "none_required": "null",
}
_COMPARE = {
    "greater_than": (">", "gt"),
    "greater_than_equal": (">=", "ge"),
    "less_than": ("<", "lt"),
    "less_than_equal": ("<=", "le"),
}


def plain_problem(err: dict, shown) -> str | None:
    """Pydantic's error ``err`` (one entry of ``ValidationError.errors()``) in the plain words of the config
    messages: ``expected an integer, got 1.5``, ``0 must be >= 1``, ``'adamm' is not one of 'sgd', 'adam'``;
    ``shown(value)`` prints a value (cut short, passwords redacted).  ``None`` for a kind without plain words here."""
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if kind.endswith("_type") and kind[: -len("_type")] in _TYPE_WORDS:
        return f"expected {_TYPE_WORDS[kind[: -len('_type')]]}, got {shown(value)}"
    if kind in ("int_from_float", "int_parsing", "float_parsing", "bool_parsing"):
        word = {"int": "an integer", "float": "a number", "bool": "true or false"}[kind.split("_")[0]]
        return f"expected {word}, got {shown(value)}"
    if kind == "finite_number":
        return f"{shown(value)} must be a finite number"
    if kind in _COMPARE:
        op, key = _COMPARE[kind]
        bound = ctx.get(key)
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)  # "must be > 0", not "> 0.0"
        return f"{shown(value)} must be {op} {bound}"
    if kind == "literal_error":
        expected = str(ctx.get("expected", ""))
        names = [x.strip().strip("'") for x in expected.replace(" or ", ", ").split(",")]
        return f"{shown(value)} is not one of {expected}{did_you_mean(value, names)}"
    if kind == "too_long":
        return f"has more than {ctx.get('max_length')} entries"
    if kind == "too_short":
        n = ctx.get("min_length")
        return f"needs at least {n} entr{'y' if n == 1 else 'ies'}"
    if kind == "string_too_long":
        return f"longer than {ctx.get('max_length')} characters"
    if kind == "string_too_short":
        return "must not be empty"
    if kind == "string_pattern_mismatch":
        return f"{shown(value)} does not match the pattern {ctx.get('pattern')}"
    if kind == "missing":
        return "is required"
    return None
