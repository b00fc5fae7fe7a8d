"""Mid-fold resume: a fold killed after k evaluations and resumed from its last checkpoint ends bit-identical to the
fold that was never interrupted (final weights, best weights, best metrics and epoch, history).

The kill is simulated by raising from ``on_checkpoint`` right after the k-th checkpoint was stored; the resumed fold
starts from a *fresh* model, loss and optimiser (other initial weights) and the state read back from storage through
:class:`dml_core.training.checkpoint.CheckpointDir` (``torch.load(weights_only=True)``).  Augmentations draw from
torch's RNG (``train_transform``), so a resume that forgot the RNG streams diverges (shown by the last test).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dml_core.training.loop as train_mod
from dml_core.data import ImageDataset, eval_transform, synthetic, train_transform
from dml_core.losses import build_loss
from dml_core.models import EmbeddingModel
from dml_core.training.checkpoint import LATEST, CheckpointDir, load_state, save_state
from dml_core.training.loop import TrainConfig, train_fold

IMAGE, DIM = 16, 8
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


class Killed(RuntimeError):
    pass


def _data():
    table = synthetic(12, 6, image_size=IMAGE, seed=0)
    classes = np.unique(table.labels)
    return (
        ImageDataset(table.subset(classes[:8]), train_transform(IMAGE)),
        ImageDataset(table.subset(classes[8:]), eval_transform(IMAGE)),
    )


def _fresh(loss_name: str, init_seed: int):
    torch.manual_seed(init_seed)
    model = EmbeddingModel(trunk="tiny", embedding_dim=DIM, freeze_bn=False)
    loss = build_loss(loss_name, num_classes=8, embedding_dim=DIM)
    return model, loss


def _config(**kw) -> TrainConfig:
    base = dict(
        classes_per_batch=4,
        m=2,
        iters_per_epoch=3,
        max_epochs=7,
        eval_every=1,
        patience=None,
        trunk_lr=1e-3,
        embedder_lr=2e-3,
        loss_lr=5e-2,
        eval_batch_size=16,
        seed=3,
        device="cpu",
    )
    return TrainConfig(**{**base, **kw})


def _comparable(history):
    """History without its wall-clock fields (they can never be bit-identical)."""
    return [{k: v for k, v in r.items() if k not in ("seconds", "eval_seconds")} for r in history]


def _run(loss_name, config, ckpt_dir=None, kill_after=None, resume=False):
    """One fold.  ``kill_after=k``: raise once the k-th checkpoint is stored.  ``resume``: fresh modules (other
    initial weights) resumed from ``ckpt_dir``'s latest state."""
    train, val = _data()
    model, loss = _fresh(loss_name, init_seed=99 if resume else 7)
    store = CheckpointDir(str(ckpt_dir)) if ckpt_dir is not None else None
    saved = []

    def on_checkpoint(state):
        store.save(state)
        saved.append(state["iteration"])
        if kill_after is not None and len(saved) == kill_after:
            raise Killed(f"killed after checkpoint {kill_after}")

    state = store.load() if resume else None
    res = train_fold(
        model, loss, train, val, config, on_checkpoint=on_checkpoint if store else None, resume_state=state
    )
    return res, model, loss, saved


def _assert_identical(a, b):
    res_a, model_a, loss_a = a
    res_b, model_b, loss_b = b
    assert (res_a.status, res_a.reason, res_a.best_epoch, res_a.iterations, res_a.epochs, res_a.stopped_early) == (
        res_b.status,
        res_b.reason,
        res_b.best_epoch,
        res_b.iterations,
        res_b.epochs,
        res_b.stopped_early,
    )
    assert res_a.best_metrics == res_b.best_metrics
    assert _comparable(res_a.history) == _comparable(res_b.history)
    for mod_a, mod_b in ((model_a, model_b), (loss_a, loss_b)):
        sa, sb = mod_a.state_dict(), mod_b.state_dict()
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), f"final {k}"
    for part in ("model", "loss"):
        for k, v in res_a.best_state[part].items():
            assert torch.equal(v, res_b.best_state[part][k]), f"best {part} {k}"


@pytest.mark.parametrize("loss_name", ["contrastive", "proxynca_pp"])
def test_resumed_fold_is_bit_identical_to_the_uninterrupted_one(tmp_path, loss_name):
    config = _config()
    ref = _run(loss_name, config)
    with pytest.raises(Killed):
        _run(loss_name, config, tmp_path / "ckpt", kill_after=4)  # epochs 0..3 evaluated and checkpointed
    # only the latest state and the one holding the best weights are kept
    assert len(list((tmp_path / "ckpt").glob("state-*.pt"))) <= 2
    assert (tmp_path / "ckpt" / LATEST).exists()
    res, model, loss, saved = _run(loss_name, config, tmp_path / "ckpt", resume=True)
    assert saved[0] == 4 * config.iters_per_epoch  # the first new evaluation is epoch 4's: nothing redone
    _assert_identical(ref[:3], (res, model, loss))
    if loss_name == "proxynca_pp":  # the loss's parameters did train (else their equality proves nothing)
        assert any(p.requires_grad for p in loss.parameters())
        init = _fresh(loss_name, init_seed=7)[1].state_dict()
        assert any(not torch.equal(v, init[k]) for k, v in loss.state_dict().items())


