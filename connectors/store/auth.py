"""Authenticated entries: a keyed BLAKE3 tag over an entry's data and header (spec: docs/store-format.md).

The xxh3 checksum proves integrity, not authorship: anyone who can write the
store directory can publish an entry with a correct checksum. With a store
key, writers add a `mac` field to the header's metadata,

    mac = "blake3:" + <key id, 16 hex> + ":" + <tag, 64 hex>
    tag = BLAKE3-keyed(mac_key, data section || header with the tag's 64 hex as "0")

and readers holding the key serve only entries whose tag verifies. Several
keys may be accepted (rotation); the first one signs. A key is any secret
string (kvctl generates 64 hex digits); the MAC key and the key id are derived
from it with BLAKE3's key derivation, so the secret itself never appears in
an entry.

Keys come from a file (one per line, `#` comments; the first signs) or the
environment, never from a command line: `$KVCTL_STORE_KEY` (keys separated by
commas) or `$KVCTL_STORE_KEY_FILE` (a path).
"""

from __future__ import annotations

import os
import re
import secrets as secrets_mod
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import blake3

from connectors.store.errors import StoreError

KEY_ENV = "KVCTL_STORE_KEY"  # the store keys themselves, comma-separated (first signs)
KEY_FILE_ENV = "KVCTL_STORE_KEY_FILE"  # a file of store keys, one per line (first signs)
MAC_FIELD = "mac"  # the metadata field that holds the tag
MAC_SCHEME = "blake3"
KEY_ID_HEX_LEN = 16
TAG_HEX_LEN = 64
BLANK_TAG = "0" * TAG_HEX_LEN  # what the tag reads as while it is computed
MAC_VALUE = re.compile(rf"{MAC_SCHEME}:([0-9a-f]{{{KEY_ID_HEX_LEN}}}):([0-9a-f]{{{TAG_HEX_LEN}}})")
_MAC_CONTEXT = "kvctl-fs-kv 2026-12 entry MAC key v1"
_KEY_ID_CONTEXT = "kvctl-fs-kv 2026-12 key id v1"
UNSIGNED = "unsigned"
BAD_SIGNATURE = "bad signature"


class EntryUnauthenticated(StoreError):
    """An entry a keyed reader may not serve: it has no tag, or its tag does not verify.

    Not `EntryCorrupt`: the entry may be another writer's (another cluster, a
    key being rotated), so it is refused and recomputed, never deleted.
    `reason` starts with "unsigned" or "bad signature".
    """

    def __init__(self, path: Path | str, reason: str):
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{self.path.name}: {reason}")


class StoreKeyError(StoreError):
    """A store key setting that cannot be used (empty, unreadable file)."""


@dataclass(frozen=True)
class StoreKey:
    key_id: str  # 16 hex digits, written into every tag this key makes
    mac_key: bytes = b""  # 32 bytes, derived from the secret

    def __repr__(self) -> str:  # never show key material in a log or traceback
        return f"StoreKey({self.key_id})"


class StoreKeys:
    """The keys a store accepts; the first one signs."""

    def __init__(self, keys: Sequence[StoreKey]):
        if not keys:
            raise StoreKeyError("no store key given")
        self.keys = tuple(keys)
        self.by_id = {k.key_id: k for k in reversed(self.keys)}

    @classmethod
    def from_secrets(cls, secrets: Sequence[str]) -> "StoreKeys":
        return cls([derive_key(s) for s in secrets])

    @property
    def signer(self) -> StoreKey:
        return self.keys[0]

    @property
    def key_ids(self) -> list[str]:
        return [k.key_id for k in self.keys]

    def __repr__(self) -> str:
        return f"StoreKeys({', '.join(self.key_ids)})"


def derive_key(secret: str) -> StoreKey:
    """The MAC key and key id of one secret. Raises StoreKeyError for an empty secret."""
    material = secret.strip().encode()
    if not material:
        raise StoreKeyError("a store key is empty")
    mac_key = blake3.blake3(material, derive_key_context=_MAC_CONTEXT).digest()
    key_id = blake3.blake3(material, derive_key_context=_KEY_ID_CONTEXT).hexdigest()[:KEY_ID_HEX_LEN]
    return StoreKey(key_id, mac_key)


def generate_secret() -> str:
    """A new store key: 256 random bits as 64 hex digits."""
    return secrets_mod.token_hex(32)


def parse_key_file(text: str) -> list[str]:
    """The keys in a key file: one per line, blank lines and `#` comments skipped, first signs."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def read_key_file(path: Path | str) -> StoreKeys:
    """The keys in the file at `path`. Raises StoreKeyError naming the file (unreadable, no key)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise StoreKeyError(f"store key file {path}: {e.strerror or e}") from None
    found = parse_key_file(text)
    if not found:
        raise StoreKeyError(f"store key file {path} holds no key")
    return StoreKeys.from_secrets(found)


