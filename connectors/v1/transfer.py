"""What FSConnector (V1) loads and saves, decided without vLLM.

Entries without a hidden state. V1 computes at least the last prompt token
on the decode instance, so a V1 producer stores the prompt's KV only: its
``hidden`` tensor is ``[1, 0]`` (one row, no columns; the format allows it)
and its identity's `model` ends in ``;hidden=none``. That suffix changes the
key, so:

- a V0 decode, which needs the last token's hidden state, looks up the key
  of its own identity and never finds a V1 entry: a plain miss (it
  recomputes and logs "miss"), never a zero-width hidden state, and it never
  deletes the V1 entry as corrupt;
- a V1 decode looks up both keys, its own first, then the V0 producer's
  (same identity without the suffix), so V0 P -> V1 D works: the V0 entry's
  KV is used and its hidden state ignored.

Everything else in the identity is the V0 rule (connectors.store.format):
model (weights + serving settings, connectors.served_model), layers,
kv_parts, kv_heads and head_size per TP rank, KV dtype, TP rank and size.
The block size is not in it: entries are token-major.

Full prompts only: an entry holds every prompt token, keyed on all of them,
as V0 does. The decode side loads ``prompt_len - 1`` tokens at most (V1 must
compute the last one) and never those its own prefix cache already holds.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from connectors.store import auth, format as fmt

KV_ONLY_SUFFIX = ";hidden=none"  # appended to `model` in the identity of entries with no hidden state


def kv_only_identity(identity: fmt.KVIdentity) -> fmt.KVIdentity:
    """The identity of an entry that holds KV only (what a V1 producer writes)."""
    if identity.model.endswith(KV_ONLY_SUFFIX):
        return identity
    return dataclasses.replace(identity, model=identity.model + KV_ONLY_SUFFIX)


def is_kv_only(identity: fmt.KVIdentity) -> bool:
    return identity.model.endswith(KV_ONLY_SUFFIX)


def lookup_identities(identity: fmt.KVIdentity) -> tuple[fmt.KVIdentity, fmt.KVIdentity]:
    """The identities a V1 reader tries, in order: V1 producers' (KV only), then V0 producers'."""
    base = dataclasses.replace(identity, model=identity.model.removesuffix(KV_ONLY_SUFFIX))
    return kv_only_identity(base), base


def rank_identity(identity: fmt.KVIdentity, tp_rank: int) -> fmt.KVIdentity:
    return dataclasses.replace(identity, tp_rank=tp_rank)


@dataclass(frozen=True)
class EntryCheck:
    """The scheduler's verdict on one prompt's entries (one per TP rank)."""

    identity: fmt.KVIdentity | None  # the identity (rank 0) whose entries are valid; None: none is
    key: str  # rank 0's key of that identity, else of the one `reason` is about
    reason: str  # "" when found; else why nothing is loaded (miss, corrupt: ..., ...)
    kv_only: bool = True  # `key` is of the KV-only identity (a V1 producer's entry)
    corrupt: tuple[fmt.EntryCorrupt, ...] = ()  # entries proven invalid (the caller removes them)
    pending: bool = False  # missing, but a fresh pending marker says its save is under way

    @property
    def found(self) -> bool:
        return self.identity is not None


def check_entry(root: Path, identity: fmt.KVIdentity, token_ids: Sequence[int],
                keys: auth.StoreKeys | None = None, *, full: bool = True) -> None:
    """Verify the entry of `identity` for exactly these tokens without loading it (rules 0-7, 9-11; 12 with keys).

    Reads the header and compares the stored token ids with the prompt's;
    `full` also streams the data section through the checksum (and, with
    keys, the signature; bounded memory). Without it the work is bounded by the header and the token ids
    (8 bytes a token): the scheduler's check, which decides the offer; the
    worker's load verifies the checksum. Raises
    FileNotFoundError (miss), EntryCorrupt (invalid: the entry should be
    removed), TokensDiffer (other tokens under this key),
    auth.EntryUnauthenticated (with keys: unsigned, bad signature; left alone),
    OSError (cannot be read).
    """
    raw = fmt.token_bytes(token_ids)
    key = fmt.key_from_token_bytes(identity, raw)
    path = fmt.entry_path(root, key)
    with fmt.open_entry(path) as (f, _):
        header = fmt.parse_header(path, f)
        if header.identity != identity:
            raise fmt.EntryCorrupt(path, f"identity {header.identity} != expected {identity}")
        if header.num_tokens != len(raw) // 8:
            raise fmt.EntryCorrupt(path, f"holds {header.num_tokens} tokens, the prompt has {len(raw) // 8}")
        begin, end = header.span("token_ids")
        stored = _pread(f, header.data_start + begin, end - begin)
        if stored != raw:
            raise TokensDiffer(f"{path.name}: stored token ids differ from the prompt's")
        if full:
            fmt.verify_data(path, f, header, keys)


class TokensDiffer(fmt.StoreError):
    """An entry under the prompt's key holds other token ids (collision or tampering): never served."""


