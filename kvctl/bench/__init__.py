"""`kvctl bench`: how fast the store and the transfer are, measured side by side.

Modules:

    common.py   no torch: timing, bench dirs, machine info, running a module in the rig
    store.py    runs in the rig (torch): our store vs raw file I/O and the peers' formats
    layout.py   runs in the rig (torch): gather/scatter through the paged layouts vs memcpy
    ttft.py     no torch: real vLLM servers, decode TTFT with KV loaded vs recomputed
    report.py   no torch: the result object (ratios, goals) and the README markdown table
    suite.py    the entry points the CLI calls: run_store / run_layout / run_ttft / run_all
    serve.py    no torch: `vllm bench serve` (a subprocess) against the P/D endpoint and a
                plain vLLM server, side by side; the store fraction from D's logs
    faults.py   no torch: kill -9 one instance of a pool under load through the router
                (failed requests, recovery time, wrong answers); `kvctl bench faults`

The rich tables are kvctl.views.bench; only the rig-side entry points print (their JSON).

The rig-side modules print one JSON object on stdout when run as
`python -m kvctl.bench.<name> '<params json>'`; kvctl itself never imports
torch. Machines here are noisy, so every result leads with ratios of figures
measured in the same run. Throughput ratios are `ours / baseline` (times:
`baseline_s / ours_s`): above 1 means ours is faster. Ratios of times (TTFT,
multi overhead) say so in their name's definition: lower is better. A
headline ratio is the worst case over the sizes measured; `ratios_by_size`
has each size.

May import: `kvctl.cluster`, `kvctl.runtime`, `kvctl.provision`, `kvctl.verify` (markers,
cluster_info, log_files, load_mode's prompts),
`kvctl.client`, `kvctl.net`, `kvctl.signals`, `kvctl.subprocesses`, `kvctl.errors`, `kvctl.paths`; store.py and
layout.py also torch, numpy, safetensors and `connectors` (they run in the rig),
and common.py is imported there too, so it stays torch-free and light. Never a
command or a view.
"""
