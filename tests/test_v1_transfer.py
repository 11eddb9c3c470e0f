"""FSConnector (V1) decisions without vLLM or torch: KV-only identity, V0/V1 entry lookup, what is loaded and saved."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import pytest

from connectors.store import format as fmt
from connectors.v1 import transfer

ID = fmt.KVIdentity(model="files:xxh3_128:" + "ab" * 16 + ";dtype=float32", num_layers=2, kv_parts=2,
                    kv_heads=2, head_size=4, dtype="F32")
TOKENS = [1, 5, 9, 300, 7, 7, 2]


def write(root: Path, identity: fmt.KVIdentity, tokens: list[int], hidden_cols: int = 8,
          kv_fill: float = 0.5) -> Path:
    """An entry as a producer writes it (no torch): V0 stores one hidden row, V1 a [1, 0] one."""
    shape = (identity.num_layers, identity.kv_parts, len(tokens), identity.kv_heads, identity.head_size)
    count = 1
    for d in shape:
        count *= d
    blobs = {
        "token_ids": fmt.TensorBlob("I64", (len(tokens),), fmt.token_bytes(tokens)),
        "kv": fmt.TensorBlob("F32", shape, struct.pack(f"<{count}f", *([kv_fill] * count))),
        "hidden": fmt.TensorBlob("F32", (1, hidden_cols), struct.pack(f"<{hidden_cols}f", *([1.0] * hidden_cols))),
    }
    return fmt.write_entry(root, fmt.compute_key(identity, tokens), identity, blobs, fsync=False)


def test_kv_only_entries_have_their_own_key_so_a_v0_decode_never_finds_them(tmp_path):
    v1 = transfer.kv_only_identity(ID)
    assert v1.model == ID.model + ";hidden=none" and transfer.is_kv_only(v1) and not transfer.is_kv_only(ID)
    assert transfer.kv_only_identity(v1) == v1
    assert fmt.compute_key(v1, TOKENS) != fmt.compute_key(ID, TOKENS)
    write(tmp_path, v1, TOKENS, hidden_cols=0)
    # A V0 decode looks up its own identity's key: nothing there, a plain miss.
    assert not fmt.entry_path(tmp_path, fmt.compute_key(ID, TOKENS)).exists()
    # The KV-only entry is a valid entry for every tool (inspect-store, store check).
    header = fmt.verify_entry(fmt.entry_path(tmp_path, fmt.compute_key(v1, TOKENS)))
    assert header.tensors["hidden"]["shape"] == [1, 0] and header.identity == v1


def test_block_size_is_not_part_of_the_identity():
    assert "block" not in ID.canonical().decode()


def test_a_v1_reader_tries_v1_entries_first_then_v0_ones():
    own, v0 = transfer.lookup_identities(ID)
    assert (own, v0) == (transfer.kv_only_identity(ID), ID)
    assert transfer.lookup_identities(own) == (own, ID)


def test_find_entry_takes_a_v0_producers_entry(tmp_path):
    write(tmp_path, ID, TOKENS)
    check = transfer.find_entry(tmp_path, ID, TOKENS, tp_size=1)
    assert check.found and check.identity == ID and not check.kv_only
    assert check.key == fmt.compute_key(ID, TOKENS)


def test_find_entry_prefers_the_kv_only_entry(tmp_path):
    write(tmp_path, ID, TOKENS)
    write(tmp_path, transfer.kv_only_identity(ID), TOKENS, hidden_cols=0)
    check = transfer.find_entry(tmp_path, ID, TOKENS, tp_size=1)
    assert check.identity == transfer.kv_only_identity(ID) and check.kv_only


def test_a_miss_names_the_kv_only_key(tmp_path):
    check = transfer.find_entry(tmp_path, ID, TOKENS, tp_size=1)
    assert not check.found and check.reason == "miss"
    assert check.key == fmt.compute_key(transfer.kv_only_identity(ID), TOKENS) and check.kv_only


def test_a_corrupt_entry_is_reported_and_handed_back_for_removal(tmp_path):
    path = write(tmp_path, transfer.kv_only_identity(ID), TOKENS, hidden_cols=0)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in the KV: the header is fine, the checksum is not
    path.write_bytes(bytes(data))
    check = transfer.find_entry(tmp_path, ID, TOKENS, tp_size=1)
    assert not check.found and check.reason.startswith("corrupt: checksum mismatch")
    assert [e.path for e in check.corrupt] == [path] and check.kv_only


def test_a_corrupt_v1_entry_falls_back_to_a_valid_v0_entry(tmp_path):
    path = write(tmp_path, transfer.kv_only_identity(ID), TOKENS, hidden_cols=0)
    path.write_bytes(path.read_bytes()[:-4])  # truncated
    write(tmp_path, ID, TOKENS)
    check = transfer.find_entry(tmp_path, ID, TOKENS, tp_size=1)
    assert check.found and check.identity == ID and len(check.corrupt) == 1


def test_other_tokens_under_the_prompts_key_are_never_served(tmp_path):
    other = [1, 5, 9, 300, 7, 7, 3]
    src = write(tmp_path, ID, other)
    src.rename(fmt.entry_path(tmp_path, fmt.compute_key(ID, TOKENS)))  # as if the keys collided
    check = transfer.find_entry(tmp_path, ID, TOKENS, tp_size=1)
    assert not check.found and check.reason == "token mismatch" and not check.kv_only


def test_an_entry_for_another_model_or_prompt_length_is_not_served(tmp_path):
    other = dataclasses.replace(ID, model="hf:org/x@" + "0" * 40)
    write(tmp_path, other, TOKENS)
    assert transfer.find_entry(tmp_path, ID, TOKENS, tp_size=1).reason == "miss"
    write(tmp_path, ID, TOKENS[:-1])
    assert transfer.find_entry(tmp_path, ID, TOKENS, tp_size=1).reason == "miss"


def test_tensor_parallel_needs_every_ranks_entry(tmp_path):
    ranked = dataclasses.replace(ID, tp_size=2)
    write(tmp_path, ranked, TOKENS)
    check = transfer.find_entry(tmp_path, ranked, TOKENS, tp_size=2)
    assert not check.found and check.reason == "miss (tp rank 1)"
    write(tmp_path, dataclasses.replace(ranked, tp_rank=1), TOKENS)
    assert transfer.find_entry(tmp_path, ranked, TOKENS, tp_size=2).identity == ranked


def test_check_entry_reads_nothing_it_is_not_asked_for(tmp_path):
    with pytest.raises(FileNotFoundError):
        transfer.check_entry(tmp_path, ID, TOKENS)
    fmt.entry_path(tmp_path, fmt.compute_key(ID, TOKENS)).mkdir()  # a directory under the entry's name
    with pytest.raises(fmt.EntryCorrupt, match="directory"):
        transfer.check_entry(tmp_path, ID, TOKENS)


@pytest.mark.parametrize("prompt_len,computed,expected", [
    (10, 0, 9),  # all but the last prompt token
    (10, 4, 5),  # beyond the local prefix cache hit
    (10, 9, 0), (10, 10, 0), (1, 0, 0),
])
def test_tokens_to_load(prompt_len, computed, expected):
    assert transfer.tokens_to_load(prompt_len, computed) == expected


@pytest.mark.parametrize("computed,scheduled,prompt_len,expected", [
    (0, 10, 10, True),  # whole prompt in one step
    (0, 4, 10, False), (4, 4, 10, False),  # chunked prefill: not yet
    (8, 4, 10, True),  # the last chunk (its step also samples)
    (10, 1, 10, False),  # decode steps never save again
    (6, 4, 10, True),  # prefix cache gave 6, the step computes the rest
])
def test_prompt_completes(computed, scheduled, prompt_len, expected):
    assert transfer.prompt_completes(computed, scheduled, prompt_len) is expected


def test_slots_for_maps_positions_through_the_block_table():
    assert transfer.slots_for([7, 2], 4, 0, 6) == [28, 29, 30, 31, 8, 9]
    assert transfer.slots_for([7, 2], 4, 3, 5) == [31, 8]
    with pytest.raises(ValueError, match="need 3 blocks"):
        transfer.slots_for([7, 2], 4, 0, 9)
