"""The on-disk training-signal store: safetensors shards plus an atomically replaced JSON manifest.

Why this exists: TIDE (Sec. 3.2-3.3) trains the drafter from the target's hidden states that
serving already computed. The engine (one writer) and the trainer process (one or more readers,
possibly on another host over a shared filesystem) exchange those signals through a directory:

    root/
      manifest.json                 {"version": 1, "next_seq": 7, "shards": [ShardInfo, ...]}
      .lock                         fcntl lock file serialising manifest read-modify-write
      000000000005-1f3a9c2e.safetensors
      000000000006-77b0d4aa.safetensors

A shard is one batch of signals (rows). Row i says: at ``positions[i]`` of sequence
``seq_ids[i]`` the target saw ``token_ids[i]``, its tapped hidden states were ``taps[i]``, and
the token that followed was ``next_token_ids[i]`` (the label a drafter learns to predict).

Atomicity: a shard is written to a temporary name in ``root``, fsynced, then ``os.replace``d to
its final name *before* the manifest mentions it; the manifest is replaced the same way. A reader
that lists the manifest therefore only ever sees complete shards. Eviction (oldest first, to keep
``total_bytes() <= byte_budget``) removes shards from the manifest first and unlinks the files
afterwards, so a reader may find a listed shard gone: ``read`` then raises ``ShardGone`` and the
reader skips it.

On-disk dtype of ``taps``: bfloat16 by default. Hidden states of LLMs carry a few very large
"massive activation" channels (magnitudes of 1e3-1e4 in middle layers); bfloat16 has float32's
exponent range so they never overflow, whereas float16 (max 65504, and 1e-5 underflow) can. Most
targets also run in bfloat16, in which case storing bfloat16 is lossless. float16 keeps 3 more
mantissa bits and is available (``taps_dtype="float16"``) for float32 targets with tame ranges.

Worked example::

    store = SignalStore(Path("/shared/signals"), byte_budget=1 << 30)
    sid = store.append(SignalShard(taps=torch.randn(4, 96), token_ids=..., next_token_ids=...,
                                   seq_ids=..., positions=..., domain_ids=torch.zeros(4, dtype=torch.long),
                                   domains=["code"]))
    for info in store.list_shards(since=last_seen_id):
        try:
            shard = store.read(info.shard_id)
        except ShardGone:
            continue                     # evicted between listing and reading
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from tidespec.errors import UserError
from tidespec.files import TMP_PREFIX, atomic_write, fsync_path, write_synced

MANIFEST_NAME = "manifest.json"
LOCK_NAME = ".lock"
SHARD_SUFFIX = ".safetensors"
MANIFEST_VERSION = 1
TAPS_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


class ShardGone(LookupError):
    """The shard was evicted (or never existed) by the time it was read."""


class StoreError(UserError, RuntimeError):
    """The store directory or a shard file is malformed."""


_ROW_FIELDS = ("taps", "token_ids", "next_token_ids", "seq_ids", "positions", "domain_ids", "alphas", "topk_ids",
               "topk_logits", "hidden")  # SignalShard's per-row tensors (dimension 0 = rows)


@dataclass
class SignalShard:
    """One batch of training signals, N rows. All per-row tensors live on the CPU.

    ``domains`` is the vocabulary of domain labels and ``domain_ids[i]`` indexes it, so one shard
    may mix requests from several workloads. ``alphas[i]`` is the acceptance rate the deployed
    drafter reached on the request row i came from (NaN if unknown): Algorithm 1 of TIDE stores
    (h, alpha) and compares the new drafter against the average alpha of its training split.
    """

    taps: torch.Tensor  # [N, k*H] target hidden states at the tapped layers, concatenated
    token_ids: torch.Tensor  # [N] int64 token at each position
    next_token_ids: torch.Tensor  # [N] int64 the target's token that followed (label)
    seq_ids: torch.Tensor  # [N] int64 engine sequence id
    positions: torch.Tensor  # [N] int64 position of token_ids[i] in its sequence
    domain_ids: torch.Tensor | None = None  # [N] int64 index into ``domains``; None = all domain 0
    alphas: torch.Tensor | None = None  # [N] float32 acceptance rate of the row's request; NaN = unknown
    topk_ids: torch.Tensor | None = None  # [N, K] int64 target's top-k token ids
    topk_logits: torch.Tensor | None = None  # [N, K] float target's top-k logits
    # [N, H] the target's final (normed) hidden state at each position: its logits are this times
    # the LM head, so a trainer recovers the target's top-k without storing them (LoRA alignment)
    hidden: torch.Tensor | None = None
    domains: list[str] = field(default_factory=lambda: [""])
    wall_time: float = 0.0  # unix time the shard was cut (0 = stamped by the store on append)
    drafter_version: int = 0  # version of the drafter deployed while these rows were served
    acceptance: dict[str, float] = field(default_factory=dict)  # e.g. {"mean_alpha": .., "num_steps": ..}

    def __post_init__(self) -> None:
        if self.taps.dim() != 2:
            raise ValueError(f"taps must be [N, k*H], got shape {tuple(self.taps.shape)}")
        n = self.taps.shape[0]
        for name in ("token_ids", "next_token_ids", "seq_ids", "positions", "domain_ids", "alphas"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (n,):
                raise ValueError(f"{name} must have shape ({n},), got {tuple(t.shape)}")
        if (self.topk_ids is None) != (self.topk_logits is None):
            raise ValueError("topk_ids and topk_logits must be given together")
        if self.topk_ids is not None and self.topk_logits is not None:
            if self.topk_ids.dim() != 2 or self.topk_ids.shape[0] != n or self.topk_ids.shape != self.topk_logits.shape:
                raise ValueError(f"topk_ids/topk_logits must both be [{n}, K]")
        if self.hidden is not None and (self.hidden.dim() != 2 or self.hidden.shape[0] != n):
            raise ValueError(f"hidden must be [{n}, H], got shape {tuple(self.hidden.shape)}")
        if not self.domains:
            raise ValueError("domains must name at least one domain")
        if self.domain_ids is not None and n > 0:
            lo, hi = int(self.domain_ids.min()), int(self.domain_ids.max())
            if lo < 0 or hi >= len(self.domains):
                raise ValueError(f"domain_ids must index domains (0..{len(self.domains) - 1}), got {lo}..{hi}")

    @property
    def num_signals(self) -> int:
        return int(self.taps.shape[0])

    @property
    def domain(self) -> str:
        """The shard's single domain label, or ``"mixed"`` when rows come from several."""
        if self.domain_ids is None or len(self.domains) == 1:
            return self.domains[0]
        used = torch.unique(self.domain_ids).tolist()
        return self.domains[used[0]] if len(used) == 1 else "mixed"

    def row_domains(self) -> list[str]:
        """Domain label of every row."""
        if self.domain_ids is None:
            return [self.domains[0]] * self.num_signals
        return [self.domains[i] for i in self.domain_ids.tolist()]

    def in_domains(self, domains: frozenset[str]) -> SignalShard:
        """The shard's rows whose domain label is one of ``domains`` (the same shard if all are).

        Example: rows of domains [code, medical, medical], domains {medical} -> a 2-row shard."""
        keep = torch.tensor([d in domains for d in self.row_domains()], dtype=torch.bool)  # [N]
        if bool(keep.all()):
            return self
        rows = {name: getattr(self, name)[keep] for name in _ROW_FIELDS if getattr(self, name) is not None}
        return replace(self, **rows)


