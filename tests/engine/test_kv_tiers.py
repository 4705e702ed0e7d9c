"""The tiered prefix cache (pagedjax.kv_offload.tiers): prefixes the device pool evicts come back
from host memory and from disk with the tokens of recomputing them, the KV moved bit for bit,
corrupt and foreign disk files refused, a failing disk degrading to the host tier alone, and a
second process finding the first's blocks on disk."""

import hashlib
import json
import logging
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from helpers import child_pythonpath, until_done

from pagedjax import EngineConfig, LLMEngine, SamplingParams
from pagedjax.kv_offload.block_transfers import host_block, set_host_block
from pagedjax.kv_offload.disk_tier import MAGIC, SUFFIX, DiskTier
from pagedjax.scheduler.block_hash import hash_block, root_hash

BASE = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, min_seq_bucket=4,
            block_size=4, num_blocks=24)
BLOCK_BYTES = 2048  # debug-tiny: 2 * 2 layers * 4 tokens * 2 KV heads * 16 dims * 4 bytes


def sessions(num=4, length=38, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, length).tolist() for _ in range(num)]


def run_rounds(engine, docs, rounds=3, concurrent=True):
    """Each round asks every document again with a new question: greedy, seeded sampling and
    n = 2 in turn. concurrent: a round's requests together (the pool holds about two)."""
    outputs = []
    kinds = [SamplingParams(max_tokens=6, temperature=0.0),
             SamplingParams(max_tokens=6, temperature=0.8, seed=5),
             SamplingParams(max_tokens=5, temperature=0.8, seed=3, n=2)]
    for r in range(rounds):
        ids = []
        for i, doc in enumerate(docs):
            ids.append(engine.add_request(doc + [r, 7, i], kinds[(r + i) % len(kinds)]))
            if not concurrent:
                outputs += drain(engine, ids[-1:])
        if concurrent:
            outputs += drain(engine, ids)
    return outputs


def drain(engine, ids):
    done = {}
    for _ in until_done(engine):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [[c.token_ids for c in done[i].outputs] for i in ids]


def engine_with(model, **kwargs):
    return LLMEngine(model, EngineConfig(**{**BASE, **kwargs}))


@pytest.fixture(scope="module")
def recomputed(tiny_model):
    return run_rounds(engine_with(tiny_model, enable_prefix_caching=False), sessions())


@pytest.mark.parametrize("concurrent", [True, False])
def test_host_tier_hits_give_the_tokens_of_recomputing(tiny_model, recomputed, concurrent):
    docs = sessions()
    device_only = engine_with(tiny_model)
    tiered = engine_with(tiny_model, kv_offload_bytes=64 * BLOCK_BYTES)
    on = run_rounds(tiered, docs, concurrent=concurrent)
    off = run_rounds(device_only, docs, concurrent=concurrent)
    if concurrent:
        assert on == off == recomputed
        assert tiered.stats.num_preemptions > 0, "the pool was meant to force preemption"
    else:
        assert on == off
    tier = tiered.scheduler.kv_manager.host_tier
    assert tier.num_hits > 0 and tiered.kv_tiers.moved.blocks_to_device == tier.num_hits
    # every hit is a block the device alone had lost
    assert tiered.stats.num_prefix_hit_tokens > device_only.stats.num_prefix_hit_tokens
    assert tiered.stats.num_prompt_tokens_computed < device_only.stats.num_prompt_tokens_computed
    assert tiered.scheduler.kv_manager.num_used_blocks == 0


@pytest.mark.parametrize("extra", [
    dict(async_scheduling=True),
    dict(speculative_config=dict(method="ngram", num_speculative_tokens=2,
                                 prompt_lookup_min=1, prompt_lookup_max=2))],
    ids=["async", "ngram"])
def test_tiers_under_async_scheduling_and_speculative_decoding(tiny_model, recomputed, tmp_path,
                                                               extra):
    """Copies out landing while the next step is already dispatched; drafts' blocks (never
    published) beside blocks coming back from the host and the disk."""
    engine = engine_with(tiny_model, kv_offload_bytes=6 * BLOCK_BYTES,
                         kv_disk_dir=str(tmp_path), kv_disk_bytes=1 << 22, **extra)
    assert run_rounds(engine, sessions()) == recomputed
    tiers = engine.stats.kv_tiers
    assert tiers["host"]["hits"] > 0 and tiers["disk"]["hits"] > 0
    if "async_scheduling" in extra:
        assert engine.stats.num_ahead_steps > 0
    else:
        assert engine.stats.num_spec_draft_tokens > 0
    engine.close()


