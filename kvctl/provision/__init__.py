"""Environment setup: what must exist before a cluster can run.

    rig.py         the vLLM CPU rig (a venv under $KVCTL_HOME keyed by its inputs);
                   `digest`, the content key rig steps and image tags share
    elf_patch.py   the libstdc++ symbol-version patch the rig may need
    images.py      docker images (CPU image from a debootstrapped base, GPU image)
    tiny_model.py  the random-weight Llama and offline tokenizer

Commands run through `kvctl.subprocesses.run_streamed` (one runner, one tail).
rig.py and elf_patch.py use the standard library only: docker/rig-install.py
runs them in an image build's bare python (Dockerfile.cpu copies them, with
kvctl/__init__.py, errors.py, paths.py and subprocesses.py).

May import: `kvctl.errors`, `kvctl.paths`, `kvctl.subprocesses`, and (images.py)
`kvctl.runtime.docker_engine` for the engine connection. Never a runtime, the
cluster, a command or a view.
"""
