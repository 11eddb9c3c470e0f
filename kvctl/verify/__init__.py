"""Proof that KV travelled and the answer is right: checks, the one driver, reports.

    markers.py       the log lines operators grep for, parsed into events (pure)
    checks.py        the four checks per request and their evidence (log text, store files, outputs)
    report.py        RequestReport and VerifyReport: `kvctl verify --json`'s contract
    log_files.py     reading an instance's log from an offset; waiting for a line
    cluster_info.py  what verify needs from a cluster's state (URLs, logs, configs, store)
    prompts.py       the default prompts, prompts files, the empty-prompt check
    verifier.py      the driver: ClusterVerifier (per-request steps) and run_verify, the one
                     loop over prompts (concurrency, keep going, expected send children)
    load_mode.py     verify under load: generated prompts, throughput and latency figures
    junit.py         JUnit XML from verify reports

May import: `kvctl.client`, `kvctl.cluster` (state only), `kvctl.errors`, `kvctl.paths`,
`connectors.store`, `connectors.config`. Never a command, a view or another front end.
Library code: nothing here prints; errors name fields (`max_tokens`), never CLI flags.
"""
