"""The connectors' log lines: the templates they log and the patterns that read them back.

Operators grep these substrings and kvctl's verify and benches parse them
(kvctl.verify.markers), so each line's text lives here once. The templates are
`logging` format strings (the connectors pass their arguments lazily); the
patterns search, not match: a line may carry any prefix (log level, time,
docker timestamps). Standard library only: kvctl imports this without torch.

    P  [rank0]: KV send DONE. key=<32 hex> tokens=<T> bytes=<n> ms=<f> gather_ms=<f>
    P  [rank0]: KV send DROPPED. key=<hex> tokens=<T> reason=<why> (serving continues; nothing published)
    P  sent to connector <Name> (child <i>, <ms> ms)                  (MultiConnectorV0)
    PD FSConnector store keys: signing with <id>; accepting <id>[, <id>...]   (or: none (...))
    P  [rank0]: child <i> <Name> failed in send_kv_caches_and_hidden_states: <error>
    D  [rank0]: Successfully received all KVs and hidden states, skip model forwarding. keys=<hex>[,<hex>...] tokens=.. bytes=.. ms=..
    D  [rank0]: Failed to receive all KVs and hidden states, redo model forwarding. reason=<text>
    D  [rank0]: KV load DONE. req=<id> key=<hex> prompt_tokens=<T> loaded=<n> computed=<c> prefix_cached=<p> bytes=<n> ms=<f>
    D  [rank0]: KV load NONE. req=<id> key=<hex> prompt_tokens=<T> loaded=0 computed=<c> prefix_cached=<p> reason=<why>
    D  [rank0]: KV load FAILED. req=<id> key=<hex> ... reason=<why>
    D  [rank0]: KV load WAITED. req=<id> key=<hex> waited_ms=<f> for its save under way: <how it ended>

The V1 FSConnector logs the KV load lines (once per request on D) and never the
skip/redo lines (D always computes at least the last prompt token). The
upstream V0 connectors print the send/skip/redo phrases without the key=value
tail; the patterns accept both. vLLM's own `Received request <id>: prompt: ...`
is read too (RECEIVED), and so is LMCache's server (`lmcache server`, multi-process
mode), per store or retrieve of whole chunks, in lines that name no request:

    LMCache INFO: Stored <N> tokens in <s> seconds
    LMCache INFO: Retrieved <N> tokens in <s> seconds   (LMCACHE_RE)
"""

from __future__ import annotations

import re

# The phrases operators grep for (and verify's evidence quotes).
KV_SEND_PHRASE = "KV send DONE."
SKIP_PHRASE = "Successfully received all KVs and hidden states, skip model forwarding"
REDO_PHRASE = "Failed to receive all KVs and hidden states, redo model forwarding"
SEND_METHOD = "send_kv_caches_and_hidden_states"
RECV_METHOD = "recv_kv_caches_and_hidden_states"

_RANK = "[rank%d]: "

# --- templates (logging format strings) ---------------------------------------------------

# P: one prompt's KV published (rank, key, tokens, bytes, ms, gather_ms) ...
KV_SEND = _RANK + KV_SEND_PHRASE + " key=%s tokens=%d bytes=%d ms=%.1f gather_ms=%.1f"
# ... or found already stored (rank, key, tokens).
KV_SEND_STORED = _RANK + KV_SEND_PHRASE + " key=%s tokens=%d bytes=0 ms=0.0 (already stored)"
# P: a save given up on: the store did not answer within the deadline, or is stalled (rank, key, tokens, reason).
KV_SEND_DROPPED = _RANK + "KV send DROPPED. key=%s tokens=%d reason=%s (serving continues; nothing published)"
# P: a publish failed (rank, key, error, "; N similar failures not logged" or "").
KV_SEND_FAILED = _RANK + "KV send FAILED for key=%s: %s (serving continues; nothing published)%s"
# P: what was not published, and why: a whole step (rank, problem), one request (rank,
# request, tokens, refusal), a step short of hidden rows (rank, key, rows, step tokens).
KV_NOT_SENT = _RANK + "KV not sent: %s"
KV_NOT_SENT_REQUEST = _RANK + "KV not sent for request %s (%d tokens): %s"
KV_NOT_SENT_HIDDEN = _RANK + "KV not sent for key=%s: %d hidden rows for a step of %d tokens"
# V0 D: every prefill of the step served from the store (rank, keys, tokens, bytes, ms, load_ms, scatter_ms).
SKIP_FORWARD = (_RANK + SKIP_PHRASE + ". keys=%s tokens=%d bytes=%d ms=%.1f load_ms=%.1f "
                "scatter_ms=%.1f")
