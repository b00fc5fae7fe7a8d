"""train_fold / embed: history and early-stopping semantics, divergence, determinism, optimiser groups,
label remapping, and DDP equivalence (2 gloo ranks × 16 = 1 process × 32)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dml_core.training.loop as train_mod
from dml_core.data import ImageDataset, synthetic, train_transform
from dml_core.models import EmbeddingModel
from dml_core.training.loop import FoldResult, TrainConfig, _optimizer, embed, train_fold

IMAGE = 16


# ------------------------------------------------------------------------------------ fixtures
class PairLoss(nn.Module):
    """Smooth contrastive-style pair loss on L2-normalised embeddings (no parameters).

    Mean squared distance of positive pairs + mean softplus(4·(1 − d²)) over negative pairs.
    Records every value it returns (``values``) so tests can compare per-iteration losses.
    """

    def __init__(self):
        super().__init__()
        self.values: list[float] = []

    def forward(self, emb, labels):
        z = F.normalize(emb, dim=1)
        d2 = (2 - 2 * z @ z.T).clamp_min(0)
        same = labels[:, None] == labels[None, :]
        off = ~torch.eye(len(labels), dtype=torch.bool, device=emb.device)
        pos, neg = same & off, ~same
        value = d2[pos].mean() + F.softplus(4 * (1 - d2[neg])).mean()
        self.values.append(float(value.detach()))
        return value


class ProxyLoss(nn.Module):
    """ProxyNCA-style: softmax over −scale·‖ẑ − p̂_c‖² with one learnable proxy per class."""

    def __init__(self, num_classes: int, dim: int, scale: float = 3.0):
        super().__init__()
        self.num_classes = num_classes
        self.proxies = nn.Parameter(torch.randn(num_classes, dim))
        self.scale = scale
        self.values: list[float] = []

    def forward(self, emb, labels):
        if int(labels.max()) >= self.num_classes or int(labels.min()) < 0:
            raise AssertionError(f"labels {labels.tolist()} outside [0, {self.num_classes})")
        d2 = torch.cdist(F.normalize(emb, dim=1), F.normalize(self.proxies, dim=1)).pow(2)
        value = F.cross_entropy(-self.scale * d2, labels)
        self.values.append(float(value.detach()))
        return value


class NaNAt(nn.Module):
    """Wraps a loss and returns NaN at call ``k`` (1-based)."""

    def __init__(self, base: nn.Module, k: int):
        super().__init__()
        self.base, self.k, self.calls = base, k, 0

    def forward(self, emb, labels):
        self.calls += 1
        value = self.base(emb, labels)
        return value * float("nan") if self.calls == self.k else value


def make_data(num_classes=12, per_class=6, train_classes=8, transform=None, seed=0):
    table = synthetic(num_classes, per_class, image_size=IMAGE, seed=seed)
    classes = np.unique(table.labels)
    train = ImageDataset(table.subset(classes[:train_classes]), transform)
    val = ImageDataset(table.subset(classes[train_classes:]))
    return train, val


def make_model(seed=0, dim=8):
    torch.manual_seed(seed)
    return EmbeddingModel(trunk="tiny", embedding_dim=dim)


def config(**kw) -> TrainConfig:
    base = dict(
        classes_per_batch=4,
        m=2,
        iters_per_epoch=2,
        max_epochs=2,
        eval_every=1,
        patience=None,
        eval_batch_size=16,
        seed=0,
        device="cpu",
    )
    base.update(kw)
    return TrainConfig(**base)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


# ------------------------------------------------------------------------------------ single process
def test_single_process_run_history_and_best_state():
    train, val = make_data()
    model = make_model()
    before = _params(model)
    records = []
    res = train_fold(model, PairLoss(), train, val, config(trunk_lr=1e-3, embedder_lr=1e-3), on_eval=records.append)
    assert isinstance(res, FoldResult) and res.status == "ok" and res.reason == ""
    assert [r["epoch"] for r in res.history] == [0, 1, 2]
    assert [r["iteration"] for r in res.history] == [0, 2, 4]
    assert res.iterations == 4 and res.epochs == 2 and not res.stopped_early
    assert res.history[0]["train_loss"] is None  # epoch 0 = untrained, nothing trained yet
    assert all(math.isfinite(r["train_loss"]) for r in res.history[1:])
    for r in res.history:
        assert {"map_at_r", "r_precision", "precision_at_1"} <= set(r["metrics"])
        assert r["seconds"] >= r["eval_seconds"] >= 0
    assert records == res.history, "on_eval must see every record, in order"
    scores = [r["metrics"]["map_at_r"] for r in res.history]
    assert res.best_epoch == res.history[int(np.argmax(scores))]["epoch"]
    assert res.best_metrics == res.history[int(np.argmax(scores))]["metrics"]
    assert set(res.best_state) == {"model", "loss"}
    assert set(res.best_state["model"]) == set(model.state_dict())
    assert all(t.device.type == "cpu" for t in res.best_state["model"].values())
    assert any(not torch.equal(before[k], v) for k, v in _params(model).items()), "model did not train"
    assert res.train_seconds > 0


def test_train_loss_is_the_mean_since_the_last_eval():
    train, val = make_data()
    loss = PairLoss()
    res = train_fold(make_model(), loss, train, val, config(iters_per_epoch=3, max_epochs=2, eval_every=1))
    v = loss.values
    assert len(v) == 6
    assert res.history[1]["train_loss"] == pytest.approx(np.mean(v[:3]), rel=1e-6)
    assert res.history[2]["train_loss"] == pytest.approx(np.mean(v[3:]), rel=1e-6)


def test_early_stopping_follows_epoch_minus_best_epoch_greater_than_patience(monkeypatch):
    # Scripted val MAP@R per evaluation (evals at epochs 0, 2, 4, ...): best epoch 6; with patience 3
    # epoch 8 (8-6=2) continues and epoch 10 (10-6=4 > 3) stops.  The best state is the epoch-6 one.
    scores = iter([0.1, 0.3, 0.2, 0.5, 0.4, 0.45, 0.9])
    monkeypatch.setattr(train_mod, "_evaluate", lambda *a, **k: {"map_at_r": next(scores)})
    snapshots = {}
    model = make_model()

    def on_eval(r):
        snapshots[r["epoch"]] = {k: v.clone() for k, v in model.state_dict().items()}

    train, val = make_data()
    cfg = config(iters_per_epoch=1, max_epochs=50, eval_every=2, patience=3, trunk_lr=1e-3, embedder_lr=1e-3)
    res = train_fold(model, PairLoss(), train, val, cfg, on_eval=on_eval)
    assert [r["epoch"] for r in res.history] == [0, 2, 4, 6, 8, 10]
    assert [r["is_best"] for r in res.history] == [True, True, False, True, False, False]
    assert res.best_epoch == 6 and res.best_metrics == {"map_at_r": 0.5}
    assert res.stopped_early and res.status == "ok" and res.epochs == 10 and res.iterations == 10
    for k, v in res.best_state["model"].items():
        assert torch.equal(v, snapshots[6][k]), k
    assert any(not torch.equal(res.best_state["model"][k], snapshots[10][k]) for k in snapshots[10])


def test_untrained_model_can_stay_best_and_patience_triggers():
    # lr 0: nothing changes, every eval equals epoch 0's, which stays best (first max wins).
    train, val = make_data()
    cfg = config(trunk_lr=0.0, embedder_lr=0.0, max_epochs=20, patience=2, iters_per_epoch=1)
    res = train_fold(make_model(), PairLoss(), train, val, cfg)
    assert [r["epoch"] for r in res.history] == [0, 1, 2, 3]
    assert res.best_epoch == 0 and res.stopped_early
    assert all(r["metrics"] == res.history[0]["metrics"] for r in res.history)


class NaNEmbeddings(nn.Module):
    """Wraps a model: from forward call ``k`` (1-based) on, the embeddings of training batches are NaN (in eval mode
    too with ``also_eval``); with ``one_row`` only the batch's first row is."""

    def __init__(self, base: nn.Module, k: int, also_eval: bool = False, one_row: bool = False):
        super().__init__()
        self.base, self.k, self.calls, self.also_eval, self.one_row = base, k, 0, also_eval, one_row
        self.trunk, self.embedder = base.trunk, base.embedder

    def forward(self, images):
        out = self.base(images)
        if self.training:
            self.calls += 1
        if (self.training and self.calls >= self.k) or (self.also_eval and not self.training):
            out = torch.cat([out[:1] * float("nan"), out[1:]]) if self.one_row else out * float("nan")
        return out


