"""Sweep-config validation: every bad input is one error naming its field, raised before Ray or MLflow start."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipelines.config.presets import DEMO, demo_config
from pipelines.config.schema import ConfigError, check_tracking_uri, check_uri, load_config, parse_config

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


@pytest.mark.parametrize(
    "path",
    [
        "pipelines/config/demo.yaml",
        "configs/omniglot.yaml",
        "configs/mlrc-cub200.yaml",
        "configs/omniglot-zoo.yaml",
        "examples/circle-vs-contrastive.yaml",
    ],
)
def test_shipped_presets_parse(path, monkeypatch):
    # a preset with runtime_env.py_modules puts the module's folder on this process's sys.path: undone after the test
    monkeypatch.setattr(sys, "path", list(sys.path))
    cfg = load_config(ROOT / path)
    name = Path(path).stem
    assert cfg.name == name
    assert cfg.protocol.folds == 4 and cfg.protocol.fold_layout == "mlrc"
    assert all(ls.search_space is not None for ls in cfg.losses)


def test_mlrc_preset_is_the_papers_protocol():
    p = load_config(ROOT / "configs" / "mlrc-cub200.yaml").protocol
    assert (p.trials, p.startup_trials, p.reproductions) == (50, 5, 10)
    assert (p.iters_per_epoch, p.eval_every, p.patience) == (100, 2, 9)
    assert p.train["classes_per_batch"] * p.train["m"] == 32 and p.train["trunk_lr"] == 1e-6


def test_demo_has_three_losses_two_from_seed_papers_and_warm_folds():
    cfg = parse_config(DEMO)
    names = [ls.name for ls in cfg.losses]
    assert len(names) >= 3 and len({"proxynca_pp", "mpa", "rsw", "group_loss"} & set(names)) >= 2
    assert cfg.resources.workers_per_fold == 1 and not cfg.resources.use_gpu  # warm single-worker folds
    assert cfg.protocol.reproductions >= 3  # so that the demo's intervals mean something


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
    assert "pos_margin" not in ls.searched() and ls.fixed_values()["pos_margin"] == 0.0


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
    for uri in (
        "http://127.0.0.1:5000",
        "https://mlflow.example.org/",
        "sqlite:///runs/x.db",
        "sqlite:////abs/x.db",
        "postgresql://u:p@db:5432/mlflow",
        "postgresql+psycopg2://u@127.0.0.1:5432/mlflow",
        "http://user:pw@host:5000",
    ):
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
    from pipelines.execution.preflight.study_plans import preflight

    cfg = parse_config(_cfg(**{"datasets.0": {"kind": "folder", "path": str(tmp_path / "nowhere")}}))
    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    assert info.value.field == "datasets[0].path" and "does not exist" in str(info.value)


def test_too_few_classes_for_four_folds_times_m():
    from pipelines.execution.preflight.study_plans import preflight

    cfg = parse_config(
        _cfg(**{"datasets.0": {"kind": "synthetic", "num_classes": 16, "per_class": 4, "image_size": 16}})
    )
    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    e = info.value
    assert e.field == "datasets[0]"
    assert "16 classes are too few for 4 folds" in str(e) and "8 × 4" in str(e)


def test_unknown_loss_parameter_is_rejected_by_the_loss():
    from pipelines.execution.preflight.study_plans import preflight

    cfg = parse_config(_cfg(losses=[{"name": "contrastive", "params": {"pos_margn": 0.1}}]))
    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    assert info.value.field == "losses[0].params.pos_margn"
    assert "pos_margn" in str(info.value)


def test_batch_must_split_across_workers():
    from pipelines.execution.preflight.study_plans import preflight

    cfg = parse_config(_cfg(**{"resources.workers_per_fold": 3}))
    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    assert info.value.field == "resources.workers_per_fold" and "8 × 4 = 32" in str(info.value)


@pytest.mark.parametrize(
    "train, field",
    [
        ({"optimizer": "lbfgs"}, "protocol.train.optimizer"),
        ({"momentum": float("nan")}, "protocol.train.momentum"),
        ({"trunk_lr": float("inf")}, "protocol.train.trunk_lr"),
        ({"amp_dtype": "int8"}, "protocol.train.amp_dtype"),
        ({"m": 0}, "protocol.train.m"),
    ],
)
def test_bad_train_setting_names_its_own_field(train, field):
    assert _error(_cfg(**{"protocol.train": train})).field == field


def test_train_config_errors_left_to_preflight_name_their_own_field():
    """What only dml_core.training.loop.TrainConfig rejects is mapped by the field it names, not by a substring."""
    from pipelines.execution.preflight.study_plans import _train_config_field

    assert (
        _train_config_field("TrainConfig.momentum must be a finite non-negative number, got nan")
        == "protocol.train.momentum"
    )
    assert _train_config_field("TrainConfig.iters_per_epoch must be a positive integer") == "protocol.iters_per_epoch"
    assert _train_config_field("something else") == "protocol.train"


def test_preflight_builds_one_plan_per_dataset_and_loss():
    from pipelines.execution.preflight.study_plans import preflight

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
    from pipelines.execution.studies.continuation import check_restart, check_resume

    cfg = parse_config(_cfg(storage=str(tmp_path)))
    cfg.local_dir().mkdir(parents=True)
    (cfg.local_dir() / "sweep_config.json").write_text(json.dumps(cfg.model_dump(mode="json")))
    with pytest.raises(ConfigError) as info:
        check_restart(cfg, resume=False)  # the same sweep again without --resume: refused at once
    assert info.value.field == "name" and "--resume" in str(info.value)
    check_restart(cfg, resume=False, rerun={"contrastive"})  # ... unless a study is to run again
    check_resume(cfg)  # same config: fine
    check_resume(parse_config(_cfg(storage=str(tmp_path), **{"resources.max_concurrent_trials": 2})))
    with pytest.raises(ConfigError) as info:
        check_resume(parse_config(_cfg(storage=str(tmp_path), **{"protocol.trials": 9})))
    assert info.value.field == "protocol.trials" and "(2 there, 9 now;" in str(info.value)
    # a loss added: a new study, the others reused (with or without --resume); a loss removed or changed: refused
    grown = parse_config(_cfg(storage=str(tmp_path), losses=[*DEMO["losses"], "triplet"]))
    check_restart(grown, resume=False)
    check_resume(grown)
    with pytest.raises(ConfigError) as info:
        check_resume(parse_config(_cfg(storage=str(tmp_path), losses=DEMO["losses"][:1])))
    assert info.value.field == "losses[1]" and "losses may only be added" in str(info.value)


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
    assert out.stderr.strip().splitlines() == [out.stderr.strip().splitlines()[0]] and out.stderr.startswith(
        "config error: losses[1].name: unknown loss 'mpaa' (known: "
    )
    assert "Traceback" not in out.stderr
    assert "ray imported: False" in out.stdout
    assert not (tmp_path / "runs").exists() and not (tmp_path / "mlruns").exists()


def test_a_new_sweep_never_reuses_mlflow_runs_of_an_old_one_with_the_same_name(tmp_path, monkeypatch):
    """Fresh storage but the same sweep name in the same MLflow experiment: refused before Ray starts."""
    from pipelines.execution.sweep import run_sweep
    from pipelines.tracking.runs import Tracker

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
    from pipelines.execution.preflight.study_plans import preflight

    plans = preflight(parse_config(_cfg(**{"model.pooling": "kmax:4"})))
    assert {p.model_kwargs["pooling"] for p in plans} == {"kmax:4"}
    with pytest.raises(ConfigError) as info:
        preflight(parse_config(_cfg(**{"model.pooling": "kmax:5"})))
    assert info.value.field == "model.pooling"
    assert "K = 5 exceeds the 2×2 = 4 positions" in str(info.value) and "datasets[0].image_size 16" in str(info.value)


def test_recipe_paper_gives_each_loss_its_papers_model_and_batch():
    from pipelines.execution.preflight.study_plans import batch_of, preflight

    doc = copy.deepcopy(DEMO)
    doc["protocol"]["recipe"] = "paper"
    doc["protocol"]["train"] = {
        k: v for k, v in doc["protocol"]["train"].items() if k not in ("classes_per_batch", "m")
    }
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

    from dml_core.training.config import TrainConfig
    from pipelines.execution.folds.trial import _fold_config

    fold = SimpleNamespace(index=0, train_classes=(0, 1), val_classes=(2, 3))
    manifest = SimpleNamespace(test_classes=(4, 5))

    def wd(train):
        ctx = SimpleNamespace(
            fixed_params={},
            train=TrainConfig(**train),
            loss="margin",
            table_ref=None,
            image_size=16,
            model_kwargs={},
            use_gpu=False,
            cpus_per_worker=1,
            tracking_uri="",
            experiment_id="",
            study="s",
            sweep="x",
            mid_fold_resume=True,
        )
        return _fold_config(ctx, fold, {}, 0, "run", False, manifest, "parent").train.loss_weight_decay

    # unset: train_fold applies the loss's own (0 for Margin's beta, as MLRC ran it; tests/test_library.py)
    assert wd({}) is None
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


# ------------------------------------------------------------------------------------ schema (pydantic) and JSON Schema


def test_published_json_schema_is_the_models_current_schema():
    from pipelines.config.schema import sweep_json_schema

    published = json.loads((ROOT / "docs" / "sweep-config.schema.json").read_text())
    assert published == json.loads(json.dumps(sweep_json_schema())), (
        "regenerate docs/sweep-config.schema.json (see its test) after changing pipelines/config/schema.py"
    )


def test_shipped_configs_pass_the_published_json_schema_and_bad_ones_do_not():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "docs" / "sweep-config.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    for path in [*sorted((ROOT / "configs").glob("*.yaml")), ROOT / "infra" / "reeval" / "omniglot-weekly.yaml"]:
        assert not list(validator.iter_errors(yaml.safe_load(path.read_text()))), path
    assert list(validator.iter_errors(_cfg(**{"protocol.trials": 0})))
    assert list(validator.iter_errors(_cfg(**{"resources.gpus": 1})))


def test_protocol_training_defaults_are_train_configs():
    """dml_core.training.loop.TrainConfig decides the protocol's training defaults; the schema repeats no literal."""
    import dataclasses

    from dml_core.training.loop import TrainConfig
    from pipelines.config.schema import ProtocolSpec, TrainSpec

    tc = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    p = ProtocolSpec()
    assert (p.iters_per_epoch, p.max_epochs, p.eval_every, p.patience) == (
        tc["iters_per_epoch"],
        tc["max_epochs"],
        tc["eval_every"],
        tc["patience"],
    )
    for name, f in TrainSpec.model_fields.items():
        if f.default is not None:
            assert f.default == tc[name], name
    source = (ROOT / "pipelines" / "config" / "protocol.py").read_text()  # where ProtocolSpec and TrainSpec live
    assert '_TC["iters_per_epoch"]' in source and "= Field(100," not in source


