"""Image folders: hidden entries (``.ipynb_checkpoints/``, ``.DS_Store``, macOS ``._*`` files) are neither classes nor
images, through ``dmlrc data prepare folder`` and the folder reader alike."""

from __future__ import annotations

import io
import json

from PIL import Image

from dml_core.datasets.folder import scan


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


def _folder(root):
    for cls in ("cat", "dog"):
        (root / cls).mkdir(parents=True)
        for i in range(3):
            (root / cls / f"{i}.png").write_bytes(_png())
    # what notebooks and file managers leave behind
    (root / ".ipynb_checkpoints").mkdir()
    (root / ".ipynb_checkpoints" / "0-checkpoint.png").write_bytes(_png())
    (root / ".DS_Store").write_bytes(b"\0\1")
    (root / "cat" / "._0.png").write_bytes(b"AppleDouble, not an image")
    (root / "dog" / ".thumbs").mkdir()
    (root / "dog" / ".thumbs" / "0.png").write_bytes(_png())
    return root


def test_hidden_entries_are_neither_classes_nor_images(tmp_path):
    found = scan(_folder(tmp_path / "images"))
    assert found.class_names == ["cat", "dog"]
    assert [rel for rel, _ in found.rows] == [f"{c}/{i}.png" for c in ("cat", "dog") for i in range(3)]


def test_data_prepare_folder_makes_no_class_of_a_hidden_folder(tmp_path, capsys):
    from pipelines.cli import main

    src = _folder(tmp_path / "images")
    argv = ["data", "prepare", "folder", "--src", str(src), "--dest", str(tmp_path / "out"), "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["num_images"] == 6
    assert "6 images, 2 classes" in capsys.readouterr().out
