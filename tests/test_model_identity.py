"""Model identity (connectors.store.model_identity): changes with the weights, equal across copies.

Real files only: generated tiny models, hand-made Hugging Face cache layouts,
a cache directory that cannot be written. No torch, no vLLM.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from connectors.store import model_identity as mi
from connectors.store.model_identity import ModelIdentityError, fingerprint, served_model_key, weights_identity
from kvctl.provision.tiny_model import write_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def age(*paths: Path, seconds: float = 3600) -> None:
    """Date files back so they are past the racy window and get cached."""
    for p in paths:
        for f in ([p] if p.is_file() else [x for x in p.iterdir() if x.is_file()]):
            t = time.time() - seconds
            os.utime(f, (t, t))


def model_dir(root: Path, weights: bytes = b"w" * 1000, config: str = '{"hidden": 8}') -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(config)
    (root / "model.safetensors").write_bytes(weights)
    (root / "tokenizer.json").write_text('{"vocab": 1}')
    return root


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "fp-cache"


def test_same_generated_model_at_two_paths_has_one_identity(tmp_path, cache):
    a, b = write_model(tmp_path / "a", seed=1).path, write_model(tmp_path / "elsewhere" / "b", seed=1).path
    ida, idb = weights_identity(a, cache_dir=cache), weights_identity(b, cache_dir=cache)
    assert ida.id == idb.id and ida.id.startswith("files:xxh3_128:") and len(ida.id) == 15 + 32
    assert ida.source == "fingerprint" and ida.files == 2  # config.json + model.safetensors


def test_regenerating_with_another_seed_at_the_same_path_changes_the_identity(tmp_path, cache):
    path = write_model(tmp_path / "m", seed=1).path
    age(path)
    first = weights_identity(path, cache_dir=cache)
    assert weights_identity(path, cache_dir=cache).hashed_files == 0  # cached now
    write_model(path, seed=2)  # same path, same config, other weights
    second = weights_identity(path, cache_dir=cache)
    assert second.id != first.id and second.hashed_files >= 1
    write_model(path, seed=1)
    assert weights_identity(path, cache_dir=cache).id == first.id


def test_same_size_rewrite_in_place_with_the_old_mtime_is_hashed_again(tmp_path, cache):
    """The stat cache cannot be fooled by `cp --preserve=timestamps` over the file: ctime moves."""
    path = model_dir(tmp_path / "m", weights=b"a" * 4096)
    age(path)
    weights = path / "model.safetensors"
    first = fingerprint(path, cache_dir=cache)
    old = os.stat(weights)
    with open(weights, "r+b") as f:  # same inode, same size, other content
        f.write(b"b" * 4096)
    os.utime(weights, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert os.stat(weights).st_mtime_ns == old.st_mtime_ns and os.stat(weights).st_ino == old.st_ino
    second = fingerprint(path, cache_dir=cache)
    assert second.hashed_files == 1 and second.id != first.id


def test_cache_hit_reads_no_file(tmp_path, cache, monkeypatch):
    path = model_dir(tmp_path / "m")
    age(path)
    cold = fingerprint(path, cache_dir=cache)
    assert cold.hashed_files == 2 and cold.cache_problem is None
    doc = json.loads(Path(cold.cache).read_text())
    assert sorted(doc["files"]) == ["config.json", "model.safetensors"]

    def no_reading(file):
        raise AssertionError(f"{file} was read on a cache hit")

    monkeypatch.setattr(mi, "_hash_file", no_reading)
    warm = fingerprint(path, cache_dir=cache)
    assert warm.id == cold.id and warm.hashed_files == 0 and warm.files == 2


def test_recently_modified_files_are_not_cached(tmp_path, cache):
    path = model_dir(tmp_path / "m")  # just written: inside the racy window
    first = fingerprint(path, cache_dir=cache)
    assert fingerprint(path, cache_dir=cache).hashed_files == 2
    assert json.loads(Path(first.cache).read_text())["files"] == {}


def test_unwritable_cache_still_gives_the_identity(tmp_path):
    path = model_dir(tmp_path / "m")
    age(path)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    found = fingerprint(path, cache_dir=blocker / "cache")  # mkdir fails, even as root
    assert found.id == fingerprint(path, cache_dir=tmp_path / "ok").id
    assert found.cache_problem and "cannot" in found.cache_problem
    assert "cache not used" in found.describe()


def test_damaged_cache_file_is_ignored_and_replaced(tmp_path, cache):
    path = model_dir(tmp_path / "m")
    age(path)
    good = fingerprint(path, cache_dir=cache)
    Path(good.cache).write_text('{"version": 1, "files": {"model.safetensors": {"stat": 1, "xxh3_128": "zz"}')
    again = fingerprint(path, cache_dir=cache)
    assert again.id == good.id and again.hashed_files == 2
    doc = json.loads(Path(good.cache).read_text())  # rewritten whole
    assert doc["version"] == 1 and len(doc["files"]) == 2
    # A cache entry with the right stat but a wrong digest would be trusted: the stat is the contract.
    # One with another stat is never used.
    doc["files"]["model.safetensors"]["stat"][1] += 1
    doc["files"]["model.safetensors"]["xxh3_128"] = "0" * 32
    Path(good.cache).write_text(json.dumps(doc))
    assert fingerprint(path, cache_dir=cache).id == good.id


def _fingerprint_in_child(args):
    path, cache = args
    found = fingerprint(path, cache_dir=cache)
    return found.id, found.hashed_files


def test_concurrent_processes_agree_and_leave_a_valid_cache(tmp_path, cache):
    path = model_dir(tmp_path / "m", weights=os.urandom(8 << 20))
    age(path)
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        results = pool.map(_fingerprint_in_child, [(str(path), str(cache))] * 8)
    assert len({r[0] for r in results}) == 1
    # They take turns under the lock: the first hashes, the others read its digests.
    assert sum(r[1] for r in results) == 2
    [cache_file] = cache.glob("*.json")
    assert len(json.loads(cache_file.read_text())["files"]) == 2
    assert not list(cache.glob(".*.tmp"))


def test_what_the_fingerprint_covers(tmp_path, cache):
    path = model_dir(tmp_path / "m")
    base = fingerprint(path, cache_dir=cache).id
    (path / "tokenizer.json").write_text('{"vocab": 2}')  # tokenizers don't change KV of given ids
    (path / "README.md").write_text("hello")
    (path / "original").mkdir()
    (path / "original" / "consolidated.00.pth").write_bytes(b"x")  # vLLM loads the top level only
    (path / "x.safetensors").mkdir()  # a directory is not a file
    assert fingerprint(path, cache_dir=cache).id == base
    (path / "config.json").write_text('{"hidden": 16}')  # architecture
    changed = fingerprint(path, cache_dir=cache).id
    assert changed != base
    (path / "modeling_custom.py").write_text("# remote code")
    assert fingerprint(path, cache_dir=cache).id != changed
    (path / "modeling_custom.py").unlink()
    (path / "model-00002.safetensors").write_bytes(b"")  # another shard, even empty
    assert fingerprint(path, cache_dir=cache).id != changed


def test_file_names_count_inside_a_directory_but_not_for_a_single_file_model(tmp_path, cache):
    a = model_dir(tmp_path / "a")
    b = model_dir(tmp_path / "b")
    (b / "model.safetensors").rename(b / "weights.safetensors")
    assert fingerprint(a, cache_dir=cache).id != fingerprint(b, cache_dir=cache).id
    (tmp_path / "q4.gguf").write_bytes(b"GGUF" + b"\1" * 100)
    (tmp_path / "copy-of-q4.gguf").write_bytes(b"GGUF" + b"\1" * 100)
    one = weights_identity(tmp_path / "q4.gguf", cache_dir=cache)
    assert one.id == weights_identity(tmp_path / "copy-of-q4.gguf", cache_dir=cache).id and one.files == 1


def test_symlinked_model_dir_and_files_are_followed(tmp_path, cache):
    real = model_dir(tmp_path / "real")
    (tmp_path / "link").symlink_to(real)
    linked = model_dir(tmp_path / "linked-files")
    (linked / "model.safetensors").unlink()
    (linked / "model.safetensors").symlink_to(real / "model.safetensors")
    want = fingerprint(real, cache_dir=cache).id
    assert fingerprint(tmp_path / "link", cache_dir=cache).id == want
    assert fingerprint(linked, cache_dir=cache).id == want


def test_nothing_to_fingerprint_and_missing_models_are_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README.md").write_text("no model here")
    with pytest.raises(ModelIdentityError) as e:
        weights_identity(tmp_path / "empty", cache_dir=tmp_path / "c")
    assert "holds none of the files" in e.value.message and "model_id" in e.value.fix
    with pytest.raises(ModelIdentityError) as e:
        weights_identity("org/not-downloaded", cache_dir=tmp_path / "c")
    assert "Hugging Face cache" in e.value.message and str(tmp_path / "hub") in e.value.message


def test_dangling_links_and_fifos_are_not_model_files(tmp_path, cache):
    path = model_dir(tmp_path / "m")
    (path / "model-00002.safetensors").symlink_to(tmp_path / "missing")  # dangling: skipped, not a file
    assert fingerprint(path, cache_dir=cache).files == 2
    fifo = path / "model-00003.safetensors"
    os.mkfifo(fifo)  # not a regular file: never opened (would block)
    assert fingerprint(path, cache_dir=cache).files == 2


# -------------------------------------------------------------- Hugging Face cache

def hf_repo(hub: Path, repo: str, commit: str = COMMIT, weights: bytes = b"w" * 100) -> Path:
    """A hub cache entry laid out as huggingface_hub writes it (snapshot files link to blobs)."""
    repo_dir = hub / ("models--" + repo.replace("/", "--"))
    (repo_dir / "blobs").mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, content in (("config.json", b"{}"), ("model.safetensors", weights),
                          ("tokenizer.json", b"{}")):
        blob = repo_dir / "blobs" / f"{abs(hash((name, content))):x}"
        blob.write_bytes(content)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    return snap


def test_hf_snapshot_is_named_by_its_commit_without_reading(tmp_path, monkeypatch):
    snap = hf_repo(tmp_path / "hub", "org/name")
    monkeypatch.setattr(mi, "_hash_file", lambda f: pytest.fail("a snapshot was hashed"))
    found = weights_identity(snap, cache_dir=tmp_path / "c")
    assert found.id == f"hf:org/name@{COMMIT}" and found.source == "hf-snapshot"
    # Through a symlink to the snapshot, and on another host's cache: same identity.
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "llama").symlink_to(snap)
    assert weights_identity(tmp_path / "models" / "llama").id == found.id
    other = hf_repo(tmp_path / "other-host" / "hub", "org/name")
    assert weights_identity(other).id == found.id


def test_hf_snapshot_with_a_file_replaced_by_hand_is_fingerprinted(tmp_path, cache):
    snap = hf_repo(tmp_path / "hub", "org/name")
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").write_bytes(b"fine-tuned")
    found = weights_identity(snap, cache_dir=cache)
    assert found.source == "fingerprint" and found.id.startswith("files:")


def test_hub_name_resolves_through_the_cache_refs(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hf_repo(tmp_path / "hub", "org/name")
    assert weights_identity("org/name").id == f"hf:org/name@{COMMIT}"
    assert weights_identity("org/name", revision=COMMIT).source == "hf-cache"
    with pytest.raises(ModelIdentityError):
        weights_identity("org/name", revision="v2")  # a revision that was never downloaded


# -------------------------------------------------------------- served model key

def test_served_model_key_adds_the_settings_that_change_kv():
    w = f"hf:org/name@{COMMIT}"
    assert served_model_key(w, {"dtype": "bfloat16", "quantization": None, "rope_scaling": {},
                                "disable_sliding_window": False}) == w + ";dtype=bfloat16"
    assert served_model_key(w, {"dtype": "float16"}) != served_model_key(w, {"dtype": "bfloat16"})
    assert (served_model_key(w, {"rope_scaling": {"type": "yarn", "factor": 4.0}, "dtype": "bfloat16"})
            == w + ';dtype=bfloat16;rope_scaling={"factor":4.0,"type":"yarn"}')


def test_identity_of_a_fresh_model_is_logged_with_its_cost(tmp_path, cache):
    path = model_dir(tmp_path / "m", weights=b"w" * (1 << 20))
    text = fingerprint(path, cache_dir=cache).describe()
    assert text.startswith("files:xxh3_128:") and "2 files" in text and "2 hashed" in text
