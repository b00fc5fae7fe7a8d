"""Sweep-config validation: every bad input is one error naming its field, raised before Ray or MLflow start."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipelines.config import ConfigError, check_tracking_uri, check_uri, load_config, parse_config
from pipelines.presets import DEMO, demo_config

ROOT = Path(__file__).resolve().parents[1]


def _cfg(**changes):
    """The demo preset with dotted-path changes, e.g. ``_cfg(**{"protocol.trials": 0})``."""
    doc = copy.deepcopy(DEMO)
    for path, value in changes.items():
        node = doc
        keys = path.split(".")
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node.setdefault(k, {})
        if isinstance(node, list):
            node[int(keys[-1])] = value
        else:
            node[keys[-1]] = value
    return doc


def _error(doc) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    return info.value


@pytest.mark.parametrize("name", ["demo", "omniglot", "mlrc-cub200"])
def test_shipped_presets_parse(name):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    assert cfg.name == name
    assert cfg.protocol.folds == 4 and cfg.protocol.fold_layout == "mlrc"
    assert all(ls.space is not None for ls in cfg.losses)


def test_mlrc_preset_is_the_papers_protocol():
    p = load_config(ROOT / "configs" / "mlrc-cub200.yaml").protocol
    assert (p.trials, p.startup_trials, p.reproductions) == (50, 5, 10)
    assert (p.iters_per_epoch, p.eval_every, p.patience) == (100, 2, 9)
    assert p.train["classes_per_batch"] * p.train["m"] == 32 and p.train["trunk_lr"] == 1e-6


def test_builtin_demo_equals_configs_demo_yaml():
    from_file = load_config(ROOT / "configs" / "demo.yaml").to_dict()
    built_in = parse_config(demo_config("demo")).to_dict()
    assert from_file == built_in


def test_demo_has_three_losses_two_from_seed_papers_and_two_gloo_workers():
    cfg = parse_config(DEMO)
    names = [ls.name for ls in cfg.losses]
    assert len(names) >= 3 and len({"proxynca_pp", "mpa", "rsw", "group_loss"} & set(names)) >= 2
    assert cfg.resources.workers_per_fold == 2 and not cfg.resources.use_gpu
    assert cfg.protocol.reproductions == 2


def test_demo_names_are_fresh():
    assert demo_config()["name"].startswith("demo-")
    assert demo_config("x")["name"] == "x"


def test_unknown_loss_names_the_field_and_the_known_losses():
    e = _error(_cfg(**{"losses.1": {"name": "mpaa"}}))
    assert e.field == "losses[1].name"
    assert str(e).startswith("losses[1].name: unknown loss 'mpaa' (known: ")
    assert "contrastive" in str(e) and "mpa" in str(e)


def test_loss_may_be_given_as_a_bare_name():
    cfg = parse_config(_cfg(losses=["contrastive", {"name": "mpa"}]))
    assert [ls.name for ls in cfg.losses] == ["contrastive", "mpa"]


def test_out_of_range_parameter_names_the_field():
    e = _error(_cfg(**{"losses.0": {"name": "contrastive", "params": {"pos_margin": 7.0}}}))
    assert e.field == "losses[0].params.pos_margin"
    assert "outside the search space" in str(e)


def test_pinned_parameter_is_removed_from_the_search():
    cfg = parse_config(_cfg(**{"losses.0": {"name": "contrastive", "params": {"pos_margin": 0.0}}}))
    ls = cfg.losses[0]
    assert "pos_margin" not in ls.searched() and ls.fixed()["pos_margin"] == 0.0


def test_duplicate_loss_is_rejected():
    e = _error(_cfg(losses=["contrastive", "contrastive"]))
    assert e.field == "losses[1].name"


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"protocol.trials": 0}, "protocol.trials"),
        ({"protocol.trials": "many"}, "protocol.trials"),
        ({"protocol.reproductions": 1}, "protocol.reproductions"),
        ({"protocol.sampler": "ax"}, "protocol.sampler"),
        ({"protocol.folds": 5}, "protocol.folds"),
        ({"protocol.fold_layout": "random"}, "protocol.fold_layout"),
        ({"protocol.train": {"lr": 0.1}}, "protocol.train.lr"),
        ({"protocol.train": {"m": 0}}, "protocol.train.m"),
        ({"protocol.patience": -1}, "protocol.patience"),
        ({"resources.workers_per_fold": 0}, "resources.workers_per_fold"),
        ({"resources.use_gpu": "yes"}, "resources.use_gpu"),
        ({"resources.cpus_per_worker": 0}, "resources.cpus_per_worker"),
        ({"model.trunk": "vgg"}, "model.trunk"),
        ({"model.pooling": "mean"}, "model.pooling"),
        ({"model.pooling": "kmax"}, "model.pooling"),
        ({"model.pooling": "gem:0"}, "model.pooling"),
        ({"datasets.0": {"kind": "imagenet", "path": "x"}}, "datasets[0].kind"),
        ({"datasets.0": {"kind": "synthetic", "num_classes": 8}}, "datasets[0].per_class"),
        ({"datasets.0": {"kind": "omniglot"}}, "datasets[0].path"),
        ({"datasets.0": {"kind": "synthetic", "num_classes": 8, "per_class": 4, "colour": 1}}, "datasets[0].colour"),
        ({"name": "a/b"}, "name"),
        ({"learning_rate": 1}, "learning_rate"),
        ({"losses": []}, "losses"),
        ({"datasets": []}, "datasets"),
    ],
)
def test_bad_fields_are_named(changes, field):
    assert _error(_cfg(**changes)).field == field


@pytest.mark.parametrize(
    "uri, field",
    [
        ({"tracking.uri": "htp://localhost:5000"}, "tracking.uri"),
        ({"tracking.uri": "http://"}, "tracking.uri"),
        ({"tracking.uri": "http://host:99999"}, "tracking.uri"),
        ({"tracking.uri": "mlruns"}, "tracking.uri"),
        ({"tracking.uri": "sqlite://mlflow.db"}, "tracking.uri"),
        ({"tracking.uri": "file:///abs/mlruns"}, "tracking.uri"),
        ({"tracking.uri": "mysql+psycopg2://u@h/db"}, "tracking.uri"),
        ({"storage": "gs://bucket/x"}, "storage"),
        ({"storage": "s3://"}, "storage"),
        ({"storage": "s3://Bad_Bucket/x"}, "storage"),
        ({"datasets.0": {"kind": "omniglot", "path": "s3://bucket/omniglot"}}, "datasets[0].path"),
        ({"datasets.0": {"kind": "parquet", "path": "hdfs://nn/cub"}}, "datasets[0].path"),
    ],
)
def test_bad_uris_are_named(uri, field):
    assert _error(_cfg(**uri)).field == field


def test_good_uris_pass():
    for uri in ("http://127.0.0.1:5000", "https://mlflow.example.org/", "sqlite:///runs/x.db",
                "sqlite:////abs/x.db", "postgresql://u:p@db:5432/mlflow",
                "postgresql+psycopg2://u@127.0.0.1:5432/mlflow", "http://user:pw@host:5000"):
        assert check_tracking_uri(uri) == uri
    assert check_uri("s3://bucket/prefix", "storage") == "s3://bucket/prefix"
    assert check_uri("runs", "storage") == "runs"


def test_relative_sqlite_uri_is_made_absolute_for_workers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = parse_config(_cfg(**{"tracking.uri": "sqlite:///x.db"}))
    assert cfg.tracking_uri() == f"sqlite:///{tmp_path / 'x.db'}"
    assert parse_config(_cfg()).tracking_uri() == f"sqlite:///{tmp_path / 'runs' / 'demo' / 'mlflow.db'}"


def test_tracking_uri_falls_back_to_the_environment(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example.org:5000")
    assert parse_config(_cfg()).tracking_uri() == "http://mlflow.example.org:5000"
    assert parse_config(_cfg(**{"tracking.uri": "http://other:1"})).tracking_uri() == "http://other:1"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "mlruns")
    assert _error(_cfg()).field.startswith("MLFLOW_TRACKING_URI")


def test_infra_files_are_valid_yaml_and_the_reeval_config_passes_the_schema():
    for path in sorted((ROOT / "infra").rglob("*.yaml")):
        docs = list(yaml.safe_load_all(path.read_text()))
        assert docs and all(isinstance(d, dict) for d in docs), path
    cfg = load_config(ROOT / "infra" / "reeval" / "omniglot-weekly.yaml", name="omniglot-20250101")
    assert cfg.name == "omniglot-20250101" and cfg.experiment_name() == "omniglot-weekly"
    assert cfg.storage_is_s3 and cfg.tracking_uri().startswith("http://")


def test_missing_config_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


# ---------------------------------------------------------------------------------------- preflight (data + losses)


def test_missing_dataset_names_the_path(tmp_path):
    from pipelines.preflight import preflight

    cfg = parse_config(_cfg(**{"datasets.0": {"kind": "folder", "path": str(tmp_path / "nowhere")}}))
    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    assert info.value.field == "datasets[0].path" and "does not exist" in str(info.value)


def test_too_few_classes_for_four_folds_times_m():
    from pipelines.preflight import preflight

    cfg = parse_config(_cfg(**{"datasets.0": {"kind": "synthetic", "num_classes": 16, "per_class": 4,
                                              "image_size": 16}}))
    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    e = info.value
    assert e.field == "datasets[0]"
    assert "16 classes are too few for 4 folds" in str(e) and "8 × 4" in str(e)


def test_unknown_loss_parameter_is_rejected_by_the_loss():
    from pipelines.preflight import preflight

    cfg = parse_config(_cfg(losses=[{"name": "contrastive", "params": {"pos_margn": 0.1}}]))
    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    assert info.value.field == "losses[0].params.pos_margn"
    assert "pos_margn" in str(info.value)


def test_batch_must_split_across_workers():
    from pipelines.preflight import preflight

    cfg = parse_config(_cfg(**{"resources.workers_per_fold": 3}))
    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    assert info.value.field == "resources.workers_per_fold" and "8 × 4 = 32" in str(info.value)


@pytest.mark.parametrize("train, field", [
    ({"optimizer": "lbfgs"}, "protocol.train.optimizer"),
    ({"momentum": float("nan")}, "protocol.train.momentum"),
    ({"trunk_lr": float("inf")}, "protocol.train.trunk_lr"),
    ({"amp_dtype": "int8"}, "protocol.train.amp_dtype"),
    ({"m": 0}, "protocol.train.m"),
])
def test_bad_train_setting_names_its_own_field(train, field):
    assert _error(_cfg(**{"protocol.train": train})).field == field


def test_train_config_errors_left_to_preflight_name_their_own_field():
    """What only dml_core.train.TrainConfig rejects is mapped by the field it names, not by a substring."""
    from pipelines.preflight import _train_config_field

    assert _train_config_field("TrainConfig.momentum must be a finite non-negative number, got nan") == \
        "protocol.train.momentum"
    assert _train_config_field("TrainConfig.iters_per_epoch must be a positive integer") == "protocol.iters_per_epoch"
    assert _train_config_field("something else") == "protocol.train"


def test_preflight_builds_one_plan_per_dataset_and_loss():
    from pipelines.preflight import preflight

    plans = preflight(parse_config(DEMO))
    assert [p.key for p in plans] == ["synthetic/contrastive", "synthetic/proxynca_pp", "synthetic/mpa"]
    pp = plans[1]
    # the protocol's shared model where the config leaves pooling/LayerNorm open: the same for every loss
    assert all(p.model_kwargs["pooling"] == "avg" and p.model_kwargs["layer_norm"] is False for p in plans)
    assert (pp.classes_per_batch, pp.m) == (8, 4)
    assert pp.dataset.manifest.layout == "mlrc" and len(pp.dataset.manifest.folds) == 4
    assert "loss_lr" in pp.searched and "prob" in pp.fixed


# ---------------------------------------------------------------------------------------- resume guard


def test_existing_sweep_needs_resume_and_resume_must_not_change_the_study(tmp_path):
    from pipelines.sweep import _check_resume

    cfg = parse_config(_cfg(storage=str(tmp_path)))
    cfg.local_dir().mkdir(parents=True)
    (cfg.local_dir() / "sweep_config.json").write_text(json.dumps(cfg.to_dict()))
    with pytest.raises(ConfigError) as info:
        _check_resume(cfg, resume=False)
    assert info.value.field == "name" and "--resume" in str(info.value)
    _check_resume(cfg, resume=True)  # same config: fine
    _check_resume(parse_config(_cfg(storage=str(tmp_path), **{"resources.max_concurrent_trials": 2})), True)
    with pytest.raises(ConfigError) as info:
        _check_resume(parse_config(_cfg(storage=str(tmp_path), **{"protocol.trials": 9})), resume=True)
    assert info.value.field == "protocol"


# ---------------------------------------------------------------------------------------- the CLI


def test_cli_bad_config_exits_2_with_one_line_and_starts_nothing(tmp_path):
    doc = _cfg(storage=str(tmp_path / "runs"))
    doc["losses"][1] = {"name": "mpaa"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    code = (
        "import sys\n"
        "from pipelines.cli import main\n"
        f"rc = main(['sweep', {str(path)!r}])\n"
        "print('ray imported:', 'ray' in sys.modules)\n"
        "sys.exit(rc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        out.stderr.strip().splitlines()[0]
    ] and out.stderr.startswith("config error: losses[1].name: unknown loss 'mpaa' (known: ")
    assert "Traceback" not in out.stderr
    assert "ray imported: False" in out.stdout
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlruns").exists()


def test_a_new_sweep_never_reuses_mlflow_runs_of_an_old_one_with_the_same_name(tmp_path, monkeypatch):
    """Fresh storage but the same sweep name in the same MLflow experiment: refused before Ray starts."""
    from pipelines.sweep import run_sweep
    from pipelines.tracking import Tracker

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'shared.db'}"
    Tracker.open(uri, "team").get_or_create({"sweep": "demo", "study": "synthetic/contrastive", "stage": "study"})
    cfg = parse_config(_cfg(storage=str(tmp_path / "fresh"), tracking={"uri": uri, "experiment": "team"}))
    with pytest.raises(ConfigError) as info:
        run_sweep(cfg)
    assert info.value.field == "name" and "already has runs" in str(info.value)
    assert "ray" not in sys.modules or not __import__("ray").is_initialized()


def test_kmax_pooling_larger_than_the_feature_map_fails_in_preflight():
    """The tiny trunk maps 16-px images to 2×2 positions: K-max with K = 4 fits, K = 5 is one named error."""
    from pipelines.preflight import preflight

    plans = preflight(parse_config(_cfg(**{"model.pooling": "kmax:4"})))
    assert {p.model_kwargs["pooling"] for p in plans} == {"kmax:4"}
    with pytest.raises(ConfigError) as info:
        preflight(parse_config(_cfg(**{"model.pooling": "kmax:5"})))
    assert info.value.field == "model.pooling"
    assert "K = 5 exceeds the 2×2 = 4 positions" in str(info.value) and "datasets[0].image_size 16" in str(info.value)


def test_recipe_paper_gives_each_loss_its_papers_model_and_batch():
    from pipelines.preflight import batch_of, preflight

    doc = copy.deepcopy(DEMO)
    doc["protocol"]["recipe"] = "paper"
    doc["protocol"]["train"] = {k: v for k, v in doc["protocol"]["train"].items() if k not in ("classes_per_batch", "m")}
    doc["losses"] = [{"name": "proxynca_pp"}]
    cfg = parse_config(doc)
    (pp,) = preflight(cfg)
    assert pp.model_kwargs["pooling"] == "max" and pp.model_kwargs["layer_norm"] is True  # ProxyNCA++ recipe
    from dml_core.losses import loss_info

    mpa = cfg.model.kwargs(loss_info("mpa").model)  # (its 45 × 4 batch needs more classes than the demo has)
    assert mpa["pooling"] == "gem" and mpa["layer_norm"] is False  # MPA §4.2 cubic GeM
    assert batch_of(cfg, cfg.losses[0]) == (8, 4)
    doc["protocol"]["recipe"] = "nope"
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    assert info.value.field == "protocol.recipe"


def test_loss_weight_decay_follows_the_loss_unless_configured():
    from types import SimpleNamespace

    from pipelines.trial import _fold_config

    fold = SimpleNamespace(index=0, train_classes=(0, 1), val_classes=(2, 3))
    manifest = SimpleNamespace(test_classes=(4, 5))

    def wd(train):
        ctx = SimpleNamespace(fixed_params={}, train=train, loss="margin", table_ref=None, image_size=16,
                              model_kwargs={}, use_gpu=False, cpus_per_worker=1, tracking_uri="", experiment_id="",
                              study="s", sweep="x")
        return _fold_config(ctx, fold, {}, 0, "run", False, manifest, "parent")["train"]["loss_weight_decay"]

    assert wd({}) == 0.0  # MLRC ran Margin's beta without weight decay (loss_info metadata)
    assert wd({"loss_weight_decay": 1e-3}) == 1e-3  # an explicit protocol.train value wins


@pytest.mark.parametrize("key", ["datasets", "losses"])
def test_lists_must_be_non_empty_with_distinct_names(key):
    doc = copy.deepcopy(DEMO)
    doc[key] = []
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    assert info.value.field == key
    doc = copy.deepcopy(DEMO)
    doc[key] = doc[key] + [copy.deepcopy(doc[key][0])]
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    n = len(doc[key]) - 1
    assert info.value.field == f"{key}[{n}].name" and f"already listed as {key}[0]" in str(info.value)
