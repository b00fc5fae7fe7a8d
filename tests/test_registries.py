"""One registry per kind — losses, trunks, dataset kinds — of one shape (``dml_core/registry.py``): the built-ins'
names kept in one table that the resolver, the sweep config and ``dmlrc list`` all read, and the entry points of the
kind's group found from installed metadata, a plug-in's code imported only when a user names it.

Entry points are faked by replacing ``importlib.metadata.entry_points`` (as ``tests/test_plugin_registry.py`` does),
each read from a ``<name>-<version>.dist-info`` folder under ``tmp_path`` so that it carries its distribution; the
plug-in's module is a real file under ``tmp_path`` on ``sys.path``.
"""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dml_core.data import ImageTable
from dml_core.datasets.registry import (
    DATASET_KIND_REGISTRY,
    DatasetPluginError,
    UnknownNameError,
    builtin_dataset_kinds,
    list_plugin_dataset_kinds,
    load_dataset,
    resolve_dataset_kind,
)
from dml_core.losses import list_losses, resolve_loss
from dml_core.losses.registry import LOSS_REGISTRY
from dml_core.plugins import LossPluginError, PluginDistribution, PluginError, TrunkPluginError
from dml_core.registry import Registry
from dml_core.trunks import BUILTIN_TRUNKS, resolve_trunk
from dml_core.trunks.registry import TRUNK_REGISTRY
from pipelines.config import fields
from pipelines.config.datasets import DATASET_KINDS, PluginDataset, dataset_models
from pipelines.config.errors import ConfigError
from pipelines.config.schema import parse_config
from pipelines.listing import catalogue, render_text