def test_unset_train_keys_stay_unset_so_recipe_and_loss_defaults_apply():
    cfg = parse_config(_cfg(**{"protocol.train": {"momentum": 0.5, "optimizer": None}}))
    assert cfg.protocol.train == {"momentum": 0.5}


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"resources.fold_executor": "warm", "resources.workers_per_fold": 2}, "resources.fold_executor"),
        ({"resources.fold_executor": "fast"}, "resources.fold_executor"),
        ({"resources.max_concurrent_studies": 0}, "resources.max_concurrent_studies"),
        ({"resources.max_concurrent_studies": True}, "resources.max_concurrent_studies"),
    ],
)
def test_fold_executor_and_study_concurrency_are_checked(changes, field):
    assert _error(_cfg(**changes)).field == field


def test_fold_executor_and_study_concurrency_defaults_and_valid_values():
    r = parse_config(_cfg()).resources
    assert (r.fold_executor, r.max_concurrent_studies) == ("auto", None)
    r = parse_config(
        _cfg(
            **{
                "resources.fold_executor": "warm",
                "resources.workers_per_fold": 1,
                "resources.max_concurrent_studies": 3,
            }
        )
    ).resources
    assert (r.fold_executor, r.workers_per_fold, r.max_concurrent_studies) == ("warm", 1, 3)
    assert parse_config(_cfg(**{"resources.fold_executor": "train"})).resources.fold_executor == "train"


