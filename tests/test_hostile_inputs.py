"""What a hostile tester fed the product: each input is one clear line (a ``ConfigError`` naming the field or file,
which the CLI prints as ``config error: <field>: …``) before anything expensive starts, or is accepted with one
``warning:`` line; no third-party warning above that line, no secret in it (docs/reliability.md, bad input)."""

from __future__ import annotations

import copy
import io
import json
import math
import os
import pickle
import socket
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

from pipelines.config.errors import ConfigError
from pipelines.config.presets import DEMO
from pipelines.config.redact import redact_credentials
from pipelines.config.schema import parse_config
from pipelines.results.bundle import bundle_doc, checksum, comparable_studies, read_bundle, read_bundles
from pipelines.results.fingerprint import Fingerprint
from pipelines.results.report_studies import Study

FP = Fingerprint(
    {
        "dataset.name": "synthetic",
        "dataset.content_sha256": "c0ffee",
        "protocol.reproductions": 2,
        "reproduction.seeds": [1000, 2000],
    }
)


def _cfg(**changes) -> dict:
    """The demo preset with dotted-path changes (``{"protocol.max_epochs": 2}``)."""
    doc = copy.deepcopy(DEMO)
    for path, value in changes.items():
        node = doc
        *parents, last = path.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = value
    return doc


def _study(**changes) -> Study:
    """A finished study as ``dmlrc report`` bundles it: 2 reproductions, their interval, its fingerprint."""
    fields = dict(
        run_id="r1",
        dataset="synthetic",
        loss="contrastive",
        metrics={
            "test.concat.map_at_r.mean": 0.30,
            "test.concat.map_at_r.ci_low": 0.17,
            "test.concat.map_at_r.ci_high": 0.43,
            "test.n_reproductions": 2.0,
            "untrained.concat.map_at_r": 0.05,
        },
        reproductions={0: {"test.concat.map_at_r": 0.29}, 1: {"test.concat.map_at_r": 0.31}},
        seeds={0: "1000", 1: "2000"},
        best_params={"margin": "0.25"},
        fingerprint=FP,
    )
    fields.update(changes)
    return Study(**fields)


def _bundle(tmp_path: Path, *studies: Study, edit=None) -> str:
    """A bundle file of ``studies``; ``edit(doc)`` changes it and the checksum is stamped again (a consistent lie)."""
    doc = bundle_doc("zoo", list(studies))
    if edit is not None:
        edit(doc)
        doc["checksum"] = checksum(doc)
    path = tmp_path / "results-bundle.json"
    path.write_text(json.dumps(doc, allow_nan=True))
    return str(path)


def _refusal(uri: str, field: str = "compare_with") -> str:
    with pytest.raises(ConfigError) as info:
        read_bundle(uri, field)
    assert info.value.field == field
    text = str(info.value)
    assert "\n" not in text and "\x1b" not in text
    return text


# ------------------------------------------------------------------------------------- 1. files that are not files


def test_a_device_as_a_bundle_is_refused_by_stat_before_it_is_read():
    assert "/dev/zero is a character device, not a results bundle" in _refusal("/dev/zero", "--compare-with")
    with pytest.raises(ConfigError) as info:  # the sweep config: refused as the config is read
        parse_config(_cfg(compare_with="/dev/zero"))
    assert info.value.field == "compare_with" and "character device" in str(info.value)


def test_a_fifo_as_a_bundle_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "results-bundle.json"
    os.mkfifo(fifo)
    got: dict[str, BaseException] = {}

    def read() -> None:
        try:
            read_bundle(str(fifo))
        except BaseException as e:  # noqa: BLE001 - whatever it raised, the test reads it below
            got["error"] = e

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(20)
    if reader.is_alive():  # blocked opening the FIFO: a writer end lets it go before the test fails
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
        pytest.fail("reading a FIFO as a results bundle blocked")
    assert isinstance(got.get("error"), ConfigError), got
    assert "is a FIFO (named pipe), not a results bundle" in str(got["error"])


def test_a_bundle_of_nested_brackets_is_a_data_error_naming_the_file(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 400_000)
    assert f"{path} is not a results bundle (JSON nested too deeply)" in _refusal(str(path))


