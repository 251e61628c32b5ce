"""Durable file writes, the one cache directory and the versioned publish area: what the model loader,
the profiler, the drafter publishers (EAGLE-3 and Medusa heads) and the signal store share.

Why this exists: a crash must never leave a half-written cache entry, checkpoint or manifest
that a later reader trusts, and every cached artefact (converted GGUF checkpoints, measured
profiles) must land under one root that honours the same environment variables, keyed by the
CPU it was measured on where it is a measurement (``cpu_name``). Each writer used to carry its own
fsync helper and its own idea of the cache root.

Measurements are taken under ``exclusive`` on their cache entry: processes starting together on one
machine (a fleet's replicas, test workers) measure once, in turn, instead of all at once on the same
cores, which is slower for each and makes timed choices wrong.

Worked example::

    atomic_write(root / "manifest.json", b"{...}")   # readers see the old or the whole new file
    cache_root()                                      # $TIDESPEC_CACHE, else $XDG_CACHE_HOME/tidespec,
                                                      # else ~/.cache/tidespec
    measure_once(entry, read, measure)                # the cached value, else measured (and written)
                                                      # by one process at a time
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

TMP_PREFIX = ".tmp-"  # temporary names start with this; readers skip them, cleaners may delete them


def cache_root() -> Path:
    """``$TIDESPEC_CACHE`` if set, else ``$XDG_CACHE_HOME/tidespec`` (``XDG_CACHE_HOME`` defaults to ``~/.cache``)."""
    env = os.environ.get("TIDESPEC_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tidespec"


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's marketing name with its family and model numbers from ``cpuinfo``
    (``platform.processor()`` elsewhere): part of the key of every cached measurement (kernel plans,
    profiles), which holds only on the CPU it was taken on. The numbers matter: a cloud VM may call a
    Zen 4 and a Zen 5 host both "AMD EPYC".

    Example: ``"AMD EPYC (family 26, model 2)"``.
    """
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="utf-8") as fh:
            for line in fh:
                key, sep, value = line.partition(":")
                if not sep:
                    break  # the first processor's block ends at a blank line
                fields.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory after a rename inside it makes the rename durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old or the complete new file."""
    tmp = path.parent / f"{TMP_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
    try:
        write_synced(tmp, data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(path.parent)


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock named after ``path`` for the block: other processes that ask for the same
    one wait. Read the entry again inside the block, since another process may have written it while
    this one waited. The lock files live apart, in ``cache_root()/locks`` (never deleted: deleting a
    lock file others may hold breaks the lock), so a failed measurement leaves its folder as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)  # the entry's folder, for the writer inside the block
    locks = cache_root() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    with open(locks / f"{path.name}-{key}.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def measure_once(entry: Path, read: Callable[[], T | None], measure: Callable[[], T]) -> T:
    """The measurement cached at ``entry``: ``read()`` (None when there is none, or it is unreadable
    or stale), else ``measure()``, which writes it, under ``exclusive(entry)``: a process that finds
    another measuring the same entry waits, then reads what that one wrote.

    Example: ``measure_once(path, lambda: load(path), lambda: write(path, time_it()))`` -> the
    value; two test workers asking at once measure once (together they took 261-304 s where one took 5)."""
    value = read()
    if value is not None:
        return value
    with exclusive(entry):
        value = read()
        return value if value is not None else measure()


def directory_fingerprint(directory: Path) -> tuple[tuple[str, int, int], ...]:
    """The fingerprint of a directory (a published version, an adapter): (name, size, mtime in ns) of every file in it,
    sorted; () when it is gone. A copy still in progress changes it; an untouched directory does not."""
    try:
        stats = [(p.relative_to(directory).as_posix(), p.stat()) for p in directory.rglob("*") if p.is_file()]
    except OSError:  # a file vanished while we looked: different from anything seen, so tried again
        return (("", -1, -1),)
    return tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats))


# ----------------------------------------------------------------------------------------------
# a versioned publish area: root/v1, v2, ... and LATEST (EAGLE-3 heads, Medusa heads)
# ----------------------------------------------------------------------------------------------

METRICS_NAME = "metrics.json"  # each version's record of the round that published it
LATEST_NAME = "LATEST"
_PUBLISH_LOCK_NAME = ".lock"
_VERSION_DIR = re.compile(r"^v(\d+)$")


def list_versions(root: Path | str) -> list[int]:
    """Complete versions present (``v{N}`` dirs; temp dirs are ignored), ascending."""
    r = Path(root)
    if not r.is_dir():
        return []
    out = [int(m.group(1)) for p in r.iterdir() if (m := _VERSION_DIR.match(p.name)) and p.is_dir()]
    return sorted(out)


def latest_version(root: Path | str) -> int | None:
    """The version ``LATEST`` points at; without a readable ``LATEST``, the newest ``v{N}`` dir."""
    r = Path(root)
    try:
        n = int((r / LATEST_NAME).read_text(encoding="utf-8").strip())
        if (r / f"v{n}").is_dir():
            return n
    except (OSError, ValueError):
        pass
    versions = list_versions(r)
    return versions[-1] if versions else None


def publish_version(root: Path, write: Callable[[Path], None], metrics: dict[str, Any]) -> int:
    """Write ``root/v{N}`` atomically and point ``LATEST`` at it; returns N. ``write(d)`` writes one
    version's files into the empty directory ``d``; ``metrics`` (JSON) go beside them as ``metrics.json``
    with ``"version": N``. A temp dir is written, fsynced and renamed into place whole, so a reader
    never sees half a version; concurrent publishers each get a distinct N (a lost rename race retries
    with N+1); ``LATEST`` only ever moves forward.

    Example: an empty root -> 1 (``root/v1``, ``LATEST`` "1"), then 2, ...
    """
    root.mkdir(parents=True, exist_ok=True)
    metrics_json = json.loads(json.dumps(metrics))  # fail early on non-JSON metrics
    while True:
        versions = list_versions(root)
        n = (versions[-1] if versions else 0) + 1
        tmp = root / f"{TMP_PREFIX}v{n}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.mkdir()
            write(tmp)
            write_synced(tmp / METRICS_NAME,
                         (json.dumps({"version": n, **metrics_json}, indent=2, sort_keys=True) + "\n").encode())
            fsync_path(tmp)
            try:
                os.rename(tmp, root / f"v{n}")
            except OSError:
                if (root / f"v{n}").exists():
                    continue  # another publisher took v{n}: try the next number
                raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        break
    fsync_path(root)
    with open(root / _PUBLISH_LOCK_NAME, "a+", encoding="utf-8") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        current = latest_version(root) if (root / LATEST_NAME).exists() else None
        if current is None or n > current:
            tmp_latest = root / f"{TMP_PREFIX}{LATEST_NAME}-{uuid.uuid4().hex[:8]}"
            write_synced(tmp_latest, f"{n}\n".encode())
            os.replace(tmp_latest, root / LATEST_NAME)
            fsync_path(root)
    return n
