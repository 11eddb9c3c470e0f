"""MultiConnectorV0 gathers a request's KV once for all its FS children (runs in the rig).

Two real FSConnectors on two real stores under one MultiConnectorV0, and a
non-FS child between them: the paged caches are gathered once per request,
the non-FS child still gets the paged caches through the V0 API, and both
entries are byte for byte the entry a single FSConnector publishes alone.
"""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import torch
import vllm  # noqa: F401  (runs in the rig; a missing vLLM must fail, not skip)

from connectors.store.deadline import StoreCallPool
from connectors.logs import SendFailureLog
from connectors.store import format as fmt
from connectors.store.fs_store import FSStore
from connectors.v0.fs_connector import FSConnector
from connectors.v0.kv_layout import CacheGeometry, PagedAttentionLayout
from connectors.v0.multi_connector import Child, MultiConnectorV0

G = CacheGeometry(block_size=16, kv_heads=2, head_size=32)
LAYERS, BLOCKS, HIDDEN = 3, 16, 64
IDENT = fmt.KVIdentity(model="m;dtype=float32", num_layers=LAYERS, kv_parts=2, kv_heads=2,
                       head_size=32, dtype="F32")
PROMPTS = [list(range(100, 137)), list(range(300, 316))]  # 37 tokens (2 blocks + 5), one whole block


