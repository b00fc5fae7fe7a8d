"""Reading prepared shards: `ShardedTable`, an `ImageTable`-like view that never holds the dataset's bytes.

Labels and original splits are read up front (two small columns) and checked against the manifest (every row's
(label, class_name), and on v2 its global `index`); image bytes are read one row group at a time on demand, through a
small per-process LRU, and every row read checks its own `index` (v1: its label) and its image's sha256.  A table
pickles without open files or clients, and notices a fork, so DataLoader workers reopen their own handles."""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dml_core.shards.cache import default_cache_dir, download_verified, verify_in_place
from dml_core.shards.errors import CorruptImageError, ManifestError, ShardChecksumError
from dml_core.shards.manifest import PARQUET_SCHEMA, read_manifest, split_manifest_uri
from dml_core.storage import open_storage

__all__ = ["ShardedTable", "ShardSource", "check_shard_names"]


class ShardSource:
    """Everything shared by a table and its subsets: the manifest, the storage, and per-process handles."""

    def __init__(self, uri, *, endpoint_url=None, cache_dir=None, cache_row_groups=16, verify_rows=True, rehash=False):
        root, name = split_manifest_uri(uri)
        self.storage = open_storage(root, endpoint_url=endpoint_url)
        self.manifest_uri = self.storage.uri_of(name)
        self.manifest = read_manifest(uri, endpoint_url=endpoint_url)
        # No cache_dir given: every process uses its own machine's default (a worker node on another machine has
        # its own disk and home; the driver's path may not exist there), also after unpickling.
        self.cache_dir_given = cache_dir is not None
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self.cache_row_groups = int(cache_row_groups)
        self.verify_rows = bool(verify_rows)
        self.rehash = bool(rehash)  # verify: hash every shard even when a stamp / cached copy says it is known
        # v2 rows carry their global index; v1 rows are checked by label (weaker: a wrong row of the same class
        # passes, but never one of another class)
        self.id_column = "index" if self.manifest["schema_version"] >= 2 else "label"
        shards = self.manifest["shards"]
        self.shard_starts = np.cumsum([0] + [s["rows"] for s in shards])
        self.group_starts = [np.cumsum([0] + list(s["row_groups"])) for s in shards]
        self._reset_process_state()

    # Per-process state: never pickled, rebuilt after a fork (a forked worker must not share file offsets).
    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._files: dict[int, pq.ParquetFile] = {}
        self._local: dict[int, Path] = {}
        self._lru: OrderedDict[tuple[int, int], tuple[pa.Array, pa.Array, pa.Array, np.ndarray]] = OrderedDict()
        self.labels: np.ndarray | None = None  # the label column, set by ShardedTable (v1 row checks use it)

    def __getstate__(self):
        state = self.__dict__.copy()
        for k in ("_files", "_local", "_lru", "_pid"):
            state.pop(k)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if not self.cache_dir_given:
            self.cache_dir = default_cache_dir()
        self._reset_process_state()

    def _check_process(self):
        if self._pid != os.getpid():
            self._reset_process_state()

    def shard_name(self, k: int) -> str:
        return self.manifest["shards"][k]["path"]

    def local_shard(self, k: int) -> Path:
        """Path of a verified local copy of shard k (downloaded into the cache for S3)."""
        self._check_process()
        if k in self._local:
            return self._local[k]
        entry = self.manifest["shards"][k]
        expected = entry["sha256"]
        in_place = self.storage.local_path(entry["path"])
        if in_place is not None:
            path = verify_in_place(in_place, expected, self.cache_dir / "verified", entry["path"], rehash=self.rehash)
        else:
            path = download_verified(
                self.storage, entry["path"], expected, self.cache_dir / "shards", rehash=self.rehash
            )
        self._local[k] = path
        return path

    def parquet(self, k: int) -> pq.ParquetFile:
        self._check_process()
        f = self._files.get(k)
        if f is None:
            path = self.local_shard(k)
            try:
                f = pq.ParquetFile(path, memory_map=True)
            except (pa.ArrowException, OSError) as e:
                raise ShardChecksumError(
                    f"{path}: shard {self.shard_name(k)} is not a readable parquet file ({e})"
                ) from e
            self._check_layout(k, f)
            self._files[k] = f
        return f

    def read_group(self, k: int, rg: int | None, columns: list[str]) -> pa.Table:
        """Row group `rg` of shard k (all of it if None); a page that does not decode is a CorruptImageError
        naming the shard (its sha256 matched, so the manifest was written for a damaged file)."""
        f = self.parquet(k)
        try:
            if rg is None:
                return f.read(columns=columns, use_threads=False)
            return f.read_row_group(rg, columns=columns, use_threads=False)
        except (pa.ArrowException, OSError) as e:
            part = f"row group {rg}" if rg is not None else f"columns {columns}"
            raise CorruptImageError(
                f"{self.manifest_uri}: shard {self.shard_name(k)} {part}: unreadable ({type(e).__name__}: {e})"
            ) from e

    def _check_layout(self, k: int, f: pq.ParquetFile) -> None:
        """The file's schema, rows and row-group sizes must be the manifest's: rows are located through the
        manifest's `row_groups`, so a reordered list would read other rows (of other classes)."""
        entry = self.manifest["shards"][k]
        where = f"{self.manifest_uri}: shards[{k}] ({entry['path']})"
        names = set(f.schema_arrow.names)
        need = set(PARQUET_SCHEMA.names) - ({"index"} if self.id_column == "label" else set())
        if not need <= names:
            raise ManifestError(f"{where}: the file lacks columns {sorted(need - names)}")
        for name in sorted(need):  # a label column of strings would otherwise be parsed back into numbers
            got, want = f.schema_arrow.field(name).type, PARQUET_SCHEMA.field(name).type
            if got != want:
                raise ManifestError(f"{where}: column {name!r} is {got}, expected {want}")
        meta = f.metadata
        if meta.num_rows != entry["rows"]:
            raise ManifestError(f"{where}: rows {entry['rows']}, but the file holds {meta.num_rows} rows")
        actual = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        if actual != list(entry["row_groups"]):

            def shown(xs):
                return str(xs) if len(xs) <= 12 else f"{str(xs[:12])[:-1]}, ...] ({len(xs)} groups)"

            raise ManifestError(
                f"{where}: row_groups {shown(list(entry['row_groups']))} do not match the "
                f"file's row groups {shown(actual)}"
            )

    def locate(self, g: int) -> tuple[int, int, int, int]:
        """Global row -> (shard, row in shard, row group, offset in row group)."""
        k = int(np.searchsorted(self.shard_starts, g, side="right") - 1)
        r = g - int(self.shard_starts[k])
        starts = self.group_starts[k]
        rg = int(np.searchsorted(starts, r, side="right") - 1)
        return k, r, rg, r - int(starts[rg])

    def row_group(self, k: int, rg: int) -> tuple[pa.Array, pa.Array, pa.Array, np.ndarray]:
        self._check_process()
        key = (k, rg)
        hit = self._lru.get(key)
        if hit is not None:
            self._lru.move_to_end(key)
            return hit
        # One thread: this runs inside a DataLoader worker, which is the unit of parallelism.
        t = self.read_group(k, rg, ["image", "sha256", "relpath", self.id_column])
        # Keep Arrow arrays (no per-row Python objects); a row is converted only when it is asked for.
        value = (
            t.column("image").combine_chunks(),
            t.column("sha256").combine_chunks(),
            t.column("relpath").combine_chunks(),
            t.column(self.id_column).to_numpy(),
        )
        self._lru[key] = value
        while len(self._lru) > max(1, self.cache_row_groups):
            self._lru.popitem(last=False)
        return value

    def image_bytes(self, g: int) -> bytes:
        k, r, rg, off = self.locate(g)
        images, digests, relpaths, ids = self.row_group(k, rg)
        self._check_row_id(g, k, r, ids[off], relpaths[off])
        data = images[off].as_py()
        if self.verify_rows and hashlib.sha256(data).hexdigest() != digests[off].as_py():
            raise CorruptImageError(
                f"{self.manifest_uri}: shard {self.shard_name(k)} row {r} "
                f"({relpaths[off].as_py()}): image bytes do not match their sha256"
            )
        return data

    def _check_row_id(self, g: int, k: int, r: int, got, relpath) -> None:
        """The row read must be row g: its own `index` (v2), or at least its label (v1)."""
        if self.id_column == "index":
            if int(got) != g:
                raise CorruptImageError(
                    f"{self.manifest_uri}: shard {self.shard_name(k)} row {r}: the row read "
                    f"there ({relpath.as_py()}) holds row {int(got)} of the dataset, expected "
                    f"{g} (manifest and shard disagree)"
                )
        elif self.labels is not None and int(got) != int(self.labels[g]):
            raise CorruptImageError(
                f"{self.manifest_uri}: shard {self.shard_name(k)} row {r} ({relpath.as_py()}): "
                f"label {int(got)}, expected {int(self.labels[g])} (manifest and shard disagree)"
            )

    def relpath(self, g: int) -> str:
        k, _, rg, off = self.locate(g)
        return self.row_group(k, rg)[2][off].as_py()

    def row_name(self, g: int) -> str:
        k, r, _, _ = self.locate(g)
        return f"shard {self.shard_name(k)} row {r} ({self.relpath(g)})"


