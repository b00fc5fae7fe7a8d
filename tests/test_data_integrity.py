"""Corrupted datasets, shards and manifests: each case must fail with a `DataError`
(a ValueError) whose message starts with the file (and row) at fault, never be accepted silently.

Cases: a flipped shard byte with its mtime restored (stale verify), a reordered `row_groups` list (images served
with other classes' labels), a reader that looks at the wrong offset, truncated / bit-flipped PNG and JPEG at
prepare time, listing paths that leave `--src` (`..`, absolute, symlinks), zip entries with `..` or absolute names,
two classes with one name, a corrupt zip, manifests that are not a JSON object or have wrong field types, and
`check_rows` (the preflight's cheap per-row header check).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from test_datasets_prepare import jpeg, make_fake_cars, make_fake_cub, make_fake_sop

from dml_core.data import read_parquet_manifest
from dml_core.datasets import prepare
from dml_core.shards import (
    CorruptImageError,
    DataError,
    ManifestError,
    Record,
    ShardChecksumError,
    check_rows,
    verify_shards,
    write_shards,
)

OMNIGLOT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "omniglot"


def png(seed: int, size: int = 24) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _records(n_classes=2, per_class=4):
    recs, data = [], {}
    for c in range(n_classes):
        for j in range(per_class):
            rel = f"c{c}/{j}.jpg"
            data[rel] = jpeg(c * 50 + j)
            recs.append(Record(rel, c, f"class{c}", "train", (lambda b: lambda: b)(data[rel])))
    return recs, data


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def _rewrite_manifest(out: Path, edit) -> Path:
    mpath = out / "manifest.json"
    m = json.loads(mpath.read_text())
    edit(m)
    mpath.write_text(json.dumps(m))
    return mpath


# --------------------------------------------------------------------------------------------- shards


def test_verify_hashes_every_shard_even_when_the_stamp_matches(tmp_path):
    """A byte flipped where neither the row checksums nor decoding look (the footer's writer string), with the
    file's size and mtime restored: the stamp matches, yet `verify` must hash and fail."""
    recs, _ = _records()
    m = write_shards(recs, tmp_path / "out", dataset="toy", progress=False)
    shard = tmp_path / "out" / m["shards"][0]["path"]
    verify_shards(tmp_path / "out", cache_dir=tmp_path / "cache")  # ok, and leaves a stamp
    st = shard.stat()
    _flip(shard, shard.read_bytes().rindex(b"parquet-cpp-arrow"))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_mtime_ns == st.st_mtime_ns and shard.stat().st_size == st.st_size
    with pytest.raises(ShardChecksumError, match=f"^{shard}: shard {m['shards'][0]['path']} sha256"):
        verify_shards(tmp_path / "out", cache_dir=tmp_path / "cache")
    # reads use the stamp, but it includes the inode change time, which restoring the mtime cannot restore
    with pytest.raises(ShardChecksumError):
        read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache")


def test_a_table_sent_to_another_machine_uses_that_machines_cache(tmp_path, monkeypatch):
    """A table opened with the default cache (``$DMLRC_CACHE_DIR``, else ~/.cache/dmlrc) and unpickled on a Ray
    worker of another node uses that node's default, not the driver's path; an explicit ``cache_dir`` travels."""
    import pickle

    recs, _ = _records()
    write_shards(recs, tmp_path / "out", dataset="toy", progress=False)
    monkeypatch.setenv("DMLRC_CACHE_DIR", str(tmp_path / "driver"))
    table = read_parquet_manifest(tmp_path / "out")
    blob = pickle.dumps(table)
    monkeypatch.setenv("DMLRC_CACHE_DIR", str(tmp_path / "worker"))
    there = pickle.loads(blob)
    assert there._source.cache_dir == tmp_path / "worker"
    assert there.images[0] and (tmp_path / "worker" / "verified").is_dir()
    pinned = pickle.loads(pickle.dumps(read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "mine")))
    assert pinned._source.cache_dir == tmp_path / "mine"


def test_reordered_row_groups_in_the_manifest_are_rejected(tmp_path):
    """A manifest whose row_groups list is reordered is refused, so no row is read with another class's label."""
    recs, _ = _records(2, 4)
    m = write_shards(recs, tmp_path / "out", dataset="toy", row_group_rows=3, progress=False)
    assert m["shards"][0]["row_groups"] == [3, 3, 2]
    mpath = _rewrite_manifest(tmp_path / "out", lambda mj: mj["shards"][0].update(row_groups=[2, 3, 3]))
    with pytest.raises(
        ManifestError,
        match=rf"^{mpath}: shards\[0\] \(shards/part-00000.parquet\): row_groups "
        r"\[2, 3, 3\] do not match the file's row groups \[3, 3, 2\]",
    ):
        read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache")
    with pytest.raises(ManifestError):
        check_rows(tmp_path / "out", cache_dir=tmp_path / "cache")


def test_a_row_read_at_a_wrong_offset_is_caught_by_its_index_column(tmp_path):
    """Defence in depth: whatever maps a row to (row group, offset) wrongly, the row read carries its own index."""
    recs, _ = _records(2, 4)
    write_shards(recs, tmp_path / "out", dataset="toy", row_group_rows=3, progress=False)
    t = read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache")
    src = t._source
    src.group_starts[0] = np.array([0, 2, 5, 8])  # a locate bug: rows 2.. now land one row late
    t.images[1]
    with pytest.raises(
        CorruptImageError,
        match=r"shard shards/part-00000.parquet row 2: the row read there "
        r"\(c0/3.jpg\) holds row 3 of the dataset, expected 2",
    ):
        t.images[2]