def test_disk_tier_hits_give_the_tokens_of_recomputing(tiny_model, recomputed, tmp_path):
    # 6 host blocks: most of what the device evicts goes on to disk
    engine = engine_with(tiny_model, kv_offload_bytes=6 * BLOCK_BYTES,
                         kv_disk_dir=str(tmp_path), kv_disk_bytes=1 << 22)
    assert run_rounds(engine, sessions()) == recomputed
    disk = engine.kv_tiers.disk
    assert disk.num_hits > 0 and disk.num_corrupt == 0 and disk.num_writes > 0
    assert engine.scheduler.kv_manager.host_tier.num_overflow > 0  # straight to disk, too
    engine.close()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_blocks_move_down_and_back_bit_for_bit(tiny_model, tmp_path, kv_cache_dtype):
    engine = engine_with(tiny_model, kv_cache_dtype=kv_cache_dtype,
                         kv_offload_bytes=8 * BLOCK_BYTES, kv_disk_dir=str(tmp_path),
                         kv_disk_bytes=1 << 22)
    runner, tiers = engine.runner, engine.kv_tiers
    keys = iter(jax.random.split(jax.random.key(0), 4))
    runner.kv_cache = jax.tree.map(  # random content in every block (int8: random scales too)
        lambda a: (jax.random.randint(next(keys), a.shape, -127, 127, a.dtype)
                   if a.dtype == np.int8 else jax.random.normal(next(keys), a.shape, a.dtype)),
        runner.kv_cache)
    before = jax.tree.map(np.asarray, runner.read_blocks([3, 5, 9]))

    class Out:  # the transfers a schedule would ask for
        tier_spills = tier_overflow = tier_loads = ()
        tier_offloads = [(3, 0), (5, 1), (9, 2)]

    tiers.copy_out(Out)
    tiers.flush()
    for slot in range(3):  # host -> disk -> back
        tiers.disk.write(bytes([slot]) * 16, host_block(tiers.host_pool, slot, tiers.num_layers))
    tiers.disk.drain()
    tiers.host_pool = jax.tree.map(np.zeros_like, tiers.host_pool)  # only the disk has them
    for slot in range(3):
        set_host_block(tiers.host_pool, slot, tiers.disk.read(bytes([slot]) * 16),
                       tiers.num_layers)
    Out.tier_offloads, Out.tier_loads = (), [(0, 11), (1, 12), (2, 13)]
    tiers.copy_in(Out)
    after = jax.tree.map(np.asarray, runner.read_blocks([11, 12, 13]))
    for i in range(3):  # (the fourth is the null block, a power of two's padding)
        for a, b in zip(host_block(before, i, tiers.num_layers),
                        host_block(after, i, tiers.num_layers)):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert len(jax.tree.leaves(before)) == (2 if kv_cache_dtype == "int8" else 1)
    engine.close()


def _files(directory):
    return sorted(os.path.join(directory, f) for f in os.listdir(directory)
                  if f.endswith(SUFFIX))