# ------------------------------------------------------------------------------------- 2. bundles that lie


def test_a_valid_bundle_still_reads(tmp_path):
    (s,) = read_bundle(_bundle(tmp_path, _study())).studies
    assert (s.dataset, s.loss, len(s.reproductions)) == ("synthetic", "contrastive", 2)


def test_the_same_data_under_another_dataset_name_is_one_warning_naming_both(tmp_path, capsys):
    bundles = read_bundles([_bundle(tmp_path, _study(), _study(loss="triplet"))])
    ours = Fingerprint({**FP.fields, "dataset.name": "cub"})  # the same content_sha256, another name
    assert comparable_studies(bundles, "compare_with", {"cub"}, lambda d, loss: ours, {}) == []
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: compare_with: ")
    assert "its dataset 'synthetic' holds the same data as dataset 'cub' here" in lines[0]
    assert "its 2 studies are left out" in lines[0]
    other = Fingerprint({**ours.fields, "dataset.content_sha256": "other"})  # other data: no word
    assert comparable_studies(bundles, "compare_with", {"cub"}, lambda d, loss: other, {}) == []
    assert capsys.readouterr().err == ""


def test_a_bundle_cut_to_fewer_reproductions_is_refused(tmp_path):
    def cut(doc):
        del doc["studies"][0]["reproductions"][1]

    text = _refusal(_bundle(tmp_path, _study(), edit=cut))
    assert "'synthetic': 1 reproductions with test metrics, but its metric test.n_reproductions says 2" in text

    def cut_both(doc):  # the count edited too: the fingerprint's count still holds
        del doc["studies"][0]["reproductions"][1]
        del doc["studies"][0]["metrics"]["test.n_reproductions"]

    assert "its fingerprint's protocol.reproductions says 2" in _refusal(_bundle(tmp_path, _study(), edit=cut_both))


def test_a_failed_reproduction_without_test_metrics_is_not_counted(tmp_path):
    """The report bundles every reproduction run; one that failed holds no test metric and is not in the interval."""
    reps = {0: {"test.concat.map_at_r": 0.29}, 1: {"test.concat.map_at_r": 0.31}, 2: {}}
    (s,) = read_bundle(_bundle(tmp_path, _study(reproductions=reps, seeds={0: "1000", 1: "2000", 2: ""}))).studies
    assert len(s.reproductions) == 3


def test_a_reproduction_seed_outside_the_fingerprint_is_refused(tmp_path):
    text = _refusal(_bundle(tmp_path, _study(seeds={0: "1000", 1: "7"})))
    assert "reproduction seed 7 is not one of its fingerprint's reproduction.seeds" in text


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"metrics": {**_study().metrics, "test.concat.map_at_r.mean": math.nan}}, "metrics.test.concat.map_at_r.mean"),
        ({"metrics": {**_study().metrics, "untrained.concat.map_at_r": math.inf}}, "metrics.untrained.concat.map_at_r"),
        ({"reproductions": {0: {"test.concat.map_at_r": math.nan}, 1: {}}}, "reproductions[0].test.concat.map_at_r"),
    ],
)
def test_non_finite_metrics_in_a_bundle_are_refused_naming_study_and_field(tmp_path, changes, field):
    text = _refusal(_bundle(tmp_path, _study(**changes)))
    assert f"study 'contrastive' on 'synthetic': {field} is " in text and "finite" in text


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"loss": "contrastive\x1b[31m\n| forged | 99.9 |"}, "study 0: loss 'contrastive\\x1b[31m\\n| forged"),
        ({"dataset": "cub\r\n"}, "study 0: dataset 'cub\\r\\n'"),
        ({"loss": "a b"}, "study 0: loss 'a b': not a loss name"),
        ({"best_params": {"margin": "0.25\n| forged |"}}, "best_params.margin holds a control character"),
    ],
)
def test_names_and_text_that_would_reach_the_terminal_raw_are_refused(tmp_path, changes, says):
    assert says in _refusal(_bundle(tmp_path, _study(**changes)))