def test_schema_v1_shards_without_an_index_column_are_still_read_and_checked_by_label(tmp_path):
    recs, data = _records(2, 4)
    m = write_shards(recs, tmp_path / "out", dataset="toy", row_group_rows=3, progress=False)
    shard = tmp_path / "out" / m["shards"][0]["path"]
    pq.write_table(pq.read_table(shard).drop_columns(["index"]), shard, row_group_size=3)
    _rewrite_manifest(
        tmp_path / "out",
        lambda mj: (
            mj.update(schema_version=1),
            mj["shards"][0].update(sha256=hashlib.sha256(shard.read_bytes()).hexdigest()),
        ),
    )
    t = read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache")
    assert [t.images[i] for i in range(8)] == [data[f"c{c}/{j}.jpg"] for c in range(2) for j in range(4)]
    t._source.group_starts[0] = np.array([0, 2, 5, 8])  # rows 2.. one late: row 3 (class 0) is still class 0 ...
    t._source._lru.clear()
    t.images[2]
    with pytest.raises(CorruptImageError, match=r"row 3 \(c1/0.jpg\): label 1, expected 0"):  # ... row 4 is class 1
        t.images[3]


def test_manifest_rows_per_shard_must_match_the_file(tmp_path):
    recs, _ = _records(2, 4)
    write_shards(recs, tmp_path / "out", dataset="toy", row_group_rows=3, progress=False)

    def edit(mj):
        mj["shards"][0].update(rows=7, row_groups=[3, 3, 1])
        mj["num_images"] = 7
        mj["classes"][1]["count"] = 3

    _rewrite_manifest(tmp_path / "out", edit)
    with pytest.raises(ManifestError, match=r"shards\[0\] \(shards/part-00000.parquet\): rows 7, but the file holds 8"):
        read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache")


def test_an_unreadable_page_names_the_shard_and_row_group(tmp_path):
    """A damaged compressed page in a shard whose manifest sha256 was rewritten to match: not a traceback."""
    recs, _ = _records(2, 4)
    m = write_shards(recs, tmp_path / "out", dataset="toy", row_group_rows=3, progress=False)
    shard = tmp_path / "out" / m["shards"][0]["path"]
    meta = pq.ParquetFile(shard).metadata.row_group(1)
    col = next(meta.column(i) for i in range(meta.num_columns) if meta.column(i).path_in_schema == "relpath")
    raw = bytearray(shard.read_bytes())
    end = col.data_page_offset + col.total_compressed_size
    raw[end - 12 : end - 1] = bytes(b ^ 0xFF for b in raw[end - 12 : end - 1])  # inside the ZSTD payload
    shard.write_bytes(bytes(raw))
    _rewrite_manifest(tmp_path / "out", lambda mj: mj["shards"][0].update(sha256=hashlib.sha256(raw).hexdigest()))
    t = read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache")
    t.images[2]
    with pytest.raises(
        CorruptImageError,
        match=r"manifest.json: shard shards/part-00000.parquet row group 1: "
        r"unreadable",
    ):
        t.images[3]
    with pytest.raises(CorruptImageError, match="row group 1: unreadable"):
        verify_shards(tmp_path / "out", cache_dir=tmp_path / "cache")


@pytest.mark.parametrize(
    "payload, field",
    [
        ("[1, 2, 3]", "not a JSON object"),
        ("{not json", "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
    ],
)
def test_a_manifest_that_is_not_a_json_object_names_the_file(tmp_path, payload, field):
    (tmp_path / "manifest.json").write_bytes(payload if isinstance(payload, bytes) else payload.encode())
    with pytest.raises(ManifestError, match=f"^{tmp_path / 'manifest.json'}: {field}"):
        read_parquet_manifest(tmp_path)


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda m: m.update(num_images="8"), "num_images"),
        (lambda m: m.update(num_images=True), "num_images"),
        (lambda m: m.update(classes={"a": 1}), "classes"),
        (lambda m: m["classes"][1].update(label="1"), r"classes\[1\]\.label"),
        (lambda m: m["classes"][0].update(name=None), r"classes\[0\]\.name"),
        (lambda m: m.update(shards="shards/part-00000.parquet"), "shards"),
        (lambda m: m["shards"][0].update(rows="8"), r"shards\[0\]\.rows"),
        (lambda m: m["shards"][0].update(row_groups="3,3,2"), r"shards\[0\]\.row_groups"),
        (lambda m: m["shards"][0].update(row_groups=[3, 3, 2.0]), r"shards\[0\]\.row_groups\[2\]"),
        (lambda m: m["shards"][0].update(row_groups=[3, 0, 3, 2]), r"shards\[0\]\.row_groups\[1\]"),
        (lambda m: m["shards"][0].update(sha256=5), r"shards\[0\]\.sha256"),
        (lambda m: m["shards"][0].update(sha256="abc"), r"shards\[0\]\.sha256"),
        (lambda m: m["shards"][0].update(path="../../etc/passwd"), r"shards\[0\]\.path"),
        (lambda m: m["shards"][0].update(path="/etc/passwd"), r"shards\[0\]\.path"),
        (lambda m: m["shards"][0].pop("row_groups"), r"shards\[0\]\.row_groups"),
        (lambda m: m.pop("dataset"), "dataset"),
    ],
)
def test_manifest_fields_of_the_wrong_type_are_named(tmp_path, edit, field):
    recs, _ = _records(2, 4)
    write_shards(recs, tmp_path / "out", dataset="toy", row_group_rows=3, progress=False)
    mpath = _rewrite_manifest(tmp_path / "out", edit)
    with pytest.raises(ManifestError, match=f"^{mpath}: {field}: "):
        read_parquet_manifest(tmp_path / "out", cache_dir=tmp_path / "cache")