def test_seed_bounds_include_the_seeds_the_sweep_derives():
    assert _error(_cfg(seed=2**32)).field == "seed"
    e = _error(_cfg(seed=2**32 - 1))  # reproduction seeds add 1000·(i+1): they would pass 2**32-1
    assert e.field == "seed" and "reproduction" in str(e)
    top = 2**32 - 1 - 1000 * DEMO["protocol"]["reproductions"] - 3
    assert parse_config(_cfg(seed=top)).protocol.seed == top


# ---------------------------------------------------------------------------------------- YAML file


def test_yaml_anchors_and_merge_keys_still_work(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_cfg()) + "x-batch: &b {classes_per_batch: 8, m: 4}\n")
    text = path.read_text().replace("x-batch:", "x_unused:")
    doc = yaml.safe_load(text)
    doc.pop("x_unused")
    base = yaml.safe_dump(doc)
    path.write_text("_batch: &b {classes_per_batch: 8, m: 4}\n" + base)
    with pytest.raises(ConfigError) as info:  # an anchor's holder is an unknown key...
        load_config(path)
    assert info.value.field == "_batch"
    doc["protocol"]["train"] = {"<<": {"classes_per_batch": 8, "m": 4}, "m": 4}
    path.write_text(yaml.safe_dump(doc).replace("'<<'", "<<"))
    assert load_config(path).protocol.train["m"] == 4  # ...but merge keys may repeat what they merge


