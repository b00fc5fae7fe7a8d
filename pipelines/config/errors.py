"""The one error type of configuration problems: ``ConfigError(field, message)``, and pydantic's errors in plain
words.

``str(e)`` is ``"<field>: <what is wrong>"``; a document with several problems carries the others in ``e.more``.
The CLI prints ``config error: <that>`` as one line per problem (at most :data:`MAX_SHOWN`) and exits 2.

:func:`to_config_error` is the one translator of a pydantic ``ValidationError`` into that form, for every config
document (the sweep's and the re-evaluation's); :class:`DocumentWords` says what is particular to a document.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast, get_args

from pipelines.config.redact import redact_uri, shown

if TYPE_CHECKING:  # annotations only: reading a config's errors needs no pydantic import here
    from pydantic import BaseModel, ValidationError

__all__ = [
    "ConfigError",
    "FieldError",
    "MAX_SHOWN",
    "DocumentWords",
    "did_you_mean",
    "plain_problem",
    "to_config_error",
]

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


def plain_problem(err: Mapping[str, Any], shown: Callable[[Any], str]) -> str | None:
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


# --------------------------------------------------------------------------------------------------- translation
#: Labels pydantic gives the members of a union in an error location (``str``, ``int``, ...): not fields.
_UNION_LABELS = {"str", "int", "float", "bool", "none", "dict", "list"}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PRINTABLE_KEY = re.compile(r"[^\x00-\x1f\x7f]{1,80}")


@dataclass(frozen=True)
class DocumentWords:
    """What is particular to one kind of config document when its errors are worded.

    ``root``: the pydantic model of the document.  ``user_keys``: fields that map the user's own keys
    (``params``, ``env_vars``, a re-evaluation's ``datasets``), whose keys a location keeps as written.
    ``tags``: the tags of the document's discriminated union (the dataset kinds) and ``tag_noun`` what they name.
    ``words(err, loc)``: the document's own wording of an error at ``loc`` (``None``: the shared wording)."""

    root: type[BaseModel]
    user_keys: frozenset[str] = frozenset()
    tags: tuple[str, ...] = ()
    tag_noun: str = ""
    words: Callable[[Mapping[str, Any], tuple], str | None] | None = None


def _key(part: Any) -> str:
    """A user's own key as a location prints it: as written, unless that would break the one-line message."""
    return part if isinstance(part, str) and _PRINTABLE_KEY.fullmatch(part) else shown(part)


def field_path(loc: tuple, doc: DocumentWords) -> str:
    """Pydantic's error location → ``losses[1].params.margin`` / ``models[0].alias`` / ``datasets.cub200``: union
    members' labels and discriminated-union tags dropped, the user's own keys kept."""
    out = ""
    for i, part in enumerate(loc):
        inside = i >= 1 and loc[i - 1] in doc.user_keys
        if inside:
            out += f".{_key(part)}"
        elif isinstance(part, int):
            out += f"[{part}]"
        elif not _IDENTIFIER.fullmatch(part) or part in _UNION_LABELS:
            continue  # a union member's label (``str``, ``dict[str,any]``, ``function-after[...]``)
        elif part in doc.tags and i >= 1 and isinstance(loc[i - 1], int):
            continue  # the tag pydantic puts after a list item of a discriminated union
        else:
            out += f".{part}" if out else part
    return out


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The config models an annotation holds (``list[LossSpec]`` → LossSpec; a union → each member)."""
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return [cast("type[BaseModel]", annotation)]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _model_at(loc: tuple, root: type[BaseModel]) -> type[BaseModel] | None:
    """The config model validating the object at ``loc`` of a ``root`` document (for the "allowed here" list of an
    unknown key)."""
    candidates: list[type[BaseModel]] = [root]
    for part in loc:
        if isinstance(part, int):
            continue
        if len(candidates) > 1:  # a discriminated union: pydantic's next part is the member's tag
            tagged = [m for m in candidates if get_args(m.model_fields["kind"].annotation) == (part,)]
            if tagged:
                candidates = tagged
                continue
            return None
        fields = candidates[0].model_fields
        if part not in fields:
            return None
        candidates = _models_in(fields[part].annotation)
        if not candidates:
            return None
    return candidates[0] if len(candidates) == 1 else None


def _one_error(err: Mapping[str, Any], prefix: tuple, doc: DocumentWords) -> ConfigError:
    """One pydantic error as ``<field>: <problem>``: the field is pydantic's location, extended by a
    :class:`FieldError`'s own sub-path; the problem is in the plain words of :func:`plain_problem`, with the offending
    value for type and range errors."""
    ctx = err.get("ctx") or {}
    raised = ctx.get("error")
    if isinstance(raised, ConfigError) and raised.field:  # raised with its own field
        return raised
    loc, kind = prefix + tuple(err["loc"]), err["type"]
    where = field_path(loc, doc)
    if kind == "value_error" and isinstance(raised, FieldError):
        rel = raised.path
        if rel.startswith("@"):  # relative to the document, not to the validated object
            where = rel[1:]
        else:
            where = f"{where}.{rel}" if where and not rel.startswith(("[", ".")) else f"{where}{rel}"
        problem = str(raised)
    elif kind in ("value_error", "assertion_error"):
        problem = str(raised or err["msg"])
    elif kind == "extra_forbidden":
        parent = field_path(loc[:-1], doc)
        where = f"{parent}.{_key(loc[-1])}" if parent else _key(loc[-1])  # the unknown key itself, as written
        model = _model_at(tuple(err["loc"])[:-1], doc.root)
        allowed = list(model.model_fields) if model is not None else []
        problem = "unknown key" + did_you_mean(loc[-1], allowed)
        if allowed:
            problem += f" (allowed here: {', '.join(sorted(allowed))})"
    elif kind == "union_tag_not_found":
        where, problem = f"{where}.kind", f"is required (one of {', '.join(doc.tags)})"
    elif kind == "union_tag_invalid":
        where = f"{where}.kind"
        tag = ctx.get("tag")
        problem = (
            f"unknown {doc.tag_noun} kind {shown(tag)}{did_you_mean(tag, doc.tags)} (known: {', '.join(doc.tags)})"
        )
    else:
        own = doc.words(err, loc) if doc.words is not None else None
        problem = own or plain_problem(err, shown) or err["msg"]
    return ConfigError(where or "config", redact_uri(problem))


def to_config_error(e: ValidationError, doc: DocumentWords, prefix: tuple = ()) -> ConfigError:
    """Every pydantic error of a document, one :class:`ConfigError` each (the first one's ``more`` holds the
    others), an unknown top-level key first (a misspelt key explains the errors after it); one per field (a union's
    members each report the same field: the first says it).  ``prefix``: where the validated part sits in the
    document (``("runtime_env",)``)."""
    errors = sorted(
        e.errors(include_url=False),
        key=lambda err: not (err["type"] == "extra_forbidden" and len(prefix) + len(err["loc"]) == 1),
    )
    found: dict[str, ConfigError] = {}
    for err in errors:
        one = _one_error(err, prefix, doc)
        found.setdefault(one.field, one)
    first, *more = found.values()
    return ConfigError(first.field, first.problem, more=more)