def _pread(f, offset: int, n: int) -> bytes:
    data = os.pread(f.fileno(), n, offset)
    while len(data) < n:
        more = os.pread(f.fileno(), n - len(data), offset + len(data))
        if not more:
            break
        data += more
    return data


def find_entry(root: Path, identity: fmt.KVIdentity, token_ids: Sequence[int], tp_size: int,
               keys: auth.StoreKeys | None = None, *, full: bool = True,
               pending_s: float | None = None) -> EntryCheck:
    """The first identity (lookup_identities order) whose entries for every TP rank are valid.

    `full`: as in check_entry (False: header and token ids only).
    `pending_s`: when nothing is found and the KV-only entry (a V1 producer's)
    is missing, look at its pending marker: one younger than `pending_s`
    makes the check `pending` (the entry is being saved: ask again); an older
    one is stale: removed, and the miss's reason says so. Without a marker the entry is looked
    up once more (its writer removes the marker after the rename, so the
    entry may have appeared between the two looks). A hit costs nothing
    extra; a miss costs two more lookups of names that are not there.
    Never raises: a miss, an invalid entry, other tokens or a read error is
    a reason. Invalid entries are returned in `corrupt` for removal.
    """
    reasons, corrupt = [], []
    for candidate in lookup_identities(identity):
        problem, rank = _check_ranks(root, candidate, token_ids, tp_size, keys, full, corrupt)
        if problem is None:
            return EntryCheck(candidate, fmt.compute_key(candidate, token_ids), "", is_kv_only(candidate),
                              tuple(corrupt))
        reasons.append((fmt.compute_key(candidate, token_ids), problem, is_kv_only(candidate), rank))
    own_key, own_problem, _, own_rank = reasons[0]  # the KV-only candidate
    if pending_s is not None and own_problem.startswith("miss"):
        candidate = lookup_identities(identity)[0]
        marker_key = (own_key if own_rank == candidate.tp_rank else
                      fmt.compute_key(rank_identity(candidate, own_rank), token_ids))
        marker = _pending_marker(root, marker_key, pending_s)
        if marker is not None and marker[0]:
            why = f"pending: its save is under way (marker {marker[1] * 1e3:.0f} ms old)"
            return EntryCheck(None, own_key, why, True, tuple(corrupt), pending=True)
        if _check_ranks(root, candidate, token_ids, tp_size, keys, full, corrupt)[0] is None:
            return EntryCheck(candidate, own_key, "", True, tuple(corrupt))
        if marker is not None:
            reasons[0] = (own_key, f"{own_problem} (its pending marker was stale, {marker[1]:.1f} s old: "
                                   f"no save behind it; removed)", True, own_rank)
    # Report the most telling reason: a damaged entry over a miss, a partial miss over a plain one.
    key, reason, kv_only, _ = min(reasons, key=lambda r: (r[1].startswith("miss"), -r[3]))
    return EntryCheck(None, key, reason, kv_only, tuple(corrupt))


