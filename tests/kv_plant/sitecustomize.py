"""A KV plant for tests/test_real_model_e2e.py, loaded as `sitecustomize` by a V0 P server
whose PYTHONPATH holds this directory (after kvctl's overlay, before the rig's packages).

It changes nothing until vLLM imports the real FSConnector; then it wraps two of its steps.
What they do is read at every send from the file $KVCTL_KV_PLANT names (the test switches it
while the server runs):

    noise   each entry's V (part 1 of every layer) gets Gaussian noise of NOISE_STD times
            V's own standard deviation, after the gather and before the entry is checksummed
            and signed: a valid, signed entry holding wrong KV
    drop    each entry is published and P logs its send as usual, then the entry is removed:
            D never receives it
    other, or no file: the unchanged FSConnector

Each planted entry prints one `kv plant: ...` line to the server's log, so a test can tell
that the plant ran (an entry already in the store is not gathered again: no plant then).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

TARGET = "connectors.v0.fs_connector"
MODE_ENV = "KVCTL_KV_PLANT"
NOISE_STD = 2.0  # times the std of the V being sent


def _mode() -> str:
    path = os.environ.get(MODE_ENV)
    try:
        with open(path or "", encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


def _patch(module) -> None:
    import torch

    connector = module.FSConnector
    store_cls = module.FSStore
    gather, save = connector._gather, store_cls.save
    seed = [0]

    def noisy_gather(self, layout, kv_caches, slots):
        kv = gather(self, layout, kv_caches, slots)
        if _mode() == "noise":
            v = kv[:, 1]  # [layers, kv_parts, tokens, heads, head_size]: part 1 is V
            seed[0] += 1
            noise = torch.randn(v.shape, generator=torch.Generator().manual_seed(seed[0]))
            v.add_((noise * NOISE_STD * v.float().std()).to(v.dtype))
            print(f"kv plant: noise added to V of {v.shape[2]} tokens", file=sys.stderr, flush=True)
        return kv

    def dropping_save(self, identity, token_ids, kv, hidden):
        result = save(self, identity, token_ids, kv, hidden)
        if _mode() == "drop":
            os.unlink(result.path)
            print(f"kv plant: dropped entry {result.key}", file=sys.stderr, flush=True)
        return result

    connector._gather = noisy_gather
    store_cls.save = dropping_save
    print("kv plant: FSConnector patched", file=sys.stderr, flush=True)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the real module, then patches it right after it runs (once)."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchOnImport())