class MaskedLoss(nn.Module):
    """PairLoss over the finite rows only: NaN embeddings give a finite loss (the case the loop must still catch)."""

    def forward(self, emb, labels):
        keep = torch.isfinite(emb).all(dim=1)
        if keep.sum() < 2:
            return emb.new_zeros(()) + 0.0 * torch.nan_to_num(emb).sum()
        return PairLoss()(emb[keep], labels[keep])


@pytest.mark.parametrize("one_row", [False, True])
def test_non_finite_embeddings_end_the_fold_diverged_even_when_the_loss_stays_finite(one_row):
    train, val = make_data()
    model = NaNEmbeddings(make_model(), 3, one_row=one_row)
    res = train_fold(model, MaskedLoss(), train, val, config(iters_per_epoch=2, max_epochs=5))
    assert res.status == "diverged" and "non-finite embeddings" in res.reason and "iteration 3" in res.reason
    assert res.iterations == 3


def _ddp_nan_row_worker(rank: int, world: int):
    train, val = make_data()
    model = NaNEmbeddings(make_model(), 3 if rank == 1 else 10**9, one_row=True)  # rank 1's third batch only
    res = train_fold(model, MaskedLoss(), train, val, config(iters_per_epoch=2, max_epochs=5))
    return res.status, res.reason, res.iterations


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_every_rank_ends_diverged_when_one_ranks_embedding_row_is_non_finite():
    """Rank 0's own embeddings and the masked loss stay finite: it stops with rank 1 (the AND over ranks), no hang."""
    from ddp_util import run_ddp

    ranks = run_ddp(_ddp_nan_row_worker, 2)
    assert ranks[0] == ranks[1] == ("diverged", "non-finite embeddings (NaN/inf features) at iteration 3 (epoch 2)", 3)


