"""The connector inside a real vLLM (CPU, the tiny random Llama): prefix sharing across processes, a
prefill/decode hand-off through one ``kvstore serve`` daemon, and faults (daemon killed, a corrupt block,
a consumer whose layout differs, no daemon at start). Every engine is its own process; tokens are greedy,
so "identical tokens" compares against the same prompts run with no connector. Runs that do not depend on
each other start together (the module fixtures below), two at a time."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess

import pytest

from kvstore.errors import ChecksumError, KeyNotFoundError

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from conftest import Daemon, short_tmpdir  # noqa: E402
from vllm_runner import (  # noqa: E402
    BLOCK,
    EngineRunner,
    Run,
    claimable_tokens,
    flip_bytes,
    load_run,
    make_prompts,
    popen_engine,
    results,
    segment_address,
)

pytestmark = [pytest.mark.heavy(240), pytest.mark.timeout(1800)]


def distinct_full_blocks(prompts: list[list[int]], block: int = BLOCK) -> int:
    seen = set()
    for p in prompts:
        for end in range(block, len(p) + 1, block):
            seen.add(tuple(p[:end]))
    return len(seen)


@pytest.fixture(scope="module")
def workdir():
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts()


@pytest.fixture(scope="module")
def engine(workdir, prompts) -> EngineRunner:
    from kvstore.integrations.vllm.tiny_model import build_tiny_llama

    return EngineRunner(workdir, build_tiny_llama(os.path.join(workdir, "tiny-llama")), prompts)


@pytest.fixture(scope="module")
def first_runs(engine, workdir):
    """Started together: the prompts with no connector (the baseline), and a first kv_both engine
    (PYTHONHASHSEED=1) saving into a daemon."""
    d = Daemon(workdir, capacity="256MiB").start()
    try:
        base, run1 = results(engine.start(), engine.start(url=d.unix_url, hash_seed=1))
        yield base, d, run1
    finally:
        d.stop()


@pytest.fixture(scope="module")
def baseline(first_runs) -> Run:
    """The prompts with no connector: what every connector run must reproduce token for token."""
    return first_runs[0]


@pytest.fixture(scope="module")
def saved(first_runs):
    """A daemon holding the blocks that a first kv_both engine (PYTHONHASHSEED=1) saved."""
    return first_runs[1:]


OTHER_LAYOUTS = {"dtype": ("--dtype", "float32"), "block_size": ("--block-size", "64")}


@pytest.fixture(scope="module")
def other_layout_runs(saved, engine) -> dict[str, Run]:
    """Consumers whose layout differs from the saved blocks', started together (they only look up)."""
    d, _ = saved
    runs = results(*(engine.start(url=d.unix_url, role="kv_consumer", args=args) for args in OTHER_LAYOUTS.values()))
    return dict(zip(OTHER_LAYOUTS, runs, strict=True))


