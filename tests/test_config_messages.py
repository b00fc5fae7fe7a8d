"""What a config error says: every problem of the document (one line each, up to a limit), the keys allowed where an
unknown one was found, "did you mean" for a mistyped name, plain words instead of pydantic's, and inline search
spaces checked as strictly as the rest of the config."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from pipelines.config.schema import parse_config
from tests.test_config import _cfg, _error

# ------------------------------------------------------------------------------------------------ every problem


def test_every_problem_of_the_document_is_reported_one_line_each():
    e = _error(_cfg(**{"seed": 1.5, "protocol.trials": 0, "protocol.sampler": "gpp"}))
    assert e.lines() == [
        "seed: expected an integer, got 1.5",
        "protocol.trials: 0 must be >= 1",
        "protocol.sampler: 'gpp' is not one of 'gp' or 'tpe'; did you mean 'gp'?",
    ]
    assert str(e) == "seed: expected an integer, got 1.5"  # the first problem, as before, with no "(and 2 more ...)"


def test_many_problems_are_cut_at_the_limit_with_a_count():
    from pipelines.config.errors import MAX_SHOWN

    doc = _cfg()
    for i in range(MAX_SHOWN + 3):
        doc[f"unknown_{i}"] = 1
    lines = _error(doc).lines()
    assert len(lines) == MAX_SHOWN + 1
    assert all(line.startswith("unknown_") and "unknown key" in line for line in lines[:-1])
    assert lines[-1] == "3 more problems not shown (fix these and run again)"


def test_the_cli_prints_each_problem_on_its_own_config_error_line(tmp_path):
    doc = _cfg(**{"protocol.trails": 3, "model.embedding_dim": "big"})
    doc["storage"] = str(tmp_path / "runs")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    code = f"import sys\nfrom pipelines.cli import main\nsys.exit(main(['sweep', {str(path)!r}]))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert [line.split(":")[1].strip() for line in lines] == ["model.embedding_dim", "protocol.trails"]
    assert all(line.startswith("config error: ") for line in lines)
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------------------ the words


def test_an_unknown_key_lists_the_keys_allowed_there_and_the_closest():
    e = _error(_cfg(**{"protocol.trails": 3}))
    assert e.field == "protocol.trails"
    assert e.problem.startswith("unknown key; did you mean 'trials' or 'train'? (allowed here: eval_every, ")
    e = _error(_cfg(**{"datasets.0.colour": 1}))
    assert e.problem == (
        "unknown key (allowed here: classes, image_size, kind, name, num_classes, per_class, seed)"
    )  # the synthetic kind's keys
    assert "(allowed here: compare_with, datasets, losses, model, name, protocol" in _error(_cfg(sampler="gp")).problem
    assert "workers_per_fold" in _error(_cfg(**{"resources.workers": 2})).problem
    assert "classes_per_batch" in _error(_cfg(**{"protocol.train.clases_per_batch": 2})).problem
    e = _error(_cfg(losses={"all": True, "exclud": []}))
    assert (e.field, e.problem) == (
        "losses.exclud",
        "unknown key; did you mean 'exclude'? (allowed here: all, exclude)",
    )
    e = _error(_cfg(runtime_env={"py_module": []}))
    assert e.field == "runtime_env.py_module" and "did you mean 'py_modules'? (allowed here: env_vars, " in e.problem


@pytest.mark.parametrize(
    "changes, line",
    [
        ({"name": 5}, "name: expected a string, got 5"),
        ({"seed": "zero"}, "seed: expected an integer, got 'zero'"),
        ({"model.freeze_bn": "yes"}, "model.freeze_bn: expected true or false, got 'yes'"),
        ({"protocol.train.trunk_lr": "fast"}, "protocol.train.trunk_lr: expected a number, got 'fast'"),
        ({"protocol.train.trunk_lr": 0}, "protocol.train.trunk_lr: 0 must be > 0"),
        ({"model": [1]}, "model: expected a mapping, got [1]"),
        ({"model.trunk": ""}, "model.trunk: must not be empty"),
        ({"protocol.folds": 11}, "protocol.folds: 11 must be <= 10"),
    ],
)
def test_plain_words_not_pydantics(changes, line):
    e = _error(_cfg(**changes))
    assert e.lines()[0] == line
    assert "Input should" not in str(e)


@pytest.mark.parametrize(
    "changes, field, suggestion",
    [
        ({"losses.0": "contrastiv"}, "losses[0].name", "did you mean 'contrastive'?"),
        ({"model.trunk": "resnet19"}, "model.trunk", "did you mean 'resnet18' or 'resnet50'?"),
        ({"datasets.0.kind": "synthetc"}, "datasets[0].kind", "did you mean 'synthetic'?"),
        ({"protocol.train.optimizer": "adamm"}, "protocol.train.optimizer", "did you mean 'adam'?"),
        ({"losses": {"all": True, "exclude": ["contrastve"]}}, "losses.exclude[0]", "did you mean 'contrastive'?"),
    ],
)
def test_a_mistyped_name_gets_did_you_mean(changes, field, suggestion):
    e = _error(_cfg(**changes))
    assert e.field == field and suggestion in e.problem, str(e)


# ------------------------------------------------------------------------------------------------ inline spaces


def test_a_flat_inline_space_with_paper_defaults_beside_it_is_accepted():
    loss = {
        "name": "contrastive",
        "space": {"pos_margin": {"low": 0.0, "high": 0.5}, "neg_margin": {"low": 0.5, "high": 1.5}},
        "fixed": {"distance": "cosine"},
        "paper_defaults": {"pos_margin": 0.1},
    }
    space = parse_config(_cfg(**{"losses.0": loss})).losses[0].search_space
    assert sorted(space.params) == ["neg_margin", "pos_margin"]
    assert space.paper_defaults == {"pos_margin": 0.1} and space.fixed == {"distance": "cosine"}
    e = _error(_cfg(**{"losses.0": {**loss, "paper_defaults": {"pos_margin": 0.9}}}))
    assert e.field == "losses[0].paper_defaults.pos_margin" and "outside the search space" in e.problem


def test_paper_defaults_beside_a_space_of_another_shape_says_which_shape_is_expected():
    nested = {"space": {"pos_margin": {"low": 0.0, "high": 0.5}}}
    e = _error(_cfg(**{"losses.0": {"name": "contrastive", "space": nested, "paper_defaults": {"pos_margin": 0.1}}}))
    assert e.field == "losses[0].paper_defaults"
    assert "space: {margin: {low: .., high: ..}}" in e.problem and "put paper_defaults inside it" in e.problem
    e = _error(_cfg(**{"losses.0": {"name": "contrastive", "fixed": {"pos_margin": 0.1}}}))
    assert e.field == "losses[0].fixed" and "give the space too" in e.problem


@pytest.mark.parametrize(
    "param, problem",
    [
        ({"low": 0.0, "high": 0.5, "log": "false"}, "space.pos_margin.log: expected true or false, got 'false'"),
        ({"low": 0.1, "high": 0.5, "log": 1}, "space.pos_margin.log: expected true or false, got 1"),
        ({"low": 0.2, "high": 0.8, "type": "int"}, "space.pos_margin.low: 0.2 is not an integer"),
        ({"low": 0, "high": 2.5, "type": "int"}, "space.pos_margin.high: 2.5 is not an integer"),
        ({"low": 0.0, "high": float("inf")}, "space.pos_margin.high: inf is not a finite number"),
    ],
)
def test_inline_space_values_are_strict(param, problem):
    for space in ({"pos_margin": param}, {"space": {"pos_margin": param}}):  # flat and file-shaped
        e = _error(_cfg(**{"losses.0": {"name": "contrastive", "space": space}}))
        assert e.field == "losses[0].space" and e.problem.startswith(problem), str(e)


def test_an_int_range_with_integral_float_bounds_is_an_int_range():
    loss = {"name": "mpa", "space": {"num_proxies": {"low": 1.0, "high": 4, "type": "int"}}}
    space = parse_config(_cfg(losses=[loss])).losses[0].search_space
    p = space.params["num_proxies"]
    assert (p.low, p.high, p.type) == (1, 4, "int") and isinstance(p.low, int)


def test_a_mistyped_key_of_an_inline_space_gets_did_you_mean_not_the_flat_reading():
    e = _error(_cfg(**{"losses.0": {"name": "contrastive", "space": {"spaec": {"pos_margin": {"low": 0, "high": 1}}}}}))
    assert e.field == "losses[0].space"
    assert "unknown top-level key(s) ['spaec']" in e.problem and "did you mean 'space'?" in e.problem
    e = _error(_cfg(**{"losses.0": {"name": "contrastive", "space": {"pos_margin": {"lwo": 0, "high": 1}}}}))
    assert e.problem.startswith("space.pos_margin: unknown key(s) ['lwo']") and "did you mean 'low'" in e.problem