def test_duplicate_key_names_both_lines(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: demo\nseed: 1\nseed: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.field == "seed" and "lines 2 and 3" in str(info.value)


def test_not_utf8_names_the_file_and_the_offset(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"name: d\xe9mo\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.field == str(path) and "not UTF-8" in str(info.value) and "offset 7" in str(info.value)


def test_alias_bomb_is_refused_quickly(tmp_path):
    import time

    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x","x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 12)]
    path = tmp_path / "c.yaml"
    path.write_text("\n".join(lines) + "\n")
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="more than 20000 nodes"):
        load_config(path)
    assert time.perf_counter() - t0 < 5


# ---------------------------------------------------------------------------------------- credentials in URIs


def test_passwords_in_uris_are_never_echoed_nor_stored(monkeypatch):
    from pipelines.config.schema import redact_uri

    e = _error(_cfg(**{"tracking.uri": "http://user:hunter2@host:99999"}))
    assert e.field == "tracking.uri" and "hunter2" not in str(e) and "user:***@host" in str(e)
    cfg = parse_config(_cfg(**{"tracking.uri": "postgresql+psycopg2://mlflow:hunter2@127.0.0.1:5432/mlflow"}))
    assert "hunter2" in cfg.tracking_uri()  # workers need it ...
    assert "hunter2" not in json.dumps(cfg.model_dump(mode="json"))  # ... sweep_config.json and MLflow params do not
    assert cfg.model_dump(mode="json")["tracking"]["uri"] == "postgresql+psycopg2://mlflow:***@127.0.0.1:5432/mlflow"
    assert redact_uri("see http://a:b@h:1/x and s3://bucket/k") == "see http://a:***@h:1/x and s3://bucket/k"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "htp://user:hunter2@host")
    assert "hunter2" not in str(_error(_cfg()))


def test_postgresql_uris_use_the_installed_driver():
    import importlib.util

    for uri in ("postgresql://u:p@127.0.0.1:5432/mlflow", "postgresql+psycopg2://u:p@127.0.0.1:5432/mlflow"):
        cfg = parse_config(_cfg(**{"tracking.uri": uri}))
        if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
            assert cfg.tracking_uri() == "postgresql+psycopg2://u:p@127.0.0.1:5432/mlflow"


# -------------------------------------------------------------------------------------- preflight: locations, resources


def _preflight_error(cfg) -> ConfigError:
    from pipelines.execution.preflight.study_plans import preflight

    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    return info.value


def test_unwritable_storage_and_sqlite_fail_fast_naming_the_field(tmp_path, monkeypatch):
    """No MLflow retries (minutes) on an unwritable sqlite DB: preflight checks with os.access, writing nothing."""
    import os
    import time

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked else real_access(p, mode))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    e = _preflight_error(parse_config(_cfg(storage=str(locked))))
    assert e.field == "storage" and "not writable" in str(e)
    t0 = time.perf_counter()
    e = _preflight_error(
        parse_config(_cfg(storage=str(tmp_path / "ok"), tracking={"uri": f"sqlite:///{locked}/sub/mlflow.db"}))
    )
    assert e.field == "tracking.uri" and "not writable" in str(e) and time.perf_counter() - t0 < 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["locked"]


