"""A relay's weight versions: immutable once committed, complete or absent, collected when
nothing needs them (pure: no I/O, no clock of its own).

    store = VersionStore()
    store.begin(7)                                  # a publish (or a pull) of version 7 starts
    store.put(7, 0, data, sha256_hex)               # ChecksumError: refused, nothing stored
    manifest = store.commit(Manifest(7, buckets))   # visible from here on, never changed again
    store.latest(); store.bucket(7, 0)
    with store.pinned(7): ...                       # not collected while an applier reads it
    store.lease(7, until=now + 60)                  # nor while a child relay downloads it

A version is *staged* while its buckets arrive and *committed* once every bucket the manifest
lists is there with the manifest's checksum: only committed versions are served. A publisher or
upstream that dies mid-version leaves a staging entry that is never served (the next ``begin``
of that version starts it afresh; ``abandon`` drops it). Committing a version again with the same
manifest is a no-op; with another manifest it is refused (versions are immutable).

Versions are ordered by (generation, number). A generation is one trainer process's life
(``Manifest.generation``, set by the publisher at its start): a trainer resumed from a checkpoint
publishes its policy version again, which may be lower than what its crashed predecessor
published. Within a generation only a newer number may begin; a newer generation may begin any
number, and the versions of older generations with a number at or above it are dropped at once
(they came from steps the resumed run will redo).

Collection (``collect``): every committed version older than the newest is dropped unless it is
pinned (an applier is loading it into an engine) or leased (a child relay is downloading it).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field


class ChecksumError(ValueError):
    """A bucket whose bytes do not hash to the checksum it should have."""


class VersionError(ValueError):
    """A version operation the store refuses (the message names the version and why)."""


def digest(data: bytes) -> str:
    """SHA-256 hex digest of ``data``."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class BucketInfo:
    """One bucket of a version: its checksum, size and tensor count."""

    sha256: str
    nbytes: int
    tensors: int

    def to_dict(self) -> dict:
        return {"sha256": self.sha256, "nbytes": self.nbytes, "tensors": self.tensors}

    @classmethod
    def from_dict(cls, raw: dict) -> BucketInfo:
        return cls(str(raw["sha256"]), int(raw["nbytes"]), int(raw["tensors"]))


@dataclass(frozen=True)
class Manifest:
    """What a version is: its number and its buckets in order (the trainer's checksums)."""

    version: int
    buckets: tuple[BucketInfo, ...]
    generation: int = 0
    """The publishing trainer's generation (module docstring)."""

    @property
    def key(self) -> tuple[int, int]:
        return (self.generation, self.version)

    def __post_init__(self) -> None:
        if self.version < 0:
            raise VersionError(f"weight version must be >= 0, got {self.version}")
        if not self.buckets:
            raise VersionError(f"version {self.version} has no bucket")

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "generation": self.generation,
            "buckets": [b.to_dict() for b in self.buckets],
        }

    @classmethod
    def from_dict(cls, raw: dict) -> Manifest:
        try:
            buckets = tuple(BucketInfo.from_dict(b) for b in raw["buckets"])
            return cls(int(raw["version"]), buckets, int(raw.get("generation", 0)))
        except (
            KeyError,
            TypeError,
            ValueError,
        ) as err:  # the request's error (400), not a conflict
            raise ValueError(
                f"malformed manifest {str(raw)[:200]!r}: {err}; expected "
                "{'version': int, 'buckets': [{'sha256': str, 'nbytes': int, 'tensors': int}]}"
            ) from err


@dataclass
class _Staging:
    buckets: dict[int, bytes] = field(default_factory=dict)
    checksums: dict[int, str] = field(default_factory=dict)