def test_corrupt_and_foreign_disk_blocks_are_refused(tiny_model, recomputed, tmp_path):
    first = engine_with(tiny_model, kv_offload_bytes=6 * BLOCK_BYTES,
                        kv_disk_dir=str(tmp_path), kv_disk_bytes=1 << 22)
    run_rounds(first, sessions(), rounds=1)
    first.close()
    key = first.scheduler.kv_manager.cache_key
    # the first block of three documents: every walk of theirs reads it first
    files = [os.path.join(tmp_path, hash_block(root_hash(key, None), doc[:4]).hex() + SUFFIX)
             for doc in sessions()[:3]]
    doc = sessions()[3]  # its second block: the first still reads from disk
    files.append(os.path.join(tmp_path, hash_block(hash_block(root_hash(key, None), doc[:4]),
                                                   doc[4:8]).hex() + SUFFIX))
    assert all(os.path.exists(f) for f in files)
    num_files = len(_files(tmp_path))
    with open(files[0], "r+b") as f:  # a flipped byte in the payload
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))
    with open(files[1], "r+b") as f:  # truncated
        f.truncate(os.path.getsize(files[1]) - 100)
    with open(files[2], "rb") as f:  # another model's: its header names other weights
        data = f.read()
    start = len(MAGIC) + 4
    length = int.from_bytes(data[len(MAGIC):start], "little")
    header = json.loads(data[start:start + length])
    header["key"] = "another-model:float32"
    encoded = json.dumps(header).encode()
    with open(files[2], "wb") as f:
        f.write(MAGIC + len(encoded).to_bytes(4, "little") + encoded + data[start + length:])
    with open(files[3], "rb") as f:  # well-formed, checksum valid, leaves of another shape
        data = f.read()
    header = json.loads(data[start:start + int.from_bytes(data[len(MAGIC):start], "little")])
    wrong = np.zeros(3, np.float32)
    header["leaves"] = [[[3], "float32"]] * len(header["leaves"])
    header["checksum"] = hashlib.blake2b(wrong.tobytes() * len(header["leaves"]),
                                         digest_size=16).hexdigest()
    encoded = json.dumps(header).encode()
    with open(files[3], "wb") as f:
        f.write(MAGIC + len(encoded).to_bytes(4, "little") + encoded
                + wrong.tobytes() * len(header["leaves"]))
    second = engine_with(tiny_model, kv_offload_bytes=6 * BLOCK_BYTES,
                         kv_disk_dir=str(tmp_path), kv_disk_bytes=1 << 22)
    assert second.kv_tiers.disk.num_blocks == num_files
    # the first round again: its prefixes come from disk, bar the three refused blocks
    assert run_rounds(second, sessions(), rounds=1) == recomputed[:4]
    disk = second.kv_tiers.disk
    assert disk.num_corrupt == 4 and disk.num_hits > 0
    second.close()
    # deleted when refused, then written again with the KV their requests recomputed
    third = DiskTier(str(tmp_path), 1 << 22, disk.key, disk.layout)
    assert all(third.read(bytes.fromhex(os.path.basename(f)[:-len(SUFFIX)])) is not None
               for f in files) and third.num_corrupt == 0
    third.close()


