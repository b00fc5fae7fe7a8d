"""Trunks from user code: an import path ``"package.module:attr"`` or an installed entry point of the group
``dml_reality_check.trunks`` (``docs/trunks.md`` has the contract and examples).

The object named is a callable taking no required argument (it may take ``pretrained=``) that returns an
``nn.Module`` mapping (B, 3, H, W) images to a (B, C, H, W) feature map and having an int ``feature_dim`` (or
``num_features``, timm's name) — C.  An optional ``preprocessing`` (a :class:`Preprocessing` or a dict of its
fields) on the callable, else on the module, declares its input convention; the ImageNet one otherwise.

Every way this can go wrong is a ``ValueError`` with one message naming the trunk, never a traceback through this
module: the module does not import (the plugin's exception type, message and the file:line it came from), no such
attribute, not callable, required arguments, the call raises, a result that is not an ``nn.Module``, no usable
feature dimension, a bad ``preprocessing``, an entry-point name exported by two distributions or clashing with a
built-in trunk.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import traceback
from pathlib import Path

from torch import nn

from dml_core.trunks.preprocessing import Preprocessing

__all__ = ["ENTRY_POINT_GROUP", "IMPORT_PATH", "load_object", "entry_points_named", "installed_entry_points",
           "call_factory", "feature_dim_of", "declared_preprocessing"]

ENTRY_POINT_GROUP = "dml_reality_check.trunks"
#: ``package.module:attr`` (the attribute may be dotted: ``module:Class.factory``), as in setuptools entry points.
IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")

_IMPORTLIB_DIR = os.path.dirname(importlib.__file__)


def _origin(exc: BaseException) -> str:
    """`` (raised at file:line)`` for the innermost frame of ``exc`` that is neither this module nor importlib's
    machinery — the plugin's own code — or ``""``.  A SyntaxError names the offending line itself."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" (at {exc.filename}:{exc.lineno})"
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<frozen") and os.path.dirname(f.filename) != _IMPORTLIB_DIR
              and f.filename != __file__]
    return f" (raised at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def load_object(module: str, attr: str, trunk: str, what: str):
    """``module`` imported and ``attr`` (dotted) looked up in it; ``what`` says where the reference came from in
    error messages (``'pkg.mod:build'`` or ``entry point 'x' of distribution 'd 1.0'``)."""
    try:
        obj = importlib.import_module(module)
    except Exception as e:  # the plugin's own error, whatever it is
        raise ValueError(f"trunk {trunk!r}: cannot import module {module!r} ({what}): {_one_line(e)}{_origin(e)}"
                         ) from None
    parts = attr.split(".")
    for i, part in enumerate(parts):
        owner = module if i == 0 else f"{module}:{'.'.join(parts[:i])}"
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"trunk {trunk!r}: {owner!r} has no attribute {part!r} ({what})") from None
        except Exception as e:  # a module-level __getattr__ of the plugin failing
            raise ValueError(f"trunk {trunk!r}: looking up {part!r} in {owner!r} raised {_one_line(e)}{_origin(e)}"
                             ) from None
    if not callable(obj):
        raise ValueError(f"trunk {trunk!r}: {module}:{attr} is a {type(obj).__name__}, not a callable returning the "
                         f"trunk module ({what})")
    return obj


def installed_entry_points(name: str | None = None) -> list:
    """The entry points of group ``dml_reality_check.trunks`` (those called ``name`` if given); metadata only,
    nothing of the plugins is imported."""
    from importlib.metadata import entry_points

    return [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if name is None or ep.name == name]


def distribution_of(ep) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "an unknown distribution"
    return f"{dist.metadata['Name'] or dist.name} {dist.version}"


def entry_points_named(name: str, builtin: bool) -> list:
    """The entry points called ``name``, at most one: two distributions exporting it, or one exporting the name of a
    built-in trunk (``builtin``), is a ``ValueError`` naming both sides."""
    eps, seen = [], set()
    for ep in installed_entry_points(name):
        key = (distribution_of(ep), ep.value)
        if key not in seen:  # the same distribution found twice on sys.path
            seen.add(key)
            eps.append(ep)
    if builtin and eps:
        sides = " and ".join(f"{distribution_of(ep)!r} ({ep.value})" for ep in eps)
        raise ValueError(f"trunk {name!r}: the entry point {name!r} of {sides} (group {ENTRY_POINT_GROUP}) "
                         f"clashes with the built-in trunk {name!r} of 'dml-reality-check'; rename the entry point or "
                         "uninstall that distribution")
    if len(eps) > 1:
        sides = " and ".join(f"{distribution_of(ep)!r} ({ep.value})" for ep in eps)
        raise ValueError(f"trunk {name!r} is exported by two distributions: {sides} (entry point group "
                         f"{ENTRY_POINT_GROUP}); uninstall one, or name the trunk by its import path")
    return eps


def _signature(obj):
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):  # some builtins and C extensions have none
        return None


def check_signature(obj, ref: str, trunk: str) -> bool:
    """Whether ``obj`` takes ``pretrained=``; a ``ValueError`` when it has required arguments besides it."""
    sig = _signature(obj)
    if sig is None:
        return False
    params = sig.parameters.values()
    required = [p.name for p in params if p.default is inspect.Parameter.empty and p.name != "pretrained"
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if required:
        raise ValueError(f"trunk {trunk!r}: {ref} must be callable without arguments (pretrained= aside), but it "
                         f"requires {required}")
    return any(p.name == "pretrained" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def call_factory(obj, ref: str, trunk: str, pretrained: Path | None) -> tuple[nn.Module, bool]:
    """Call the plugin: ``obj(pretrained=<local path or None>)`` if it takes ``pretrained``, else ``obj()``.
    Returns the module and whether the plugin took the weights file itself."""
    takes_pretrained = check_signature(obj, ref, trunk)
    try:
        module = obj(pretrained=None if pretrained is None else str(pretrained)) if takes_pretrained else obj()
    except Exception as e:
        raise ValueError(f"trunk {trunk!r}: {ref}() raised {_one_line(e)}{_origin(e)}") from None
    if not isinstance(module, nn.Module):
        raise ValueError(f"trunk {trunk!r}: {ref}() returned a {type(module).__name__}, not a torch.nn.Module")
    return module, takes_pretrained


def feature_dim_of(module: nn.Module, ref: str, trunk: str) -> int:
    """The module's ``feature_dim`` (else ``num_features``): a positive int, or a ``ValueError``."""
    for attr in ("feature_dim", "num_features"):
        value = getattr(module, attr, None)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"trunk {trunk!r}: {ref}() returned a module whose {attr} is {value!r}, not a "
                                 "positive int (the channel count of its feature map)")
            return value
    raise ValueError(f"trunk {trunk!r}: {ref}() returned a {type(module).__name__} without an int feature_dim (or "
                     "num_features) attribute: the channel count C of its (B, C, H, W) feature map")


def declared_preprocessing(obj, ref: str, trunk: str) -> Preprocessing | None:
    """``obj.preprocessing`` as a :class:`Preprocessing` (``None`` when absent); a bad value is a ``ValueError``."""
    value = getattr(obj, "preprocessing", None)
    if value is None or isinstance(value, property) or callable(value) and not isinstance(value, (Preprocessing, dict)):
        return None  # absent, or an instance property / method: read from the built module instead
    return Preprocessing.coerce(value, where=f"trunk {trunk!r}: {ref}.preprocessing")
