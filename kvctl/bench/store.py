"""Store bench, run in the rig (torch): our FS store vs the disk's limit and the peers.

For each entry size, on the same filesystem, in rounds (every method once per
round, so noise spreads evenly), best of N after one untimed warm-up round:

    ours              FSStore.save (fsync off / on) and FSStore.load (key,
                      checksum, token check included)
    raw               the same bytes with plain buffered write() / read()
                      (+ fsync; + a cold read after posix_fadvise(DONTNEED))
    per_layer_st      vLLM V1's example storage connector: a folder per
                      prompt, one safetensors file per layer {"kv_cache": [2, T, H, D]}
    seed_st           the seed's file store: one safetensors file per request
                      with a [2, L, T, H, D] tensor (plus hidden and tokens)
    torch_save        torch.save / torch.load of the same dict

A load is timed until one byte of every page of its result has been read
(`touch_pages`): safetensors' load_file maps the file lazily, and a mapping
is not yet a load. The KV is an 8B GQA model's in bf16 (32 layers x K,V x 8 heads x 128 = 128 KiB
per token), so 512 MB is 4096 tokens. Peers get their natural input layout,
built before timing. Files are removed as soon as they are timed.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import safetensors.torch
import torch

from connectors.store import format as fmt
from connectors.store.fs_store import FSStore
from kvctl.bench.common import Progress, best_of, gbps, rig_main, speed_ratio

LAYERS, KV_HEADS, HEAD_SIZE, HIDDEN = 32, 8, 128, 4096
DTYPE, DTYPE_TAG = torch.bfloat16, "BF16"
BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_SIZE * 2  # 128 KiB
IDENTITY = fmt.KVIdentity(model="kvctl-bench-8b-gqa", num_layers=LAYERS, kv_parts=2,
                          kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=DTYPE_TAG)
PEERS = ("per_layer_safetensors", "seed_safetensors", "torch_save")


def tokens_for(mb: float) -> int:
    return max(1, round(mb * 2**20 / BYTES_PER_TOKEN))


# --- page cache: drop a file's pages, and check that they went ---

def drop_cache(path: Path) -> None:
    """Write back and evict `path`'s pages, so the next read comes from the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # only clean pages can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_fraction(path: Path) -> float | None:
    """Share of `path`'s pages in the page cache (mincore), None if unknown."""
    size = path.stat().st_size
    if size == 0:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            return None
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                return None
            return sum(v & 1 for v in vec) / pages
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def touch_pages(obj) -> int:
    """Read one byte of every page of a load's result, so lazy (mmap) loads do their I/O.

    Every method's load is timed with this: a load counts as done when its
    bytes are in this process's memory, not when a mapping exists.
    """
    if isinstance(obj, torch.Tensor):
        if obj.numel() == 0:
            return 0
        flat = obj.reshape(-1).view(torch.uint8)
        return int(flat[::mmap.PAGESIZE].sum())
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return int(np.frombuffer(obj, dtype=np.uint8)[::mmap.PAGESIZE].sum())
    if isinstance(obj, dict):
        return sum(touch_pages(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(touch_pages(v) for v in obj)
    return touch_pages(obj.kv) + touch_pages(obj.hidden)  # FSStore's LoadedEntry


# --- the formats under test: save(dir) -> what to load and remove; load(that) ---

class Method:
    """One way to store a request's KV: `save` writes under a dir, `load` reads it back."""

    def __init__(self, name: str, save: Callable[[Path], Path], load: Callable[[Path], object]):
        self.name, self.save, self.load = name, save, load


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _files(path: Path) -> list[Path]:
    return sorted(path.iterdir()) if path.is_dir() else [path]


def make_methods(kv: torch.Tensor, hidden: torch.Tensor, tokens: list[int]) -> dict[str, Method]:
    """Every method, closed over the same KV (peers get their natural layouts, built here)."""
    token_tensor = torch.tensor(tokens, dtype=torch.int64)
    raw_parts = [token_tensor.numpy(), kv.view(torch.uint8).reshape(-1).numpy(),
                 hidden.view(torch.uint8).reshape(-1).numpy()]
    seed_kv = kv.transpose(0, 1).contiguous()  # the seed keeps [2, L, T, H, D]

    def ours_save(fsync: bool) -> Callable[[Path], Path]:
        return lambda d: FSStore(d, fsync=fsync).save(IDENTITY, tokens, kv, hidden).path

    def ours_load(path: Path):
        return FSStore(path.parent).load(IDENTITY, tokens)

    def raw_save(fsync: bool) -> Callable[[Path], Path]:
        def save(d: Path) -> Path:
            path = d / "raw.bin"
            with open(path, "wb") as f:
                for part in raw_parts:
                    f.write(part)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            return path
        return save

    def raw_load(path: Path):
        with open(path, "rb") as f:
            return f.read()

    def per_layer_save(d: Path) -> Path:
        folder = d / "per_layer"  # vLLM V1: <storage>/<prompt hash>/<layer name>.safetensors
        folder.mkdir()
        for layer in range(LAYERS):
            safetensors.torch.save_file({"kv_cache": kv[layer]},
                                        folder / f"model.layers.{layer}.self_attn.attn.safetensors")
        return folder

    def per_layer_load(folder: Path):
        return [safetensors.torch.load_file(folder / f"model.layers.{layer}.self_attn.attn.safetensors")
                ["kv_cache"] for layer in range(LAYERS)]

    def seed_save(d: Path) -> Path:
        path = d / "seed.safetensors"
        safetensors.torch.save_file({"input_tokens": token_tensor, "kv": seed_kv, "hidden": hidden}, path)
        return path

    def torch_save(d: Path) -> Path:
        path = d / "kv.pt"
        torch.save({"input_tokens": token_tensor, "kv": kv, "hidden": hidden}, path)
        return path

    methods = [
        Method("ours", ours_save(False), ours_load),
        Method("ours_fsync", ours_save(True), ours_load),
        Method("raw", raw_save(False), raw_load),
        Method("raw_fsync", raw_save(True), raw_load),
        Method("per_layer_safetensors", per_layer_save, per_layer_load),
        Method("seed_safetensors", seed_save, safetensors.torch.load_file),
        Method("torch_save", torch_save, lambda p: torch.load(p, weights_only=True)),
    ]
    return {m.name: m for m in methods}


# --- one size ---

COLD = ("ours", "raw")  # methods whose loads are also timed cold


def bench_size(root: Path, mb: float, repeat: int, progress: Progress) -> dict:
    """Times (best of `repeat`) of every method for one entry size; removes its files."""
    tokens = list(range(1, tokens_for(mb) + 1))
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn((LAYERS, 2, len(tokens), KV_HEADS, HEAD_SIZE), generator=gen).to(DTYPE)
    hidden = torch.randn((1, HIDDEN), generator=gen).to(DTYPE)
    methods = make_methods(kv, hidden, tokens)
    nbytes = kv.numel() * kv.element_size()
    save_s = {name: float("inf") for name in methods}
    load_s = {name: float("inf") for name in methods}
    cold_s = {name: float("inf") for name in COLD}
    file_bytes: dict[str, int] = {}
    dropped: list[float] = []
    for round_ in range(repeat + 1):  # round 0 warms up (first touch of memory is slow in VMs)
        names = list(methods)
        names = names[round_ % len(names):] + names[:round_ % len(names)]  # rotate: no fixed order
        for name in names:
            m = methods[name]
            work = root / f"{name}-{round_}"
            work.mkdir()
            try:
                holder: list[Path] = []
                t_save = best_of(lambda: holder.append(m.save(work)), 1)
                path = holder[0]
                file_bytes[name] = sum(f.stat().st_size for f in _files(path))
                t_load = best_of(lambda: touch_pages(m.load(path)), 1)
                t_cold = None
                if name in COLD:
                    def drop() -> None:
                        for f in _files(path):
                            drop_cache(f)
                        dropped.append(1.0 - (resident_fraction(_files(path)[0]) or 0.0))
                    t_cold = best_of(lambda: touch_pages(m.load(path)), 1, before=drop)
            finally:
                _remove(work)
            if round_:
                save_s[name] = min(save_s[name], t_save)
                load_s[name] = min(load_s[name], t_load)
                if t_cold is not None:
                    cold_s[name] = min(cold_s[name], t_cold)
        progress(f"store {mb:g} MB: round {round_}/{repeat} done"
                 + (" (warm-up)" if not round_ else ""))
    return {"mb": mb, "tokens": len(tokens), "kv_bytes": nbytes, "file_bytes": file_bytes,
            "save_s": save_s, "load_s": load_s, "load_cold_s": cold_s,
            "cold_pages_dropped": round(min(dropped), 3) if dropped else None,
            "save_gbps": {k: gbps(nbytes, v) for k, v in save_s.items()},
            "load_gbps": {k: gbps(nbytes, v) for k, v in load_s.items()},
            "ratios": size_ratios(save_s, load_s, cold_s)}


def size_ratios(save_s: dict, load_s: dict, cold_s: dict) -> dict[str, float]:
    """Throughput ratios, ours / baseline (> 1: ours faster). Save: fsync off unless named."""
    r = {
        "save_vs_raw_write": speed_ratio(save_s["raw"], save_s["ours"]),
        "save_fsync_vs_raw_write_fsync": speed_ratio(save_s["raw_fsync"], save_s["ours_fsync"]),
        "load_vs_raw_read": speed_ratio(load_s["raw"], load_s["ours"]),
        "load_cold_vs_raw_read_cold": speed_ratio(cold_s["raw"], cold_s["ours"]),
    }
    for peer in PEERS:
        r[f"save_vs_{peer}"] = speed_ratio(save_s[peer], save_s["ours"])
        r[f"load_vs_{peer}"] = speed_ratio(load_s[peer], load_s["ours"])
    r["save_vs_best_peer"] = speed_ratio(min(save_s[p] for p in PEERS), save_s["ours"])
    r["load_vs_best_peer"] = speed_ratio(min(load_s[p] for p in PEERS), load_s["ours"])
    return r


def run(params: dict, progress: Progress) -> dict:
    """params: dir (str), sizes_mb (list), repeat (int). Returns raw figures per size."""
    torch.set_num_threads(1)  # the store path is single-threaded; extra threads only add noise
    root = Path(params["dir"])
    sizes = [bench_size(root, float(mb), int(params["repeat"]), progress) for mb in params["sizes_mb"]]
    return {"shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_size": HEAD_SIZE,
                      "dtype": DTYPE_TAG, "bytes_per_token": BYTES_PER_TOKEN},
            "torch": torch.__version__, "safetensors": safetensors.__version__,
            "sizes": sizes}


if __name__ == "__main__":
    sys.exit(rig_main(run, sys.argv))
