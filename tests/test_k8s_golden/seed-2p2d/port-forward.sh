#!/bin/sh
# Forwards the router and every instance of 'pd' to this host, at the URLs attach.yaml names.
# Run it in its own terminal; Ctrl-C stops every forward.
set -eu
trap 'kill $(jobs -p) 2>/dev/null' INT TERM EXIT
kubectl -n serving port-forward svc/pd-router 18000:8000 &
kubectl -n serving port-forward svc/pd-prefill-0 18100:8000 &
kubectl -n serving port-forward svc/pd-prefill-1 18101:8000 &
kubectl -n serving port-forward svc/pd-decode-0 18200:8000 &
kubectl -n serving port-forward svc/pd-decode-1 18201:8000 &
wait
