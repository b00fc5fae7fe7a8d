"""The loss zoo's shared checks (``dml_core/losses/checks.py``) and their use by every registered loss."""

from __future__ import annotations

import math

import pytest
import torch

from dml_core.losses import build_loss, list_losses, loss_info
from dml_core.losses.checks import check_batch, choice, flag, integer, non_negative, number, positive, sizes
from dml_core.losses.registry import MLRC_BATCH, MLRC_MODEL

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------------ hyperparameters
@pytest.mark.parametrize(
    "kwargs,value,message",
    [
        ({}, float("nan"), r"^loss 'l': x must be a finite number, got nan$"),
        ({}, float("inf"), r"^loss 'l': x must be a finite number, got inf$"),
        ({}, "0.1", r"^loss 'l': x must be a finite number, got '0.1'$"),
        ({}, True, r"^loss 'l': x must be a finite number, got True$"),  # a YAML `true` is not 1.0
        ({"gt": 0}, 0.0, r"^loss 'l': x must be a finite number > 0, got 0.0$"),
        ({"gt": 0}, float("nan"), r"^loss 'l': x must be a finite number > 0, got nan$"),
        ({"ge": 0}, -1e-9, r"^loss 'l': x must be a finite number >= 0, got -1e-09$"),
        ({"ge": 0, "allow_inf": True}, float("nan"), r"^loss 'l': x must be a number >= 0, got nan$"),
        ({"ge": 0, "allow_inf": True}, -math.inf, r"^loss 'l': x must be a number >= 0, got -inf$"),
        ({"ge": 0, "le": 1}, 1.5, r"^loss 'l': x must be a number in \[0, 1\], got 1.5$"),
        ({"gt": 0, "le": 1}, 0, r"^loss 'l': x must be a number in \(0, 1\], got 0$"),
        (
            {"ge": 0, "null": "no miner"},
            -1,
            r"^loss 'l': x must be a finite number >= 0 \(or null for no miner\), got -1$",
        ),
    ],
)
def test_number_rejects_with_one_requirement_text(kwargs, value, message):
    with pytest.raises(ValueError, match=message):
        number("l", "x", value, **kwargs)


def test_number_accepts_and_returns_floats():
    assert number("l", "x", 3) == 3.0 and type(number("l", "x", 3)) is float
    assert number("l", "x", 0, ge=0) == 0.0
    assert number("l", "x", 1, ge=0, le=1) == 1.0
    assert number("l", "x", math.inf, ge=0, allow_inf=True) == math.inf
    assert number("l", "x", None, null="no miner") is None
    assert positive("l", "x", 1e-12) == 1e-12 and non_negative("l", "x", 0) == 0.0
    with pytest.raises(ValueError, match="x must be a finite number, got None"):
        number("l", "x", None)  # None only where the field says what it means
    with pytest.raises(TypeError, match="gt or ge"):
        number("l", "x", 1.0, gt=0, ge=0)


def test_integer_flag_choice_sizes():
    assert integer("l", "k", 10.0) == 10 and type(integer("l", "k", 10.0)) is int  # YAML / float spaces
    assert integer("l", "k", 0, ge=0) == 0 and integer("l", "k", None, null="one phase") is None
    for bad in (1.5, 0, True, "2", math.inf, math.nan, None):
        with pytest.raises(ValueError, match=r"^loss 'l': k must be an integer >= 1, got "):
            integer("l", "k", bad)
    with pytest.raises(ValueError, match=r"k must be an integer >= 0 \(or null for one phase\), got -1$"):
        integer("l", "k", -1, ge=0, null="one phase")
    assert flag("l", "f", False) is False
    with pytest.raises(ValueError, match=r"^loss 'l': f must be true or false, got 1$"):
        flag("l", "f", 1)
    assert choice("l", "c", "b", ("a", "b")) == "b"
    with pytest.raises(ValueError, match=r"^loss 'l': c must be one of \['a', 'b'\], got 'z'$"):
        choice("l", "c", "z", ("a", "b"))
    assert sizes("l", 4.0, 8) == (4, 8)
    with pytest.raises(ValueError, match=r"^loss 'l': embedding_dim must be an integer >= 1, got 0$"):
        sizes("l", 4, 0)


# ------------------------------------------------------------------------------------------------ batches
def test_check_batch_returns_compute_dtypes():
    y = torch.tensor([0, 1, 1], dtype=torch.int32)
    for dtype, expected in [
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ]:
        x, labels = check_batch("l", torch.randn(3, 2).to(dtype), y, num_classes=2, embedding_dim=2)
        assert x.dtype == expected and labels.dtype == torch.int64
    x32 = torch.randn(3, 2)
    assert torch.equal(check_batch("l", x32, y)[0], x32)  # finite float32: the same values, no conversion
    bad = x32.clone()
    bad[1, 0] = float("inf")
    assert check_batch("l", bad, y)[0].isnan().all()  # one non-finite value: all NaN, so that every loss is NaN
    assert check_batch("l", torch.randn(0, 2), torch.zeros(0, dtype=torch.long), num_classes=2)[0].shape == (0, 2)


