"""Input and hyperparameter checks shared by every loss module.

One message format for the whole zoo, so that a bad value fails before training with an error
that names the loss and the field::

    loss 'mpa': gamma must be a finite number > 0, got -0.1
    loss 'sec:triplet': sec_eta must be a finite number >= 0, got nan
    loss 'cosface': labels contain class id 6, outside [0, num_classes=6)

Every check raises ``ValueError`` (what :func:`dml_core.losses.build_loss` callers and the
pipeline's preflight catch) and returns the value in its canonical type (``float``, ``int``,
``bool``), so a constructor can write ``self.tau = non_negative(self.name, "tau", tau)``.
A field has one requirement text however it fails (wrong type, NaN, out of range), so the
message is the same whichever of those the caller got wrong.

``loss`` is the name the message quotes: the registry name (``self.name``), or for a wrapper
the composed name (``"sec:triplet"``).
"""

from __future__ import annotations

import math
from typing import Any, NoReturn, Sequence, overload

import torch

__all__ = [
    "fail",
    "number",
    "positive",
    "non_negative",
    "integer",
    "sizes",
    "flag",
    "choice",
    "check_batch",
]

#: Half-precision embeddings are upcast before the loss: norms, log-sum-exps and reductions in fp32 even under
#: AMP (fp16 overflows exp(α·S) at the MPA family's α = 32 and loses ProxyNCA++'s distances to cancellation; the
#: "Precision"/"Dtype" items of docs/losses/*.md §Ambiguities resolved).  float64 stays float64 (gradcheck).
_UPCAST = (torch.float16, torch.bfloat16)


def fail(loss: str, message: str) -> NoReturn:
    """Raise ``ValueError("loss '<loss>': <message>")``."""
    raise ValueError(f"loss {loss!r}: {message}")


def _fmt(bound: float) -> str:
    return f"{bound:g}"


def _is_real(value: Any) -> bool:
    # bool is an int subclass, but ``margin: true`` in a YAML file is a mistake, not 1.0.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _null_note(null: str | None) -> str:
    return "" if null is None else f" (or null for {null})"


# Without `null` a check never returns None: the overloads tell a type checker so.
@overload
def number(
    loss: str,
    field: str,
    value: Any,
    *,
    gt: float | None = None,
    ge: float | None = None,
    le: float | None = None,
    allow_inf: bool = False,
    null: None = None,
) -> float: ...
@overload
def number(
    loss: str,
    field: str,
    value: Any,
    *,
    gt: float | None = None,
    ge: float | None = None,
    le: float | None = None,
    allow_inf: bool = False,
    null: str,
) -> float | None: ...
def number(
    loss: str,
    field: str,
    value: Any,
    *,
    gt: float | None = None,
    ge: float | None = None,
    le: float | None = None,
    allow_inf: bool = False,
    null: str | None = None,
) -> float | None:
    """A real hyperparameter: finite (unless ``allow_inf``), optionally ``> gt`` / ``>= ge`` and ``<= le``.

    ``null``: ``None`` is accepted (and returned) and this text says what it means, e.g.
    ``null="no miner"`` → "... (or null for no miner)".  The requirement text is
    "a finite number > 0", "a number >= 0" (``allow_inf``) or "a number in [0, 1]" (a closed
    range implies finiteness).
    """
    if gt is not None and ge is not None:
        raise TypeError("number(): give gt or ge, not both")
    if value is None and null is not None:
        return None
    low = gt if gt is not None else ge
    if low is not None and le is not None:
        need = f"a number in {'(' if gt is not None else '['}{_fmt(low)}, {_fmt(le)}]"
    else:
        need = "a number" if allow_inf else "a finite number"
        if low is not None:
            need += f" {'>' if gt is not None else '>='} {_fmt(low)}"
        if le is not None:
            need += f" <= {_fmt(le)}"
    ok = _is_real(value) and not math.isnan(value) and (allow_inf or math.isfinite(value))
    ok = ok and (gt is None or value > gt) and (ge is None or value >= ge) and (le is None or value <= le)
    if not ok:
        fail(loss, f"{field} must be {need}{_null_note(null)}, got {value!r}")
    return float(value)


def positive(loss: str, field: str, value: Any) -> float:
    """A finite number > 0 (temperatures, scales, α of log-sum-exp losses)."""
    return number(loss, field, value, gt=0)


def non_negative(loss: str, field: str, value: Any) -> float:
    """A finite number >= 0 (loss weights such as τ, η)."""
    return number(loss, field, value, ge=0)