class VersionStore:
    """The versions one relay holds (module docstring)."""

    def __init__(self) -> None:
        self._staging: dict[int, _Staging] = {}
        self._staging_generation: dict[int, int] = {}
        self._committed: dict[int, tuple[Manifest, list[bytes]]] = {}
        self._pins: Counter[int] = Counter()
        self._leases: dict[int, float] = {}

    # -- receiving ---------------------------------------------------------------------------
    def begin(self, version: int, generation: int = 0) -> None:
        """Start receiving ``version`` of ``generation`` (again, if an earlier attempt did not
        complete)."""
        latest = self.latest()
        held = self._committed.get(version)
        if held is not None and held[0].generation == generation:
            return  # a republish: commit() checks it is the same
        if latest is not None and (generation, version) < latest.key:
            raise VersionError(
                f"version {version} of generation {generation} is older than the newest "
                f"committed version {latest.version} of generation {latest.generation}; "
                "versions only move forward (a resumed trainer starts a newer generation)"
            )
        if latest is not None and generation > latest.generation:
            for v in [v for v, (m, _) in self._committed.items() if v >= version]:
                del self._committed[v]  # the crashed run's future: the resumed run redoes it
        self._staging[version] = _Staging()
        self._staging_generation[version] = generation

    def put(self, version: int, index: int, data: bytes, sha256: str) -> None:
        """Stage bucket ``index`` of ``version``; ``ChecksumError`` (nothing stored) when
        ``data`` does not hash to ``sha256``."""
        if version in self._committed:
            return
        staging = self._staging.get(version)
        if staging is None:
            raise VersionError(f"version {version} was not begun (begin it before its buckets)")
        if index < 0:
            raise VersionError(f"bucket index must be >= 0, got {index}")
        actual = digest(data)
        if actual != sha256:
            raise ChecksumError(
                f"bucket {index} of version {version}: sha256 {actual} != expected {sha256}"
            )
        staging.buckets[index] = data
        staging.checksums[index] = sha256

    def commit(self, manifest: Manifest) -> Manifest:
        """Make ``manifest.version`` visible: every bucket staged with the manifest's checksum
        and size, else ``VersionError`` naming what is missing or different."""
        v = manifest.version
        if v in self._committed:
            held = self._committed[v][0]
            if held != manifest:
                raise VersionError(f"version {v} is committed with another manifest (immutable)")
            return held
        staging = self._staging.get(v)
        if staging is None:
            raise VersionError(f"version {v} was not begun")
        if self._staging_generation.get(v, 0) != manifest.generation:
            raise VersionError(
                f"version {v} was begun for generation {self._staging_generation.get(v, 0)}, "
                f"the manifest says generation {manifest.generation}"
            )
        missing = [i for i in range(len(manifest.buckets)) if i not in staging.buckets]
        extra = sorted(i for i in staging.buckets if i >= len(manifest.buckets))
        wrong = [
            i
            for i, b in enumerate(manifest.buckets)
            if i in staging.buckets
            and (staging.checksums[i] != b.sha256 or len(staging.buckets[i]) != b.nbytes)
        ]
        if missing or extra or wrong:
            raise VersionError(
                f"version {v} cannot commit: buckets missing {missing}, beyond the manifest "
                f"{extra}, differing from the manifest {wrong}"
            )
        self._committed[v] = (manifest, [staging.buckets[i] for i in range(len(manifest.buckets))])
        self.abandon(v)
        for older in [s for s in self._staging if s < v]:
            self.abandon(older)  # an unfinished older version will never be served
        return manifest

    def abandon(self, version: int) -> None:
        """Drop the staged (uncommitted) buckets of ``version``."""
        self._staging.pop(version, None)
        self._staging_generation.pop(version, None)

    # -- serving -----------------------------------------------------------------------------
    def newest_version(self) -> int | None:
        latest = self.latest()
        return None if latest is None else latest.version

    def latest(self) -> Manifest | None:
        """The newest committed manifest by (generation, version)."""
        return max((m for m, _ in self._committed.values()), key=lambda m: m.key, default=None)

    def manifest(self, version: int) -> Manifest:
        return self._held(version)[0]

    def bucket(self, version: int, index: int) -> bytes:
        buckets = self._held(version)[1]
        if not 0 <= index < len(buckets):
            raise VersionError(f"version {version} has buckets 0..{len(buckets) - 1}, not {index}")
        return buckets[index]

    def _held(self, version: int) -> tuple[Manifest, list[bytes]]:
        held = self._committed.get(version)
        if held is None:
            raise VersionError(
                f"version {version} is not held here (committed: {sorted(self._committed)})"
            )
        return held

    def committed_versions(self) -> list[int]:
        return sorted(self._committed)

    def staged_versions(self) -> list[int]:
        return sorted(self._staging)

    # -- collection --------------------------------------------------------------------------
    @contextlib.contextmanager
    def pinned(self, version: int) -> Iterator[None]:
        """``version`` is not collected inside the block."""
        self._pins[version] += 1
        try:
            yield
        finally:
            self._pins[version] -= 1
            if not self._pins[version]:
                del self._pins[version]

    def lease(self, version: int, until: float) -> None:
        """``version`` is not collected by ``collect(now)`` while ``now < until``."""
        self._leases[version] = max(until, self._leases.get(version, until))

    def collect(self, now: float) -> list[int]:
        """Drop every committed version older than the newest that is neither pinned nor
        leased at ``now``; returns the dropped versions."""
        self._leases = {v: t for v, t in self._leases.items() if t > now}
        newest = self.newest_version()
        dropped = [
            v
            for v in self._committed
            if v != newest and not self._pins.get(v) and v not in self._leases
        ]
        for v in dropped:
            del self._committed[v]
        return sorted(dropped)