def test_loss_names_of_every_form_are_accepted(tmp_path):
    for loss in ("sec:triplet", "mylab.losses:CircleLoss", "sec:l2_reg:my-lab.losses:Circle_2"):
        assert read_bundle(_bundle(tmp_path, _study(loss=loss))).studies[0].loss == loss


# ------------------------------------------------------------------------------------- 3. warm-up beyond the budget


def test_a_warmup_longer_than_the_folds_budget_is_refused_with_both_numbers():
    doc = _cfg(**{"protocol.max_epochs": 2, "protocol.iters_per_epoch": 1, "protocol.eval_every": 1})
    doc["protocol"]["train"]["lr_warmup_iters"] = 100_000
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    assert info.value.field == "protocol.train.lr_warmup_iters"
    assert "100000 iterations of warm-up >= a fold's whole budget" in str(info.value)
    assert "max_epochs × iters_per_epoch = 2 × 1 = 2" in str(info.value)
    doc["protocol"]["train"]["lr_warmup_iters"] = 1  # shorter than the budget: accepted
    assert parse_config(doc).protocol.train["lr_warmup_iters"] == 1


# ------------------------------------------------------------------------------------- 4. credentials in a bundle URI


def test_an_s3_bundle_uri_with_credentials_never_prints_them():
    text = _refusal("s3://AKIAEXAMPLEKEY:wJalrSECRETxyz@bucket/b.json", "--compare-with")
    assert "AKIAEXAMPLEKEY" not in text and "wJalrSECRETxyz" not in text
    assert "credentials do not belong in an s3:// URI" in text and "@bucket" in text


def test_a_librarys_message_quoting_the_uris_credentials_is_redacted():
    uri = "s3://AKIAEXAMPLEKEY:wJalr%2FSECRET@bucket/b.json"
    botocore = 'Invalid bucket name "AKIAEXAMPLEKEY:wJalr/SECRET@bucket": Bucket name must match the regex'
    text = redact_credentials(botocore, uri)
    assert "AKIAEXAMPLEKEY" not in text and "SECRET" not in text and text.startswith('Invalid bucket name "***@bucket"')


# ------------------------------------------------------------------------------------- 5. --resume names the field


@pytest.mark.parametrize(
    "stored, changes, field, values",
    [
        ({}, {"protocol.max_epochs": 10}, "protocol.max_epochs", "(8 there, 10 now;"),
        ({}, {"seed": 7}, "seed", "(0 there, 7 now;"),  # the datasets' and protocol's seeds follow it
        (
            {"protocol.fold_layout": "kfold", "protocol.folds": 5},
            {"protocol.fold_layout": "kfold", "protocol.folds": 6},
            "protocol.folds",
            "(5 there, 6 now;",
        ),
        ({}, {"datasets": [{**DEMO["datasets"][0], "per_class": 30}]}, "datasets[0].per_class", "(20 there, 30 now;"),
    ],
)
def test_resume_after_a_change_names_the_exact_field(tmp_path, stored, changes, field, values):
    from pipelines.execution.studies.continuation import check_resume

    before = parse_config(_cfg(storage=str(tmp_path), **stored))
    before.local_dir().mkdir(parents=True)
    (before.local_dir() / "sweep_config.json").write_text(json.dumps(before.model_dump(mode="json")))
    with pytest.raises(ConfigError) as info:
        check_resume(parse_config(_cfg(storage=str(tmp_path), **changes)))
    assert info.value.field == field and values in str(info.value)


# ------------------------------------------------------------------------------------- 6. third-party warnings


def test_a_refused_checkpoint_comes_without_torchs_pickle_protocol_warning():
    from dml_core.training.checkpoint import load_weights_only

    buf = io.BytesIO()
    torch.save({"format": 1, "w": Path("not a tensor")}, buf, pickle_protocol=5)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(pickle.UnpicklingError, match="refused: the file holds more than tensors"):
            load_weights_only(io.BytesIO(buf.getvalue()))
    assert [str(w.message) for w in seen] == []


class _ReturnsAFloat(torch.nn.Module):
    def forward(self, x, y):
        return float(x.sum())


def test_a_loss_returning_a_float_is_one_line_without_torchs_requires_grad_warning():
    from pipelines.execution.preflight.study_plans import _check_loss_value

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(ConfigError, match="returned a float, not a tensor"):
            _check_loss_value(_ReturnsAFloat(), "mylab:Circle", "losses[0].name", 16, (4, 2))
    assert [str(w.message) for w in seen] == []


