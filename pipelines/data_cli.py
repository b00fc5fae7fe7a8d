"""`dmlrc data ...`: turn an official dataset layout, an image folder or a dataset CSV into parquet shards +
manifest, and verify them.

    dmlrc data prepare cub200   --src /data/CUB_200_2011 --dest s3://bucket/datasets/cub200
    dmlrc data prepare omniglot --src shared/data/omniglot --dest ./datasets/omniglot
    dmlrc data prepare folder   --src ./my_images --dest ./datasets/my_images          # <root>/<class>/<image>
    dmlrc data prepare csv      --src s3://bucket/raw/products.csv --dest s3://bucket/datasets/products
    dmlrc data verify s3://bucket/datasets/cub200

`--endpoint-url` (or the `AWS_ENDPOINT_URL` environment variable) points boto3 at a non-AWS S3 (SeaweedFS,
MinIO ...).  `pipelines/cli.py` wires this in with `add_data_parser(subparsers)`; `run_data(args)` returns the
exit code.
"""

from __future__ import annotations

import argparse
import sys
import zipfile

from dml_core.datasets import DATASETS, KINDS, prepare, reader
from dml_core.shards import verify_shards
from dml_core.storage import read_errors
from pipelines.config import redact_uri

__all__ = ["add_data_parser", "run_data"]


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def add_data_parser(subparsers) -> argparse.ArgumentParser:
    """Add `data {prepare,verify}` to an argparse subparsers object; returns the `data` parser."""
    data = subparsers.add_parser(
        "data",
        help="prepare / verify datasets as parquet shards",
        description="Prepare datasets (official layouts, image folders, CSVs) as parquet "
        "shards; verify prepared shards.",
    )
    sub = data.add_subparsers(dest="data_command", metavar="{prepare,verify}")
    sub.required = True

    p = sub.add_parser(
        "prepare", help="read a dataset (official layout, image folder or CSV) and write parquet shards + manifest.json"
    )
    p.add_argument(
        "dataset",
        choices=DATASETS + KINDS,
        help="a named dataset, or `folder` (<root>/<class>/<image>) or `csv` (path,label[,class_name,"
        "split,query,gallery]); see dmlrc docs datasets",
    )
    p.add_argument(
        "--src",
        required=True,
        help="the dataset's official directory (see dml_core/datasets/<name>.py), "
        "the image folder, or the CSV file (local or s3://)",
    )
    p.add_argument(
        "--root",
        default=None,
        help="csv: the folder (local or s3://) the CSV's paths are relative to (default: the CSV's own folder)",
    )
    p.add_argument(
        "--name",
        default=None,
        help="folder / csv: the dataset's name in the manifest (default: the folder's or the CSV's name)",
    )
    p.add_argument("--dest", required=True, help="local directory or s3://bucket/prefix")
    p.add_argument("--endpoint-url", default=None, help="S3 endpoint (default: $AWS_ENDPOINT_URL, else AWS)")
    p.add_argument("--shard-mb", type=_positive_int, default=128, help="target image bytes per shard (MiB)")
    p.add_argument(
        "--row-group-rows", type=_positive_int, default=64, help="rows per parquet row group (the unit of random reads)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing manifest at --dest")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    v = sub.add_parser(
        "verify",
        help="check every shard and image checksum of a prepared dataset, labels <-> class "
        "names one to one, decode every image",
    )
    v.add_argument("uri", help="local directory / manifest.json / s3://bucket/prefix")
    v.add_argument("--endpoint-url", default=None)
    v.add_argument("--cache-dir", default=None, help="where S3 shards are downloaded (default ~/.cache/dmlrc)")
    v.add_argument("--no-decode", action="store_true", help="checksums only")
    v.add_argument("--no-progress", action="store_true")
    data.set_defaults(func=run_data)
    return data


def run_data(args: argparse.Namespace) -> int:
    """`dmlrc data ...`; a bad source, destination or shard is one line ``data error: <file>[: row N]: <problem>``
    on stderr and exit status 2 (the readers name the file; where an error does not, the argument is named)."""
    errors = read_errors()
    try:
        return _run_data(args)
    except MemoryError:
        print("data error: out of memory", file=sys.stderr)
        return 2
    except errors as e:
        text = " ".join(str(e).split()) or type(e).__name__
        if isinstance(e, (KeyError, TypeError, IndexError, AttributeError, EOFError, zipfile.BadZipFile)):
            text = f"{type(e).__name__}: {text}"
        where = str(args.src if args.data_command == "prepare" else args.uri)
        if where not in text and not text.startswith(("/", "s3://", ".")):
            text = f"{where}: {text}"
        print(f"data error: {redact_uri(text)}", file=sys.stderr)
        return 2


def _run_data(args: argparse.Namespace) -> int:
    if args.data_command == "prepare":
        generic = args.dataset in KINDS
        if not generic and (args.root is not None or args.name is not None):
            raise ValueError(f"{args.src}: --root and --name are for `prepare folder` / `prepare csv` only")
        manifest = prepare(
            args.dataset,
            args.src,
            args.dest,
            endpoint_url=args.endpoint_url,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            max_shard_bytes=args.shard_mb << 20,
            row_group_rows=args.row_group_rows,
            root=args.root,
            dataset_name=args.name,
        )
        print(
            f"{manifest['dataset']}: {manifest['num_images']} images, {manifest['num_classes']} classes, "
            f"{len(manifest['shards'])} shards -> {args.dest}"
        )
        print(f"  splits: {manifest['counts']['per_split']}")
        if generic:
            return 0
        expected = reader(args.dataset).EXPECTED
        if (manifest["num_classes"], manifest["num_images"]) != (expected["classes"], expected["images"]):
            print(
                f"  note: the official {args.dataset} has {expected['classes']} classes and {expected['images']} "
                f"images; this source differs",
                file=sys.stderr,
            )
        return 0
    if args.data_command == "verify":
        summary = verify_shards(
            args.uri,
            endpoint_url=args.endpoint_url,
            cache_dir=args.cache_dir,
            decode=not args.no_decode,
            progress=not args.no_progress,
        )
        print(
            f"ok: {summary['dataset']}: {summary['images']} images, {summary['classes']} classes, "
            f"{summary['shards']} shards verified"
        )
        return 0
    raise ValueError(f"unknown data command {args.data_command!r}")