class _LazyImages(Sequence):
    """`table.images[i]` -> verified image bytes, read from its row group on demand."""

    def __init__(self, table: ShardedTable):
        self._table = table

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._table._source.image_bytes(self._table._global(i))


class ShardedTable:
    """An `ImageTable`-like view over prepared shards (local or S3) that never holds the dataset's bytes.

    Same surface as `dml_core.data.ImageTable`: `labels` (int64, read up front from the label column),
    `class_names` (aligned with `np.unique(labels)`), `images` (lazy: `images[i]` -> encoded bytes),
    `meta["split"]` (original split per row), `subset(classes)`, `take(indices)`, `row_name(i)`, `len()`;
    plus `relpath(i)`, `manifest` and `dataset`.
    `ImageDataset(table, transform)` decodes and transforms in DataLoader workers.
    """

    def __init__(self, uri, *, endpoint_url=None, cache_dir=None, cache_row_groups=16, verify_rows=True, rehash=False):
        source = ShardSource(
            uri,
            endpoint_url=endpoint_url,
            cache_dir=cache_dir,
            cache_row_groups=cache_row_groups,
            verify_rows=verify_rows,
            rehash=rehash,
        )
        labels, splits = [], []
        v2 = source.id_column == "index"
        for k in range(len(source.manifest["shards"])):
            t = source.read_group(k, None, ["label", "class_name", "split"] + (["index"] if v2 else []))
            check_shard_names(source, k, t)
            labels.append(t.column("label").to_numpy())
            splits.append(np.asarray(t.column("split").to_pylist(), dtype=str))
            if v2:  # rows in their global order: the shard is the one the manifest lists at this position
                idx = t.column("index").to_numpy()
                start = int(source.shard_starts[k])
                bad = np.flatnonzero(idx != np.arange(start, start + len(idx)))
                if bad.size:
                    r = int(bad[0])
                    raise ManifestError(
                        f"{source.manifest_uri}: shards[{k}] ({source.shard_name(k)}): row {r} "
                        f"holds row {int(idx[r])} of the dataset, expected {start + r} (shards "
                        "reordered or from another dataset)"
                    )
        all_labels = np.concatenate(labels).astype(np.int64) if labels else np.zeros(0, np.int64)
        _check_label_counts(all_labels, source.manifest, source.manifest_uri)
        source.labels = all_labels
        self._init_view(
            source, np.arange(len(all_labels)), all_labels, np.concatenate(splits) if splits else np.zeros(0, dtype=str)
        )

    def _init_view(self, source, rows, all_labels, all_splits):
        self._source = source
        self._rows = np.asarray(rows, dtype=np.int64)
        self._all_labels = all_labels
        self._all_splits = all_splits
        self.labels = all_labels[self._rows]
        self.meta = {"split": all_splits[self._rows]}
        names = {c["label"]: c["name"] for c in source.manifest["classes"]}
        self.class_names = [names[int(l)] for l in np.unique(self.labels)]
        self.images = _LazyImages(self)

    def _view(self, rows) -> ShardedTable:
        t = ShardedTable.__new__(ShardedTable)
        t._init_view(self._source, rows, self._all_labels, self._all_splits)
        return t

    @property
    def manifest(self) -> dict:
        return self._source.manifest

    def content_sha256(self) -> str:
        """sha256 over every row of the dataset (not only this view's): its label, class name and image sha256, in
        row order.  The same images prepared again — by another version, another pyarrow, another machine — give
        the same value, where the shard files' own hashes would differ."""
        h = hashlib.sha256()
        source = self._source
        for k in range(len(source.manifest["shards"])):
            t = source.read_group(k, None, ["label", "class_name", "sha256"])
            for label, name, digest in zip(*(t.column(c).to_pylist() for c in ("label", "class_name", "sha256"))):
                h.update(f"{label}\t{name}\t{digest}\n".encode())
        return h.hexdigest()

    @property
    def dataset(self) -> str:
        return self._source.manifest["dataset"]

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"ShardedTable({self._source.manifest_uri!r}, rows={len(self)}, classes={len(self.class_names)})"

    def _global(self, i: int) -> int:
        n = len(self._rows)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for a table of {n} rows")
        return int(self._rows[i])

    def subset(self, classes) -> ShardedTable:
        """Rows whose label is in `classes` (labels unchanged)."""
        return self._view(self._rows[np.isin(self.labels, np.asarray(list(classes), dtype=np.int64))])

    def take(self, indices) -> ShardedTable:
        """Rows `indices` of this table, in that order."""
        return self._view(self._rows[np.asarray(indices, dtype=np.int64)])

    def row_name(self, i: int) -> str:
        return f"{self._source.manifest_uri}: {self._source.row_name(self._global(i))}"

    def relpath(self, i: int) -> str:
        """Path of row i's image in the official layout (read with its row group)."""
        return self._source.relpath(self._global(i))