@dataclass(frozen=True)
class ShardInfo:
    """Manifest entry for one shard (what readers can filter on without opening the file)."""

    shard_id: str
    seq: int  # monotonically increasing append counter; shard ids sort by it
    file: str
    num_signals: int
    num_bytes: int
    wall_time: float
    domain: str
    domains: tuple[str, ...]
    drafter_version: int
    acceptance: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["domains"] = list(self.domains)
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> ShardInfo:
        return ShardInfo(shard_id=str(d["shard_id"]), seq=int(d["seq"]), file=str(d["file"]),
                         num_signals=int(d["num_signals"]), num_bytes=int(d["num_bytes"]),
                         wall_time=float(d["wall_time"]), domain=str(d["domain"]),
                         domains=tuple(d["domains"]), drafter_version=int(d["drafter_version"]),
                         acceptance={str(k): float(v) for k, v in d["acceptance"].items()})


class ShardSink(Protocol):
    """Anything a ``CaptureBuffer`` can flush shards into (``SignalStore`` or a test double)."""

    def append(self, shard: SignalShard) -> str: ...


def shard_seq(shard_id: str) -> int:
    """The append counter encoded in a shard id: ``shard_seq("000000000012-ab12cd34") == 12``."""
    head = shard_id.split("-", 1)[0]
    if not head.isdigit():
        raise ValueError(f"not a shard id: {shard_id!r}")
    return int(head)