def test_non_finite_validation_embeddings_end_the_fold_diverged_not_at_chance_level():
    """An overflowing pooling makes every embedding NaN: reported as such, not as a run whose metrics are chance."""
    train, val = make_data()
    res = train_fold(NaNEmbeddings(make_model(), 10**9, also_eval=True), PairLoss(), train, val, config())
    assert res.status == "diverged" and "non-finite validation embeddings" in res.reason, res.reason
    assert res.history == [] and res.iterations == 0


@pytest.mark.parametrize("k,evals,best_after", [(1, [0], 0), (3, [0, 1], None), (5, [0, 1, 2], None)])
def test_non_finite_loss_returns_diverged_without_raising(k, evals, best_after):
    train, val = make_data()
    cfg = config(iters_per_epoch=2, max_epochs=10, trunk_lr=1e-3, embedder_lr=1e-3)
    res = train_fold(make_model(), NaNAt(PairLoss(), k), train, val, cfg)
    assert res.status == "diverged"
    assert f"iteration {k}" in res.reason and "non-finite loss" in res.reason
    assert res.iterations == k
    assert [r["epoch"] for r in res.history] == evals
    assert res.best_metrics and res.best_state  # the evaluations before the NaN still count
    if best_after is not None:
        assert res.best_epoch == best_after


def test_same_seed_is_deterministic_other_seed_differs():
    train, val = make_data(transform=train_transform(IMAGE))  # random augmentation drawn from torch's RNG

    def run(seed):
        model = make_model()
        res = train_fold(model, PairLoss(), train, val, config(seed=seed, trunk_lr=1e-3, embedder_lr=1e-3))
        return res, model.state_dict()

    (a, sa), (b, sb), (c, _) = run(0), run(0), run(1)
    assert [r["metrics"] for r in a.history] == [r["metrics"] for r in b.history]
    assert [r["train_loss"] for r in a.history] == [r["train_loss"] for r in b.history]
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert [r["train_loss"] for r in a.history] != [r["train_loss"] for r in c.history]


def test_amp_is_ignored_on_cpu():
    train, val = make_data()
    runs = [
        train_fold(make_model(), PairLoss(), train, val, config(amp=amp, max_epochs=1, trunk_lr=1e-3, embedder_lr=1e-3))
        for amp in (False, True)
    ]
    assert runs[0].history[-1]["train_loss"] == runs[1].history[-1]["train_loss"]
    assert runs[0].best_metrics == runs[1].best_metrics


@pytest.mark.parametrize("option", ["cpu_amp", "channels_last"])
def test_cpu_speed_options_train_and_stay_close_to_fp32(option):
    """bf16 autocast on CPU and channels-last memory: the fold trains, the parameters stay fp32 (bf16 is the forward
    only), channels-last reaches the conv weights, and the first loss stays close to the fp32 run's (same batch)."""
    train, val = make_data()
    ref_loss = PairLoss()
    train_fold(make_model(seed=3), ref_loss, train, val, config(iters_per_epoch=2, max_epochs=1))
    model, loss = make_model(seed=3), PairLoss()
    res = train_fold(model, loss, train, val, config(iters_per_epoch=2, max_epochs=1, **{option: True}))
    assert res.status == "ok", res.reason
    assert all(p.dtype == torch.float32 for p in model.parameters())
    if option == "channels_last":
        conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
        assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    tol = 5e-2 if option == "cpu_amp" else 1e-4  # bf16 keeps 8 bits of mantissa
    assert loss.values[0] == pytest.approx(ref_loss.values[0], rel=tol)


