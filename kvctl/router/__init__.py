"""kvctl's P/D router: one OpenAI-compatible endpoint in front of N prefill and M decode servers.

A completion request goes to a prefill instance with `max_tokens=1` (so P computes
the prompt's KV and publishes it to the store); once P has answered, the client's
original body goes, byte for byte, to a decode instance, and D's answer is relayed
to the client as it arrives. See docs/router.md.

    config.py     RouterConfig and InstanceConfig: the instances (`name=URL`), policy,
                  timeouts and intervals (all defaults in one place), validated; pure
    bodies.py     the prefill body rule and OpenAI-style error bodies; pure
    pool.py       one pool per role: health state, outstanding requests, the
                  round-robin / least-outstanding choice; pure (no I/O)
    headers.py    the headers each answer carries (request id, P, D, P's milliseconds); pure
    route_log.py  the one log line per routed request (request id, P, D, status,
                  latencies): writing it and parsing it back; pure
    metrics.py    counters and latency histograms (prometheus_client), the /metrics text; pure
    health.py     the background health checker (GET /health on every instance)
    app.py        create_app(config) -> aiohttp Application, and start_router/serve
    __main__.py   `python -m kvctl.router --prefill URL --decode URL --port N ...`: the
                  front end `kvctl router serve` (kvctl.commands.router), alone
    bench.py      the router's added latency against fake P/D servers (p50/p99;
                  `kvctl bench router`)
    fakes.py      `python -m kvctl.router.fakes PORT...`: those instant fake servers

May import: aiohttp, prometheus_client, `kvctl.errors` (`bench` also `kvctl.net`; `fakes`
typer; the `__main__` entry point `kvctl.frontend` and `kvctl.commands.router`, to run its
command). Never torch or vLLM (it runs in kvctl's light venv), never a command, a view,
the cluster, verify or scenario packages otherwise (they start and drive the router; it
knows nothing of them). Library code: nothing here prints (fakes says `ready` to its
parent); errors name fields (`prefill`, `port`), never command-line flags.
"""
