"""connectors.config.topology: which child sends, receives, carries the transfer and stores where."""

from __future__ import annotations

from seed_configs import SEED_D, SEED_P

from connectors.config.topology import (
    children,
    fs_storage_paths,
    receiving_children,
    sending_children,
    transfer_child,
    transfer_store,
)


def fs(role: str = "kv_producer", **extra) -> dict:
    return {"kv_connector": "FSConnector", "kv_role": role,
            "kv_connector_extra_config": {"fs_storage_path": "/store", **extra}}


def multi(*children, role: str = "kv_both") -> dict:
    return {"kv_connector": "MultiConnectorV0", "kv_role": role,
            "kv_connector_extra_config": {"connectors": list(children)}}


LMCACHE = {"kv_connector": "LMCacheConnector", "kv_role": "kv_both"}


def test_seed_topology():
    assert [(c.index, c.connector, c.role, c.sends, c.receives, c.transfer, c.store) for c in children(SEED_P)] == [
        (0, "FSConnector", "kv_producer", True, False, True, "fs_local_storage"),
        (1, "LMCacheConnector", "kv_both", True, True, False, None)]
    assert [c.index for c in sending_children(SEED_P)] == [0, 1]
    assert [c.index for c in receiving_children(SEED_P)] == [1]
    assert transfer_child(SEED_P, "send").index == 0 and transfer_child(SEED_P, "recv") is None
    assert children(SEED_D) == [] and sending_children({}) == []


def test_a_child_acts_by_its_own_role_gated_by_the_parents():
    cfg = multi(fs("kv_consumer"), {"kv_connector": "FSConnector"}, LMCACHE, fs("kv_producer"))
    # A child without a role does nothing: nothing is inherited (vLLM refuses it anyway).
    assert [(c.index, c.connector) for c in sending_children(cfg)] == [(2, "LMCacheConnector"), (3, "FSConnector")]
    assert [c.index for c in receiving_children(cfg)] == [0, 2]
    assert children(cfg)[1].role is None
    # The parent's role decides whether send/recv run at all.
    assert [c.index for c in sending_children(multi(LMCACHE, fs(), role="kv_consumer"))] == []
    assert [c.index for c in receiving_children(multi(LMCACHE, fs("kv_consumer"), role="kv_producer"))] == []
    assert [c.index for c in receiving_children(multi(LMCACHE, role="kv_consumer"))] == [0]


def test_malformed_children_are_skipped_with_their_index_kept():
    cfg = multi(None, "x", fs(), {"kv_connector": 3, "kv_role": ["kv_both"]})
    assert [(c.index, c.connector, c.role) for c in children(cfg)] == [(2, "FSConnector", "kv_producer"),
                                                                      (3, None, None)]
    for garbage in (None, 3, "x", {"kv_connector": "MultiConnectorV0", "kv_connector_extra_config": []},
                    {"kv_connector": "MultiConnectorV0", "kv_connector_extra_config": {"connectors": {}}}):
        assert children(garbage) == [] and transfer_store(garbage, "send") is None
        assert fs_storage_paths(garbage) == []


def test_transfer_store_picks_the_transfer_child():
    assert transfer_store(multi(fs("kv_both", fs_storage_path="/off"), fs(transfer=True)), "send") == "/store"
    assert transfer_store(multi(fs(), LMCACHE), "send") == "/store"
    assert transfer_store(multi(fs(fs_storage_path="/a"), fs(fs_storage_path="/b")), "send") is None  # ambiguous
    assert transfer_store(fs("kv_producer"), "recv") is None
    assert transfer_store(fs("kv_consumer"), "recv") == "/store"
    # Only FSConnector children carry the transfer store kvctl checks.
    marked_other = {**LMCACHE, "kv_connector_extra_config": {"transfer": True}}
    assert transfer_store(multi(fs(), marked_other), "send") == "/store"
    assert transfer_child(multi(fs(), marked_other), "send").index == 0


def test_fs_storage_paths_names_every_store():
    cfg = multi(fs(fs_storage_path="/a"), LMCACHE, fs("kv_consumer", fs_storage_path="/b"))
    assert fs_storage_paths(cfg) == ["/a", "/b"]
    assert fs_storage_paths(fs()) == ["/store"] and fs_storage_paths(SEED_D) == ["fs_local_storage"]
    assert fs_storage_paths(LMCACHE) == []