def _check_ranks(root: Path, candidate: fmt.KVIdentity, token_ids: Sequence[int], tp_size: int,
                 keys: auth.StoreKeys | None, full: bool, corrupt: list) -> tuple[str | None, int]:
    """(None, last rank) when every rank's entry of `candidate` is valid, else (why not, the rank)."""
    problem, rank = None, 0
    for rank in range(tp_size):
        try:
            check_entry(root, rank_identity(candidate, rank), token_ids, keys, full=full)
        except FileNotFoundError:
            problem = "miss"
        except fmt.EntryCorrupt as e:
            corrupt.append(e)
            problem = f"corrupt: {e.reason}"
        except TokensDiffer:
            problem = "token mismatch"
        except auth.EntryUnauthenticated as e:  # another writer's entry: refused, never removed
            problem = f"refused: {e.reason}"
        except OSError as e:
            problem = f"unreadable: {e.strerror or e}"
        if problem:
            if tp_size > 1:
                problem += f" (tp rank {rank})"
            break
    return problem, rank


def _pending_marker(root: Path, key: str, fresh_s: float) -> tuple[bool, float] | None:
    """(fresh, age in s) of `key`'s pending marker: fresh when younger than `fresh_s`; None when there is none.

    A stale marker (a dead or stuck writer's) is removed, best effort. A
    marker that cannot be looked at counts as none.
    """
    try:
        marker = fmt.find_pending(root, key)
    except OSError:
        return None
    if marker is None:
        return None
    age = fmt.pending_age(marker)
    if age < fresh_s:
        return True, max(age, 0.0)
    try:
        fmt.remove_store_file(marker, unchanged=True)
    except OSError:
        pass
    return False, age


def tokens_to_load(prompt_len: int, num_computed: int) -> int:
    """How many prompt tokens a V1 reader loads beyond `num_computed` (its local prefix cache hit).

    All but the last prompt token (V1 computes at least one token itself),
    never fewer than zero.
    """
    return max(0, prompt_len - 1 - num_computed)


def prompt_completes(num_computed: int, num_scheduled: int, prompt_len: int) -> bool:
    """This step computes the prompt's last token (chunked prefill: the last chunk)."""
    return num_computed < prompt_len <= num_computed + num_scheduled


def slots_for(block_ids: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """Cache slots (block_id * block_size + offset) of prompt positions [start, end)."""
    if end > len(block_ids) * block_size:
        raise ValueError(f"positions up to {end} need {-(-end // block_size)} blocks of {block_size}, "
                         f"the request has {len(block_ids)}")
    return [block_ids[i // block_size] * block_size + i % block_size for i in range(start, end)]


# ---------------------------------------------------------------- scheduler -> worker

@dataclass
class LoadSpec:
    """Load prompt positions [start, end) of one request's entry into its blocks."""

    req_id: str
    token_ids: list[int]  # the whole prompt
    kv_only: bool  # the entry is a V1 producer's (KV only); else a V0 producer's
    block_ids: list[int]
    start: int  # = tokens the local prefix cache already held
    end: int  # start + tokens loaded; at most len(token_ids) - 1
    block_size: int = 0  # the plan's, set by the worker


@dataclass
class SaveSpec:
    """Store one request's whole prompt (its KV is complete once this step's forward ran)."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    block_size: int = 0  # the plan's, set by the worker
    gather_s: float = 0.0  # how long copying it out of the cache took (set by the worker)


@dataclass
class Skip:
    """A prefill that loads nothing, and why (the worker logs it with its own key)."""

    req_id: str
    token_ids: list[int]
    kv_only: bool  # which identity the key in the log line is of
    prefix_cached: int
    reason: str


@dataclass
class StepPlan:
    """FSConnector's per-step metadata: what each worker loads, saves and reports."""

    block_size: int  # the KV cache manager's block size (slots are in its blocks)
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # requests preempted before this step
