"""Point vLLM 0.9.2's V0 LMCacheConnector at LMCache >= 0.3's module names.

vLLM 0.9.2 imports `lmcache.experimental.cache_engine`; LMCache renamed
`lmcache.experimental` to `lmcache.v1` in 0.3.0 (its docker/patch replaces the
whole file for the same reason). Only that import is rewritten. Exits non-zero
when the file is missing or has neither the old nor the new import, so an
unexpected vLLM fails the image build instead of failing at serve time.
Finds the file without importing vLLM (no GPU needed at build time).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

OLD = "lmcache.experimental.cache_engine"
NEW = "lmcache.v1.cache_engine"
REL = Path("distributed/kv_transfer/kv_connector/lmcache_connector.py")


def main() -> int:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        print("patch-vllm-lmcache: vllm is not installed in this python", file=sys.stderr)
        return 1
    path = Path(next(iter(spec.submodule_search_locations))) / REL
    try:
        text = path.read_text()
    except OSError as e:
        print(f"patch-vllm-lmcache: cannot read {path}: {e}", file=sys.stderr)
        return 1
    if OLD in text:
        path.write_text(text.replace(OLD, NEW))
        print(f"patch-vllm-lmcache: {path}: {OLD} -> {NEW}")
    elif NEW in text:
        print(f"patch-vllm-lmcache: {path} already imports {NEW}")
    else:
        print(f"patch-vllm-lmcache: {path} imports neither {OLD} nor {NEW}; "
              "is this vLLM 0.9.x?", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
