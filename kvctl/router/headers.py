"""The HTTP headers the router adds to each answer: what a client (kvctl verify) reads back; pure."""

REQUEST_ID = "X-Request-Id"  # the client's, or a new one; P and D get the same
PREFILL_HEADER = "X-Kvctl-Prefill"  # the prefill instance's name
DECODE_HEADER = "X-Kvctl-Decode"  # the decode instance's name
PREFILL_MS_HEADER = "X-Kvctl-Prefill-Ms"  # P's part in milliseconds (sent to P until P's answer was read)
