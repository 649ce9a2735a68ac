"""The relay's version store (``relay.versions``) and bucket codec: versions are complete or
absent, immutable once committed, only move forward, refuse bytes that do not match their
checksum, and are collected only when no applier pins and no child relay leases them."""

from __future__ import annotations

import pytest
import torch

from megatron_earl.rollout.weights.relay.codec import decode_bucket, encode_bucket
from megatron_earl.rollout.weights.relay.versions import (
    BucketInfo,
    ChecksumError,
    Manifest,
    VersionError,
    VersionStore,
    digest,
)


def _stage(store: VersionStore, version: int, blobs: list[bytes]) -> Manifest:
    store.begin(version)
    for i, data in enumerate(blobs):
        store.put(version, i, data, digest(data))
    return Manifest(version, tuple(BucketInfo(digest(b), len(b), 1) for b in blobs))


def test_a_version_is_served_only_once_committed_whole():
    store = VersionStore()
    manifest = _stage(store, 3, [b"a" * 10, b"b" * 7])
    assert store.latest() is None and store.staged_versions() == [3]
    with pytest.raises(VersionError, match="not held"):
        store.bucket(3, 0)
    store.commit(manifest)
    assert store.latest() == manifest and store.bucket(3, 1) == b"b" * 7
    assert store.staged_versions() == []


def test_commit_with_a_missing_or_differing_bucket_is_refused_and_nothing_is_served():
    store = VersionStore()
    blobs = [b"x" * 4, b"y" * 4, b"z" * 4]
    store.begin(1)
    store.put(1, 0, blobs[0], digest(blobs[0]))
    store.put(1, 2, blobs[2], digest(blobs[2]))
    full = Manifest(1, tuple(BucketInfo(digest(b), len(b), 1) for b in blobs))
    with pytest.raises(VersionError, match=r"missing \[1\]"):
        store.commit(full)
    other = Manifest(1, (BucketInfo(digest(b"q"), 1, 1), full.buckets[1], full.buckets[2]))
    store.put(1, 1, blobs[1], digest(blobs[1]))
    with pytest.raises(VersionError, match=r"differing from the manifest \[0\]"):
        store.commit(other)
    assert store.latest() is None


def test_bytes_that_do_not_match_their_checksum_are_refused_and_not_stored():
    store = VersionStore()
    store.begin(0)
    with pytest.raises(ChecksumError, match="bucket 0 of version 0"):
        store.put(0, 0, b"corrupted", digest(b"original"))
    with pytest.raises(VersionError, match="missing"):
        store.commit(Manifest(0, (BucketInfo(digest(b"original"), 8, 1),)))


def test_versions_are_immutable_and_only_move_forward():
    store = VersionStore()
    manifest = _stage(store, 5, [b"five"])
    store.commit(manifest)
    store.begin(5)  # a republish of the same version
    assert store.commit(manifest) == manifest
    with pytest.raises(VersionError, match="another manifest"):
        store.commit(Manifest(5, (BucketInfo(digest(b"other"), 5, 1),)))
    with pytest.raises(VersionError, match="older than the newest committed version 5"):
        store.begin(4)
    with pytest.raises(VersionError, match="was not begun"):
        store.put(6, 0, b"six", digest(b"six"))


def test_a_resumed_trainer_is_a_newer_generation_and_rolls_the_relay_back():
    store = VersionStore()
    for v in (9, 12):
        store.begin(v, generation=1)
        store.put(v, 0, bytes([v]), digest(bytes([v])))
        store.commit(Manifest(v, (BucketInfo(digest(bytes([v])), 1, 1),), generation=1))
    with pytest.raises(VersionError, match="version 10 of generation 1 is older"):
        store.begin(10, generation=1)
    store.begin(10, generation=2)  # resumed from the checkpoint of version 10
    assert store.committed_versions() == [9]  # 12 came from steps the resumed run redoes
    store.put(10, 0, b"r", digest(b"r"))
    with pytest.raises(
        VersionError,
        match="begun for generation 2, the manifest says generation 1",
    ):
        store.commit(Manifest(10, (BucketInfo(digest(b"r"), 1, 1),), generation=1))
    resumed = Manifest(10, (BucketInfo(digest(b"r"), 1, 1),), generation=2)
    store.commit(resumed)
    assert store.latest() == resumed and store.newest_version() == 10
    assert Manifest.from_dict(resumed.to_dict()) == resumed
    assert (
        Manifest.from_dict({"version": 3, "buckets": [resumed.buckets[0].to_dict()]}).generation
        == 0
    )


def test_an_unfinished_older_version_is_dropped_when_a_newer_one_commits():
    store = VersionStore()
    store.begin(1)
    store.put(1, 0, b"one", digest(b"one"))
    store.commit(_stage(store, 2, [b"two"]))
    assert store.staged_versions() == [] and store.committed_versions() == [2]


def test_collection_keeps_the_newest_and_what_is_pinned_or_leased():
    store = VersionStore()
    for v in (1, 2, 3):
        store.commit(_stage(store, v, [bytes([v]) * 3]))
    store.lease(1, until=100.0)
    with store.pinned(2):
        assert store.collect(now=50.0) == []
        assert store.committed_versions() == [1, 2, 3]
    assert store.collect(now=50.0) == [2]
    assert store.collect(now=100.0) == [1]
    assert store.committed_versions() == [3]


def test_manifest_from_bad_json_names_the_expected_shape():
    with pytest.raises(ValueError, match="malformed manifest") as err:
        Manifest.from_dict({"version": 1, "buckets": [{"sha256": "x"}]})
    assert not isinstance(err.value, VersionError)  # the request's error (400), no conflict
    with pytest.raises(VersionError, match="no bucket"):
        Manifest(1, ())


def test_codec_round_trip_keeps_order_dtype_and_values():
    bucket = [
        ("z.weight", torch.randn(3, 4)),
        ("a.bias", torch.arange(5, dtype=torch.bfloat16)),
        ("m.weight", torch.randn(2, 2).t()),  # not contiguous
    ]
    out = decode_bucket(encode_bucket(bucket))
    assert [n for n, _ in out] == ["z.weight", "a.bias", "m.weight"]
    for (_, want), (_, got) in zip(bucket, out):
        assert got.dtype == want.dtype and torch.equal(got, want)
    with pytest.raises(ValueError, match="names a tensor twice"):
        encode_bucket([("a", torch.zeros(1)), ("a", torch.ones(1))])