@overload
def integer(loss: str, field: str, value: Any, *, ge: int = 1, null: None = None) -> int: ...
@overload
def integer(loss: str, field: str, value: Any, *, ge: int = 1, null: str) -> int | None: ...
def integer(loss: str, field: str, value: Any, *, ge: int = 1, null: str | None = None) -> int | None:
    """An integer ``>= ge``.  Integral floats (``10.0``, as YAML or a float search space may give) are accepted."""
    if value is None and null is not None:
        return None
    ok = _is_real(value) and math.isfinite(value) and int(value) == value and value >= ge
    if not ok:
        fail(loss, f"{field} must be an integer >= {ge}{_null_note(null)}, got {value!r}")
    return int(value)


def sizes(loss: str, num_classes: Any, embedding_dim: Any) -> tuple[int, int]:
    """The registry's ``num_classes`` and ``embedding_dim`` (each an integer >= 1)."""
    return integer(loss, "num_classes", num_classes), integer(loss, "embedding_dim", embedding_dim)


def flag(loss: str, field: str, value: Any) -> bool:
    """A switch: exactly ``True`` or ``False`` (not 0/1, not "yes")."""
    if not isinstance(value, bool):
        fail(loss, f"{field} must be true or false, got {value!r}")
    return value


def choice(loss: str, field: str, value: Any, options: Sequence[Any]) -> Any:
    """One of ``options`` (listed in the message in the given order)."""
    if value not in options:
        fail(loss, f"{field} must be one of {list(options)}, got {value!r}")
    return value


def check_batch(
    loss: str,
    embeddings: Any,
    labels: Any,
    *,
    num_classes: int | None = None,
    embedding_dim: int | None = None,
    nonempty: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``(embeddings, labels)`` and return them ready for a loss: ``(float embeddings, int64 labels)``.

    * embeddings: a floating-point (batch, dim) tensor; with ``embedding_dim`` its width must match (losses whose
      parameters have that width: proxies, class weights, a classifier);
    * labels: an integer (batch,) tensor;
    * ``num_classes``: labels must lie in [0, num_classes) — only for losses that index per-class parameters
      (the min/max costs one device sync);
    * ``nonempty``: reject an empty batch (losses whose reductions would divide by zero).

    fp16/bf16 embeddings are upcast to fp32 (see ``_UPCAST``); other dtypes are returned unchanged.  A batch with
    a NaN or infinite value comes back all NaN: every built-in loss then returns a non-finite value (a bad embedding
    propagates, it is not refused: a refusal would need a host sync per batch, and training ends such a fold
    ``diverged`` by the loss it reads).
    """
    if not torch.is_tensor(embeddings) or embeddings.dim() != 2:
        got = tuple(embeddings.shape) if torch.is_tensor(embeddings) else type(embeddings).__name__
        fail(loss, f"embeddings must be a (batch, {embedding_dim or 'dim'}) tensor, got {got}")
    if not embeddings.is_floating_point():
        fail(loss, f"embeddings must be floating point, got {embeddings.dtype}")
    if embedding_dim is not None and embeddings.shape[1] != embedding_dim:
        fail(loss, f"embeddings have dimension {embeddings.shape[1]}, expected embedding_dim={embedding_dim}")
    if not torch.is_tensor(labels) or labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
        got = tuple(labels.shape) if torch.is_tensor(labels) else type(labels).__name__
        fail(loss, f"labels must be a ({embeddings.shape[0]},) tensor matching embeddings, got {got}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        fail(loss, f"labels must be integer class ids, got {labels.dtype}")
    if nonempty and embeddings.shape[0] == 0:
        fail(loss, "the batch is empty")
    if num_classes is not None and labels.numel() > 0:
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= num_classes:
            fail(loss, f"labels contain class id {lo if lo < 0 else hi}, outside [0, num_classes={num_classes})")
    if embeddings.dtype in _UPCAST:
        embeddings = embeddings.float()
    # One non-finite value makes every embedding NaN, so that the loss is non-finite whatever the loss masks, mines
    # or clamps (a NaN row drops out of a miner's pairs or a hinge and left contrastive, triplet and n-pair finite):
    # training's divergence rule reads the loss.  A device-side flag, no host sync; finite batches pass unchanged.
    embeddings = embeddings.masked_fill(~torch.isfinite(embeddings).all(), float("nan"))
    return embeddings, labels.long()