@pytest.mark.skipif(
    hasattr(__import__("os"), "geteuid") and __import__("os").geteuid() == 0,
    reason="root may write anywhere: the os.access variant above covers it",
)
def test_unwritable_storage_by_permissions(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert _preflight_error(parse_config(_cfg(storage=str(locked)))).field == "storage"


def test_use_gpu_without_gpus_fails_before_launch(monkeypatch):
    import torch

    from pipelines.execution.runtime.resources import check_cluster_resources, check_local_gpus

    cfg = parse_config(_cfg(**{"resources.use_gpu": True}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError) as info:
        check_local_gpus(cfg)
    assert info.value.field == "resources.use_gpu" and "0 GPUs" in str(info.value)
    check_local_gpus(cfg, address="ray://head:10001")  # a cluster's GPUs are known only once Ray is up
    with pytest.raises(ConfigError) as info:
        check_cluster_resources(cfg, {"CPU": 16.0, "memory": 1e9})
    assert info.value.field == "resources.use_gpu" and "the Ray cluster has 0 GPUs and 16 CPUs" in str(info.value)
    check_cluster_resources(cfg, {"CPU": 16.0, "GPU": 2.0})
    with pytest.raises(ConfigError) as info:
        check_cluster_resources(
            parse_config(_cfg(**{"resources.cpus_per_worker": 4, "resources.workers_per_fold": 2})), {"CPU": 6.0}
        )
    assert info.value.field == "resources.cpus_per_worker"


def test_pretrained_weights_are_checked_in_preflight(tmp_path):
    import torch
    import torchvision

    good = tmp_path / "resnet18.pt"
    torch.save(torchvision.models.resnet18().state_dict(), good)
    from pipelines.execution.preflight.study_plans import check_pretrained

    check_pretrained(parse_config(_cfg(model={"trunk": "resnet18", "pretrained": str(good)})))
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    (tmp_path / "junk.pt").write_bytes(b"junk")
    for name, words in (("nope.pt", "not found"), ("list.pt", "state_dict"), ("junk.pt", "could not be read")):
        e = _preflight_error(parse_config(_cfg(model={"trunk": "resnet18", "pretrained": str(tmp_path / name)})))
        assert e.field == "model.pretrained" and words in str(e) and name in str(e)


def test_corrupt_omniglot_zip_names_the_file(tmp_path):
    (tmp_path / "images_background.zip").write_bytes(b"PK\x03\x04 truncated")
    e = _preflight_error(parse_config(_cfg(datasets=[{"kind": "omniglot", "path": str(tmp_path), "image_size": 16}])))
    assert e.field == "datasets[0].path" and "images_background.zip" in str(e)


def test_a_row_whose_image_header_is_corrupt_names_the_dataset_path(tmp_path):
    import io as _io

    import numpy as np
    import pyarrow.parquet as pq
    from PIL import Image

    from dml_core.shards import Record, write_shards
    from pipelines.execution.preflight.datasets import check_image_rows

    buf = _io.BytesIO()
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(buf, format="PNG")
    write_shards(
        [Record(f"c{c}/{i}.png", c, f"c{c}", "train", buf.getvalue) for c in range(2) for i in range(3)],
        tmp_path / "pq",
        dataset="toy",
        progress=False,
    )
    check_image_rows(str(tmp_path / "pq"), "datasets[1]")
    shard = next((tmp_path / "pq").rglob("*.parquet"))
    t = pq.read_table(shard)
    images = t.column("image").to_pylist()
    images[3] = b"\x89PNG\r\n\x1a\n but not really"  # the shard's own sha256 is stale now: caught either way
    pq.write_table(t.set_column(t.schema.get_field_index("image"), "image", [images]), shard)
    with pytest.raises(ConfigError) as info:
        check_image_rows(str(tmp_path / "pq"), "datasets[1]")
    assert info.value.field == "datasets[1].path" and "part" in str(info.value)


def test_prepared_parquet_rows_are_read_in_preflight(tmp_path, monkeypatch):
    """A real prepared dataset goes through check_image_rows (dml_core.shards.check_rows) in preflight."""
    import io as _io

    import numpy as np
    from PIL import Image

    import pipelines.execution.preflight.study_plans as pf
    from dml_core.shards import Record, write_shards

    def png(v):
        buf = _io.BytesIO()
        Image.fromarray(np.full((8, 8, 3), v, np.uint8)).save(buf, format="PNG")
        return buf.getvalue()

    records = [
        Record(f"c{c}/{i}.png", c, f"c{c}", "train", (lambda v=c * 7 + i: png(v))) for c in range(32) for i in range(6)
    ]
    write_shards(records, tmp_path / "pq", dataset="toy", progress=False, row_group_rows=16)
    seen = []
    real = pf.check_image_rows
    monkeypatch.setattr(pf, "check_image_rows", lambda uri, where: (seen.append(uri), real(uri, where)))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = parse_config(
        _cfg(
            storage=str(tmp_path / "runs"),
            datasets=[{"kind": "parquet", "path": str(tmp_path / "pq"), "image_size": 16}],
        )
    )
    pf.preflight(cfg)
    assert seen == [str(tmp_path / "pq")]


# ---------------------------------------------------------------------------------------- dmlrc data / dmlrc report


def _cli(argv, capsys):
    from pipelines.cli import main

    rc = main(argv)
    err = capsys.readouterr().err.strip()
    return rc, err


@pytest.mark.parametrize(
    "argv_tail, words",
    [
        (["verify", "{tmp}/nowhere"], "nowhere"),
        (["verify", "{tmp}/notjson"], "notjson"),
        (["prepare", "omniglot", "--src", "{tmp}/badzip", "--dest", "{tmp}/out", "--no-progress"], "badzip"),
        (["prepare", "cub200", "--src", "{tmp}/empty", "--dest", "{tmp}/out", "--no-progress"], "empty"),
    ],
)
def test_data_errors_are_one_line_exit_2(tmp_path, capsys, argv_tail, words):
    (tmp_path / "notjson").mkdir()
    (tmp_path / "notjson" / "manifest.json").write_text("[1, 2")
    (tmp_path / "badzip").mkdir()
    (tmp_path / "badzip" / "images_background.zip").write_bytes(b"not a zip")
    (tmp_path / "empty").mkdir()
    rc, err = _cli(["data", *[a.replace("{tmp}", str(tmp_path)) for a in argv_tail]], capsys)
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("data error: ") and words in err, err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_report_bad_input_is_one_config_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    rc, err = _cli(["report", "--experiment", "x", "--tracking-uri", f"sqlite:///{tmp_path}/nope.db"], capsys)
    assert (
        rc == 2 and err.startswith("config error: --tracking-uri: no sqlite DB") and not (tmp_path / "nope.db").exists()
    )
    rc, err = _cli(["report", "--experiment", "x", "--tracking-uri", "http://u:hunter2@127.0.0.1:9"], capsys)
    assert rc == 2 and err.startswith("config error: --tracking-uri: MLflow server") and "hunter2" not in err
    rc, err = _cli(["report", "--experiment", "x", "--tracking-uri", "file:///x"], capsys)
    assert rc == 2 and err.startswith("config error: --tracking-uri: ")
    from pipelines.tracking.runs import Tracker

    uri = f"sqlite:///{tmp_path / 'db.sqlite'}"
    Tracker.open(uri, "real")
    capsys.readouterr()  # MLflow's own start-up log lines
    (tmp_path / "afile").write_text("x")
    rc, err = _cli(
        ["report", "--experiment", "real", "--tracking-uri", uri, "--out", str(tmp_path / "afile" / "r")], capsys
    )
    assert rc == 2 and err.startswith("config error: --out: ")
    rc, err = _cli(["report", "--experiment", "nope", "--tracking-uri", uri, "--out", str(tmp_path / "r")], capsys)
    assert rc == 2 and err.startswith("config error: --experiment: no MLflow experiment named 'nope'"), err
    assert len(err.splitlines()) == 1


def test_the_zoo_preset_studies_every_builtin_loss_under_one_budget():
    from pipelines.config.spaces import builtin_spaces

    cfg = load_config(ROOT / "configs" / "omniglot-zoo.yaml")
    assert sorted(ls.name for ls in cfg.losses) == sorted(builtin_spaces())
    p = cfg.protocol
    assert p.trials >= 20 and p.startup_trials == 4 and p.reproductions >= 5
    assert p.train["classes_per_batch"] == 8 and p.train["m"] == 4  # one batch for every loss
    # the recipe bench/README_convergence.md chose: Adam 1e-3, an evaluation every 200 iterations, patience 1,200
    # iterations, at most 8,000 iterations
    assert (p.train["optimizer"], p.train["trunk_lr"], p.train["embedder_lr"]) == ("adam", 1e-3, 1e-3)
    assert p.iters_per_epoch * p.eval_every == 200 and p.iters_per_epoch * p.patience == 1200
    assert p.iters_per_epoch * p.max_epochs == 8000