def check_shard_names(src: ShardSource, k: int, t: pa.Table) -> None:
    """Every row's (label, class_name) of shard k must be a class of the manifest: labels and class names map one
    to one within the shard and, as every shard is held to the same list, across shards.  A shard re-stamped after
    its labels were swapped, shifted or its class names exchanged fails here, naming its first such row."""
    want = {int(c["label"]): c["name"] for c in src.manifest["classes"]}
    labels, names = t.column("label"), t.column("class_name")
    pairs = pa.table({"label": labels, "class_name": names}).group_by(["label", "class_name"]).aggregate([])
    bad = [
        (int(l), n)
        for l, n in zip(pairs.column("label").to_pylist(), pairs.column("class_name").to_pylist())
        if want.get(int(l)) != n
    ]
    if not bad:
        return
    lab, nam = labels.to_numpy(), np.asarray(names.to_pylist(), dtype=object)
    r = min(int(np.flatnonzero((lab == l) & (nam == n))[0]) for l, n in bad)
    l, n = int(lab[r]), nam[r]
    if l not in want:
        problem = f"label {l} (class name {n!r}) is not a class of the manifest"
    else:
        problem = f"label {l} has class name {n!r} here, but the manifest's label {l} is {want[l]!r}"
    groups = src.group_starts[k]
    rg = int(np.searchsorted(groups, r, side="right") - 1)
    relpath = src.read_group(k, rg, ["relpath"]).column("relpath")[r - int(groups[rg])].as_py()
    raise ManifestError(
        f"{src.manifest_uri}: shard {src.shard_name(k)} row {r} ({relpath}): {problem} (labels "
        "and class names must match one to one)"
    )


def _check_label_counts(labels: np.ndarray, manifest: dict, where: str) -> None:
    uniq, counts = np.unique(labels, return_counts=True)
    got = {int(l): int(c) for l, c in zip(uniq, counts)}
    want = {int(c["label"]): int(c["count"]) for c in manifest["classes"]}
    if got != want:
        diff = sorted(l for l in set(got) | set(want) if got.get(l) != want.get(l))[:10]
        raise ManifestError(f"{where}: label column disagrees with the manifest's class counts for labels {diff}")
