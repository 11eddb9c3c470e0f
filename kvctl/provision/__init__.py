"""Environment setup: what must exist before a cluster can run.

    rig.py         the vLLM CPU rig (a venv under $KVCTL_HOME keyed by its inputs)
    elf_patch.py   the libstdc++ symbol-version patch the rig may need
    images.py      docker images (CPU image from a debootstrapped base, GPU image)
    tiny_model.py  the random-weight Llama and offline tokenizer

May import: `kvctl.errors`, `kvctl.paths`. Never a runtime or a command.
"""