#: The plug-in's module; imported only when a config or a caller names its kind.
MODULE = "dmlrc_test_dataset_kind"
PLUGIN_CODE = '''
import numpy as np

from dml_core.data import ImageTable


def load(*, path, classes=3, per_class=2):
    """Tiny grey images, ``classes`` classes of ``per_class`` each."""
    labels = np.repeat(np.arange(classes), per_class)
    return ImageTable([np.zeros((8, 8, 3), np.uint8) for _ in labels], labels)


def not_a_table(*, path):
    return [path]


def no_path(*, root):
    return None


def fails(*, path):
    raise RuntimeError("the archive is gone")
'''


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """The plug-in's module on ``sys.path`` (not imported), removed from ``sys.modules`` afterwards."""
    src = tmp_path / "src"
    src.mkdir()
    (src / f"{MODULE}.py").write_text(textwrap.dedent(PLUGIN_CODE), encoding="utf-8")
    (src / "dmlrc_test_broken_kind.py").write_text("raise ImportError('needs the lab VPN')\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(src))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    yield src
    sys.modules.pop(MODULE, None)
    sys.modules.pop("dmlrc_test_broken_kind", None)


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """``installed(dist, {group: {name: value}})``: entry points as ``importlib.metadata.entry_points`` reports them,
    each with its distribution (``dist 1.0``, installed from an index)."""
    eps: list[importlib.metadata.EntryPoint] = []

    def fake(*, group: str = "") -> list[importlib.metadata.EntryPoint]:
        return [ep for ep in eps if ep.group == group]

    def install(dist: str, groups: dict[str, dict[str, str]]) -> None:
        info = tmp_path / "meta" / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n", encoding="utf-8")
        lines = []
        for group, named in groups.items():
            lines += [f"[{group}]"] + [f"{k} = {v}" for k, v in named.items()] + [""]
        (info / "entry_points.txt").write_text("\n".join(lines), encoding="utf-8")
        eps.extend(importlib.metadata.PathDistribution(info).entry_points)

    monkeypatch.setattr(importlib.metadata, "entry_points", fake)
    return install


def _config(dataset: dict) -> dict:
    return {"name": "x", "datasets": [dataset], "losses": ["contrastive"]}


def _config_error(dataset: dict) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        parse_config(_config(dataset))
    return e.value


# ------------------------------------------------------------------------------------------------ one shape
def test_the_three_registries_share_one_shape():
    registries = {"loss": LOSS_REGISTRY, "trunk": TRUNK_REGISTRY, "dataset kind": DATASET_KIND_REGISTRY}
    for kind, registry in registries.items():
        assert isinstance(registry, Registry) and registry.kind == kind
        assert registry.group.startswith("dml_reality_check.")
        assert issubclass(registry.error, PluginError)
        assert registry.names() and all(name in registry for name in registry.names())
    assert [r.group for r in registries.values()] == [
        "dml_reality_check.losses",
        "dml_reality_check.trunks",
        "dml_reality_check.datasets",
    ]
    assert (LOSS_REGISTRY.error, TRUNK_REGISTRY.error, DATASET_KIND_REGISTRY.error) == (
        LossPluginError,
        TrunkPluginError,
        DatasetPluginError,
    )
    # each kind's resolver hands out what its registry holds for a built-in name
    assert resolve_loss("contrastive") is LOSS_REGISTRY.get("contrastive")
    assert resolve_trunk("tiny") is TRUNK_REGISTRY.get("tiny")
    assert resolve_dataset_kind("folder") is DATASET_KIND_REGISTRY.get("folder")


def test_a_registry_refuses_a_name_registered_twice_and_its_table_is_read_only():
    registry: Registry[int] = Registry("widget", "dml_reality_check.widgets", PluginError)
    registry.register("one", 1)
    with pytest.raises(ValueError, match=r"^widget 'one' registered twice$"):
        registry.register("one", 2)
    with pytest.raises(TypeError):
        registry.builtins["two"] = 2  # type: ignore[index]
    assert registry.names() == ("one",) and registry.get("two") is None


# ------------------------------------------------------------------------------------------------ one table
def test_the_builtin_names_come_from_one_table(capsys):
    kinds = builtin_dataset_kinds()
    assert kinds == DATASET_KIND_REGISTRY.names() == ("synthetic", "omniglot", "parquet", "folder", "csv")
    assert DATASET_KINDS == kinds  # what the config validator reads
    assert fields.DATASET_KINDS == kinds  # what its errors list as known
    assert tuple(dataset_models()) == kinds  # one config model per registered kind, in the registry's order
    cat = catalogue()
    assert [d["kind"] for d in cat["dataset_kinds"]] == list(kinds)  # what `dmlrc list` shows
    assert _config_error({"kind": "imagenet", "path": "x"}).problem.endswith(f"(known: {', '.join(kinds)})")
    assert TRUNK_REGISTRY.names() == BUILTIN_TRUNKS
    assert [t["name"] for t in cat["trunks"]] == list(BUILTIN_TRUNKS)
    assert sorted(LOSS_REGISTRY.names()) == list_losses() == [loss["name"] for loss in cat["losses"]]


def test_each_builtin_kinds_config_hands_its_loader_the_arguments_it_takes(tmp_path):
    entries = {
        "synthetic": {"kind": "synthetic", "num_classes": 4, "per_class": 4, "seed": 3},
        "omniglot": {"kind": "omniglot", "path": str(tmp_path)},
        "parquet": {"kind": "parquet", "path": str(tmp_path)},
        "folder": {"kind": "folder", "path": str(tmp_path)},
        "csv": {"kind": "csv", "path": str(tmp_path / "d.csv"), "root": str(tmp_path)},
    }
    assert list(entries) == list(builtin_dataset_kinds())
    for kind, entry in entries.items():
        spec = parse_config(_config(entry)).datasets[0]
        assert type(spec) is dataset_models()[kind]
        resolve_dataset_kind(kind).check(spec.loader_arguments())  # binds to the loader's signature
    table = load_dataset("synthetic", num_classes=4, per_class=2, image_size=8, seed=0)
    assert len(table) == 8 and set(table.labels.tolist()) == {0, 1, 2, 3}


# ------------------------------------------------------------------------------------------------ dataset plug-ins
def test_a_dataset_kind_plugin_is_listed_with_its_distribution_and_not_imported(installed, plugin_module, capsys):
    installed("acme-data", {"dml_reality_check.datasets": {"acme_images": f"{MODULE}:load"}})
    assert list_plugin_dataset_kinds() == {"acme_images": (PluginDistribution("acme-data", "1.0"),)}
    plugins = {(p["kind"], p["name"]): p for p in catalogue()["plugins"]}
    listed = plugins[("dataset kind", "acme_images")]
    assert listed["distributions"] == [{"name": "acme-data", "version": "1.0", "origin": "index"}]
    assert listed["status"] == "ok"
    text = render_text(catalogue(), width=120)
    row = ["dataset", "kind", "acme_images", "acme-data", "1.0", "ok"]
    assert any(line.split() == row for line in text.splitlines())
    # neither listing nor a config of a built-in kind imports the plug-in
    parse_config(_config({"kind": "synthetic", "num_classes": 4, "per_class": 4}))
    resolve_dataset_kind("folder")
    assert MODULE not in sys.modules


def test_a_dataset_kind_plugin_is_resolved_when_a_config_names_it(installed, plugin_module, tmp_path):
    installed("acme-data", {"dml_reality_check.datasets": {"acme_images": f"{MODULE}:load"}})
    entry = {"kind": "acme_images", "path": str(tmp_path), "image_size": 16, "params": {"classes": 5}}
    spec = parse_config(_config(entry)).datasets[0]
    assert MODULE in sys.modules  # imported, and checked, when the config was read
    assert isinstance(spec, PluginDataset) and spec.name == "acme_images"
    assert spec.loader_arguments() == {"path": str(tmp_path), "classes": 5}
    kind = resolve_dataset_kind("acme_images")
    assert kind.origin == "entry_point" and kind.distribution == PluginDistribution("acme-data", "1.0")
    assert kind.ref == f"{MODULE}:load" and kind.description.startswith("Tiny grey images")
    table = load_dataset(spec.kind, **spec.loader_arguments())
    assert isinstance(table, ImageTable) and len(np.unique(table.labels)) == 5
    e = _config_error({**entry, "params": {"colour": "red"}})
    assert e.field == "datasets[0].params"
    assert e.problem == f"dataset kind 'acme_images': {MODULE}:load: got an unexpected keyword argument 'colour'"


def test_an_unknown_dataset_kind_is_one_error_naming_it_and_the_known_ones(installed, plugin_module):
    installed("acme-data", {"dml_reality_check.datasets": {"acme_images": f"{MODULE}:load"}})
    with pytest.raises(UnknownNameError) as e:
        resolve_dataset_kind("imagenet")
    assert str(e.value) == (
        "unknown dataset kind 'imagenet' (known: synthetic, omniglot, parquet, folder, csv; plugins: acme_images)"
    )
    assert e.value.known == list(builtin_dataset_kinds()) and e.value.plugins == ["acme_images"]
    error = _config_error({"kind": "acme_imagse", "path": "x"})
    assert error.field == "datasets[0].kind" and error.problem.startswith("unknown dataset kind 'acme_imagse'")
    assert MODULE not in sys.modules


def test_a_dataset_kind_plugin_that_cannot_be_used_is_one_line(installed, plugin_module, tmp_path):
    installed(
        "acme-data",
        {
            "dml_reality_check.datasets": {
                "broken": "dmlrc_test_broken_kind:load",
                "listy": f"{MODULE}:not_a_table",
                "pathless": f"{MODULE}:no_path",
                "failing": f"{MODULE}:fails",
                "folder": f"{MODULE}:load",  # a built-in's name: never reached through it
            }
        },
    )
    installed("other-data", {"dml_reality_check.datasets": {"failing": f"{MODULE}:load"}})
    error = _config_error({"kind": "broken", "path": str(tmp_path)})
    assert error.field == "datasets[0].kind"
    assert "cannot import module 'dmlrc_test_broken_kind': ImportError: needs the lab VPN" in error.problem
    assert "dmlrc_test_broken_kind.py:1" in error.problem and "\n" not in error.problem
    with pytest.raises(DatasetPluginError, match=r"does not take path as a keyword argument"):
        resolve_dataset_kind("pathless")
    with pytest.raises(DatasetPluginError, match=rf"{MODULE}:not_a_table\(\) returned a list, not a dml_core"):
        load_dataset("listy", path=str(tmp_path))
    with pytest.raises(DatasetPluginError, match=r"exported by more than one distribution: acme-data 1.0"):
        resolve_dataset_kind("failing")
    assert resolve_dataset_kind("folder").origin == "builtin"  # the built-in always wins
    status = {p["name"]: p["status"] for p in catalogue()["plugins"] if p["kind"] == "dataset kind"}
    assert status["folder"] == "refused: a built-in has this name"
    assert status["failing"] == "refused: exported by more than one distribution"


def test_a_plugin_loader_that_raises_is_one_line_with_its_file_and_line(installed, plugin_module, tmp_path):
    installed("acme-data", {"dml_reality_check.datasets": {"failing": f"{MODULE}:fails"}})
    with pytest.raises(DatasetPluginError) as e:
        load_dataset("failing", path=str(tmp_path))
    where = Path(plugin_module / f"{MODULE}.py")
    assert str(e.value).startswith(f"dataset kind 'failing': {MODULE}:fails() raised RuntimeError: the archive is gone")
    assert f"(raised at {where}:" in str(e.value)
