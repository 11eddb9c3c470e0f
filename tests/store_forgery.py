"""What a writer without the store key can do to an entry, for the tests of authenticated entries.

`forge` is the probe's kind: noise added to the KV, the xxh3 checksum
recomputed, the header rewritten (the original tag kept, or dropped): an
entry any reader without the key takes as valid. `resign` re-signs an
entry's unchanged content with another key (a holder of that key).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from connectors.store import auth, format as fmt

_TORCH = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def forge(path: Path, *, keep_tag: bool = True, noise: float = 0.5) -> None:
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + hlen])
    data = bytearray(raw[8 + hlen:])
    begin, end = header["kv"]["data_offsets"]
    dtype = _TORCH[header["kv"]["dtype"]]
    kv = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype).float()
    kv += noise * torch.randn(kv.shape, generator=torch.Generator().manual_seed(1))
    data[begin:end] = kv.to(dtype).view(torch.uint8).numpy().tobytes()
    meta = header["__metadata__"]
    meta["checksum"] = fmt.checksum([bytes(data)])
    if not keep_tag:
        meta.pop(auth.MAC_FIELD, None)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    _replace(path, struct.pack("<Q", len(text)) + text + bytes(data))


def resign(path: Path, secret: str) -> None:
    """The same entry, signed with `secret` (published over the old one, atomically)."""
    header, data = fmt.read_entry(path)
    blobs = {}
    for name in fmt.TENSOR_ORDER:
        rec = header.tensors[name]
        begin, end = header.span(name)
        blobs[name] = fmt.TensorBlob(rec["dtype"], tuple(rec["shape"]), bytes(data[begin:end]))
    key = path.name[: -len(fmt.ENTRY_SUFFIX)]
    fmt.write_entry(path.parent, key, header.identity, blobs, keys=auth.StoreKeys.from_secrets([secret]))


def _replace(path: Path, content: bytes) -> None:
    tmp = path.with_name(f".forged-{os.getpid()}")
    tmp.write_bytes(content)
    os.replace(tmp, path)