def keys_from(key_file: str | None = None, env: Mapping[str, str] | None = None) -> StoreKeys | None:
    """The store keys configured for this process, or None (an unkeyed store).

    First that is set: `key_file` (a path from the connector's settings),
    $KVCTL_STORE_KEY_FILE, $KVCTL_STORE_KEY (comma-separated). Raises StoreKeyError
    for a file that cannot be read or a setting that holds no key.
    """
    env = os.environ if env is None else env
    path = key_file or env.get(KEY_FILE_ENV)
    if path:
        return read_key_file(path)
    raw = env.get(KEY_ENV)
    if raw is None:
        return None
    found = [s.strip() for s in raw.split(",") if s.strip()]
    if not found:
        raise StoreKeyError(f"${KEY_ENV} is set but holds no key")
    return StoreKeys.from_secrets(found)


# ---------------------------------------------------------------- tags

def blank_mac_value(key: StoreKey) -> str:
    """The `mac` field a writer puts in the header while the tag is computed."""
    return f"{MAC_SCHEME}:{key.key_id}:{BLANK_TAG}"


def hasher(key: StoreKey):
    """A keyed BLAKE3 hasher: feed it the data section, then `finish` with the blank header."""
    return blake3.blake3(key=key.mac_key, max_threads=blake3.blake3.AUTO)


def sign_header(key: StoreKey, mac, blank_header: bytes) -> bytes:
    """The header with its blank tag filled in (`mac`: the hasher fed the data section)."""
    mac.update(blank_header)
    blank = blank_mac_value(key).encode()
    filled = f"{MAC_SCHEME}:{key.key_id}:{mac.hexdigest()}".encode()
    if blank_header.count(blank) != 1:  # pragma: no cover - build_header writes it once
        raise ValueError("header does not hold exactly one blank tag")
    return blank_header.replace(blank, filled)


@dataclass
class TagCheck:
    """A reader's check of one entry's tag: feed it the data section, then `finish`."""

    path: Path
    key: StoreKey
    tag: str
    blank_header: bytes
    mac: object

    def update(self, data) -> None:
        self.mac.update(data)

    def finish(self) -> None:
        """Raises EntryUnauthenticated("bad signature ...") when the tag does not verify."""
        self.mac.update(self.blank_header)
        if not secrets_mod.compare_digest(self.mac.hexdigest(), self.tag):
            raise EntryUnauthenticated(self.path, f"{BAD_SIGNATURE}: the tag does not match the entry "
                                                  f"(key {self.key.key_id}); not written by a holder of this "
                                                  f"store's key, or changed since")


def signature_of(metadata: Mapping[str, str]) -> tuple[str, str] | None:
    """(key id, tag) of an entry's `mac` field; None when unsigned. Raises ValueError when malformed."""
    value = metadata.get(MAC_FIELD)
    if value is None:
        return None
    m = MAC_VALUE.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"mac field is not {MAC_SCHEME}:<{KEY_ID_HEX_LEN} hex>:<{TAG_HEX_LEN} hex>")
    return m.group(1), m.group(2)


def start_check(path: Path | str, metadata: Mapping[str, str], raw_header: bytes,
                keys: StoreKeys) -> TagCheck:
    """Begin checking an entry's tag from its header alone.

    Raises EntryUnauthenticated: "unsigned" (no tag), "bad signature ..."
    (malformed, or made with a key this reader does not accept).
    """
    path = Path(path)
    try:
        signed = signature_of(metadata)
    except ValueError as e:
        raise EntryUnauthenticated(path, f"{BAD_SIGNATURE}: {e}") from None
    if signed is None:
        raise EntryUnauthenticated(path, f"{UNSIGNED}: the entry has no tag and this store requires one "
                                         f"(written without the store key)")
    key_id, tag = signed
    key = keys.by_id.get(key_id)
    if key is None:
        raise EntryUnauthenticated(path, f"{BAD_SIGNATURE}: signed with key {key_id}, which this reader "
                                         f"does not accept (accepted: {', '.join(keys.key_ids)})")
    filled = f"{MAC_SCHEME}:{key_id}:{tag}".encode()
    if raw_header.count(filled) != 1:
        raise EntryUnauthenticated(path, f"{BAD_SIGNATURE}: the tag appears {raw_header.count(filled)} times "
                                         f"in the header")
    blank = raw_header.replace(filled, blank_mac_value(key).encode())
    return TagCheck(path, key, tag, blank, hasher(key))


def has_accepted_tag(metadata: Mapping[str, str], keys: StoreKeys) -> bool:
    """The header carries a well-formed tag of an accepted key (not verified: a producer's cheap check)."""
    try:
        signed = signature_of(metadata)
    except ValueError:
        return False
    return signed is not None and signed[0] in keys.by_id


def describe(keys: StoreKeys | None) -> str:
    """What a connector logs once at start-up: which key signs, which are accepted (ids only)."""
    if keys is None:
        return "none (entries are neither signed nor checked for a tag)"
    return f"signing with {keys.signer.key_id}; accepting {', '.join(keys.key_ids)}"