def test_optimiser_groups_trunk_embedder_loss():
    model = make_model()
    cfg = config()
    opt = _optimizer(model, PairLoss(), cfg)
    assert [g["name"] for g in opt.param_groups] == ["trunk", "embedder"], "no loss group without parameters"
    opt = _optimizer(model, ProxyLoss(4, 8), config(loss_lr=0.25, loss_weight_decay=0.0))
    assert isinstance(opt, torch.optim.RMSprop)
    assert [g["name"] for g in opt.param_groups] == ["trunk", "embedder", "loss"]
    trunk, emb, loss = opt.param_groups
    assert (trunk["lr"], trunk["weight_decay"], trunk["momentum"]) == (1e-6, 1e-4, 0.9)  # docs/protocol.md §Optimisers
    assert (emb["lr"], emb["weight_decay"], emb["momentum"]) == (1e-6, 1e-4, 0.9)
    assert (loss["lr"], loss["weight_decay"], loss["momentum"]) == (0.25, 0.0, 0.9)
    assert {id(p) for p in trunk["params"]} == {id(p) for p in model.trunk.parameters()}
    assert {id(p) for p in emb["params"]} == {id(p) for p in model.embedder.parameters()}


def test_each_group_uses_its_own_learning_rate():
    train, val = make_data()
    model, loss = make_model(), ProxyLoss(8, 8)
    t0, e0, l0 = _params(model.trunk), _params(model.embedder), _params(loss)
    cfg = config(trunk_lr=0.0, embedder_lr=1e-2, loss_lr=1e-2, max_epochs=1)
    assert train_fold(model, loss, train, val, cfg).status == "ok"
    assert all(torch.equal(t0[k], v) for k, v in _params(model.trunk).items())
    assert any(not torch.equal(e0[k], v) for k, v in _params(model.embedder).items())
    assert any(not torch.equal(l0[k], v) for k, v in _params(loss).items())


def test_train_labels_are_remapped_to_contiguous_ids():
    # Train classes 3..11 except 6 (non-contiguous, like an MLRC fold that wraps around).
    table = synthetic(12, 4, image_size=IMAGE, seed=1)
    train = ImageDataset(table.subset([3, 4, 5, 7, 8, 9, 10, 11]))
    val = ImageDataset(table.subset([0, 1, 2, 6]))
    loss = ProxyLoss(8, 8)  # asserts 0 <= label < 8
    assert train_fold(make_model(), loss, train, val, config(max_epochs=1)).status == "ok"
    with pytest.raises(ValueError, match="num_classes=5 but train_set has 8 classes"):
        train_fold(make_model(), ProxyLoss(5, 8), train, val, config(max_epochs=1))


def test_embed_returns_rows_in_order_and_restores_mode():
    _, val = make_data()
    model = make_model()
    model.train()
    emb, labels = embed(model, val, batch_size=5, device="cpu")
    assert model.training
    model.eval()
    with torch.no_grad():
        ref = model(torch.stack([val[i][0] for i in range(len(val))]))
    assert emb.shape == (len(val), 8) and emb.dtype == torch.float32
    torch.testing.assert_close(emb, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(labels, torch.as_tensor(val.labels))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(m=0), "TrainConfig.m must be a positive integer"),
        (dict(patience=-1), "TrainConfig.patience"),
        (dict(loss_lr=float("nan")), "TrainConfig.loss_lr"),
        (dict(optimizer="adamw"), "TrainConfig.optimizer"),
        (dict(amp_dtype="int8"), "TrainConfig.amp_dtype"),
    ],
)
def test_bad_config_names_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        config(**kw)


def test_bad_inputs_raise_clear_errors():
    train, val = make_data()
    with pytest.raises(ValueError, match=r"\.trunk submodule"):
        train_fold(nn.Linear(3, 2), PairLoss(), train, val, config())
    with pytest.raises(ValueError, match="train_set must expose .labels"):
        train_fold(make_model(), PairLoss(), torch.utils.data.TensorDataset(torch.zeros(4, 3)), val, config())
    with pytest.raises(ValueError, match="TrainConfig.device"):
        train_fold(
            make_model(), PairLoss(), train, val, config(device="cuda:7" if not torch.cuda.is_available() else "bogus")
        )
    with pytest.raises(ValueError, match="classes, fewer than classes_per_batch = 9"):
        train_fold(make_model(), PairLoss(), train, val, config(classes_per_batch=9))


