"""The router's kv_transfer_params handshake (NIXL), on real sockets with fake vLLM servers.

P answers as vLLM's NixlConnector does (`kv_transfer_params` naming its engine,
blocks and side channel, only when it was asked with `do_remote_decode`), so the
tests see exactly what P and D get: P the request vLLM's toy proxy sends, D the
client's request plus the params P answered with. A P answer without them is a
502 naming P; a router without the handshake (FS clusters) does what it did.
"""

from __future__ import annotations

import json

import httpx
from prometheus_client.parser import text_string_to_metric_families
import pytest

from connectors.config.topology import handshake_connector
from kvctl.cluster.router_process import router_instance
from kvctl.cluster.router_process import start_router as start_launched_router
from kvctl.net import free_ports
from kvctl.router.bodies import PREFILL_KV_TRANSFER_PARAMS, handshake_prefill_request
from test_router import MESSAGES, MODEL, aloop, make_cluster, openai, recording_client, tokens_for  # noqa: F401

EXPECTED_P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}


def nixl_prefill(engine: str, port: int):
    """What a NIXL P answers: params for D, when (and only when) asked for a remote decode."""
    def fields(body: dict, rid: str) -> dict:
        asked = body.get("kv_transfer_params") or {}
        if not asked.get("do_remote_decode"):
            return {}
        return {"kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[0, 1, 2]],
            "remote_engine_id": engine, "remote_request_id": f"cmpl-{rid}-0", "remote_host": "127.0.0.1",
            "remote_port": port, "tp_size": 1, "remote_num_tokens": 563, "transfer_mode": "pull"}}
    return fields


def nixl_cluster(make_cluster, n_prefill: int = 1, n_decode: int = 1, **cfg):
    c = make_cluster(n_prefill, n_decode, kv_transfer_params=True, **cfg)
    for i, p in enumerate(c.prefill):
        p.answer_fields = nixl_prefill(f"engine-p{i}", 5600 + i)
    return c


def test_the_prefill_params_are_vllms_toy_proxy_ones():
    assert PREFILL_KV_TRANSFER_PARAMS == EXPECTED_P_PARAMS
    body = {"model": MODEL, "prompt": "x", "max_tokens": 9, "max_completion_tokens": 9, "min_tokens": 3,
            "min_completion_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    assert handshake_prefill_request(body) == {
        "model": MODEL, "prompt": "x", "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
        "kv_transfer_params": EXPECTED_P_PARAMS}
    assert "kv_transfer_params" not in body  # the client's body is not changed


