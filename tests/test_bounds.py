"""Winning configurations on a bound of their search space (pipelines.results.bounds)."""

from __future__ import annotations

import math

from pipelines.config.spaces import Param, SearchSpace
from pipelines.results.bounds import BoundHit, format_tag, on_bound, params_from_descriptions, parse_tag

# CosFace's space as the published Omniglot zoo searched it (tune_spaces/cosface.yaml then)
COSFACE = SearchSpace(
    "cosface",
    {
        "margin": Param("margin", 0.0, 1.0),
        "scale": Param("scale", 0.01, 200.0),
        "loss_lr": Param("loss_lr", 1e-6, 1.0, log=True),
    },
)


def test_the_published_cosface_winner_is_flagged_on_two_bounds():
    # the winner as MLflow holds it (params are strings); exp(log(1e-6)) is how a log-scale sampler returns the bound
    hits = on_bound(COSFACE, {"margin": "0.9385", "scale": "0.01", "loss_lr": math.exp(math.log(1e-6))})
    assert hits == [BoundHit("scale", "low", 0.01), BoundHit("loss_lr", "low", 1e-6)]
    assert format_tag(hits) == "scale=low(0.01); loss_lr=low(1e-06)"
    assert [h.describe() for h in hits] == ["scale at lower bound 0.01", "loss_lr at lower bound 1e-06"]


def test_tolerance_is_a_share_of_the_range_on_the_search_scale():
    lr = {"loss_lr": Param("loss_lr", 1e-6, 1.0, log=True)}
    # log range ln(1e6) ≈ 13.8; 0.1 % of it is a factor e^0.0138 ≈ 1.0139 from the bound
    assert on_bound(lr, {"loss_lr": 1.01e-6}) == [BoundHit("loss_lr", "low", 1e-6)]
    assert on_bound(lr, {"loss_lr": 1.05e-6}) == []
    assert on_bound(lr, {"loss_lr": 0.99}) == [BoundHit("loss_lr", "high", 1.0)]
    assert on_bound(lr, {"loss_lr": 0.95}) == []
    # linear: 0.1 % of [0, 90] is 0.09
    margin = {"margin": Param("margin", 0.0, 90.0)}
    assert on_bound(margin, {"margin": 0.05}) == [BoundHit("margin", "low", 0.0)]
    assert on_bound(margin, {"margin": 0.5}) == []
    assert on_bound(margin, {"margin": 89.95}) == [BoundHit("margin", "high", 90.0)]
    assert on_bound({"margin": Param("margin", 0.0, 90.0)}, {"margin": 0.05}, rel_tol=1e-4) == []


def test_integers_only_exactly_and_other_parameters_skipped():
    space = {
        "num_proxies": Param("num_proxies", 1, 10, type="int"),
        "pooling": Param("pooling", type="categorical", choices=("avg", "max")),
        "alpha": Param("alpha", 1.0, 64.0, log=True),
    }
    assert on_bound(space, {"num_proxies": 10, "pooling": "avg", "alpha": 8.0}) == [
        BoundHit("num_proxies", "high", 10.0)
    ]
    assert on_bound(space, {"num_proxies": "1"}) == [BoundHit("num_proxies", "low", 1.0)]
    assert on_bound(space, {"num_proxies": 2, "alpha": "not a number"}) == []
    assert on_bound(space, {"fixed_thing": 1.0, "alpha": math.nan}) == []  # not searched / not a value


def test_tag_round_trip():
    hits = [BoundHit("loss_lr", "low", 1e-6), BoundHit("beta", "high", 100.0)]
    assert format_tag(hits) == "loss_lr=low(1e-06); beta=high(100)"
    assert parse_tag(format_tag(hits)) == hits
    assert format_tag([]) == "none" and parse_tag("none") == []
    assert parse_tag("scale=low(0.01); garbage; x=middle(3)") == [BoundHit("scale", "low", 0.01)]


def test_space_recovered_from_the_logged_descriptions():
    # the sweep logs each searched parameter as space.<name> = Param.describe()
    params = [
        Param("loss_lr", 1e-6, 1.0, log=True),
        Param("scale", 0.01, 200.0),
        Param("num_proxies", 1, 10, type="int"),
    ]
    described = {p.name: p.describe() for p in params}
    described["pooling"] = Param("pooling", type="categorical", choices=("avg", "max")).describe()
    described["margin"] = "uniform(0, 1)"  # another writer's format: left out
    assert params_from_descriptions(described) == {p.name: p for p in params}
    recovered = params_from_descriptions(described)
    assert on_bound(recovered, {"loss_lr": "1e-06", "scale": "3.5", "num_proxies": "10"}) == [
        BoundHit("loss_lr", "low", 1e-6),
        BoundHit("num_proxies", "high", 10.0),
    ]


def test_report_flags_winners_on_a_bound_from_the_tag_or_the_logged_space(tmp_path):
    import csv
    import json

    from mlflow.tracking import MlflowClient

    from pipelines.results.bounds import ON_BOUND_TAG
    from pipelines.results.report import write_report
    from tests.test_report import REPRO, _populate

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _populate(uri, "bounds", REPRO)
    client = MlflowClient(uri)
    exp_id = client.get_experiment_by_name("bounds").experiment_id
    study = {
        r.data.tags["loss"]: r.info.run_id
        for r in client.search_runs([exp_id], "tags.stage = 'study'")
        if r.data.metrics
    }
    # mpa: the sweep's tag; contrastive: a run without the tag, its winner recomputed from the logged space
    client.set_tag(study["mpa"], ON_BOUND_TAG, "loss_lr=low(1e-06); scale=low(0.01)")
    client.log_param(study["contrastive"], "space.loss_lr", Param("loss_lr", 1e-6, 1.0, log=True).describe())
    client.log_param(study["contrastive"], "best.loss_lr", str(math.exp(math.log(1e-6))))

    paths = write_report(uri, "bounds", tmp_path / "out", log_to_mlflow=False)
    md = paths["md"].read_text()
    assert (
        "- **synthetic / mpa**: margin_mpa=0.25 — **on a bound**: loss_lr at lower bound 1e-06; scale at lower " in md
    )
    assert (
        "**synthetic / contrastive**: loss_lr=1e-06, margin_contrastive=0.25 — **on a bound**: loss_lr at lower " in md
    )
    assert "<td>loss_lr at lower bound 1e-06; scale at lower bound 0.01</td>" in paths["html"].read_text()
    rows = {r["loss"]: r["on_bound"] for r in csv.DictReader(paths["csv"].open())}
    assert rows == {
        "mpa": "loss_lr at lower bound 1e-06; scale at lower bound 0.01",
        "contrastive": "loss_lr at lower bound 1e-06",
    }
    report = json.loads(paths["json"].read_text())
    assert {s["loss"]: s["on_bound"] for s in report["studies"]} == {
        "mpa": [{"param": "loss_lr", "bound": "low", "value": 1e-6}, {"param": "scale", "bound": "low", "value": 0.01}],
        "contrastive": [{"param": "loss_lr", "bound": "low", "value": 1e-6}],
    }