# ------------------------------------------------------------------------------------ DDP
DDP_CFG = dict(
    classes_per_batch=8,
    m=4,
    iters_per_epoch=2,
    max_epochs=1,
    eval_every=1,
    optimizer="sgd",
    momentum=0.9,
    trunk_lr=0.05,
    embedder_lr=0.05,
    loss_lr=0.05,
    weight_decay=0.0,
    loss_weight_decay=0.0,
    eval_batch_size=4,
)


def _ddp_scenarios(optimizer: str, device: str = "cpu"):
    """(loss factory, config) pairs; val has 4 × 5 + 1 rows: uneven shards on 2 ranks."""
    cfg = config(**{**DDP_CFG, "optimizer": optimizer, "device": device})
    return [
        ("pair", lambda: PairLoss(), cfg),
        ("proxy", lambda: ProxyLoss(8, 8), cfg),
        ("nan", lambda: NaNAt(PairLoss(), 2), cfg),  # every rank must stop at iteration 2 (no hang)
    ]


def _run_scenarios(optimizer: str, device: str = "cpu"):
    table = synthetic(12, 6, image_size=IMAGE, seed=0)
    train = ImageDataset(table.subset(range(8)))
    val = ImageDataset(table.take(np.r_[np.flatnonzero(table.labels >= 8), 0]))  # 25 rows, one of class 0
    out = {}
    for name, make_loss, cfg in _ddp_scenarios(optimizer, device):
        model = make_model(seed=3)
        torch.manual_seed(4)
        loss = make_loss()
        res = train_fold(model, loss, train, val, cfg)
        emb, _ = embed(model, val, batch_size=3)  # on the model's device
        out[name] = dict(
            values=(loss.base if isinstance(loss, NaNAt) else loss).values,
            reason=res.reason,
            model={k: v.detach().clone() for k, v in model.state_dict().items()},
            loss={k: v.detach().clone() for k, v in loss.state_dict().items()},
            history=[(r["epoch"], r["metrics"], r["train_loss"]) for r in res.history],
            status=res.status,
            emb=emb,
        )
    return out


def _ddp_worker(rank: int, world: int, optimizer: str):
    return _run_scenarios(optimizer)


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_two_ranks_of_16_equal_one_process_of_32():
    # SGD with momentum makes the update proportional to the gradient, so a wrong DDP gradient scale
    # (e.g. ×W) shows up.  Not RMSprop: its first step is ≈ lr·sign(g), blind to the scale and
    # amplifying float noise in near-zero gradient entries far beyond 1e-5.
    from ddp_util import run_ddp

    optimizer = "sgd"

    ref = _run_scenarios(optimizer)
    ranks = run_ddp(_ddp_worker, 2, optimizer)
    init = make_model(seed=3).state_dict()
    nan = ref.pop("nan")
    assert nan["status"] == "diverged" and "iteration 2" in nan["reason"]
    for got in ranks:
        assert (got["nan"]["status"], got["nan"]["reason"]) == ("diverged", nan["reason"])
    for name, single in ref.items():
        for r, got in enumerate(ranks):
            got = got[name]
            assert got["status"] == single["status"] == "ok"
            np.testing.assert_allclose(
                got["values"], single["values"], rtol=1e-5, atol=1e-6, err_msg=f"{name} rank {r}"
            )
            for k, v in single["model"].items():
                if v.is_floating_point():
                    torch.testing.assert_close(
                        got["model"][k] - init[k], v - init[k], rtol=1e-5, atol=1e-5, msg=f"{name} {k}"
                    )
            for k, v in single["loss"].items():
                torch.testing.assert_close(got["loss"][k], v, rtol=1e-5, atol=1e-5, msg=f"{name} loss {k}")
            torch.testing.assert_close(got["emb"], single["emb"], rtol=1e-5, atol=1e-6)
            for (e1, m1, l1), (e2, m2, l2) in zip(got["history"], single["history"]):
                assert e1 == e2
                assert m1 == pytest.approx(m2, abs=1e-6)
                assert (l1 is None and l2 is None) or l1 == pytest.approx(l2, rel=1e-5)
        # every rank holds the same weights after training
        for k, v in ranks[0][name]["model"].items():
            assert torch.equal(v, ranks[1][name]["model"][k]), k
    # the update is not trivially zero (else equality would prove nothing)
    moved = max(float((ref["pair"]["model"][k] - init[k]).abs().max()) for k in init if init[k].is_floating_point())
    assert moved > 1e-4