@pytest.mark.parametrize("kill_after", [2, 4])  # killed in the warm-up (iteration 3) or in the decay (iteration 9)
def test_a_fold_with_an_lr_schedule_resumes_bit_identical(tmp_path, kill_after):
    config = _config(lr_warmup_iters=5, lr_schedule="cosine")
    ref = _run("proxynca_pp", config)
    with pytest.raises(Killed):
        _run("proxynca_pp", config, tmp_path / "ckpt", kill_after=kill_after)
    res, model, loss, saved = _run("proxynca_pp", config, tmp_path / "ckpt", resume=True)
    assert saved[0] == kill_after * config.iters_per_epoch
    _assert_identical(ref[:3], (res, model, loss))


def test_a_state_written_before_the_schedule_option_resumes_without_one(tmp_path):
    """An older state has neither ``scheduler`` nor the schedule's config fields: it resumes as it was written (no
    schedule) and is refused by a config that has one, as is a cosine fold resumed with another length."""
    config = _config(max_epochs=4)
    states = []
    ref = _run_with(config, on_checkpoint=states.append)
    old = {k: v for k, v in states[2].items() if k != "scheduler"}
    old["config"] = {k: v for k, v in old["config"].items() if not k.startswith("lr_")}
    _assert_identical(ref, _run_with(config, resume_state=old, init_seed=99))
    with pytest.raises(ValueError, match="lr_schedule='constant' \\(now 'cosine'\\)"):
        _run_with(_config(max_epochs=4, lr_schedule="cosine"), resume_state=old)
    cosine = []
    _run_with(_config(max_epochs=4, lr_schedule="cosine"), on_checkpoint=cosine.append)
    with pytest.raises(ValueError, match="max_epochs=4 \\(now 5\\)"):
        _run_with(_config(max_epochs=5, lr_schedule="cosine"), resume_state=cosine[2])


def test_early_stopping_patience_counts_across_the_interruption(tmp_path):
    config = _config(max_epochs=30, patience=2, trunk_lr=3e-2, embedder_lr=3e-2)
    ref = _run("contrastive", config)
    res = ref[0]
    assert res.stopped_early, res.reason
    # interrupt right after an evaluation that did not improve on the best, i.e. with the patience counter running
    k = next(i for i, r in enumerate(res.history) if r["epoch"] - r["best_epoch"] >= 1)
    assert k < len(res.history) - 1, "the interruption must come before the stopping evaluation"
    with pytest.raises(Killed):
        _run("contrastive", config, tmp_path / "ckpt", kill_after=k + 1)
    got = _run("contrastive", config, tmp_path / "ckpt", resume=True)
    _assert_identical(ref[:3], got[:3])


def test_killed_after_the_stopping_evaluation_resumes_to_the_same_result(tmp_path):
    config = _config(max_epochs=30, patience=2, trunk_lr=3e-2, embedder_lr=3e-2)
    ref = _run("contrastive", config)
    with pytest.raises(Killed):
        _run("contrastive", config, tmp_path / "ckpt", kill_after=len(ref[0].history))  # the very last checkpoint
    got = _run("contrastive", config, tmp_path / "ckpt", resume=True)
    assert got[3] == []  # nothing trained again
    _assert_identical(ref[:3], got[:3])


def test_resume_without_restoring_the_rng_streams_diverges(tmp_path, monkeypatch):
    """The test above can fail: with the RNG restore switched off the resumed fold draws other augmentations."""
    config = _config()
    ref = _run("contrastive", config)
    with pytest.raises(Killed):
        _run("contrastive", config, tmp_path / "ckpt", kill_after=3)
    monkeypatch.setattr(train_mod, "set_rng_state", lambda *a, **k: None)
    res, model, _, _ = _run("contrastive", config, tmp_path / "ckpt", resume=True)
    final = model.state_dict()
    assert any(not torch.equal(v, final[k]) for k, v in ref[1].state_dict().items())