@pytest.mark.parametrize("kind", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_p_is_asked_for_params_and_d_gets_the_clients_request_with_them(make_cluster, kind, stream):
    c = nixl_cluster(make_cluster)
    client, sent = recording_client(c)
    common = dict(model=MODEL, max_tokens=6, temperature=0.7, seed=7, extra_body={"min_tokens": 2},
                  extra_headers={"X-Request-Id": f"hs-{kind}-{stream}"})
    if stream:
        common["stream_options"] = {"include_usage": True}
    if kind == "chat":
        out = client.chat.completions.create(messages=MESSAGES, stream=stream, **common)
        text = ("".join(ch.choices[0].delta.content or "" for ch in out if ch.choices) if stream
                else out.choices[0].message.content)
    else:
        out = client.completions.create(prompt="Why?", stream=stream, **common)
        text = ("".join(ch.choices[0].text for ch in out if ch.choices) if stream else out.choices[0].text)
    client_body = json.loads(sent[0])
    (p_got,), (d_got,) = c.prefill[0].completions(), c.decode[0].completions()
    expected_p = {k: v for k, v in client_body.items() if k not in ("min_tokens", "stream_options")}
    expected_p.update(max_tokens=1, stream=False, kv_transfer_params=EXPECTED_P_PARAMS)
    assert p_got.json() == expected_p
    answered = nixl_prefill("engine-p0", 5600)(p_got.json(), f"hs-{kind}-{stream}")["kv_transfer_params"]
    assert d_got.json() == {**client_body, "kv_transfer_params": answered}  # every other field as sent
    assert d_got.json()["temperature"] == 0.7
    for got in (p_got, d_got):
        assert got.headers["X-Request-Id"] == f"hs-{kind}-{stream}"
    assert text == "".join(tokens_for(client_body))  # D's answer


def test_each_decode_gets_the_params_of_the_prefill_that_served_it(make_cluster):
    c = nixl_cluster(make_cluster, 2, 2)
    client = c.client()
    heads = [client.completions.with_raw_response.create(model=MODEL, prompt=f"p{i}", max_tokens=2).headers
             for i in range(4)]
    assert [h["X-Kvctl-Prefill"] for h in heads] == ["prefill-0", "prefill-1"] * 2
    for d in c.decode:
        for got in d.completions():
            p_index = got.json()["kv_transfer_params"]["remote_engine_id"][-1]
            rid = got.headers["X-Request-Id"]
            head = next(h for h in heads if h["X-Request-Id"] == rid)
            assert head["X-Kvctl-Prefill"] == f"prefill-{p_index}"
            assert got.json()["kv_transfer_params"]["remote_request_id"] == f"cmpl-{rid}-0"


@pytest.mark.parametrize("answer", [{}, {"kv_transfer_params": None}, {"kv_transfer_params": {}}])
def test_a_prefill_answer_without_params_is_a_502_naming_p_and_d_is_never_called(make_cluster, answer):
    c = make_cluster(kv_transfer_params=True)
    c.prefill[0].answer_fields = lambda body, rid: answer
    r = httpx.post(f"{c.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3},
                   timeout=30)
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["code"] == "prefill_no_kv_transfer_params" and err["instance"] == "prefill-0"
    assert "prefill instance prefill-0" in err["message"] and "kv_transfer_params" in err["message"]
    assert r.headers["X-Kvctl-Prefill"] == "prefill-0"
    assert c.decode[0].completions() == []
    metrics = httpx.get(f"{c.url}/metrics").text
    errors = [(s.labels, s.value) for f in text_string_to_metric_families(metrics)
              if f.name == "kvctl_router_errors" for s in f.samples if s.name == "kvctl_router_errors_total"]
    assert errors == [({"role": "prefill", "instance": "prefill-0", "kind": "no_kv_transfer_params"}, 1.0)]


VLLM_500 = b'{"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}'


def _errors(url: str) -> list[tuple[dict, float]]:
    metrics = httpx.get(f"{url}/metrics").text
    return [(s.labels, s.value) for f in text_string_to_metric_families(metrics)
            if f.name == "kvctl_router_errors" for s in f.samples if s.name == "kvctl_router_errors_total"]


def test_a_decode_that_fails_after_its_prefill_died_names_the_prefill(make_cluster):
    """P answers its params and dies; D cannot pull and fails the request (vLLM's default
    kv_load_failure_policy): the 502 names P, the instance that is gone, and D."""
    c = nixl_cluster(make_cluster)
    answer = c.prefill[0].answer_fields

    def answer_then_die(body: dict, rid: str) -> dict:
        c.prefill[0].health_status = 503  # from now on P's /health fails, as a killed P's does
        return answer(body, rid)

    c.prefill[0].answer_fields = answer_then_die
    c.decode[0].status, c.decode[0].error_json = 500, VLLM_500
    r = httpx.post(f"{c.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3}, timeout=30)
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["code"] == "kv_source_down" and err["instance"] == "prefill-0"
    assert err["message"].startswith(f"prefill instance prefill-0 ({c.prefill[0].url}) is down (/health answered 503)")
    assert "decode instance decode-0 could not pull this request's KV from it" in err["message"]
    assert "Internal server error" in err["message"]  # D's own answer, quoted
    assert r.headers["X-Kvctl-Prefill"] == "prefill-0" and r.headers["X-Kvctl-Decode"] == "decode-0"
    assert ({"role": "prefill", "instance": "prefill-0", "kind": "kv_source_down"}, 1.0) in _errors(c.url)


def test_a_decode_that_fails_with_its_prefill_alive_is_named_with_the_prefill_it_pulled_from(make_cluster):
    c = nixl_cluster(make_cluster)
    c.decode[0].status, c.decode[0].error_json = 500, VLLM_500
    r = httpx.post(f"{c.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3}, timeout=30)
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["code"] == "decode_failed" and err["instance"] == "decode-0"
    assert err["message"].endswith(f"D was to pull this request's KV from prefill instance prefill-0 "
                                   f"({c.prefill[0].url}), which is healthy")
    fs = make_cluster()  # without the handshake D's failure says nothing of P
    fs.decode[0].status, fs.decode[0].error_json = 500, VLLM_500
    r = httpx.post(f"{fs.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3}, timeout=30)
    assert r.json()["error"]["code"] == "decode_failed" and "pull" not in r.json()["error"]["message"]


def test_the_api_key_is_required_and_forwarded_with_the_handshake(make_cluster):
    c = nixl_cluster(make_cluster, api_key="k-1", fake_key="k-1")
    with pytest.raises(openai.AuthenticationError):
        c.client(api_key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert c.prefill[0].completions() == []
    out = c.client(api_key="k-1").completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert out.choices[0].text
    for f in (*c.prefill, *c.decode):
        assert f.completions()[0].headers["Authorization"] == "Bearer k-1"


def test_without_the_handshake_p_gets_no_params_and_d_the_clients_bytes(make_cluster):
    """An FS cluster's router: even a P that answers params changes nothing for D."""
    c = make_cluster()
    c.prefill[0].answer_fields = lambda body, rid: {"kv_transfer_params": {"do_remote_prefill": True}}
    client, sent = recording_client(c)
    client.completions.create(model=MODEL, prompt="Why?", max_tokens=3, extra_body={"min_tokens": 2})
    assert "kv_transfer_params" not in c.prefill[0].completions()[0].json()
    assert c.prefill[0].completions()[0].json()["min_tokens"] == 1  # the FS rule: clamped, kept
    assert c.decode[0].completions()[0].body == sent[0]


def test_a_launched_router_gets_the_handshake_flag(make_cluster, tmp_path):
    fakes = make_cluster()
    fakes.prefill[0].answer_fields = nixl_prefill("engine-p0", 5600)
    record = start_launched_router({"prefill-0": ("prefill", fakes.prefill[0].url),
                                    "decode-0": ("decode", fakes.decode[0].url)}, tmp_path,
                                   free_ports(1)[0], kv_transfer_params=True)
    try:
        assert "--kv-transfer-params" in record["command"]
        r = httpx.post(f"{record['url']}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200, r.text
        assert fakes.decode[0].completions()[0].json()["kv_transfer_params"]["remote_engine_id"] == "engine-p0"
    finally:
        router_instance(record).stop(5.0)


def test_which_clusters_need_the_handshake_is_the_topologys_answer():
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}
    fs = {"kv_connector": "FSConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"fs_storage_path": "/tmp/s"}}
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_producer",
             "kv_connector_extra_config": {"connectors": [nixl, fs]}}
    assert handshake_connector(nixl) == "NixlConnector"
    assert handshake_connector(multi) == "NixlConnector"
    assert handshake_connector({**nixl, "kv_connector": "NixlPullConnector"}) == "NixlPullConnector"
    assert handshake_connector(fs) is None
    assert handshake_connector({"kv_connector": "MultiConnectorV0", "kv_role": "kv_producer",
                                "kv_connector_extra_config": {"connectors": [fs]}}) is None
    assert handshake_connector(None) is None