def test_check_rows_reads_every_header_and_names_the_bad_row(tmp_path):
    recs, _ = _records(2, 4)
    m = write_shards(recs, tmp_path / "out", dataset="toy", row_group_rows=3, progress=False)
    summary = check_rows(tmp_path / "out", cache_dir=tmp_path / "cache")
    assert summary["rows"] == 8 and summary["shards"] == 1 and summary["formats"] == {"JPEG": 8}
    shard = tmp_path / "out" / m["shards"][0]["path"]
    t = pq.read_table(shard)
    images = t.column("image").to_pylist()
    images[4] = b"\x89PNX" + images[4][4:]  # magic bytes broken; its sha256 column is left alone
    t = t.set_column(t.schema.get_field_index("image"), "image", pa.array(images, pa.binary()))
    pq.write_table(t, shard, row_group_size=3)
    _rewrite_manifest(
        tmp_path / "out", lambda mj: mj["shards"][0].update(sha256=hashlib.sha256(shard.read_bytes()).hexdigest())
    )
    with pytest.raises(
        CorruptImageError,
        match=rf"^{tmp_path / 'out' / 'manifest.json'}: shard "
        r"shards/part-00000.parquet row 4 \(c1/0.jpg\): not a readable image",
    ):
        check_rows(tmp_path / "out", cache_dir=tmp_path / "cache")


# --------------------------------------------------------------------------------------------- prepare decodes


def _one_bad(tmp_path, bad: bytes, name="bad.png"):
    recs = [
        Record("ok.jpg", 0, "a", "train", lambda: jpeg(1)),
        Record(name, 1, "b", "train", lambda: bad, source=f"/data/src/{name}"),
    ]
    return lambda: write_shards(recs, tmp_path / "o", dataset="t", progress=False)