def _owned(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` on the CPU in ``dtype``, contiguous, in storage of its own.

    safetensors refuses two tensors that share memory (``token_ids`` and ``next_token_ids`` are
    naturally two slices of one sequence), so a view into a bigger buffer is copied into storage
    of its own. A conversion that already copied is not copied again.

    Example: ``seq = torch.arange(5)``; ``_owned(seq[1:], torch.int64)`` is a fresh 4-element
    tensor; ``_owned(seq, torch.int64)`` shares ``seq``'s storage (nothing to copy).
    """
    out = t.detach().to("cpu", dtype).contiguous()
    if out.untyped_storage().nbytes() != out.numel() * out.element_size():  # a view into a bigger buffer
        out = out.clone()
    return out


class SignalStore:
    """A byte-budgeted directory of signal shards; one writer and several readers may share it.

    ``byte_budget`` bounds the sum of shard file sizes; appending evicts the oldest shards first.
    Only the writer's budget matters (readers pass any value). A shard larger than the budget is
    rejected with ``ValueError``.
    """

    def __init__(self, root: Path | str, byte_budget: int, taps_dtype: str = "bfloat16") -> None:
        if byte_budget <= 0:
            raise ValueError(f"byte_budget must be > 0, got {byte_budget}")
        if taps_dtype not in TAPS_DTYPES:
            raise ValueError(f"taps_dtype must be one of {', '.join(TAPS_DTYPES)}, got {taps_dtype!r}")
        self.root = Path(root)
        self.byte_budget = byte_budget
        self.taps_dtype = TAPS_DTYPES[taps_dtype]
        self.root.mkdir(parents=True, exist_ok=True)
        self._manifest_path = self.root / MANIFEST_NAME
        self._lock_path = self.root / LOCK_NAME
        with self._locked():
            if not self._manifest_path.exists():
                self._write_manifest(0, [])

    # ----------------------------------------------------------------------------- manifest
    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self._lock_path, "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _read_manifest(self) -> tuple[int, list[ShardInfo]]:
        try:
            raw = json.loads(self._manifest_path.read_text())
        except FileNotFoundError as e:
            raise StoreError(f"no manifest in {self.root}") from e
        except json.JSONDecodeError as e:
            raise StoreError(f"corrupt manifest in {self.root}: {e}") from e
        if raw.get("version") != MANIFEST_VERSION:
            raise StoreError(f"manifest version {raw.get('version')!r} != {MANIFEST_VERSION}")
        return int(raw["next_seq"]), [ShardInfo.from_json(d) for d in raw["shards"]]

    def _write_manifest(self, next_seq: int, shards: list[ShardInfo]) -> None:
        doc = {"version": MANIFEST_VERSION, "next_seq": next_seq, "shards": [s.to_json() for s in shards]}
        atomic_write(self._manifest_path, json.dumps(doc, indent=1).encode())

    # ----------------------------------------------------------------------------- writer
    def _encode(self, shard: SignalShard, wall_time: float) -> bytes:
        n = shard.num_signals
        tensors: dict[str, torch.Tensor] = {
            "taps": _owned(shard.taps, self.taps_dtype),
            "token_ids": _owned(shard.token_ids, torch.int64),
            "next_token_ids": _owned(shard.next_token_ids, torch.int64),
            "seq_ids": _owned(shard.seq_ids, torch.int64),
            "positions": _owned(shard.positions, torch.int64),
            "domain_ids": (_owned(shard.domain_ids, torch.int64)
                           if shard.domain_ids is not None else torch.zeros(n, dtype=torch.int64)),
            "alphas": (_owned(shard.alphas, torch.float32)
                       if shard.alphas is not None else torch.full((n,), float("nan"))),
        }
        if shard.topk_ids is not None and shard.topk_logits is not None:
            tensors["topk_ids"] = _owned(shard.topk_ids, torch.int64)
            tensors["topk_logits"] = _owned(shard.topk_logits, torch.float32)
        if shard.hidden is not None:
            tensors["hidden"] = _owned(shard.hidden, self.taps_dtype)
        storages: set[int] = set()
        for name, t in tensors.items():  # one tensor passed for two fields (token_ids is positions): copy one
            ptr = t.untyped_storage().data_ptr()
            if t.numel() and ptr in storages:
                tensors[name] = t.clone()
            storages.add(ptr)
        meta = {"domains": shard.domains, "wall_time": wall_time, "drafter_version": shard.drafter_version,
                "acceptance": shard.acceptance}
        return st_save(tensors, metadata={"tidespec": json.dumps(meta)})

    def append(self, shard: SignalShard) -> str:
        """Persist ``shard`` atomically, evict oldest shards over budget, return the new shard id."""
        wall_time = shard.wall_time or time.time()
        data = self._encode(shard, wall_time)
        if len(data) > self.byte_budget:
            raise ValueError(f"shard of {len(data)} bytes exceeds the store's byte_budget {self.byte_budget}")
        tmp = self.root / f"{TMP_PREFIX}{uuid.uuid4().hex}{SHARD_SUFFIX}"
        try:
            write_synced(tmp, data)
            with self._locked():
                next_seq, shards = self._read_manifest()
                shard_id = f"{next_seq:012d}-{uuid.uuid4().hex[:8]}"
                file = f"{shard_id}{SHARD_SUFFIX}"
                os.replace(tmp, self.root / file)
                fsync_path(self.root)
                shards.append(ShardInfo(shard_id=shard_id, seq=next_seq, file=file, num_signals=shard.num_signals,
                                        num_bytes=len(data), wall_time=wall_time, domain=shard.domain,
                                        domains=tuple(shard.domains), drafter_version=shard.drafter_version,
                                        acceptance=dict(shard.acceptance)))
                evicted: list[ShardInfo] = []
                total = sum(s.num_bytes for s in shards)
                while total > self.byte_budget:
                    oldest = shards.pop(0)
                    evicted.append(oldest)
                    total -= oldest.num_bytes
                self._write_manifest(next_seq + 1, shards)
                for s in evicted:  # after the manifest stopped listing them
                    (self.root / s.file).unlink(missing_ok=True)
        finally:
            tmp.unlink(missing_ok=True)
        return shard_id

    def cleanup_orphans(self, min_age_s: float = 600.0) -> int:
        """Remove temp files and unlisted shard files older than ``min_age_s`` (left by a crashed
        writer). Returns the number of files removed. Younger files may belong to a live writer."""
        now = time.time()
        removed = 0
        with self._locked():
            _, shards = self._read_manifest()
            listed = {s.file for s in shards}
            for p in self.root.iterdir():
                orphan = p.name.startswith(TMP_PREFIX) or (p.name.endswith(SHARD_SUFFIX) and p.name not in listed)
                if orphan and now - p.stat().st_mtime >= min_age_s:
                    p.unlink(missing_ok=True)
                    removed += 1
        return removed

    # ----------------------------------------------------------------------------- readers
    def list_shards(self, since: float | str | None = None) -> list[ShardInfo]:
        """Shards in append order. ``since``: a wall time (shards cut strictly later) or a shard id
        (shards appended after it, whether or not it still exists); None = all."""
        _, shards = self._read_manifest()
        if since is None:
            return shards
        if isinstance(since, str):
            after = shard_seq(since)
            return [s for s in shards if s.seq > after]
        return [s for s in shards if s.wall_time > since]

    def read(self, shard_id: str) -> SignalShard:
        """Load one shard (taps in the store's on-disk dtype). Raises ``ShardGone`` if evicted."""
        shard_seq(shard_id)  # validates the id before it becomes a path
        path = self.root / f"{shard_id}{SHARD_SUFFIX}"
        try:
            with open(path, "rb") as f:  # one open + full read: a later unlink (eviction) cannot tear it
                data = f.read()
        except FileNotFoundError as e:
            raise ShardGone(shard_id) from e
        tensors = st_load(data)
        meta_block = _safetensors_metadata(data)
        if "tidespec" not in meta_block:
            raise StoreError(f"shard {shard_id} lacks tidespec metadata")
        meta = json.loads(meta_block["tidespec"])
        return SignalShard(
            taps=tensors["taps"], token_ids=tensors["token_ids"], next_token_ids=tensors["next_token_ids"],
            seq_ids=tensors["seq_ids"], positions=tensors["positions"], domain_ids=tensors["domain_ids"],
            alphas=tensors["alphas"], topk_ids=tensors.get("topk_ids"), topk_logits=tensors.get("topk_logits"),
            hidden=tensors.get("hidden"), domains=list(meta["domains"]), wall_time=float(meta["wall_time"]),
            drafter_version=int(meta["drafter_version"]),
            acceptance={str(k): float(v) for k, v in meta["acceptance"].items()})

    def iter_shards(self, since: float | str | None = None) -> Iterator[tuple[ShardInfo, SignalShard]]:
        """Listed shards that can still be read, skipping those evicted meanwhile."""
        for info in self.list_shards(since):
            try:
                yield info, self.read(info.shard_id)
            except ShardGone:
                continue

    def total_bytes(self) -> int:
        return sum(s.num_bytes for s in self._read_manifest()[1])

    def num_signals(self) -> int:
        return sum(s.num_signals for s in self._read_manifest()[1])


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` map of a serialized safetensors buffer. The format is an 8-byte
    little-endian header length followed by a JSON header; ``safetensors.torch.load`` returns the
    tensors only, and ``safe_open`` needs a path that eviction may unlink between its own opens."""
    if len(data) < 8:
        raise StoreError("truncated safetensors shard")
    header_len = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:8 + header_len])
    except json.JSONDecodeError as e:
        raise StoreError(f"corrupt safetensors header: {e}") from e
    meta = header.get("__metadata__") or {}
    return {str(k): str(v) for k, v in meta.items()}
