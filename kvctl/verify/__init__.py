"""Proof that KV travelled and the answer is right.

    markers.py    the log lines operators grep for, parsed into events (pure)
    verifier.py   the four checks per request, the cluster verifier and its report
    load_mode.py  verify under concurrency
    junit.py      JUnit XML from verify reports

May import: `kvctl.client`, `kvctl.cluster`, `connectors.store`, `connectors.config`.
"""
