"""Layout bench, run in the rig (torch): gather/scatter through the paged caches vs memcpy.

What FSConnector does per request, timed as best of N after a warm-up:

    gather   every layer's KV of the request's slots -> one [layers, kv_parts,
             tokens, kv_heads, head_size] tensor, the entry it saves (the
             layout's gather_layers into a GatherBuffers buffer, as FSConnector
             calls it: the buffer is reused from one step to the next)
    scatter  that tensor back into every layer's slots (scatter_layers)

against `dst.copy_(src)` of the same bytes between two preallocated
contiguous tensors (the memory's own limit). Layouts: every V0 layout we
ship: PagedAttention (the CPU backend's), FlashAttention, FlashInfer and
MLA (one latent per token, `mla_head_size` wide). The slots of a request
lie in blocks drawn from a shuffled block table twice the size the request
needs, as a busy server's would. On CUDA when torch sees a GPU.
`gather_fresh_s` (raw, no ratio) is the gather into a new tensor each time:
the gap to `gather_s` is what reusing the buffer saves (page faults).

The figures are the best of N rounds, each round timing every method once
(best_interleaved). CPU runs use 1 intra-op thread by default: on a shared 2-core machine two
OpenMP threads wait on each other whenever one is descheduled, which made
the same gather 8x slower and far noisier (measured here); the memcpy
baseline runs with the same threads, so the ratio compares like with like.
"""

from __future__ import annotations

import math
import sys
import time

import torch

from connectors.v0.kv_layout import (CacheGeometry, FlashAttentionLayout, FlashInferLayout, GatherBuffers,
                                     KVLayout, MLALayout, PagedAttentionLayout)
from kvctl.bench.common import Progress, gbps, rig_main, speed_ratio

LAYOUTS: dict[str, type[KVLayout]] = {
    "paged_attention": PagedAttentionLayout,
    "flash_attn": FlashAttentionLayout,
    "flashinfer": FlashInferLayout,
    "mla": MLALayout,
}
MLA_HEAD_SIZE = 576  # DeepSeek-V2/V3's latent: 512 + 64 rope dims
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def make_caches(name: str, g: CacheGeometry, layers: int, num_blocks: int, dtype, device) -> list:
    """One cache per layer in the layout's vLLM 0.9.2 shape (filled: untouched pages fault)."""
    shape = LAYOUTS[name].cache_shape(num_blocks, g)
    return [torch.full(shape, 0.5, dtype=dtype, device=device) for _ in range(layers)]


def layout_geometry(name: str, p: dict) -> CacheGeometry:
    """The bench's shape for a layout: MLA keeps one latent of `mla_head_size` per token."""
    if LAYOUTS[name].kv_parts == 1:
        return CacheGeometry(block_size=p["block_size"], kv_heads=1,
                             head_size=int(p.get("mla_head_size", MLA_HEAD_SIZE)))
    return CacheGeometry(block_size=p["block_size"], kv_heads=p["kv_heads"], head_size=p["head_size"])


def request_slots(tokens: int, block_size: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Slots of one prompt: its blocks come from a shuffled block table."""
    table = torch.randperm(num_blocks, generator=gen)[: -(-tokens // block_size)]
    pos = torch.arange(tokens)
    return table[pos // block_size] * block_size + pos % block_size


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_one(name: str, tokens: int, p: dict, device: torch.device, progress: Progress) -> dict:
    g = layout_geometry(name, p)
    dtype, layers, repeat = DTYPES[p["dtype"]], p["layers"], p["repeat"]
    num_blocks = 2 * -(-tokens // g.block_size) + 1
    gen = torch.Generator().manual_seed(tokens)
    slots = request_slots(tokens, g.block_size, num_blocks, gen).to(device)
    layout = LAYOUTS[name](g)
    caches = make_caches(name, g, layers, num_blocks, dtype, device)
    shape = layout.layers_shape(layers, tokens)
    # A cheap pattern, not randn (which was ~15% of the bench's own py-spy samples):
    # 1021 is prime, so a misplaced row still fails the check below.
    src = (torch.arange(math.prod(shape), dtype=torch.int32) % 1021).to(dtype).view(shape).to(device)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()

    buffers = GatherBuffers(max_bytes=2 * nbytes)

    def gather():
        buffers.start_step()
        out = layout.gather_layers(caches, slots, out=buffers.take(shape, caches[0]))
        _sync(device)
        return out

    def gather_fresh():
        layout.gather_layers(caches, slots)
        _sync(device)

    def scatter():
        layout.scatter_layers(caches, slots, src)
        _sync(device)

    def memcpy():
        dst.copy_(src)
        _sync(device)

    scatter()  # warm-up, and a correctness check: what goes in must come back out
    if not torch.equal(gather(), src):
        raise RuntimeError(f"{name}: gather after scatter returned other data ({tokens} tokens)")
    times = best_interleaved({"memcpy_s": memcpy, "gather_s": gather, "scatter_s": scatter,
                              "gather_fresh_s": gather_fresh}, repeat)
    progress(f"layout {name} {tokens} tokens: gather {times['gather_s'] * 1e3:.1f} ms, "
             f"scatter {times['scatter_s'] * 1e3:.1f} ms, memcpy {times['memcpy_s'] * 1e3:.1f} ms")
    return {"layout": name, "tokens": tokens, "bytes": nbytes,
            "geometry": {"kv_heads": g.kv_heads, "head_size": g.head_size}, **times,
            "gather_gbps": gbps(nbytes, times["gather_s"]),
            "scatter_gbps": gbps(nbytes, times["scatter_s"]),
            "memcpy_gbps": gbps(nbytes, times["memcpy_s"]),
            "ratios": {"gather_vs_memcpy": speed_ratio(times["memcpy_s"], times["gather_s"]),
                       "scatter_vs_memcpy": speed_ratio(times["memcpy_s"], times["scatter_s"])}}


def best_interleaved(fns: dict, repeat: int) -> dict[str, float]:
    """Fastest of `repeat` timed calls of each function, in rounds that call each once.

    On a shared machine a busy minute then slows every figure alike, not
    only the one measured at that moment (separate best-of-N runs gave the
    same memcpy 15 and 90 ms under load here).
    """
    best = dict.fromkeys(fns, math.inf)
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def resolve_device(wanted: str) -> torch.device:
    if wanted == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise SystemExit("device cuda: torch sees no CUDA device here")
    return torch.device(wanted)


def run(params: dict, progress: Progress) -> dict:
    """params: tokens (list), repeat, device, threads (0: torch's default), layers,
    kv_heads, head_size, block_size, dtype."""
    device = resolve_device(params.get("device", "auto"))
    if device.type == "cpu" and params.get("threads"):
        torch.set_num_threads(int(params["threads"]))
    cases = [bench_one(name, int(t), params, device, progress)
             for name in LAYOUTS for t in params["tokens"]]
    return {"device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "shape": {k: params[k] for k in ("layers", "kv_heads", "head_size", "block_size", "dtype")},
            "cases": cases}


if __name__ == "__main__":
    sys.exit(rig_main(run, sys.argv))
