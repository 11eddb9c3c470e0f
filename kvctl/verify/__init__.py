"""Proof that KV travelled and the answer is right: checks, the one driver, reports.

    markers.py       the log lines operators grep for (connectors.log_lines), parsed into events (pure)
    checks.py        the four checks per request and their evidence (log text, store files, outputs);
                     `not_observable` for a check whose evidence is out of reach
    report.py        RequestReport and VerifyReport: `kvctl verify --json`'s contract, and
                     `require` (all | observable): what a check not observable does to the verdict;
                     which instance served each request, and `pool_verdict`: a pool member
                     that served none fails the run
    log_files.py     reading an instance's log (or a pool's logs) from an offset; waiting for a
                     line; `capturing_logs` runs attached instances' `cmd:` log sources meanwhile
    cluster_info.py  what verify needs from a cluster's state (URLs, logs, configs, store), with
                     what is not observable (no log source, store not visible) and why
    children.py      each connector's own evidence per request on a multi connector cluster:
                     P's transfer send, P's offload child (LMCache's Stored/Retrieved, or an FS
                     child's entry in its own dir beside NIXL), D's load (pure)
    nixl.py          NIXL's evidence per request: vLLM's own NixlConnector and scheduler lines,
                     found by the request id, and the four checks as they read for NIXL (pure)
    metrics.py       NIXL evidence from /metrics deltas around a request, where an instance's
                     log is out of reach (attached clusters) (pure)
    prompts.py       the default prompts, prompts files, the empty-prompt check
    verifier.py      the driver: ClusterVerifier (per-request steps, direct or through the
                     endpoint, whose X-Kvctl-* headers say whose logs to read) and run_verify,
                     the one loop over prompts (concurrency, keep going, expected send
                     children, require)
    load_mode.py     verify under load: generated prompts, throughput and latency figures
    junit.py         the one JUnit writer: verify's file, and the parts scenario's adds to

May import: `kvctl.client`, `kvctl.cluster` (state only), `kvctl.router` (its bodies and
headers), `kvctl.signals`, `kvctl.errors`, `kvctl.paths`,
`connectors.store`, `connectors.config`, `connectors.log_lines`. Never a command, a view or another front end.
Library code: nothing here prints; errors name fields (`max_tokens`), never CLI flags.
"""