def test_unwritable_directory_degrades_to_the_host_tier(tiny_model, recomputed, tmp_path,
                                                        caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        engine = engine_with(tiny_model, kv_offload_bytes=6 * BLOCK_BYTES,
                             kv_disk_dir=str(blocker / "kv"), kv_disk_bytes=1 << 22)
    assert "KV disk tier off" in caplog.text and not engine.kv_tiers.disk.enabled
    assert run_rounds(engine, sessions()) == recomputed
    assert engine.scheduler.kv_manager.host_tier.num_hits > 0


def test_a_full_disk_degrades_to_the_host_tier(tiny_model, recomputed, tmp_path, caplog,
                                               monkeypatch):
    engine = engine_with(tiny_model, kv_offload_bytes=6 * BLOCK_BYTES,
                         kv_disk_dir=str(tmp_path), kv_disk_bytes=1 << 22)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("pagedjax.kv_offload.disk_tier.os.replace", full)
    with caplog.at_level(logging.WARNING):
        assert run_rounds(engine, sessions()) == recomputed
        engine.kv_tiers.disk.drain()
    disk = engine.kv_tiers.disk
    assert disk.num_write_errors == 1 and not disk.enabled
    assert "No space left on device" in caplog.text
    assert _files(tmp_path) == [] and not [f for f in os.listdir(tmp_path) if ".tmp" in f]
    engine.close()


SECOND_PROCESS = """
import json, sys
from pagedjax.models import get_config, init_model
from pagedjax import EngineConfig, LLMEngine
from test_kv_tiers import BASE, BLOCK_BYTES, run_rounds, sessions
engine = LLMEngine(init_model(get_config("debug-tiny"), seed=0), EngineConfig(
    **BASE, kv_offload_bytes=6 * BLOCK_BYTES, kv_disk_dir=sys.argv[1], kv_disk_bytes=1 << 22))
outputs = run_rounds(engine, sessions(), rounds=1)
engine.close()
print(json.dumps(outputs))
"""


@pytest.mark.slow  # a second Python starting JAX (make test-slow)
def test_a_second_process_finds_the_first_ones_blocks(tiny_model, recomputed, tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": child_pythonpath()}
    first = subprocess.run([sys.executable, "-c", SECOND_PROCESS, str(tmp_path)], env=env,
                           capture_output=True, text=True, timeout=240, check=True)
    assert json.loads(first.stdout.splitlines()[-1]) == recomputed[:4]
    written = len(_files(tmp_path))
    assert written > 0
    engine = engine_with(tiny_model, kv_offload_bytes=6 * BLOCK_BYTES,
                         kv_disk_dir=str(tmp_path), kv_disk_bytes=1 << 22)
    assert run_rounds(engine, sessions(), rounds=1) == recomputed[:4]
    disk = engine.kv_tiers.disk
    assert disk.num_hits > 0 and disk.num_corrupt == 0
    assert engine.stats.num_prefix_hit_tokens > 0  # a fresh device pool: every hit is disk's
    engine.close()


def test_disk_tier_keeps_under_its_capacity(tmp_path):
    leaves = [np.arange(256, dtype=np.float32)]
    tier = DiskTier(str(tmp_path), 3 * 1500, "key", {"block_size": 4})
    for i in range(6):
        tier.write(bytes([i]) * 16, leaves)
    tier.drain()
    assert tier.num_blocks == 3 and tier.num_evictions == 3
    assert tier.bytes_used <= 3 * 1500 and len(_files(tmp_path)) == 3
    assert tier.read(bytes([0]) * 16) is None and tier.num_misses == 1  # the oldest went
    assert tier.read(bytes([5]) * 16)[0].tolist() == leaves[0].tolist()
    tier.close()


def test_blocks_removed_or_truncated_from_outside_are_written_again(tmp_path):
    """Issue 57: files of the tier removed or truncated by someone else leave no stale entry
    that suppresses their rewrite: the next write of each block lands, and reads find it."""
    leaves = [np.arange(256, dtype=np.float32)]
    tier = DiskTier(str(tmp_path), 1 << 20, "key", {"block_size": 4})
    names = [bytes([i]) * 16 for i in range(3)]
    for name in names:
        tier.write(name, leaves)
    tier.drain()
    used, paths = tier.bytes_used, [tier._path(name) for name in names]
    os.remove(paths[0])
    with open(paths[1], "r+b") as f:
        f.truncate(100)
    for name in names:  # the device evicts them again
        tier.write(name, leaves)
    tier.drain()
    assert tier.num_writes == 5 and tier.bytes_used == used  # the third was still there
    assert all(tier.read(name)[0].tolist() == leaves[0].tolist() for name in names)
    assert tier.num_corrupt == 0
    # A read that finds its file gone has every entry whose file is gone dropped.
    for path in paths[:2]:
        os.remove(path)
    assert tier.read(names[0]) is None and tier.num_corrupt == 1
    tier.drain()
    assert names[1] not in tier and names[2] in tier and tier.bytes_used == used // 3
    tier.close()


def _block_file(tier, block_hash: bytes, leaves: list[np.ndarray]) -> bytes:
    """A well-formed block file of these leaves: the tier's key and layout, a valid checksum."""
    return tier._encode(block_hash, leaves)


def test_disk_reads_follow_no_link_wait_on_no_fifo_and_trust_no_shape(tmp_path):
    """Issue 57: a block path that is a link (to a FIFO, to a large file, to a file outside),
    a FIFO itself, or a well-formed file whose leaves are not the layout's (a valid checksum,
    shapes [3] or scalars) is refused at once without reading past a block file's size:
    counted, deleted, a miss; the good blocks beside them read on."""
    layout = {"block_size": 4, "leaves": [[[2, 4], "float32"]]}
    tier = DiskTier(str(tmp_path), 1 << 22, "key", layout)
    good = [np.arange(8, dtype=np.float32).reshape(2, 4)]
    names = [bytes([i]) * 16 for i in range(7)]
    for block_hash in names:
        tier.write(block_hash, good)
    tier.drain()
    path = {h: os.path.join(tmp_path, h.hex() + SUFFIX) for h in names}
    os.mkfifo(tmp_path / "fifo")
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(256 << 20)  # sparse: 256 MiB a reader that reads whole would hold
    for block_hash, target in zip(names[:3], (tmp_path / "fifo", big, "/etc/passwd")):
        os.remove(path[block_hash])
        os.symlink(target, path[block_hash])
    os.remove(path[names[3]])
    os.mkfifo(path[names[3]])
    for block_hash, leaf in ((names[4], np.zeros(3, np.float32)),
                             (names[5], np.float32(1.0).reshape(()))):
        data = bytearray(_block_file(tier, block_hash, [leaf]))
        start = len(MAGIC) + 4
        length = int.from_bytes(data[len(MAGIC):start], "little")
        header = json.loads(data[start:start + length])
        header["layout"] = layout  # claims the layout, carries other leaves
        header["checksum"] = hashlib.blake2b(leaf.tobytes(), digest_size=16).hexdigest()
        encoded = json.dumps(header).encode()
        with open(path[block_hash], "wb") as f:
            f.write(MAGIC + len(encoded).to_bytes(4, "little") + encoded + leaf.tobytes())
    start = time.monotonic()
    assert [tier.read(h) for h in names[:6]] == [None] * 6
    assert time.monotonic() - start < 10  # no wait on a FIFO, no 256 MiB read
    assert tier.num_corrupt == 6 and tier.bytes_read == 0 and tier.num_hits == 0
    assert not any(os.path.lexists(path[h]) for h in names[:6])
    assert os.path.exists("/etc/passwd") and big.stat().st_size == 256 << 20
    assert tier.read(names[6])[0].tolist() == good[0].tolist()
    tier.close()
    # a restarted tier indexes no link and nothing but regular files
    os.symlink(big, path[names[0]])
    os.mkfifo(path[names[1]])
    again = DiskTier(str(tmp_path), 1 << 22, "key", layout)
    assert again.num_blocks == 1 and names[6] in again
    again.close()


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_offload_bytes=-1), "kv_offload_bytes must be >= 0"),
    (dict(kv_disk_dir="/tmp/x"), "kv_disk_dir and kv_disk_bytes go together"),
    (dict(kv_disk_dir="/tmp/x", kv_disk_bytes=10), "kv_disk_dir needs kv_offload_bytes"),
    (dict(kv_offload_bytes=10, enable_prefix_caching=False), "needs enable_prefix_caching"),
    (dict(kv_offload_bytes=1.5), "kv_offload_bytes must be an integer"),
])
def test_config_refusals_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_a_host_tier_smaller_than_a_block_is_refused(tiny_model):
    with pytest.raises(ValueError, match="kv_offload_bytes .100. holds no KV block"):
        engine_with(tiny_model, kv_offload_bytes=100)