def test_prepare_rejects_a_truncated_png_naming_the_source_file(tmp_path):
    good = png(3)
    with pytest.raises(CorruptImageError, match=r"^/data/src/bad.png: does not decode"):
        _one_bad(tmp_path, good[: len(good) * 2 // 3])()
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_prepare_rejects_a_png_cut_inside_its_last_chunk(tmp_path):
    """Pillow decodes such a file without complaint (it never checks IEND): the check looks for it."""
    good = png(3)
    with pytest.raises(CorruptImageError, match=r"^/data/src/bad.png: does not decode \(PNG without an intact IEND"):
        _one_bad(tmp_path, good[:-3])()


def test_prepare_rejects_a_bit_flipped_png(tmp_path):
    good = bytearray(png(4))
    good[len(good) // 2] ^= 0x10  # inside IDAT: the chunk's CRC no longer matches
    with pytest.raises(CorruptImageError, match=r"^/data/src/bad.png: does not decode"):
        _one_bad(tmp_path, bytes(good))()


def test_prepare_rejects_a_truncated_jpeg(tmp_path):
    good = jpeg(5, size=64)
    with pytest.raises(CorruptImageError, match=r"^/data/src/bad.jpg: does not decode"):
        _one_bad(tmp_path, good[: len(good) // 2], "bad.jpg")()


def test_prepare_rejects_a_jpeg_with_a_flipped_marker(tmp_path):
    good = bytearray(jpeg(6, size=64))
    sos = bytes(good).index(b"\xff\xda")
    good[sos + 1] ^= 0x01  # the start-of-scan marker becomes an unknown one
    with pytest.raises(CorruptImageError, match=r"^/data/src/bad.jpg: (does not decode|not a readable image)"):
        _one_bad(tmp_path, bytes(good), "bad.jpg")()


def test_prepare_rejects_a_broken_image_file_in_a_real_layout_naming_the_file(tmp_path):
    expected = make_fake_cub(tmp_path / "src")
    victim = tmp_path / "src" / "CUB_200_2011" / sorted(expected)[5]
    victim.write_bytes(victim.read_bytes()[:200])
    with pytest.raises(CorruptImageError, match=f"^{victim}: "):
        prepare("cub200", tmp_path / "src", tmp_path / "out", progress=False)


# --------------------------------------------------------------------------------------------- listing files


def _cub_with_path(tmp_path, image_id: int, new_path: str) -> Path:
    make_fake_cub(tmp_path / "src")
    listing = tmp_path / "src" / "CUB_200_2011" / "images.txt"
    lines = listing.read_text().splitlines()
    lines[image_id - 1] = f"{image_id} {new_path}"
    listing.write_text("\n".join(lines) + "\n")
    return listing


def test_a_listing_path_with_dotdot_that_leaves_src_is_rejected(tmp_path):
    secret = tmp_path / "outside" / "secret.png"
    secret.parent.mkdir()
    secret.write_bytes(png(1))
    listing = _cub_with_path(tmp_path, 2, "001.Bird_A/../../../../outside/secret.png")
    with pytest.raises(DataError, match=rf"^{listing} line 2: image path .*outside.* leaves"):
        prepare("cub200", tmp_path / "src", tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_an_absolute_listing_path_is_rejected(tmp_path):
    secret = tmp_path / "secret.jpg"
    secret.write_bytes(jpeg(1))
    make_fake_sop(tmp_path / "src")
    listing = tmp_path / "src" / "Ebay_test.txt"
    lines = listing.read_text().splitlines()
    lines[1] = " ".join(lines[1].split()[:3] + [str(secret)])
    listing.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"^{listing} line 2: image path .* is absolute"):
        prepare("sop", tmp_path / "src", tmp_path / "out", progress=False)


def test_a_symlink_that_escapes_src_is_rejected(tmp_path):
    expected = make_fake_cub(tmp_path / "src")
    secret = tmp_path / "secret.jpg"
    secret.write_bytes(jpeg(77))
    victim = tmp_path / "src" / "CUB_200_2011" / sorted(expected)[3]
    victim.unlink()
    victim.symlink_to(secret)
    with pytest.raises(DataError, match=rf"^{victim}: .*symbolic link.* outside"):
        prepare("cub200", tmp_path / "src", tmp_path / "out", progress=False)


def test_a_symlinked_src_itself_is_fine(tmp_path):
    make_fake_cub(tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert prepare("cub200", tmp_path / "link", tmp_path / "out", progress=False)["num_images"] == 12


def test_an_image_id_listed_twice_is_rejected(tmp_path):
    """An image id listed twice in images.txt is refused, not silently replacing the first image."""
    listing = _cub_with_path(tmp_path, 2, "001.Bird_A/Bird_A_0000.jpg")
    text = listing.read_text().replace("2 001.Bird_A/Bird_A_0000.jpg", "1 001.Bird_A/Bird_A_0001.jpg")
    listing.write_text(text)
    with pytest.raises(DataError, match=rf"^{listing} line 2: cub200: image_id 1 is listed twice"):
        prepare("cub200", tmp_path / "src", tmp_path / "out", progress=False)


def test_two_classes_with_one_name_are_rejected(tmp_path):
    recs = [Record("a.jpg", 0, "same", "train", lambda: jpeg(1)), Record("b.jpg", 1, "same", "train", lambda: jpeg(2))]
    with pytest.raises(DataError, match="labels 0 and 1 have the same class name 'same'"):
        write_shards(recs, tmp_path / "o", dataset="t", progress=False)


def test_cars_with_two_classes_of_one_name_are_rejected(tmp_path):
    from scipy.io import loadmat, savemat

    make_fake_cars(tmp_path / "src")
    mat = loadmat(tmp_path / "src" / "cars_annos.mat")
    mat["class_names"][0, 2] = mat["class_names"][0, 1]
    savemat(tmp_path / "src" / "cars_annos.mat", {k: v for k, v in mat.items() if not k.startswith("__")})
    with pytest.raises(DataError, match="have the same class name 'Make Model 2001'"):
        prepare("cars196", tmp_path / "src", tmp_path / "out", progress=False)


# --------------------------------------------------------------------------------------------- omniglot zips


def _zip(path: Path, entries: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    return path


@pytest.mark.parametrize(
    "name",
    [
        "root/../../x_01.png",
        "/abs/Greek/char01/x_01.png",
        "root/Greek/../x_01.png",
        "root\\..\\Greek\\x.png/char01/x_01.png",
    ],
)
def test_zip_entries_that_leave_the_zip_root_are_rejected(tmp_path, name):
    z = _zip(tmp_path / "images_background_small1.zip", {"root/Greek/char01/x_01.png": png(1), name: png(2)})
    with pytest.raises(DataError, match=rf"^{z}: entry .*('\.\.'|absolute)"):
        prepare("omniglot", tmp_path, tmp_path / "out", progress=False)


def test_a_corrupt_zip_names_the_zip_file(tmp_path):
    z = _zip(tmp_path / "images_background_small1.zip", {"root/Greek/char01/x_01.png": png(1)})
    z.write_bytes(z.read_bytes()[:-30])  # the central directory is cut
    with pytest.raises(DataError, match=f"^{z}: not a readable zip file"):
        prepare("omniglot", tmp_path, tmp_path / "out", progress=False)


def test_a_zip_member_with_a_bad_crc_names_the_zip_and_member(tmp_path):
    data = png(1)
    z = _zip(tmp_path / "images_background_small1.zip", {"root/Greek/char01/x_01.png": data})
    raw = bytearray(z.read_bytes())
    raw[raw.index(data[20:40]) + 5] ^= 0x01  # stored uncompressed by writestr: flip a member byte
    z.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=rf"^{z}: root/Greek/char01/x_01.png: "):
        prepare("omniglot", tmp_path, tmp_path / "out", progress=False)


def test_an_encrypted_zip_member_is_one_data_error(tmp_path, capsys):
    """zipfile raises RuntimeError ("password required") for an encrypted member: one line naming it, no traceback.
    Python cannot write encrypted zips: the member's "encrypted" flag bit is set in both headers instead."""
    z = _zip(tmp_path / "images_background_small1.zip", {"root/Greek/char01/x_01.png": png(1)})
    raw = bytearray(z.read_bytes())
    for signature, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # local header, central directory entry
        i = raw.index(signature)
        raw[i + flag_at] |= 0x01
    z.write_bytes(bytes(raw))
    line = _data_cli(capsys, "prepare", "omniglot", "--src", tmp_path, "--dest", tmp_path / "out")
    assert f"{z}: root/Greek/char01/x_01.png: encrypted in the zip" in line, line


@pytest.mark.skipif(not OMNIGLOT.is_dir(), reason=f"Omniglot zips not found at {OMNIGLOT} (shared data absent)")
def test_a_truncated_copy_of_the_real_omniglot_zip_names_the_file(tmp_path):
    src = OMNIGLOT / "images_background_small1.zip"
    z = tmp_path / src.name
    z.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with pytest.raises(DataError, match=f"^{z}: not a readable zip file"):
        prepare("omniglot", tmp_path, tmp_path / "out", progress=False)


def test_errors_are_value_errors_that_start_with_the_file():
    for cls in (ManifestError, CorruptImageError, ShardChecksumError):
        assert issubclass(cls, DataError) and issubclass(cls, ValueError)


# --------------------------------------------------------------------------------------------- dmlrc data: CLI lines


def _data_cli(capsys, *argv) -> str:
    """`dmlrc data ...` through the real CLI entry: exit status 2 and exactly one stderr line, returned."""
    from pipelines.cli import main

    capsys.readouterr()
    rc = main(["data", *map(str, argv)])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("data error: "), err
    return lines[0]


def _expect_line(line: str, text: str) -> None:
    assert line == f"data error: {text}"


def _image_folder(root: Path, classes=("a", "b"), per_class: int = 2) -> Path:
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for j in range(per_class):
            (root / name / f"{j}.jpg").write_bytes(jpeg(400 + 100 * c + j))
    return root


# --------------------------------------------------------------------------------------------- csv datasets

_CSV_CASES = {
    "missing column": (
        "path,class_name\na/0.jpg,a\n",
        "row 1: missing column 'label' (the header has 'path', 'class_name'; required: path, label)",
    ),
    "empty path": ("path,label\na/0.jpg,0\n,0\n", "row 3: empty path"),
    "dotdot path": (
        "path,label\na/0.jpg,0\na/../../secret.jpg,0\n",
        "row 3: image path 'a/../../secret.jpg' contains '..' and leaves the root {root}",
    ),
    "absolute path": (
        "path,label\n{secret},0\n",
        "row 2: image path '{secret}' is absolute (paths must be relative to the root {root})",
    ),
    "backslash path": (
        "path,label\na\\0.jpg,0\n",
        "row 2: image path 'a\\\\0.jpg' contains a backslash (paths are '/'-separated)",
    ),
    "missing file": ("path,label\na/0.jpg,0\na/9.jpg,0\n", "row 3: image 'a/9.jpg' not found under {root}"),
    "label not an integer": ("path,label\na/0.jpg,zero\n", "row 2: label 'zero' is not a non-negative integer"),
    "label a float": ("path,label\na/0.jpg,1.0\n", "row 2: label '1.0' is not a non-negative integer"),
    "label negative": ("path,label\na/0.jpg,-1\n", "row 2: label '-1' is not a non-negative integer"),
    "duplicate path": (
        "path,label\na/0.jpg,0\na/1.jpg,0\n./a//0.jpg,0\n",
        "row 4: image 'a/0.jpg' is listed twice (first on row 2)",
    ),
    "label with two names": (
        "path,label,class_name\na/0.jpg,0,a\na/1.jpg,0,b\n",
        "row 3: label 0 has class name 'b', but row 2 names it 'a'",
    ),
    "name with two labels": (
        "path,label,class_name\na/0.jpg,0,a\nb/0.jpg,1,a\n",
        "row 3: class name 'a' has label 1, but row 2 gives it label 0",
    ),
    "names differ by case": (
        "path,label,class_name\na/0.jpg,0,Apple\nb/0.jpg,1,apple\n",
        (
            "row 3: class names 'Apple' (label 0, row 2) and 'apple' (label 1) differ only by case "
            "or Unicode normalisation"
        ),
    ),
    "names differ by normalisation": (
        "path,label,class_name\na/0.jpg,0,caf\u00e9\nb/0.jpg,1,cafe\u0301\n",
        (
            "row 3: class names 'caf\u00e9' (label 0, row 2) and 'cafe\u0301' (label 1) "
            "differ only by case or Unicode normalisation"
        ),
    ),
    "control character in a name": (
        'path,label,class_name\na/0.jpg,0,"bad\nname"\n',
        "row 2: class name 'bad\\nname' contains the control character U+000A",
    ),
    "ragged row": ("path,label,class_name\na/0.jpg,0,a,extra\n", "row 2: expected 3 fields (as the header), got 4"),
    "train row flagged as query": (
        "path,label,split,is_query,is_gallery\na/0.jpg,0,train,True,\n",
        "row 2: a train row cannot be a query or gallery image",
    ),
    "bad query flag": (
        "path,label,split,is_query,is_gallery\na/0.jpg,0,validation,maybe,\n",
        "row 2: query 'maybe' is not a boolean (True/False, 1/0, yes/no, or empty)",
    ),
    "no image rows": ("path,label\n", "has a header but no image rows"),
    "not utf-8": (b"path,label\n\xff.jpg,0\n", "row 2: not UTF-8 text (byte 11: b'\\xff')"),
}


@pytest.mark.parametrize("case", sorted(_CSV_CASES))
def test_bad_csv_datasets_are_one_data_error_line_naming_the_row(tmp_path, capsys, case):
    text, problem = _CSV_CASES[case]
    root = _image_folder(tmp_path / "src")
    secret = tmp_path / "secret.jpg"
    secret.write_bytes(jpeg(1))
    listing = root / "data.csv"
    if isinstance(text, bytes):
        listing.write_bytes(text)
    else:
        listing.write_text(text.format(secret=secret), encoding="utf-8")
    line = _data_cli(capsys, "prepare", "csv", "--src", listing, "--dest", tmp_path / "out", "--no-progress")
    _expect_line(line, f"{listing}: " + problem.format(root=root, secret=secret))
    assert not (tmp_path / "out").exists()


def test_a_csv_image_linked_out_of_the_root_is_refused(tmp_path, capsys):
    root = _image_folder(tmp_path / "src")
    secret = tmp_path / "secret.jpg"
    secret.write_bytes(jpeg(2))
    (root / "a" / "evil.jpg").symlink_to(secret)
    (root / "data.csv").write_text("path,label\na/0.jpg,0\na/evil.jpg,0\n")
    line = _data_cli(capsys, "prepare", "csv", "--src", root / "data.csv", "--dest", tmp_path / "out", "--no-progress")
    _expect_line(
        line,
        f"{root / 'data.csv'}: row 3: image 'a/evil.jpg' is a symbolic link (or under one) to "
        f"{os.path.realpath(secret)}, outside the root {root}",
    )


def test_two_csv_rows_that_are_one_file_through_a_link_are_refused(tmp_path, capsys):
    root = _image_folder(tmp_path / "src")
    (root / "b" / "alias.jpg").symlink_to(root / "a" / "0.jpg")
    (root / "data.csv").write_text("path,label\na/0.jpg,0\nb/alias.jpg,1\n")
    line = _data_cli(capsys, "prepare", "csv", "--src", root / "data.csv", "--dest", tmp_path / "out", "--no-progress")
    _expect_line(
        line,
        f"{root / 'data.csv'}: row 3: image 'b/alias.jpg' is the same file as row 2's 'a/0.jpg' "
        "(through a symbolic link)",
    )


def test_a_corrupt_image_listed_in_a_csv_names_the_file_and_writes_nothing(tmp_path, capsys):
    root = _image_folder(tmp_path / "src", per_class=40)
    victim = root / "b" / "39.jpg"
    victim.write_bytes(victim.read_bytes()[:100])
    (root / "data.csv").write_text(
        "path,label\n" + "".join(f"{c}/{j}.jpg,{i}\n" for i, c in enumerate("ab") for j in range(40))
    )
    line = _data_cli(
        capsys,
        "prepare",
        "csv",
        "--src",
        root / "data.csv",
        "--dest",
        tmp_path / "out",
        "--no-progress",
        "--row-group-rows",
        "4",
    )
    assert re.fullmatch(rf"data error: {re.escape(str(victim))}: (does not decode|not a readable image) .*", line)
    assert not (tmp_path / "out").exists()  # the row groups already written were staged, then removed


# --------------------------------------------------------------------------------------------- image folders


def test_folder_class_names_that_differ_only_by_case_are_refused(tmp_path, capsys):
    root = _image_folder(tmp_path / "src", classes=("Cat", "cat"))
    line = _data_cli(capsys, "prepare", "folder", "--src", root, "--dest", tmp_path / "out", "--no-progress")
    _expect_line(line, f"{root}: class folders 'Cat' and 'cat' differ only by case or Unicode normalisation")


def test_folder_class_names_that_differ_only_by_unicode_normalisation_are_refused(tmp_path, capsys):
    root = _image_folder(tmp_path / "src", classes=("caf\u00e9", "cafe\u0301"))
    line = _data_cli(capsys, "prepare", "folder", "--src", root, "--dest", tmp_path / "out", "--no-progress")
    _expect_line(
        line, f"{root}: class folders 'cafe\u0301' and 'caf\u00e9' differ only by case or Unicode normalisation"
    )


def test_a_folder_class_name_with_a_control_character_is_refused(tmp_path, capsys):
    root = _image_folder(tmp_path / "src", classes=("good", "bad\nname"))
    line = _data_cli(capsys, "prepare", "folder", "--src", root, "--dest", tmp_path / "out", "--no-progress")
    _expect_line(line, f"{root}: class folder 'bad\\nname' contains the control character U+000A")


def test_a_folder_rooted_at_the_file_system_root_fails_at_once(tmp_path, capsys):
    """`--src /` fails within seconds with one error line naming the root, instead of walking the whole disk."""
    import time

    t = time.monotonic()
    line = _data_cli(capsys, "prepare", "folder", "--src", "/", "--dest", tmp_path / "out", "--no-progress")
    assert time.monotonic() - t < 10
    _expect_line(line, "/: is the root of a file system, not an image folder (the layout is <root>/<class>/<image>)")


def test_a_tree_that_is_not_an_image_folder_fails_fast_naming_the_root(tmp_path, capsys, monkeypatch):
    from dml_core.datasets import folder

    monkeypatch.setattr(folder, "MAX_OTHER_ENTRIES", 20)
    root = tmp_path / "home"
    (root / "notes").mkdir(parents=True)
    for i in range(25):
        (root / "notes" / f"{i:02d}.txt").write_text("x")
    _image_folder(root, classes=("photos",))
    line = _data_cli(capsys, "prepare", "folder", "--src", root, "--dest", tmp_path / "out", "--no-progress")
    _expect_line(
        line,
        f"{root}: does not look like an image folder (the layout is <root>/<class>/<image>): 21 "
        "entries are not images (e.g. 'notes/20.txt') against 0 images so far; give the dataset's own "
        "root",
    )


def test_a_link_cycle_in_a_folder_is_refused_not_followed_forever(tmp_path, capsys):
    """A link cycle (`a/loop -> .`) is refused with one error line, not followed (listing a/0.jpg over and over)."""
    root = _image_folder(tmp_path / "src")
    (root / "a" / "loop").symlink_to(".")
    line = _data_cli(capsys, "prepare", "folder", "--src", root, "--dest", tmp_path / "out", "--no-progress")
    _expect_line(
        line,
        f"{root / 'a' / 'loop'}: is a symbolic link to {os.path.realpath(root / 'a')}, a folder "
        "already listed as 'a' (a cycle, or one folder under two names)",
    )


def test_a_class_folder_linked_into_another_class_is_refused(tmp_path, capsys):
    root = _image_folder(tmp_path / "src")
    (root / "b" / "more").symlink_to(root / "a")
    line = _data_cli(capsys, "prepare", "folder", "--src", root, "--dest", tmp_path / "out", "--no-progress")
    _expect_line(
        line,
        f"{root / 'b' / 'more'}: is a symbolic link to {os.path.realpath(root / 'a')}, a folder "
        "already listed as 'a' (a cycle, or one folder under two names)",
    )


def test_a_folder_image_linked_out_of_the_root_is_refused(tmp_path, capsys):
    root = _image_folder(tmp_path / "src")
    secret = tmp_path / "secret.jpg"
    secret.write_bytes(jpeg(3))
    (root / "a" / "evil.jpg").symlink_to(secret)
    line = _data_cli(capsys, "prepare", "folder", "--src", root, "--dest", tmp_path / "out", "--no-progress")
    _expect_line(
        line,
        f"{root / 'a' / 'evil.jpg'}: is a symbolic link to {os.path.realpath(secret)}, outside the image folder {root}",
    )


def test_an_empty_class_folder_is_refused(tmp_path, capsys):
    root = _image_folder(tmp_path / "src")
    (root / "empty").mkdir()
    (root / "empty" / "README.txt").write_text("nothing here")
    line = _data_cli(capsys, "prepare", "folder", "--src", root, "--dest", tmp_path / "out", "--no-progress")
    _expect_line(
        line,
        f"{root}: class directories without images: ['empty'] (the layout is <root>/<class>/<image>; "
        f"is {root} the dataset's root?)",
    )


def test_a_corrupt_image_in_a_folder_names_the_file_and_writes_nothing(tmp_path, capsys):
    root = _image_folder(tmp_path / "src")
    victim = root / "b" / "1.jpg"
    victim.write_bytes(victim.read_bytes()[:-200])
    line = _data_cli(capsys, "prepare", "folder", "--src", root, "--dest", tmp_path / "out", "--no-progress")
    assert re.fullmatch(rf"data error: {re.escape(str(victim))}: does not decode .*", line)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------- consistent lies


def _toy_shards(tmp_path, n_classes=3, per_class=4, **kw) -> tuple[Path, dict]:
    recs, _ = _records(n_classes, per_class)
    out = tmp_path / "out"
    return out, write_shards(recs, out, dataset="toy", row_group_rows=3, progress=False, **kw)


def _restamp(out: Path, k: int, edit) -> None:
    """Rewrite shard k through `edit(table) -> table` with its row groups kept, and stamp the new sha256 into the
    manifest: the shard checksum then passes, only the contents lie."""
    m = json.loads((out / "manifest.json").read_text())
    shard = out / m["shards"][k]["path"]
    pq.write_table(edit(pq.read_table(shard)), shard, row_group_size=m["shards"][k]["row_groups"][0])
    m["shards"][k]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(m))


def _set(t: pa.Table, column: str, values) -> pa.Table:
    return t.set_column(t.schema.get_field_index(column), column, values)


def _verify_line(capsys, out: Path, tmp_path: Path) -> str:
    return _data_cli(capsys, "verify", out, "--no-progress", "--cache-dir", tmp_path / "cache")


def test_two_classes_labels_swapped_and_restamped_fail_verify(tmp_path, capsys):
    """Two equal-sized classes whose labels were swapped and the shard re-stamped fail `verify` (the per-class
    counts alone would pass)."""
    out, _ = _toy_shards(tmp_path, 2, 4)
    _restamp(out, 0, lambda t: _set(t, "label", pa.array([1 - v for v in t.column("label").to_pylist()], pa.int64())))
    _expect_line(
        _verify_line(capsys, out, tmp_path),
        f"{out / 'manifest.json'}: shard shards/part-00000.parquet row 0 (c0/0.jpg): label 1 has class name "
        "'class0' here, but the manifest's label 1 is 'class1' (labels and class names must match one to one)",
    )


def test_labels_shifted_by_one_and_restamped_fail_verify(tmp_path, capsys):
    out, _ = _toy_shards(tmp_path, 3, 4)
    _restamp(
        out, 0, lambda t: _set(t, "label", pa.array([(v + 1) % 3 for v in t.column("label").to_pylist()], pa.int64()))
    )
    _expect_line(
        _verify_line(capsys, out, tmp_path),
        f"{out / 'manifest.json'}: shard shards/part-00000.parquet row 0 (c0/0.jpg): label 1 has class name "
        "'class0' here, but the manifest's label 1 is 'class1' (labels and class names must match one to one)",
    )


def test_a_label_column_turned_into_strings_fails_verify(tmp_path, capsys):
    """A label column stored as strings fails `verify` (it is not parsed back into numbers)."""
    out, _ = _toy_shards(tmp_path, 2, 4)
    _restamp(out, 0, lambda t: _set(t, "label", pa.array([str(v) for v in t.column("label").to_pylist()])))
    _expect_line(
        _verify_line(capsys, out, tmp_path),
        f"{out / 'manifest.json'}: shards[0] (shards/part-00000.parquet): column 'label' is string, expected int64",
    )


def test_class_names_swapped_in_a_shard_fail_verify(tmp_path, capsys):
    out, _ = _toy_shards(tmp_path, 2, 4)
    swap = {"class0": "class1", "class1": "class0"}
    _restamp(out, 0, lambda t: _set(t, "class_name", pa.array([swap[v] for v in t.column("class_name").to_pylist()])))
    _expect_line(
        _verify_line(capsys, out, tmp_path),
        f"{out / 'manifest.json'}: shard shards/part-00000.parquet row 0 (c0/0.jpg): label 0 has class name "
        "'class1' here, but the manifest's label 0 is 'class0' (labels and class names must match one to one)",
    )


def test_class_names_swapped_in_the_manifest_fail_verify(tmp_path, capsys):
    out, _ = _toy_shards(tmp_path, 2, 4)
    _rewrite_manifest(out, lambda m: (m["classes"][0].update(name="class1"), m["classes"][1].update(name="class0")))
    _expect_line(
        _verify_line(capsys, out, tmp_path),
        f"{out / 'manifest.json'}: shard shards/part-00000.parquet row 0 (c0/0.jpg): label 0 has class name "
        "'class0' here, but the manifest's label 0 is 'class1' (labels and class names must match one to one)",
    )


def test_a_class_named_differently_in_another_shard_fails_verify(tmp_path, capsys):
    """Across shards: shard 1 alone calls class 1 'class2' (every shard is held to the manifest's one list)."""
    out, m = _toy_shards(tmp_path, 3, 4, max_shard_bytes=2500)
    assert len(m["shards"]) > 1
    t1 = pq.read_table(out / m["shards"][1]["path"])
    assert 1 in t1.column("label").to_pylist()
    first = t1.column("label").to_pylist().index(1)
    rel = t1.column("relpath")[first].as_py()

    def rename(t):
        pairs = zip(t.column("label").to_pylist(), t.column("class_name").to_pylist())
        return _set(t, "class_name", pa.array(["class2" if l == 1 else n for l, n in pairs]))

    _restamp(out, 1, rename)
    _expect_line(
        _verify_line(capsys, out, tmp_path),
        f"{out / 'manifest.json'}: shard {m['shards'][1]['path']} row {first} ({rel}): label 1 has class name "
        "'class2' here, but the manifest's label 1 is 'class1' (labels and class names must match one to one)",
    )


def test_a_manifest_with_case_colliding_class_names_fails(tmp_path, capsys):
    out, _ = _toy_shards(tmp_path, 2, 4)
    _rewrite_manifest(out, lambda m: (m["classes"][0].update(name="Class"), m["classes"][1].update(name="class")))
    _expect_line(
        _verify_line(capsys, out, tmp_path),
        f"{out / 'manifest.json'}: classes[0].name 'Class' and classes[1].name 'class' differ only by case or "
        "Unicode normalisation",
    )


def test_check_label_names_on_an_open_table_sees_a_shard_changed_since(tmp_path):
    from dml_core.shards import check_label_names

    out, _ = _toy_shards(tmp_path, 2, 4)
    table = read_parquet_manifest(out, cache_dir=tmp_path / "cache")
    assert check_label_names(table) == {"classes": 2, "rows": 8}
    assert check_label_names(out, cache_dir=tmp_path / "cache") == {"classes": 2, "rows": 8}
    assert check_label_names(json.loads((out / "manifest.json").read_text())) == {"classes": 2, "rows": 8}
    _restamp(out, 0, lambda t: _set(t, "label", pa.array([1 - v for v in t.column("label").to_pylist()], pa.int64())))
    table._source.manifest = json.loads((out / "manifest.json").read_text())  # as a re-read manifest would say
    table._source._files.clear()
    table._source._local.clear()
    with pytest.raises(ManifestError, match=r"row 0 \(c0/0.jpg\): label 1 has class name 'class0' here"):
        check_label_names(table)