@pytest.fixture(scope="module")
def no_daemon_runs(engine, workdir):
    """Started together, with no daemon at the URL: the default (a clear error) and degraded mode."""
    url = f"unix://{workdir}/nobody-here.sock"
    cmd, _ = engine.command(url=url)
    strict = popen_engine(cmd, hash_seed=0, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    degraded = engine.start(url=url, extra={"require_store_at_start": False})
    try:
        _, err = strict.communicate(timeout=300)
    finally:
        if strict.poll() is None:
            strict.kill()
            strict.wait()
    return (strict.returncode, err), degraded.result()


def block_keys(d: Daemon) -> list[str]:
    with d.connect("tcp") as s:
        return sorted(s.keys("kvp/"))


def test_kv_both_shares_prefixes_across_processes(saved, engine, baseline, prompts):
    d, run1 = saved
    assert run1.tokens == baseline.tokens
    assert run1.counters["saved_blocks"] >= distinct_full_blocks(prompts)
    assert len(block_keys(d)) == distinct_full_blocks(prompts)

    run2 = engine.run(url=d.unix_url, hash_seed=0)  # a fresh engine, another hash seed than run1's
    assert run2.tokens == baseline.tokens
    assert run2.cached == [claimable_tokens(p) for p in prompts]
    assert run2.counters["loaded_blocks"] > 0
    assert run2.counters["async_loads"] > 0  # loaded on the loader thread, reported through get_finished
    assert run2.counters["load_errors"] == 0 and run2.counters["lookup_errors"] == 0


def test_a_prompt_of_whole_blocks_is_loaded_whole(engine, workdir):
    """With asynchronous loads a hit may cover the whole prompt, the last token's block included: vLLM then
    recomputes only the last token to sample the next one. A prompt of exactly three blocks loads all three
    and generates the tokens of the run that computed it."""
    whole = make_prompts()[2][:3 * BLOCK]
    runner = EngineRunner(os.path.join(workdir, "whole"), engine.model, [whole])
    os.makedirs(runner.workdir, exist_ok=True)
    d = Daemon(workdir, capacity="256MiB").start()
    try:
        first = runner.run(url=d.unix_url, hash_seed=1)  # computes it (the store is empty) and saves its blocks
        second = runner.run(url=d.unix_url, hash_seed=0)  # a fresh engine, another seed: every block from the store
    finally:
        d.stop()
    assert first.transfers[0].get("saved_blocks") == 3, first.transfers
    assert second.tokens == first.tokens
    assert second.transfers[0].get("loaded_blocks") == 3, second.transfers
    assert second.counters["load_errors"] == 0


def test_layout_is_published_next_to_the_blocks(saved):
    d, _ = saved
    with d.connect("tcp") as s:
        layouts = [k for k in s.keys("vllm/") if k.endswith("/layout")]
        assert len(layouts) == 1
        meta = s.inspect(layouts[0])["meta"]
    assert meta["backend"] == "CPU_ATTN" and meta["dtype"] == "bfloat16" and meta["block_size"] == BLOCK


@pytest.mark.parametrize("changed", list(OTHER_LAYOUTS))
def test_consumer_with_another_layout_gets_no_false_hits(other_layout_runs, changed):
    run = other_layout_runs[changed]
    assert run.counters["lookups"] > 0
    assert run.counters["hit_tokens"] == 0 and run.counters["loaded_blocks"] == 0
    assert "which differs from this instance's layout" in run.stderr  # loud at start, not a silent miss


def test_corrupt_block_is_detected_removed_and_recomputed(saved, engine, baseline):
    """A block whose bytes no longer match their checksum is a load error (recomputed), is removed from the
    store so that vLLM's retry of the request misses instead of loading it again, and the recomputed block is
    saved again, intact."""
    d, _ = saved
    key = block_keys(d)[0]
    with d.connect("tcp") as s:
        info = s.inspect(key)
    address = segment_address(d.pid, info["segment"]) + info["offset"] + info["size"] // 2
    assert len(flip_bytes(d.pid, address, 8)) == 8
    try:
        run = engine.run(url=d.unix_url, hash_seed=0)
    finally:
        with d.connect("tcp") as s:
            try:
                s.get(key, verify=True)
            except ChecksumError:  # the run did not get to remove it: restore the bytes for the other tests
                flip_bytes(d.pid, address, 8)
            except KeyNotFoundError:
                pass
    assert run.counters["checksum_errors"] == 1
    assert run.counters["load_errors"] >= 1
    assert run.counters["corrupt_removed"] == 1
    assert run.tokens == baseline.tokens
    with d.connect("tcp") as s:  # recomputed and saved again by this kv_both engine
        assert bytes(s.get(key, verify=True)) and key in block_keys(d)


def test_prefill_decode_through_one_daemon(engine, workdir, baseline, prompts):
    d = Daemon(workdir, capacity="256MiB").start()
    try:
        # a long hand-off TTL: an engine start on a loaded machine must not outlast the pins
        producer = engine.run(url=d.unix_url, role="kv_producer", args=("--max-tokens", "1"),
                              extra={"handoff_ttl_s": 3600.0})
        with d.connect("tcp") as s:
            produced = s.stats()
        consumer = engine.run(url=d.unix_url, role="kv_consumer", args=("--no-prefix-cache",), hash_seed=1)
        with d.connect("tcp") as s:
            stats = s.stats()
    finally:
        d.stop()
    assert [t[:1] for t in producer.tokens] == [t[:1] for t in baseline.tokens]
    assert producer.counters["saved_blocks"] >= distinct_full_blocks(prompts)
    assert producer.counters["held_requests"] == len(prompts)  # blocks kept by vLLM until their saves landed
    assert consumer.tokens == baseline.tokens
    assert consumer.cached == [claimable_tokens(p) for p in prompts]  # every full block came from the store
    assert consumer.counters["loaded_blocks"] == sum(claimable_tokens(p) // BLOCK for p in prompts)
    assert consumer.counters["saved_blocks"] == 0 and consumer.counters["load_errors"] == 0
    assert stats["objects"] == distinct_full_blocks(prompts) + 2  # + the layout and the model's layout index
    # the hand-off blocks were pinned for the decode side, which unpinned them once it had loaded them
    assert produced["pinned_objects"] == distinct_full_blocks(prompts) and stats["expirations"] == 0
    assert stats["pinned_objects"] == 0 and stats["pinned_bytes"] == 0
    assert consumer.counters["unpinned_blocks"] == distinct_full_blocks(prompts)
    # every byte is attributed to the request it was moved for, whatever step it landed in
    block_bytes = consumer.counters["load_bytes"] // consumer.counters["loaded_blocks"]
    for prompt, mine in zip(prompts, consumer.transfers, strict=True):
        assert mine["loaded_blocks"] == claimable_tokens(prompt) // BLOCK
        assert mine["load_bytes"] == mine["loaded_blocks"] * block_bytes and mine["save_bytes"] == 0
    assert sum(t["load_bytes"] for t in consumer.transfers) == consumer.counters["load_bytes"]
    assert sum(t["save_bytes"] for t in producer.transfers) == producer.counters["save_bytes"] > 0
    assert all(t["save_pending_bytes"] == 0 for t in producer.transfers)  # every save landed


def test_daemon_killed_mid_run_every_request_completes(engine, workdir, baseline):
    d = Daemon(workdir, capacity="256MiB").start()
    cmd, out = engine.command(url=d.unix_url, args=("--batches", "2"))
    err_path = os.path.join(workdir, "killed-run.err")
    with open(err_path, "w") as err_file:  # a file, not a pipe: vLLM logs a lot, and a full pipe blocks the child
        proc = popen_engine(cmd, hash_seed=1, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err_file,
                            text=True)
    try:
        lines = []
        for line in proc.stdout:  # vLLM logs to stdout too: skip to the child's own line
            lines.append(line)
            if line.startswith("BATCH 0"):
                break
        assert lines and lines[-1].startswith("BATCH 0"), "".join(lines[-40:])
        d.kill()  # SIGKILL: no goodbye to its clients
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.communicate(timeout=300)
        with open(err_path) as f:
            err = f.read()
        assert proc.returncode == 0, err[-6000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for path in glob.glob(f"/dev/shm/kvstore-{d.pid}-*"):
            os.unlink(path)
    run = load_run(out)
    assert run.tokens == baseline.tokens
    assert run.counters["saved_blocks"] > 0  # the first batch saved while the daemon was alive
    assert run.counters["store_faults"] + run.counters["lookup_errors"] >= 1
    assert run.counters["dropped_saves"] > 0  # the second batch's saves were dropped, not fatal
    assert 1 <= err.count("is unavailable") <= 3  # one warning per connection of the connector, not per call


def test_no_daemon_at_start_is_a_clear_error(no_daemon_runs):
    returncode, stderr = no_daemon_runs[0]
    assert returncode != 0
    assert "no kvstore daemon answers at" in stderr and "kvstore serve --listen" in stderr


def test_no_daemon_at_start_degraded_mode_serves(no_daemon_runs, baseline):
    run = no_daemon_runs[1]
    assert run.tokens == baseline.tokens
    assert run.counters["loaded_blocks"] == 0 and run.counters["dropped_saves"] > 0
    assert run.counters["lookup_errors"] > 0


def test_kv_events_reach_vllms_publisher(engine, workdir, baseline, prompts):
    """With vLLM's KV events on (zmq publisher), what a router subscribed to the engine receives: for every
    block the connector saved, a BlockStored (medium STORAGE, ownership kvstore) under vLLM's own hash of that
    block (the one vLLM's GPU events use) with its tokens; for a prefill instance's promised blocks the store
    does not hold, a BlockRemoved. Fetched from the publisher's replay socket by the engine's process."""
    import random

    rng = random.Random(7)
    promised = [[rng.randrange(3, 1000) for _ in range(2 * BLOCK + 5)]]  # never saved by anyone
    path = os.path.join(workdir, "promised.json")
    with open(path, "w") as f:
        json.dump(promised, f)
    events_dir = short_tmpdir()
    d = Daemon(workdir, capacity="256MiB").start()
    try:
        run = engine.run(url=d.unix_url, hash_seed=1, args=("--kv-events", events_dir, "--promised-prompts", path))
    finally:
        d.stop()
        shutil.rmtree(events_dir, ignore_errors=True)
    assert run.tokens[:len(prompts)] == baseline.tokens
    gpu = {h: e["token_ids"][i * BLOCK:(i + 1) * BLOCK]  # vLLM's own events: block hash -> its tokens
           for e in run.kv_events if e["type"] == "BlockStored" and e["medium"] == "GPU"
           for i, h in enumerate(e["block_hashes"])}
    stored = [e for e in run.kv_events if e["type"] == "BlockStored" and e["medium"] == "STORAGE"]
    removed = [e for e in run.kv_events if e["type"] == "BlockRemoved" and e["medium"] == "STORAGE"]
    assert all(e["ownership"] == "kvstore" for e in stored + removed)
    # every saved block announced once per save, under vLLM's hash, with the tokens vLLM hashed
    assert len(stored) == run.counters["saved_blocks"]
    stored_hashes = {e["block_hashes"][0] for e in stored}
    assert len(stored_hashes) == distinct_full_blocks(prompts + promised)
    for e in stored:
        assert e["block_hashes"][0] in gpu and e["token_ids"] == gpu[e["block_hashes"][0]]
        assert e["block_size"] == BLOCK
    # the promised blocks were missing: announced removed (then computed and saved by this kv_both engine)
    assert run.counters["promised_misses"] == 1 and run.counters["promised_missing_blocks"] == 2
    promised_hashes = [h for e in removed for h in e["block_hashes"]]
    assert len(promised_hashes) == 2 and set(promised_hashes) <= stored_hashes
    assert run.counters["events_dropped"] == 0


@pytest.mark.slow
def test_tensor_parallel_2_prefill_decode(engine, workdir, prompts):
    """TP=2 (two CPU worker processes, each with half the KV heads): a kv_producer saves each rank's shard
    under its rank's fingerprint, a TP=2 kv_consumer loads every full block from the store (both ranks' keys
    present) and generates the tokens the producer computed. Several minutes on a 2-core machine."""
    # Three engine processes (and the daemon) on 2 cores: a store call's 5 s default deadline can pass while the
    # daemon waits for a core, and the fault is then (correctly) a dropped save or a recomputed load.
    # If even that is not enough, a connector marks the store unavailable (and says so): its loads recompute and
    # its saves are dropped, as they must. That run says nothing about TP=2, so it is run once more.
    extra = {"timeout_s": 120.0}
    d = Daemon(workdir, capacity="256MiB").start()

    def run(**kw):
        first = engine.run(url=d.unix_url, **kw)
        return engine.run(url=d.unix_url, **kw) if "is unavailable" in first.stderr else first

    try:
        producer = run(role="kv_producer", args=("--tp", "2"), extra={**extra, "handoff_ttl_s": 3600.0})
        with d.connect("tcp") as s:
            keys = s.keys("kvp/")
            layouts = s.keys("vllm/layouts/")
        consumer = run(role="kv_consumer", args=("--tp", "2", "--no-prefix-cache"), hash_seed=1, extra=extra)
    finally:
        d.stop()
    assert "differs from this instance's layout" not in producer.stderr + consumer.stderr  # ranks are no mismatch
    fingerprints = {k.split("/")[1] for k in keys}
    assert len(fingerprints) == 2 and len(layouts) == 2  # one per TP rank
    assert len(keys) == 2 * distinct_full_blocks(prompts)  # every block, both shards
    why = "\n".join(line for line in consumer.stderr.splitlines() if "kvstore " in line)
    # every full block came from the store
    assert consumer.cached == [claimable_tokens(p) for p in prompts], f"{consumer.counters}\n{why[-4000:]}"
    assert consumer.counters["hit_tokens"] == sum(claimable_tokens(p) for p in prompts)
    assert consumer.tokens == producer.tokens
