"""Kubernetes: render a P/D deployment's manifests, and check them against the official client.

    render.py  K8sSpec -> RenderedDeployment: per P/D instance a one-pod Deployment
               (Recreate) and a Service, both NAME-prefill-0, ... (stable names for the
               router's URLs and `kubectl logs deploy/...`; why not LeaderWorkerSets: its
               docstring), the router's Deployment and Service, a ReadWriteMany claim for
               the store, and the attach file (`kvctl attach --from-k8s DIR`) with
               `kubectl logs` sources; `write_rendered`
    check.py   each manifest loaded into the `kubernetes` client's models and compared with
               what they serialize back to (field names and types); the client is the
               optional `k8s` extra and is imported only there

The vLLM command line and environment come from kvctl.runtime.base, as for the
local and docker runtimes, so a pod runs the same server a container would.

May import: `kvctl.runtime.base` (the server command line), `kvctl.scenario.schema`
(the roles' configs, args and env), `kvctl.attach.file`, `kvctl.cluster.nixl` (NIXL's
per-instance settings), `kvctl.cluster.lmcache` (the LMCache server's command line), `connectors.config`, `kvctl.errors`. Never a command or a view. Nothing here talks to a cluster.
"""