def test_state_file_round_trip_and_config_mismatch(tmp_path):
    config = _config(max_epochs=2)
    states = []
    train, val = _data()
    model, loss = _fresh("contrastive", 7)
    train_fold(model, loss, train, val, config, on_checkpoint=states.append)
    assert [s["epoch"] for s in states] == [0, 1, 2]
    save_state(states[1], tmp_path / "s.pt")
    back = load_state(tmp_path / "s.pt")  # weights_only=True
    assert back["iteration"] == 3 and back["rng"][0]["loader"].dtype == torch.uint8
    for k, v in states[1]["optimizer"]["state"].items():
        for name, t in v.items():
            assert torch.equal(t, back["optimizer"]["state"][k][name])
    model, loss = _fresh("contrastive", 7)
    with pytest.raises(ValueError, match="trunk_lr"):
        train_fold(model, loss, train, val, _config(max_epochs=2, trunk_lr=1.0), resume_state=back)


def _ddp_resume_worker(rank: int, world: int, path: str):
    import torch.distributed as dist

    config = _config(max_epochs=4)
    states = []
    ref = _run_with(config, on_checkpoint=states.append)
    if rank == 0:
        assert all(len(s["rng"]) == world for s in states)  # every rank's RNG streams are in rank 0's state
        save_state(states[2], path)
    dist.barrier()
    got = _run_with(config, resume_state=load_state(path), init_seed=99)
    out = {}
    for name, (res, model, loss) in (("ref", ref), ("got", got)):
        out[name] = dict(
            model={k: v.clone() for k, v in model.state_dict().items()},
            loss={k: v.clone() for k, v in loss.state_dict().items()},
            history=_comparable(res.history),
            best=res.best_metrics,
        )
    return out


def _run_with(config, *, init_seed=7, **kw):
    train, val = _data()
    model, loss = _fresh("proxynca_pp", init_seed)
    res = train_fold(model, loss, train, val, config, **kw)
    return res, model, loss


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_ranks_resume_at_the_same_iteration_with_their_own_rng_streams(tmp_path):
    from ddp_util import run_ddp

    ranks = run_ddp(_ddp_resume_worker, 2, str(tmp_path / "state.pt"))
    for r, out in enumerate(ranks):
        assert out["got"]["history"] == out["ref"]["history"] and out["got"]["best"] == out["ref"]["best"], r
        for part in ("model", "loss"):
            for k, v in out["ref"][part].items():
                assert torch.equal(v, out["got"][part][k]), (r, part, k)


def test_fold_checkpoints_count_restarts_and_survive_storage_trouble(tmp_path, capsys):
    """pipelines.execution.folds.fold's use of a checkpoint directory: attempts, resumed_from and redone iterations
    across starts; a state that cannot be stored is a warning, not the end of the fold."""
    from pipelines.execution.folds.fold import _Checkpoints

    uri = str(tmp_path / "ckpt")
    first = _Checkpoints(uri, enabled=True, label="f", rank=0)
    assert first.resume_state() is None
    first.start(None, last_logged=0)
    assert (first.restarts, first.resumed_from, first.redone_iterations) == (0, [], 0)
    states = []
    train, val = _data()
    model, loss = _fresh("contrastive", 7)
    train_fold(model, loss, train, val, _config(max_epochs=2), on_checkpoint=states.append)
    first.save(states[1])  # iteration 3 stored; the attempt then got to iteration 5 before it was killed
    first.progress(epoch=2, iteration=5)

    second = _Checkpoints(uri, enabled=True, label="f", rank=0)
    state = second.resume_state()
    assert state["iteration"] == 3
    second.start(state, last_logged=3)
    assert (second.restarts, second.resumed_from, second.redone_iterations) == (1, [3], 2)

    def broken(_state):
        raise ConnectionError("S3 is down")

    second.store.save = broken
    second.save(states[2])  # no exception
    assert "S3 is down" in capsys.readouterr().err
    third = _Checkpoints(uri, enabled=True, label="f", rank=0)
    third.start(third.resume_state(), last_logged=0)
    assert (third.restarts, third.resumed_from, third.redone_iterations) == (2, [3, 3], 2)


def test_resuming_leaves_the_callers_state_as_it_was(tmp_path):
    """The state a fold resumes from is read, not trained in: resuming twice from one state object (a retry in the
    same process) starts twice from the same point."""
    config = _config(max_epochs=4, optimizer="adam")
    with pytest.raises(Killed):
        _run("proxynca_pp", config, tmp_path, kill_after=2)
    state = CheckpointDir(str(tmp_path)).load()
    before = {k: v.clone() for k, v in _tensors(state).items()}
    train, val = _data()
    model, loss = _fresh("proxynca_pp", init_seed=99)
    train_fold(model, loss, train, val, config, resume_state=state)
    after = _tensors(state)
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert not changed, f"train_fold changed the resume state it was given: {changed[:5]}"


def _tensors(obj, prefix="") -> dict[str, torch.Tensor]:
    """Every tensor in a nested dict/list, by its path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(_tensors(v, f"{prefix}/{k}"))
    return out