def test_a_hit_on_a_block_offloaded_in_the_same_schedule_waits_for_its_copy(tiny_model):
    """One schedule evicts a cached block to the host tier (A's allocation) and then loads it
    back for a prompt sharing it (B, admitted after A): the load reads the slot only once the
    copy out has landed, so B's tokens and logprobs are those of recomputing it."""
    rng = np.random.default_rng(1)
    first, other, long = (rng.integers(0, 256, n).tolist() for n in (16, 32, 52))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)

    def outputs(**kwargs):
        engine = engine_with(tiny_model, max_num_batched_tokens=64, **kwargs)
        for prompt in (first, other):  # cached on the device, `first` the least recent
            drain(engine, [engine.add_request(prompt, SamplingParams(max_tokens=1))])
        ids = [engine.add_request(long, greedy), engine.add_request(first + [1, 2, 3, 4], greedy)]
        done = {}
        for _ in until_done(engine):
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return engine, [(c.token_ids, c.cumulative_logprob) for i in ids for c in done[i].outputs]

    tiered, got = outputs(kv_offload_bytes=8 * BLOCK_BYTES)
    _, expected = outputs(enable_prefix_caching=False)
    assert tiered.kv_tiers.moved.blocks_to_device == 2  # the two `long` evicted from `first`
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    # f32: the two runs batch B's rows differently (a hit vs its whole prompt)
    np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in expected], atol=1e-4)


