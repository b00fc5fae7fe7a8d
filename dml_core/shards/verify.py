"""Checks of a whole prepared dataset: `verify_shards` (every shard re-hashed, every image decoded), `check_rows`
(the preflight's cheap check: image headers only) and `check_label_names` (labels <-> class names, on demand)."""

from __future__ import annotations

import hashlib

import numpy as np

from dml_core.shards.errors import CorruptImageError
from dml_core.shards.images import check_image, image_header
from dml_core.shards.manifest import validate_manifest
from dml_core.shards.table import ShardedTable, check_shard_names

__all__ = ["verify_shards", "check_rows", "check_label_names"]


def check_label_names(source, *, endpoint_url: str | None = None, cache_dir=None) -> dict:
    """Labels <-> class names one to one: the manifest's class list (no two names that differ only by case or
    Unicode normalisation, no control characters) and every row's (label, class_name) in every shard against it.

    `source`: an opened `ShardedTable` (re-reads the label and class_name columns of its verified local shards:
    two small columns, no image bytes), a manifest URI (opening it runs the same check), or a manifest dict (its
    class list only).  Opening a `ShardedTable` runs this check already; this function is for a caller that holds
    a table opened earlier, or only a URI (a sweep's preflight).  Raises `ManifestError` naming the file, shard,
    row, label and class; returns {"classes": C, "rows": N}."""
    if isinstance(source, dict):
        m = validate_manifest(source, f"manifest of {source.get('dataset', '?')}")
        return {"classes": len(m["classes"]), "rows": int(m["num_images"])}
    table = (
        source
        if isinstance(source, ShardedTable)
        else ShardedTable(source, endpoint_url=endpoint_url, cache_dir=cache_dir, cache_row_groups=1)
    )
    src = table._source
    validate_manifest(src.manifest, src.manifest_uri)
    for k in range(len(src.manifest["shards"])):
        check_shard_names(src, k, src.read_group(k, None, ["label", "class_name"]))
    return {"classes": len(src.manifest["classes"]), "rows": int(src.manifest["num_images"])}


def verify_shards(uri, *, endpoint_url=None, cache_dir=None, decode: bool = True, progress: bool = False) -> dict:
    """Hash every shard (always: cache stamps are not trusted here), check the row-group layout and column types,
    labels <-> class names one to one (`check_label_names`), every row's index and sha256 and (if `decode`) fully
    decode every image (`check_image`).

    Raises `ShardChecksumError` / `CorruptImageError` / `ManifestError` naming the file and row; returns a
    summary dict.
    """
    # tqdm.auto probes for Jupyter (it imports asyncio): only verify's progress bar needs it, not a reader
    from tqdm.auto import tqdm

    table = ShardedTable(uri, endpoint_url=endpoint_url, cache_dir=cache_dir, cache_row_groups=2, rehash=True)
    src = table._source
    for g in tqdm(range(len(table)), desc="verify", unit="img", disable=not progress):
        data = src.image_bytes(g)
        if decode:
            check_image(data, f"{src.manifest_uri}: {src.row_name(g)}")
    return {
        "dataset": table.dataset,
        "images": len(table),
        "classes": len(table.class_names),
        "shards": len(src.manifest["shards"]),
    }


def check_rows(uri, *, endpoint_url=None, cache_dir=None, hash_rows: bool = False) -> dict:
    """The preflight's cheap check of a prepared dataset: the manifest, every shard's sha256 (stamped, as reads
    do), the row-group layout, labels <-> class names, every row's `index`, and every row's image *header* (magic
    bytes + dimensions, `PIL.Image.open` without decoding).  `hash_rows` also checks every image's sha256 (about
    the cost of reading the bytes once more).  Full decoding is `verify_shards`' job (and `write_shards` decoded
    every image).

    Raises a `DataError` whose message starts with the manifest and names the shard and row; returns
    {"dataset", "rows", "shards", "formats": {format: count}, "min_size": (w, h), "max_size": (w, h)}.
    """
    table = ShardedTable(uri, endpoint_url=endpoint_url, cache_dir=cache_dir, cache_row_groups=1)
    src = table._source
    formats: dict[str, int] = {}
    lo, hi = [np.inf, np.inf], [0, 0]
    for k, entry in enumerate(src.manifest["shards"]):
        for rg in range(len(entry["row_groups"])):
            t = src.read_group(k, rg, ["image", "sha256", "relpath", src.id_column])
            images, digests, relpaths = (t.column(c).combine_chunks() for c in ("image", "sha256", "relpath"))
            ids = t.column(src.id_column).to_numpy()
            base = int(src.shard_starts[k] + src.group_starts[k][rg])
            for off in range(len(images)):
                g = base + off
                src._check_row_id(g, k, g - int(src.shard_starts[k]), ids[off], relpaths[off])
                data = images[off].as_py()
                where = (
                    f"{src.manifest_uri}: shard {entry['path']} row {g - int(src.shard_starts[k])} "
                    f"({relpaths[off].as_py()})"
                )
                if hash_rows and hashlib.sha256(data).hexdigest() != digests[off].as_py():
                    raise CorruptImageError(f"{where}: image bytes do not match their sha256")
                fmt, w, h = image_header(data, where)
                formats[fmt] = formats.get(fmt, 0) + 1
                lo, hi = [min(lo[0], w), min(lo[1], h)], [max(hi[0], w), max(hi[1], h)]
    return {
        "dataset": table.dataset,
        "rows": len(table),
        "shards": len(src.manifest["shards"]),
        "formats": formats,
        "min_size": tuple(int(x) for x in lo) if len(table) else None,
        "max_size": tuple(hi) if len(table) else None,
    }
