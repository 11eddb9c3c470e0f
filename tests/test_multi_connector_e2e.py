"""MultiConnectorV0 end to end in real vLLM V0 CPU servers.

P = MultiConnectorV0 kv_both with five children, in this order:
  0 ProbeConnector      logs the ids/sums of what it is handed
  1 FSConnector         kv_producer, transfer=true, the shared store (P -> D)
  2 RaisingConnector    kv_both, raises in send, recv and close
  3 FSConnector         kv_both, a P-local offload dir
  4 ProbeConnector      must see exactly what child 0 saw
D = FSConnector kv_consumer on the shared store.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from e2e_helpers import cluster_for_module, redo_lines_for, skip_line_for

from connectors.store import format as fmt
from kvctl.verify import markers
from kvctl.client import user_messages

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("vllm")]

TESTS_DIR = Path(__file__).resolve().parent
PROBE_RE = re.compile(r"probe (?P<name>\w+) send: (?P<seen>.*)$", re.M)


def fs_child(role: str, path: str, transfer: bool = False) -> dict:
    extra = {"fs_storage_path": path}
    if transfer:
        extra["transfer"] = True
    return {"kv_connector": "FSConnector", "kv_role": role, "kv_connector_extra_config": extra}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, shared_dir, rig_python, tiny_model):
    offload = tmp_path_factory.mktemp("offload")
    store = tmp_path_factory.mktemp("shared-store")
    prefill = {"kv_connector": "MultiConnectorV0", "kv_role": "kv_both",
               "kv_connector_extra_config": {"connectors": [
                   {"kv_connector": "ProbeConnector", "kv_role": "kv_producer",
                    "kv_connector_extra_config": {"probe": "first"}},
                   fs_child("kv_producer", str(store), transfer=True),
                   {"kv_connector": "RaisingConnector", "kv_role": "kv_both"},
                   fs_child("kv_both", str(offload)),
                   {"kv_connector": "ProbeConnector", "kv_role": "kv_producer",
                    "kv_connector_extra_config": {"probe": "last"}},
               ]}}
    env = {"KVCTL_EXTRA_CONNECTORS": "ProbeConnector=fault_connectors:ProbeConnector;"
                                     "RaisingConnector=fault_connectors:RaisingConnector",
           "PYTHONPATH": str(TESTS_DIR)}
    with cluster_for_module(tmp_path_factory, shared_dir, rig_python, tiny_model, "multi-e2e",
                            store=store, prefill_config=prefill, prefill_env=env,
                            decode_config=fs_child("kv_consumer", str(store))) as c:
        c.offload = offload
        yield c


PROMPTS = ["Hello, how are you?", "Write a haiku about disaggregated prefill and decode.",
           "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. 海の歌"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_transfer_and_offload_children_both_store_and_decode_matches(cluster, prompt):
    msgs = user_messages(prompt)
    tokens = cluster.p.tokenize_chat(msgs)
    # Baseline first: P's first sight of this prompt is a real forward pass.
    baseline = cluster.p.chat(msgs, max_tokens=12)
    key = cluster._key_for(tokens)
    assert key, "transfer child published no entry for the prompt"
    for root in (cluster.store, cluster.offload):
        header, data = fmt.read_entry(fmt.entry_path(root, key))
        assert fmt.token_ids_of(header, data) == tokens
    p_log = cluster.log("prefill")
    sent = {(s.child, s.name) for s in markers.child_sends(p_log)}
    assert {(0, "ProbeConnector"), (1, "FSConnector"), (3, "FSConnector"),
            (4, "ProbeConnector")} <= sent

    decoded = cluster.d.chat(msgs, max_tokens=12)
    assert cluster.wait_for("decode", lambda t: skip_line_for(t, key))
    assert not redo_lines_for(cluster.log("decode"), key)
    assert decoded.token_ids == baseline.token_ids


def test_failing_child_never_fails_the_request(cluster):
    """RaisingConnector raises in send and recv: logged with its name, request still served."""
    msgs = user_messages("Requests survive a broken child connector.")
    served = cluster.p.chat(msgs, max_tokens=4)
    assert served.token_ids and len(served.token_ids) == 4
    p_log = cluster.wait_for("prefill", lambda t: "child 2 RaisingConnector failed in send" in t and t)
    assert p_log, "the raising child's send failure was not logged"
    assert "child 2 RaisingConnector failed in recv_kv_caches_and_hidden_states: RuntimeError: " \
           "injected recv failure" in p_log
    assert not [s for s in markers.child_sends(p_log) if s.child == 2]


def test_second_request_served_by_offload_child_and_still_transferred(cluster):
    prompt = "A prompt P sees twice: the second prefill comes from its own offload store."
    msgs = user_messages(prompt)
    tokens = cluster.p.tokenize_chat(msgs)
    first = cluster.p.chat(msgs, max_tokens=8)
    key = cluster._key_for(tokens)
    transfer_entry = fmt.entry_path(cluster.store, key)
    transfer_entry.unlink()  # the transfer child must publish again on the second request

    second = cluster.p.chat(msgs, max_tokens=8)
    served = cluster.wait_for("prefill", lambda t: skip_line_for(t, key))
    assert served, "P did not skip its own forward on the second request"
    assert "received from connector FSConnector (child 3 FSConnector, skip forward)" in cluster.log("prefill")
    assert cluster.wait_for("prefill", lambda t: transfer_entry.exists(), timeout=10)
    header, data = fmt.read_entry(transfer_entry)
    assert fmt.token_ids_of(header, data) == tokens  # keyed on the full prompt
    assert second.token_ids == first.token_ids
    decoded = cluster.d.chat(msgs, max_tokens=8)
    assert decoded.token_ids == first.token_ids


def test_children_see_the_same_unmutated_objects(cluster):
    """Probe 0 runs before the FS and raising children, probe 4 after: same ids, same sums."""
    cluster.p.chat(user_messages("Probe the objects each child is handed."), max_tokens=1)
    text = cluster.log("prefill")
    first = [m.group("seen") for m in PROBE_RE.finditer(text) if m.group("name") == "first"]
    last = [m.group("seen") for m in PROBE_RE.finditer(text) if m.group("name") == "last"]
    assert first and len(first) == len(last)
    assert first == last