def model_input(prompts):
    """Two prefills whose slots come from a shuffled block table, as a real step's."""
    table = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(7)).tolist()
    slots, next_block = [], 0
    for p in prompts:
        blocks = table[next_block:next_block + -(-len(p) // 16)]
        next_block += len(blocks)
        slots += [blocks[i // 16] * 16 + i % 16 for i in range(len(p))]
    tokens = [t for p in prompts for t in p]
    meta = SimpleNamespace(seq_lens=[len(p) for p in prompts], num_prefills=len(prompts),
                           num_prefill_tokens=len(tokens), num_decode_tokens=0,
                           slot_mapping=torch.tensor(slots, dtype=torch.long))
    return SimpleNamespace(input_tokens=torch.tensor(tokens), attn_metadata=meta,
                           sampling_metadata=SimpleNamespace(seq_groups=[]))


def fs_connector(root) -> FSConnector:
    """A bound FSConnector (producer) on a real store, without a vLLM config."""
    root.mkdir()
    c = FSConnector.__new__(FSConnector)
    c._io = StoreCallPool("fs-store-io", 2, 5.0)  # what __init__ sets up (store_timeout_ms)
    c.rank, c.store, c.num_layers, c.geometry = 0, FSStore(root), LAYERS, G
    c.hidden_size, c.hidden_dtype = HIDDEN, torch.float32
    c._identity, c._layout = IDENT, PagedAttentionLayout(G)
    c._send_failures = SendFailureLog(logging.getLogger("vllm.kvctl.fs_connector"))
    return c


class PagedChild:
    """A non-FS child: records what it was handed."""

    def __init__(self):
        self.seen = []

    def send_kv_caches_and_hidden_states(self, model_executable, model_input, kv_caches, hidden):
        self.seen.append(kv_caches)

    def close(self):
        pass


def caches():
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(PagedAttentionLayout.cache_shape(BLOCKS, G), generator=gen) for _ in range(LAYERS)]


def hidden_for(mi):
    return torch.arange(mi.input_tokens.numel() * HIDDEN, dtype=torch.float32).view(-1, HIDDEN)


@pytest.fixture
def gathers(monkeypatch):
    """Count gather_layers calls (every FS child's gather goes through it)."""
    calls = []
    for cls in {c for c in PagedAttentionLayout.__mro__ if "gather_layers" in c.__dict__}:
        real = cls.__dict__["gather_layers"]

        def counting(self, caches, slots, out=None, _real=real):
            calls.append(slots.numel())
            return _real(self, caches, slots, out=out)

        monkeypatch.setattr(cls, "gather_layers", counting)
    return calls


def entry_bytes(store_root, prompt) -> bytes:
    """The entry file's bytes, but for its creation time (the only field two saves may differ in)."""
    data = fmt.entry_path(store_root, fmt.compute_key(IDENT, prompt)).read_bytes()
    return re.sub(rb'"created":"[0-9.]+"', b'"created":"0"', data, count=1)


def test_two_fs_children_share_one_gather_and_publish_what_one_child_alone_publishes(tmp_path, gathers, caplog):
    mi, kv, hidden = model_input(PROMPTS), caches(), None
    hidden = hidden_for(mi)
    before = [c.clone() for c in kv]

    alone = fs_connector(tmp_path / "alone")
    alone.send_kv_caches_and_hidden_states(None, mi, kv, hidden)
    assert gathers == [37, 16]  # one per request
    gathers.clear()

    a, b, other = fs_connector(tmp_path / "a"), fs_connector(tmp_path / "b"), PagedChild()
    multi = MultiConnectorV0.__new__(MultiConnectorV0)
    multi.rank = 0
    multi._use_children([Child(0, "FSConnector", a, True, False, True),
                         Child(1, "PagedChild", other, True, False, False),
                         Child(2, "FSConnector", b, True, False, False)])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.kvctl"):
        multi.send_kv_caches_and_hidden_states(None, mi, kv, hidden)

    assert gathers == [37, 16]  # once per request for both FS children
    assert other.seen == [kv]  # the non-FS child gets the paged caches themselves
    for prompt in PROMPTS:
        want = entry_bytes(tmp_path / "alone", prompt)
        assert entry_bytes(tmp_path / "a", prompt) == want
        assert entry_bytes(tmp_path / "b", prompt) == want
    assert all(torch.equal(x, y) for x, y in zip(kv, before))  # sends never write the caches
    # Each child still logs its own sends, and the multi connector each child's whole send.
    assert caplog.text.count("KV send DONE") == 4
    for i, name in ((0, "FSConnector"), (1, "PagedChild"), (2, "FSConnector")):
        assert f"sent to connector {name} (child {i}," in caplog.text
    assert a.shared_gathers is None and b.shared_gathers is None  # only for the step

    # The next step gathers again (nothing is served from the last step's tensors).
    again = model_input([list(range(500, 540))])
    multi.send_kv_caches_and_hidden_states(None, again, kv, hidden_for(again))
    assert gathers == [37, 16, 40]
    assert entry_bytes(tmp_path / "a", list(range(500, 540))) == entry_bytes(tmp_path / "b", list(range(500, 540)))


def test_a_child_that_already_has_the_entry_leaves_the_gather_to_the_next(tmp_path, gathers):
    mi, kv = model_input(PROMPTS[:1]), caches()
    a, b = fs_connector(tmp_path / "a"), fs_connector(tmp_path / "b")
    a.send_kv_caches_and_hidden_states(None, mi, kv, hidden_for(mi))
    gathers.clear()
    multi = MultiConnectorV0.__new__(MultiConnectorV0)
    multi.rank = 0
    multi._use_children([Child(0, "FSConnector", a, True, False, True),
                         Child(1, "FSConnector", b, True, False, False)])
    multi.send_kv_caches_and_hidden_states(None, mi, kv, hidden_for(mi))
    assert gathers == [37]
    assert entry_bytes(tmp_path / "a", PROMPTS[0]) == entry_bytes(tmp_path / "b", PROMPTS[0])


def test_consumer_loads_each_layer_straight_into_its_paged_cache(tmp_path):
    """D's side of the same entries: FSStore.load_into scatters layer by layer; a damaged entry recomputes."""
    mi, kv = model_input(PROMPTS), caches()
    producer = fs_connector(tmp_path / "store")
    producer.send_kv_caches_and_hidden_states(None, mi, kv, hidden_for(mi))
    consumer = fs_connector(tmp_path / "d")
    consumer.store = producer.store
    target = [torch.zeros_like(c) for c in kv]
    hidden, bypass, _ = consumer.recv_kv_caches_and_hidden_states(None, mi, target)
    assert bypass is True
    slots = mi.attn_metadata.slot_mapping
    layout = PagedAttentionLayout(G)
    assert torch.equal(layout.gather_layers(target, slots), layout.gather_layers(kv, slots))
    want = hidden_for(mi)
    assert torch.equal(hidden[36], want[36]) and torch.equal(hidden[52], want[52])
    # Flip one KV byte of the second entry: the checksum catches it after the first
    # request was written; the step recomputes and the entry is removed.
    path = fmt.entry_path(tmp_path / "store", fmt.compute_key(IDENT, PROMPTS[1]))
    data = bytearray(path.read_bytes())
    data[-HIDDEN * 4 - 5] ^= 0xFF
    path.write_bytes(bytes(data))
    hidden, bypass, _ = consumer.recv_kv_caches_and_hidden_states(None, mi, [torch.zeros_like(c) for c in kv])
    assert (hidden, bypass) == (None, False)
    assert not path.exists()