@pytest.mark.parametrize("name", ["contrastive", "triplet", "npair", "proxy_anchor", "sec:triplet"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_embedding_makes_the_loss_non_finite(name, bad):
    from dml_core.losses import build_loss

    loss = build_loss(name, num_classes=8, embedding_dim=16)
    emb = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(8).repeat_interleave(4)
    finite = loss(emb.clone().requires_grad_(), labels)
    assert torch.isfinite(finite)
    emb[3, 5] = bad
    assert not torch.isfinite(loss(emb.requires_grad_(), labels))


# ------------------------------------------------------------------------------------- 7. addresses and CPUs


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_ray_client_address_nobody_answers_is_exactly_one_line(tmp_path):
    address = f"ray://127.0.0.1:{_closed_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    out = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "demo", "--address", address, "--storage", str(tmp_path / "runs")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        f"config error: --address: no Ray cluster answers at {address} (Connection refused)"
    ]
    assert not (tmp_path / "runs").exists()


def test_ray_clients_timeout_warning_is_not_printed_above_the_line(monkeypatch):
    """Something listens but no Ray Client answers: Ray Client times out (shortened here) and warns; the one line
    says it."""
    import ray.util.client.worker as client_worker

    from pipelines.execution.runtime import session as ray_session

    monkeypatch.setattr(client_worker, "INITIAL_TIMEOUT_SEC", 1)
    monkeypatch.setattr(client_worker, "backoff", lambda timeout: 1)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"ray://127.0.0.1:{silent.getsockname()[1]}"
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(ConfigError, match="no Ray cluster answers at .*ray client connection timeout"):
                ray_session._join_cluster(address, "--address", {})
    assert [str(w.message) for w in seen if "Ray Client" in str(w.message)] == []


def test_more_ddp_workers_than_this_machines_cpus_are_refused_before_anything_starts():
    from pipelines.execution.runtime.resources import check_local_workers

    cfg = parse_config(_cfg(**{"resources.workers_per_fold": 8}))
    with pytest.raises(ConfigError) as info:
        check_local_workers(cfg, None, memory=64.0, cpus=2)
    assert info.value.field == "resources.workers_per_fold"
    assert "8 DDP workers × cpus_per_worker 1 = 8 CPUs, but this machine has 2" in str(info.value)
    check_local_workers(cfg, None, memory=64.0, cpus=8)  # they fit
    check_local_workers(cfg, "ray://head:10001", memory=64.0, cpus=2)  # a cluster: checked once Ray answers


def test_this_machines_cpus_are_its_affinity_capped_by_its_cgroup_quota(monkeypatch, tmp_path):
    from pipelines.execution.runtime import resources

    monkeypatch.setattr(resources.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(resources, "_CGROUP_V2_MAX", cpu_max)
    cpu_max.write_text("max 100000\n")
    assert resources.usable_cpus() == 4
    cpu_max.write_text("150000 100000\n")  # a container's --cpus 1.5
    assert resources.usable_cpus() == 2


def test_a_worker_bigger_than_every_node_is_refused_a_fold_spread_over_nodes_is_not():
    from pipelines.execution.runtime.resources import check_cluster_resources, check_node_resources

    nodes = [{"CPU": 4.0}, {"CPU": 4.0}]
    spread = parse_config(_cfg(**{"resources.workers_per_fold": 8}))
    check_cluster_resources(spread, {"CPU": 8.0})  # 8 one-CPU workers over two nodes: Ray Train places them
    check_node_resources(spread, nodes)
    wide = parse_config(_cfg(**{"resources.cpus_per_worker": 6}))
    check_cluster_resources(wide, {"CPU": 8.0})  # the cluster holds 6 CPUs, no node does
    with pytest.raises(ConfigError) as info:
        check_node_resources(wide, nodes)
    assert info.value.field == "resources.cpus_per_worker"
    assert "6 CPUs per worker, but the biggest node of the Ray cluster has 4 (2 nodes, 8 CPUs in all)" in str(
        info.value
    )