@pytest.mark.parametrize(
    "embeddings,labels,kwargs,message",
    [
        (
            torch.randn(3),
            torch.zeros(3, dtype=torch.long),
            {},
            r"embeddings must be a \(batch, dim\) tensor, got \(3,\)",
        ),
        ([[0.0]], torch.zeros(1, dtype=torch.long), {"embedding_dim": 1}, r"a \(batch, 1\) tensor, got list"),
        (torch.ones(3, 2, dtype=torch.long), torch.zeros(3, dtype=torch.long), {}, "floating point, got torch.int64"),
        (
            torch.randn(3, 6),
            torch.zeros(3, dtype=torch.long),
            {"embedding_dim": 8},
            "dimension 6, expected embedding_dim=8",
        ),
        (
            torch.randn(3, 2),
            torch.zeros(2, dtype=torch.long),
            {},
            r"labels must be a \(3,\) tensor matching embeddings",
        ),
        (torch.randn(3, 2), [0, 1, 2], {}, r"labels must be a \(3,\) tensor matching embeddings, got list"),
        (torch.randn(3, 2), torch.zeros(3), {}, "labels must be integer class ids, got torch.float32"),
        (torch.randn(3, 2), torch.zeros(3, dtype=torch.bool), {}, "labels must be integer class ids, got torch.bool"),
        (torch.randn(0, 2), torch.zeros(0, dtype=torch.long), {"nonempty": True}, "the batch is empty"),
        (torch.randn(2, 2), torch.tensor([0, 5]), {"num_classes": 5}, r"class id 5, outside \[0, num_classes=5\)"),
        (torch.randn(2, 2), torch.tensor([-2, 4]), {"num_classes": 5}, r"class id -2, outside \[0, num_classes=5\)"),
    ],
)
def test_check_batch_names_the_loss_and_the_field(embeddings, labels, kwargs, message):
    with pytest.raises(ValueError, match=r"^loss 'l': .*" + message):
        check_batch("l", embeddings, labels, **kwargs)


# ------------------------------------------------------------------------------------------------ the whole zoo
KW = {"num_classes": 4, "embedding_dim": 8}


def _batch(dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, dim, generator=g), torch.arange(8) % 4


@pytest.mark.parametrize("name", list_losses())
def test_every_loss_names_itself_and_the_field(name):
    with pytest.raises(ValueError, match=rf"^loss '{name}': num_classes must be an integer >= 1, got 0$"):
        build_loss(name, num_classes=0, embedding_dim=8)
    loss = build_loss(name, **KW)
    x, y = _batch()
    with pytest.raises(ValueError, match=rf"^loss '{name}': labels must be integer class ids, got torch.float32$"):
        loss(x, y.float())
    with pytest.raises(
        ValueError, match=rf"^loss '{name}': embeddings must be a \(batch, (8|dim)\) tensor, got \(8,\)$"
    ):
        loss(x[:, 0], y)


@pytest.mark.parametrize("name", list_losses())
def test_a_wrong_embedding_width_is_a_named_error_or_harmless(name):
    """Losses with parameters of width embedding_dim reject other widths by name (not a matmul error deep inside);
    the tuple losses, which have no such parameters, work on any width as PML does."""
    loss = build_loss(name, **KW)
    x, y = _batch(dim=5)
    try:
        value = loss(x, y)
    except ValueError as e:
        assert str(e) == f"loss '{name}': embeddings have dimension 5, expected embedding_dim=8"
        assert any(p.shape[-1] == 8 or p.shape[0] == 8 for p in loss.parameters()), "rejected without a reason"
    else:
        assert value.dim() == 0 and torch.isfinite(value)
        assert not any(8 in p.shape for p in loss.parameters()), "a loss with width-8 parameters accepted width 5"


def test_wrappers_quote_the_composed_name():
    with pytest.raises(ValueError, match=r"^loss 'sec:triplet': sec_eta must be a finite number >= 0, got -1.0$"):
        build_loss("sec:triplet", **KW, sec_eta=-1.0)
    with pytest.raises(ValueError, match=r"^loss 'l2_reg:npair': l2_reg_eta must be a finite number >= 0, got nan$"):
        build_loss("npair", **KW, l2_reg_eta=float("nan"))
    both = build_loss("triplet", **KW, sec_eta=0.5, l2_reg_eta=1e-4)
    x, y = _batch()
    with pytest.raises(ValueError, match=r"^loss 'sec:l2_reg:triplet': labels must be a \(8,\) tensor"):
        both(x, y[:3])


def test_the_protocol_recipe_lives_in_the_registry():
    for name in ("contrastive", "triplet", "normalized_softmax", "soft_triple", "proxy_anchor", "proxynca"):
        assert loss_info(name).batch is MLRC_BATCH and loss_info(name).model is MLRC_MODEL
    assert (MLRC_BATCH.classes_per_batch, MLRC_BATCH.m) == (8, 4)
    assert (MLRC_MODEL.pooling, MLRC_MODEL.layer_norm) == ("avg", False)