def test_a_prompt_waits_a_schedule_for_the_rest_of_its_disk_blocks(tiny_model, tmp_path):
    """Two prompts whose prefixes are on disk, a host tier with room for one and a third: the
    first takes its blocks up, the second waits one schedule (Request.awaiting_kv) for the
    rest of its own instead of recomputing them."""
    docs = sessions(num=2, length=25)  # 6 full blocks each
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    config = dict(kv_offload_bytes=8 * BLOCK_BYTES, kv_disk_dir=str(tmp_path),
                  kv_disk_bytes=1 << 22)
    first = engine_with(tiny_model, **config)
    before = drain(first, [first.add_request(doc, greedy) for doc in docs])
    first.close()  # both prefixes written down
    engine = engine_with(tiny_model, **config)
    ids = [engine.add_request(doc, greedy) for doc in docs]
    done = {}
    for _ in until_done(engine):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert [[c.token_ids for c in done[i].outputs] for i in ids] == before
    assert [done[i].metrics.num_cached_tokens for i in ids] == [24, 24]
    assert engine.kv_tiers.disk.num_hits == 12
    engine.close()


def test_a_restarted_server_answers_from_its_disk_tier(tmp_path):
    """The RAG service's restart: a server shut down writes its cached blocks down, and the
    next one over the same directory answers the same document's question from them (the
    usage's cached_tokens, what an OpenAI client sees)."""
    from fastapi.testclient import TestClient
    from test_server import ENGINE

    from pagedjax import LLM
    from pagedjax.serving.app import OpenAIServer

    config = dict(ENGINE, kv_offload_bytes=1 << 24, kv_disk_dir=str(tmp_path),
                  kv_disk_bytes=1 << 26)
    prompt = "copy:" + "a tiered prefix cache " * 4 + "="  # 94 tokens: five full blocks
    answers = []
    for _ in range(2):
        llm = LLM(**config)
        server = OpenAIServer(llm.engine, "tiny", enable_prompt_tokens_details=True)
        with TestClient(server.build_app()) as client:
            response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
        assert response.status_code == 200
        answers.append(response.json())
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached == [0, 80]
    assert answers[0]["choices"][0]["text"] == answers[1]["choices"][0]["text"]
    assert llm.engine.kv_tiers.disk.num_hits == 5


def test_flags():
    import argparse

    from pagedjax.tools.engine_args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-offload-gib", "0.5", "--kv-disk-dir", "/tmp/kv",
                              "--kv-disk-gib", "2"])
    kwargs = engine_kwargs(args)
    assert (kwargs["kv_offload_bytes"], kwargs["kv_disk_dir"], kwargs["kv_disk_bytes"]) == (
        2**29, "/tmp/kv", 2**31)
    EngineConfig(**kwargs)  # a valid configuration
    assert "kv_offload_bytes" not in engine_kwargs(parser.parse_args([]))


def test_a_step_that_loses_the_cache_starts_the_tiers_over(tiny_model, recomputed):
    """A step that loses the KV cache fails its requests and the engine starts over with a
    new scheduler: the host tier's books start empty, its counts carry on (the /metrics
    counters never go back), and the next requests get the tokens of recomputing."""
    engine = engine_with(tiny_model, kv_offload_bytes=64 * BLOCK_BYTES)
    run_rounds(engine, sessions(), rounds=2)
    hits = engine.stats.kv_tiers["host"]["hits"]
    assert hits > 0
    dispatch = engine.runner.dispatch_forward

    def loses_the_cache(plan):
        engine.runner.dispatch_forward = dispatch
        for leaf in jax.tree.leaves(engine.runner.kv_cache):
            leaf.delete()
        raise RuntimeError("device reset")

    engine.runner.dispatch_forward = loses_the_cache
    old_tier = engine.scheduler.kv_manager.host_tier
    failed = engine.add_request(sessions()[0] + [9], SamplingParams(max_tokens=3))
    with pytest.raises(RuntimeError, match="device reset") as raised:
        engine.step()
    (output,) = engine.fail_all(raised.value)  # what a server's engine driver does
    assert output.request_id == failed and output.finish_reason == "error"
    assert engine.scheduler.kv_manager.host_tier.num_used_blocks == 0
    assert engine.kv_tiers.counters(engine.scheduler.kv_manager)["host"]["hits"] == \
        old_tier.num_hits >= hits
    assert run_rounds(engine, sessions()) == recomputed
    assert engine.stats.kv_tiers["host"]["hits"] > hits
