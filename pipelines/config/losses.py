"""The ``losses`` of a sweep config: :class:`LossSpec` (a name the loss registry resolves, pinned parameters, its
search space, first found: inline, the user's folder, the plugin's, the built-in one) and ``losses: all``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, ValidationInfo, field_validator, model_validator

from pipelines.config.errors import ConfigError, FieldError, did_you_mean, to_config_error
from pipelines.config.fields import Path_, plugin_exited, sweep_words
from pipelines.config.spaces import (
    LOSS_LR,
    Param,
    SearchSpace,
    SpaceError,
    is_flat,
    load_space,
    parse_space,
    read_space_file,
)
from pipelines.config.strict import StrictModel
from pipelines.config.uris import shown

__all__ = ["LossSpec", "AllLosses", "expand_all"]


class LossSpec(StrictModel):
    """A loss to study; a bare string is its name.  Its search space is, first found: ``space`` here, the user's
    ``tune_spaces`` folder, the space its plugin ships, the built-in one."""

    name: str = Field(min_length=1, max_length=256)
    """A built-in name (``contrastive``, ``mpa``, ``sec:triplet``), an installed plugin's entry point
    (group ``dml_reality_check.losses``) or an import path ``package.module:attribute``; wrappers apply to any of
    them (``sec:mylab.losses:CircleLoss``)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Pinned hyperparameters (removed from the searched space)."""
    space: dict[str, Any] | Path_ | None = None
    """This loss's search space: the searched parameters directly (``{margin: {low: 0.1, high: 1.0}}``, with
    ``fixed`` and ``paper_defaults`` beside ``space``), a mapping with the keys of ``tune_spaces/*.yaml`` (``space``,
    ``fixed``, ``paper_defaults``) or the path of such a YAML file.  Overrides every other space of this loss."""
    fixed: dict[str, Any] | None = None
    """With a ``space`` that holds the parameters directly: the values that are not searched."""
    paper_defaults: dict[str, Any] | None = None
    """With a ``space`` that holds the parameters directly: the paper's values (inside the space)."""

    _space: SearchSpace | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _bare_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @field_validator("space", mode="before")
    @classmethod
    def _space_shape(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, (dict, str)):
            raise ValueError(
                f"expected a search space (a mapping with space / fixed / paper_defaults) or the path of "
                f"such a YAML file, got {shown(v)}"
            )
        return v

    @model_validator(mode="after")
    def _resolve(self, info: ValidationInfo):
        ctx = info.context or {}
        if not ctx.get("resolve", True):
            return self
        _resolve_loss(self.name)
        beside = [k for k in ("fixed", "paper_defaults") if getattr(self, k) is not None]
        if beside and not is_flat(self.space):
            raise FieldError(
                beside[0],
                "goes beside a space that holds the parameters directly (space: {margin: {low: .., high: ..}}, "
                f"{beside[0]}: {{..}}); "
                + (
                    f"this space has its own keys ({', '.join(sorted(self.space))}): put {beside[0]} inside it"
                    if isinstance(self.space, dict) and self.space
                    else f"put {beside[0]} in the space's file"
                    if isinstance(self.space, str)
                    else "give the space too"
                ),
            )
        if isinstance(self.space, dict):
            doc = self.space
            if is_flat(doc):
                doc = {"space": doc, "fixed": self.fixed or {}, "paper_defaults": self.paper_defaults or {}}
            try:
                space = parse_space(doc, f"the inline space of {self.name!r}", self.name)
            except SpaceError as e:
                detail = _detail(e, f"the inline space of {self.name!r}")
                key, sep, problem = detail.partition(": ")
                if doc is not self.space and sep and key.startswith(("paper_defaults.", "fixed.")):
                    raise FieldError(key, problem) from None  # a value given beside the flat space: named there
                raise FieldError("space", detail) from None
        elif isinstance(self.space, str):
            try:
                space = read_space_file(Path(self.space).expanduser(), self.name)
            except SpaceError as e:
                raise FieldError("space", " ".join(str(e).split())) from None
        else:
            try:
                space = load_space(self.name, ctx.get("spaces_dir"))
            except SpaceError as e:
                text = " ".join(str(e).split())
                # A broken file in the user's own folder is that folder's fault; a missing space is the loss's.
                if ctx.get("spaces_dir") is not None and not text.startswith("no search space"):
                    raise FieldError("@tune_spaces", text) from None
                raise FieldError("name", text) from None
        if space.loss != self.name:
            raise FieldError("space", f"the space is for loss {space.loss!r}, not {self.name!r}")
        for k, v in self.params.items():
            p = space.params.get(k)
            if k == LOSS_LR and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")):
                raise FieldError(f"params.{k}", f"{shown(v)} must be a positive number")
            if p is not None and not p.contains(v):
                raise FieldError(
                    f"params.{k}", f"{shown(v)} is outside the search space of {self.name!r} ({p.describe()})"
                )
        self._space = space
        return self

    @property
    def search_space(self) -> SearchSpace:
        """The resolved search space (set by validation)."""
        if self._space is None:
            raise RuntimeError(f"loss {self.name!r} was validated without resolving its search space")
        return self._space

    def searched(self) -> dict[str, Param]:
        """The Param objects the optimiser searches (the search space minus pinned ones)."""
        return {k: p for k, p in self.search_space.params.items() if k not in self.params}

    def fixed_values(self) -> dict[str, Any]:
        """Non-searched values: the space's ``fixed`` plus the pinned ``params``."""
        return {**self.search_space.fixed, **self.params}


def _detail(e: Exception, source: str) -> str:
    text = " ".join(str(e).split())
    return text[len(source) + 2 :] if text.startswith(source + ": ") else text


def _resolve_loss(name: str) -> None:
    """The registry decides what exists, and words an unknown name
    (:class:`~dml_core.losses.resolve.UnknownLossError`)."""
    # not at module level: the loss zoo takes seconds to import, and a config error must print at once
    from dml_core.losses import LossPluginError, UnknownLossError, list_losses, loss_info

    try:
        loss_info(name)
    except LossPluginError as e:
        raise FieldError("name", " ".join(str(e).split())) from None
    except SystemExit as e:  # a plugin's module that calls sys.exit() when imported: not the sweep's exit
        raise FieldError("name", plugin_exited(e, f"loss {name!r}")) from None
    except UnknownLossError as e:
        raise FieldError("name", e.message(shown) + did_you_mean(name, list_losses())) from None
    except ValueError as e:  # a malformed name ("sec:", a wrapper applied twice): the registry's words
        raise FieldError("name", " ".join(str(e).split())) from None


class AllLosses(StrictModel):
    """``losses: {all: true, exclude: [...]}``: every built-in loss that has a search space, minus ``exclude``."""

    all: Literal[True]
    exclude: list[str] = Field(default_factory=list, max_length=200)


def expand_all(value: Any, spaces: dict[str, SearchSpace]) -> Any:
    """``losses: all`` / ``{all: true, exclude: [...]}`` → the list of built-in loss names with a search space."""
    if value == "all":
        value = {"all": True}
    if not isinstance(value, dict) or "all" not in value:
        return value
    try:
        spec = AllLosses.model_validate(value)
    except ValidationError as e:
        raise to_config_error(e, sweep_words(AllLosses), prefix=("losses",)) from None
    unknown = [x for x in spec.exclude if x not in spaces]
    if unknown:
        i = spec.exclude.index(unknown[0])
        raise ConfigError(
            f"losses.exclude[{i}]",
            f"{shown(unknown[0])} is not one of the built-in losses{did_you_mean(unknown[0], spaces)} "
            f"({', '.join(sorted(spaces))})",
        )
    return [n for n in sorted(spaces) if n not in spec.exclude]