# V0 D: the step recomputes (rank, reason).
REDO_FORWARD = _RANK + REDO_PHRASE + ". reason=%s"
# V1 D, one per request: (rank, req, key, prompt_tokens, loaded, computed, prefix_cached, bytes, ms).
KV_LOAD_DONE = (_RANK + "KV load DONE. req=%s key=%s prompt_tokens=%d loaded=%d computed=%d "
                "prefix_cached=%d bytes=%d ms=%.1f")
# (rank, req, key, prompt_tokens, computed, prefix_cached, reason)
KV_LOAD_NONE = (_RANK + "KV load NONE. req=%s key=%s prompt_tokens=%d loaded=0 computed=%d "
                "prefix_cached=%d reason=%s")
# The scheduler waited for an entry whose save was under way (a pending marker): (rank, req, key, ms, how
# it ended).
KV_LOAD_WAITED = _RANK + "KV load WAITED. req=%s key=%s waited_ms=%.1f for its save under way: %s"
# (rank, req, key, prompt_tokens, computed, prefix_cached, reason, failed blocks)
KV_LOAD_FAILED = (_RANK + "KV load FAILED. req=%s key=%s prompt_tokens=%d loaded=0 computed=%d "
                  "prefix_cached=%d reason=%s; %d blocks reported to vLLM as failed "
                  "(kv_load_failure_policy decides)")
# MultiConnectorV0 P: one child's send of a step (name, index, ms) ...
# P and D at start-up: which store key signs and which are accepted (key ids only, never a key).
STORE_KEYS = "FSConnector store keys: %s"
CHILD_SENT = "sent to connector %s (child %d, %.1f ms)"
# ... or its failure (rank, index, name, error); CHILD_RECV_FAILED on D.
CHILD_SEND_FAILED = _RANK + "child %d %s failed in " + SEND_METHOD + ": %s"
CHILD_RECV_FAILED = _RANK + "child %d %s failed in " + RECV_METHOD + ": %s"
# MultiConnectorV0 D: the child whose answer the step takes (rank, name, index, name, what).
CHILD_RECEIVED = _RANK + "received from connector %s (child %d %s, %s)"

# --- patterns ------------------------------------------------------------------------------

_RANK_RE = r"\[rank(?P<rank>\d+)\]: "
KV_SEND_RE = re.compile(_RANK_RE + re.escape(KV_SEND_PHRASE) + r"(?P<rest>.*)$")
SKIP_FORWARD_RE = re.compile(_RANK_RE + re.escape(SKIP_PHRASE) + r"\.?(?P<rest>.*)$")
REDO_FORWARD_RE = re.compile(_RANK_RE + re.escape(REDO_PHRASE) + r"\.?(?P<rest>.*)$")
KV_LOAD_RE = re.compile(_RANK_RE + r"KV load (?P<outcome>DONE|NONE|FAILED)\.(?P<rest>.*)$")
CHILD_SENT_RE = re.compile(
    r"sent to connector (?P<name>[\w.]+)(?: \(child (?P<child>\d+), (?P<ms>[\d.]+) ms\))?")
CHILD_SEND_FAILED_RE = re.compile(
    r"child (?P<child>\d+) (?P<name>[\w.]+) failed in " + SEND_METHOD + r": (?P<error>.*)$")
RECEIVED_RE = re.compile(r"Received request (?P<id>[\w-]+): prompt: ")
FIELD_RE = re.compile(r"(\w+)=(\S+)")  # the key=value tail
# LMCache 0.5.6's server (engine_driven_transfer.py), on its own log; "Stored N Q tokens" is another line.
LMCACHE_STORED = "Stored"
LMCACHE_RETRIEVED = "Retrieved"
LMCACHE_RE = re.compile(r"\b(?P<what>Stored|Retrieved) (?P<tokens>\d+) tokens in (?P<seconds>[\d.]+) seconds")
