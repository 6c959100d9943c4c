"""Cluster of kvstore daemons with membership and the object directory in Redis, with real processes: a real
redis-server on a free loopback port and three ``kvstore serve --cluster`` daemons (A, B, C).

Put on A, get from B and C byte-exact (cluster client and plain daemon clients); Redis round trips per remote
get and per batch; SIGKILL of an owner (KeyNotFoundError once its membership lapses, replicas survive); SIGSTOP and
SIGCONT (bounded errors, rejoin without stale entries); Redis restarted empty (re-register, directory rebuilt);
a prefill process on A and a decode process on B completing a hand-off; superseding writes and removals;
TTL/eviction updating the directory; lazy cleanup; Redis AUTH through the URL.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import kvstore

redis = pytest.importorskip("redis", reason="the redis Python client is not installed (pip install redis)")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not on PATH (apt-get install -y redis-server)", allow_module_level=True)

import handoff_child  # noqa: E402
from cluster_procs import NS, PEER_TIMEOUT, TTL, Cluster, payload  # noqa: E402
from conftest import HELPERS, child_env, free_port, no_hang, session_token_file, short_tmpdir, wait_until  # noqa: E402

from kvstore.cluster.config import ClusterConfig, sentinel_parts  # noqa: E402
from kvstore.cluster.directory import decode_entry, encode_entry  # noqa: E402
from kvstore.cluster.store import ClusterURL, Placement  # noqa: E402
from kvstore.core.meta import ObjectMeta  # noqa: E402
from kvstore.handoff import KVHandoff, request_keys  # noqa: E402

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def cluster():
    workdir = short_tmpdir()
    c = Cluster(workdir)
    yield c
    c.close()
    shutil.rmtree(workdir, ignore_errors=True)


SIZES = [0, 1, 4096, (1 << 20) + 13]


# ---- data path ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["lz4", "lz4-shuffle"])
def test_reads_from_other_nodes_come_compressed_with_peer_compression(mode):
    """``--peer-compression``: B reads A's objects as lz4 frames over the node-to-node tcp path, byte-exact,
    compressible or not, and a reader's checksum check still holds."""
    workdir = short_tmpdir()
    c = Cluster(workdir, names="AB", args=("--peer-transport", "tcp", "--peer-compression", mode))
    try:
        a = c.client("A")
        kv = np.tile(np.arange(4096, dtype=np.float16), 128)  # 1 MiB of KV-like 2-byte values: compresses
        noise = np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()  # does not
        a.put("z/kv", kv)
        a.put("z/noise", noise)
        a.put("z/small", b"s" * 100)  # below the codec's minimum: sent raw
        for transport in ("shm", "tcp"):
            b = c.daemon_client("B", transport)
            assert np.array_equal(b.get("z/kv", verify=True).numpy(), kv)
            assert bytes(b.get("z/noise", verify=True)) == noise
            assert bytes(b.get("z/small")) == b"s" * 100
            b.close()
        # a cluster client's own reads from the members
        with kvstore.connect(c.url + "?node=B", compression=mode, timeout=PEER_TIMEOUT * 5) as reader:
            assert np.array_equal(reader.get("z/kv", verify=True).numpy(), kv)
            assert bytes(reader.get("z/noise", verify=True)) == noise
        stats = c.daemon_client("B").stats()["cluster"]
        assert stats["peer_compression"] == mode
        assert stats["remote_compressed_gets"] >= 4  # the two large objects, read twice
        assert stats["remote_gets"] >= 6
    finally:
        c.close()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.parametrize("reader", ["cluster", "daemon-shm", "daemon-tcp"])
def test_put_on_a_get_from_b_and_c_byte_exact(cluster, reader):
    a = cluster.client("A")
    values = {f"x/{n}": payload(f"x/{n}", n) for n in SIZES}
    for key, value in values.items():
        a.put(key, value)
    arr = np.arange(3 * 5 * 7, dtype=np.float16).reshape(3, 5, 7)
    a.put("x/array", arr, meta={"layer": 3})
    assert all(set(cluster.entries(k)) == {"A"} for k in values)
    for node in "BC":
        s = cluster.client(node) if reader == "cluster" else cluster.daemon_client(node, reader.split("-")[1])
        for key, value in values.items():
            assert bytes(s.get(key)) == value
            buf = bytearray(len(value) + 5)
            assert s.get_into(key, buf, verify=True) == len(value)
            assert bytes(buf[:len(value)]) == value
        obj = s.get("x/array")
        assert np.array_equal(obj.numpy(), arr) and obj.meta.user == {"layer": 3}
        outs = [bytearray(len(v)) for v in values.values()]
        assert s.batch_get_into(list(values), outs) == [len(v) for v in values.values()]
        assert [bytes(o) for o in outs] == list(values.values())
        got = s.get_many([*values, "x/none"])  # a plain shm client leases them all in one get_regions
        assert [bytes(o) for o in got[:-1]] == list(values.values())
        assert isinstance(got[-1], kvstore.KeyNotFoundError)
        for o in got[:-1]:
            o.release()
        assert s.batch_exists(["x/array", "x/none"]) == [True, False]
        with pytest.raises(kvstore.KeyNotFoundError):
            s.get("x/none")
        with pytest.raises(kvstore.BufferTooSmallError):
            s.get_into(f"x/{SIZES[-1]}", bytearray(10))
        assert s.inspect("x/array")["node"] == "A"
        assert set(values) <= set(s.keys("x/"))


def test_remote_get_costs_one_redis_round_trip_and_batches_share_it(cluster):
    a, c = cluster.client("A"), cluster.client("C")
    keys = [f"rt/{i}" for i in range(8)]
    a.batch_put([(k, payload(k, 4096)) for k in keys])
    buf = bytearray(4096)
    c.get_into(keys[0], buf)  # warm the connection to A
    before = c.directory.round_trips
    c.get_into(keys[1], buf)
    assert c.directory.round_trips - before == 1
    before = c.directory.round_trips
    c.batch_get_into(keys, [bytearray(4096) for _ in keys])
    assert c.directory.round_trips - before == 1
    before = c.directory.round_trips
    assert c.batch_exists(keys) == [True] * 8
    assert c.directory.round_trips - before == 1
    # a key on the home daemon, running and caught up, is read through its shared-memory index: no Redis at all
    before = a.directory.round_trips
    a.get_into(keys[2], buf)
    assert a.directory.round_trips - before == 0
    # the daemon path: one lookup per remote get
    b = cluster.daemon_client("B")
    b.get_into(keys[3], buf)
    reads = b.stats()["cluster"]["directory"]["reads"]
    b.get_into(keys[4], buf)
    assert b.stats()["cluster"]["directory"]["reads"] - reads == 1


def test_a_burst_of_puts_costs_few_directory_writes(cluster):
    a = cluster.daemon_client("A")
    flushes = a.stats()["cluster"]["directory"]["flushes"]
    a.batch_put([(f"burst/{i}", b"v" * 100) for i in range(200)])
    stats = a.stats()["cluster"]["directory"]
    assert stats["flushes"] - flushes <= 2 and stats["backlog"] == 0
    assert cluster.client("B").batch_exists([f"burst/{i}" for i in range(200)]) == [True] * 200


def test_replicas_and_balanced_placement(cluster):
    r = cluster.client("A", replicas=2)
    r.put("rep/k", b"twice")
    holders = set(cluster.entries("rep/k"))
    assert len(holders) == 2 and "A" in holders
    balanced = cluster.client(placement="balanced", replicas=3)
    balanced.put("rep/all", b"thrice")
    assert set(cluster.entries("rep/all")) == {"A", "B", "C"}


# ---- failures -----------------------------------------------------------------------------------------
def test_sigkill_owner_keys_missing_once_it_lapses_replicas_survive(cluster):
    a, b, c = cluster.client("A"), cluster.client("B"), cluster.client("C")
    a.put("kill/a", b"on A")
    b.put("kill/b", b"on B")
    c.put("kill/c", b"on C")
    cluster.client("A", replicas=2).put("kill/r", b"on A and one more")
    plain_b = cluster.daemon_client("B")
    assert bytes(plain_b.get("kill/a")) == b"on A"
    cluster.nodes["A"].kill()
    rds = cluster.redis.client()
    # the event: A's membership record lapses in Redis (its TTL runs out with no heartbeat); from then on its
    # keys are misses on every reader. Before it, a get may still find A's entry: it must not hang.
    assert wait_until(lambda: not rds.exists(f"{NS}:node:A"), 10 * TTL), "A's record outlived 10 x node TTL"
    for reader in (b, plain_b):
        with no_hang("a get of a dead node's key"), pytest.raises(kvstore.KeyNotFoundError):
            reader.get("kill/a")
    # A's entry stays dormant while Redis remembers A's epoch (a node cut off from Redis takes its objects back);
    # it is not served meanwhile, and goes once A rejoins under a new epoch or the grace period ends
    assert "A" in cluster.entries("kill/a")
    for reader in (b, c, plain_b):
        assert bytes(reader.get("kill/b")) == b"on B" and bytes(reader.get("kill/c")) == b"on C"
        assert bytes(reader.get("kill/r")) == b"on A and one more"
    assert wait_until(lambda: not b.exists("kill/a"), 2 * TTL)  # listed until A's record lapses


def test_sigstop_partition_bounded_then_rejoins_without_stale_entries(cluster):
    a, c = cluster.client("A"), cluster.client("C")
    b = kvstore.connect(cluster.url + "?node=B", transport="tcp", timeout=PEER_TIMEOUT)
    cluster.stores.append(b)
    a.put("stop/k1", b"old value")
    a.put("stop/k3", b"removed while A was away")
    a.put("stop/keep", b"lost with A's lapse")
    b.put("stop/b", b"B's own")
    rds = cluster.redis.client()
    old_epoch = cluster.nodes["A"].record(rds)["epoch"]
    cluster.nodes["A"].send(signal.SIGSTOP)
    outcomes: list[str] = []

    def lapsed_and_missing() -> bool:
        """One get of A's key (bounded: each call times out after PEER_TIMEOUT); True once A's record has
        lapsed in Redis and the get was a miss, the bounded outcome a partition must end in."""
        with no_hang(f"a get while A was stopped ({outcomes})"):
            try:
                b.get("stop/k1")
                outcomes.append("ok")
            except kvstore.KeyNotFoundError:
                outcomes.append("missing")
            except kvstore.StoreConnectionError:
                outcomes.append("error")
        return outcomes[-1] == "missing" and not rds.exists(f"{NS}:node:A")

    assert wait_until(lapsed_and_missing, 10 * TTL + 2 * PEER_TIMEOUT), f"no bounded miss: {outcomes}"
    assert bytes(b.get("stop/b")) == b"B's own"
    b.put("stop/k1", b"new value, written on B")
    assert b.remove("stop/k3") is False  # A's entry already lapsed: nothing live to remove
    cluster.nodes["A"].send(signal.SIGCONT)
    assert wait_until(lambda: cluster.nodes["A"].record(rds).get("epoch", old_epoch) != old_epoch, 10), \
        cluster.nodes["A"].log()
    plain_a = cluster.daemon_client("A")
    for reader in (plain_a, c, cluster.client("A")):
        assert bytes(reader.get("stop/k1")) == b"new value, written on B"
        for gone in ("stop/k3", "stop/keep"):
            with pytest.raises(kvstore.KeyNotFoundError):
                reader.get(gone)
            assert not reader.exists(gone)
    assert plain_a.stats()["cluster"]["lapses"] == 1
    a2 = cluster.client("A")
    a2.put("stop/new", b"after rejoin")
    try:
        assert bytes(c.get("stop/new")) == b"after rejoin"
    except kvstore.KeyNotFoundError as exc:
        raise AssertionError(f"{exc}; entries {cluster.entries('stop/new')}; {a2.stats()['nodes']['A']}\n"
                             f"{cluster.logs()}") from None
    assert "A" in cluster.entries("stop/new")


def test_redis_restart_reregisters_and_rebuilds_directory(cluster):
    a, b = cluster.client("A"), cluster.client("B")
    a.put("rr/a", payload("rr/a", 100_000))
    b.put("rr/b", payload("rr/b", 5000))
    plain_a = cluster.daemon_client("A")
    cluster.redis.kill()
    assert bytes(plain_a.get("rr/a")) == payload("rr/a", 100_000)  # local reads need no Redis
    plain_a.put("rr/outage", b"written while Redis was down")
    with pytest.raises(kvstore.KeyNotFoundError):
        plain_a.get("rr/b")  # remote keys cannot be resolved meanwhile: a bounded miss
    cluster.redis.start()  # same port, empty
    rds = cluster.redis.client()
    for d in cluster.nodes.values():
        assert wait_until(lambda d=d: d.record(rds).get("pid") == str(d.pid), 10), d.log()
    assert wait_until(lambda: {"A"} <= set(cluster.entries("rr/outage")) and "B" in cluster.entries("rr/b"), 10), \
        cluster.logs()
    assert "A" in cluster.entries("rr/a")
    c = cluster.client("C")
    assert bytes(c.get("rr/a")) == payload("rr/a", 100_000)
    assert bytes(c.get("rr/b")) == payload("rr/b", 5000)
    assert bytes(c.get("rr/outage")) == b"written while Redis was down"
    assert plain_a.stats()["cluster"]["rebuilds"] >= 1
    assert plain_a.stats()["cluster"]["lapses"] == 0


# ---- hand-off across nodes ------------------------------------------------------------------------------
@pytest.mark.parametrize("decoder", ["daemon", "cluster"])
def test_handoff_prefill_on_a_decode_on_b(cluster, decoder):
    layout = handoff_child.layout()
    consumer = cluster.daemon_client("B") if decoder == "daemon" else cluster.client("B")
    h = KVHandoff(consumer, layout, chunk_blocks=1)
    producer = subprocess.Popen([sys.executable, os.path.join(HELPERS, "handoff_child.py"), "publish",
                                 cluster.url + "?node=A", "req1", "6"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=child_env())
    try:
        dst = [torch.zeros(layout.cache_shape(8)) for _ in range(layout.num_layers)]
        meta = h.fetch("req1", dst, [7, 6, 5, 4, 3, 2], timeout=30)  # waits: published on A, notified on B
        out, err = producer.communicate(timeout=30)
        assert producer.returncode == 0, err.decode()[-3000:]
    finally:
        if producer.poll() is None:
            producer.kill()
    assert meta.num_blocks == 6 and b"published" in out
    src = handoff_child.caches(6)
    for c_src, c_dst in zip(src, dst, strict=True):
        assert torch.equal(c_dst[:, [7, 6, 5, 4, 3, 2]], c_src[:, :6])
    keys = request_keys("req1")
    c = cluster.client("C")
    assert not c.exists(keys["meta"]) and not any(c.batch_exists(list(meta.chunk_keys)))
    plain_a = cluster.daemon_client("A")  # A dropped its chunks when B removed them
    assert wait_until(lambda: not any(k.startswith("hf/req1/chunk") for k in plain_a.keys("hf/")), 5)


def test_a_prefix_stored_on_one_node_is_referenced_by_a_producer_on_another(cluster):
    """Prefix chunks one producer stored through node A are found (and referenced as they are, never stored
    again) by a producer of the same tokens through node B: both requests fetch A's bytes."""
    layout = handoff_child.layout()
    tokens = list(range(4 * layout.block_size))
    first, second = handoff_child.caches(8, seed=1), handoff_child.caches(8, seed=2)
    KVHandoff(cluster.client("A"), layout, chunk_blocks=2).publish(
        "pa", first, [0, 1, 2, 3], num_tokens=len(tokens), token_ids=tokens).wait()
    hb = KVHandoff(cluster.client("B"), layout, chunk_blocks=2)
    meta = hb.publish("pb", second, [0, 1, 2, 3], num_tokens=len(tokens), token_ids=tokens).wait()
    assert all(set(cluster.entries(key)) == {"A"} for key in meta.chunk_keys)
    for rid in ("pa", "pb"):
        dst = [torch.zeros(layout.cache_shape(8)) for _ in range(layout.num_layers)]
        hb.fetch(rid, dst, [4, 5, 6, 7], num_tokens=len(tokens))
        for c_src, c_dst in zip(first, dst, strict=True):
            assert torch.equal(c_dst[:, [4, 5, 6, 7]], c_src[:, [0, 1, 2, 3]]), rid


# ---- directory upkeep ------------------------------------------------------------------------------------
def test_superseding_write_and_removal_reach_every_node(cluster):
    a, b = cluster.client("A"), cluster.client("B")
    plain_a = cluster.daemon_client("A")
    a.put("sup/k", b"first, on A")
    b.put("sup/k", b"second, on B")
    assert set(cluster.entries("sup/k")) == {"B"}
    assert wait_until(lambda: bytes(plain_a.get("sup/k")) == b"second, on B", 5)  # A dropped its copy
    r = cluster.client("A", replicas=3)
    r.put("sup/r", b"same bytes everywhere")
    assert set(cluster.entries("sup/r")) == {"A", "B", "C"}  # equal content: copies coexist
    assert cluster.client("C").remove("sup/r") is True
    assert cluster.entries("sup/r") == {}
    assert wait_until(lambda: not any(cluster.daemon_client(n).exists("sup/r") for n in "ABC"), 5)
    assert cluster.client("C").remove("sup/r") is False


def test_ttl_and_eviction_update_the_directory(cluster):
    a, c = cluster.client("A"), cluster.client("C")
    a.put("up/ttl", b"short-lived", ttl=0.5)
    assert c.exists("up/ttl")
    assert wait_until(lambda: cluster.entries("up/ttl") == {}, 5)
    with pytest.raises(kvstore.KeyNotFoundError):
        c.get("up/ttl")
    a.put("up/evict", b"evict me")
    assert c.evict("up/evict") is True  # C asks A, the owner
    assert wait_until(lambda: cluster.entries("up/evict") == {}, 5)


def test_entry_of_a_missing_object_is_cleaned_on_first_miss(cluster):
    rds = cluster.redis.client()
    epoch = cluster.nodes["B"].record(rds)["epoch"]
    ghost = encode_entry(epoch, ObjectMeta(key="ghost", size=3, checksum=1, version=7))
    rds.hset(f"{NS}:obj:ghost", "B", ghost)
    rds.hset(f"{NS}:obj:stale", "B", encode_entry("old-epoch", ObjectMeta(key="stale", size=3)))
    c = cluster.client("C")
    with pytest.raises(kvstore.KeyNotFoundError):
        c.get("ghost")
    assert cluster.entries("ghost") == {}
    assert not c.exists("stale") and cluster.entries("stale") == {}


def test_redis_auth_passes_through_the_url():
    workdir = short_tmpdir()
    try:
        c = Cluster(workdir, password="s3cret")
        try:
            a, b = c.client("A"), c.client("B")
            a.put("auth/k", b"behind a password")
            assert bytes(b.get("auth/k")) == b"behind a password"
            with pytest.raises(kvstore.AuthenticationError):
                kvstore.connect(f"kvcluster://:wrong@127.0.0.1:{c.redis.port}/0", timeout=2)
            bad = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--listen",
                                  f"tcp://127.0.0.1:{free_port()}", "--cluster",
                                  f"redis://:wrong@127.0.0.1:{c.redis.port}/0", "--node-id", "D",
                                  "--token-file", session_token_file()],
                                 capture_output=True, text=True, timeout=60, env=child_env(), cwd=workdir)
            assert bad.returncode == 2 and "refused the credentials" in bad.stderr, bad.stderr[-2000:]
        finally:
            c.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_members_find_redis_through_sentinel():
    workdir = short_tmpdir()
    try:
        c = Cluster(workdir, sentinel=True)
        try:
            c.client("A").put("sentinel/k", b"found through Sentinel")
            assert bytes(c.client("C").get("sentinel/k")) == b"found through Sentinel"
            assert bytes(c.daemon_client("B").get("sentinel/k")) == b"found through Sentinel"
        finally:
            c.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# ---- configuration (no daemons) ----------------------------------------------------------------------------
def test_cluster_urls_and_config_validation():
    u = ClusterURL.parse("kvcluster://:pw@10.0.0.5:6380/2?node=n1&replicas=2&placement=balanced&ssl_ca_certs=x")
    assert u.redis_url == "redis://:pw@10.0.0.5:6380/2?ssl_ca_certs=x"
    assert (u.node, u.replicas, u.placement) == ("n1", 2, Placement.BALANCED)
    assert ClusterURL.parse("kvclusters://h:1/0").redis_url == "rediss://h:1/0"
    assert ClusterURL.parse("kvcluster+sentinel://:pw@s1:26379,s2:26380/svc/3?node=n").redis_url == \
        "redis+sentinel://:pw@s1:26379,s2:26380/svc/3"
    assert sentinel_parts("redis+sentinel://:pw@s1:26379,s2/svc/3") == ([("s1", 26379), ("s2", 26379)], "svc", 3, "pw")
    for bad in ("redis://h:1/0", "kvcluster://h:1/0?replicas=0", "kvcluster://h:1/0?placement=far",
                "kvcluster://h:1/0?node=a%20b"):
        with pytest.raises(kvstore.InvalidArgumentError):
            ClusterURL.parse(bad)
    ok = dict(redis_url="redis://h:1/0", node_id="n1", advertise="tcp://10.0.0.1:7000")
    ClusterConfig(**ok)
    for change in ({"advertise": "unix:///tmp/x"}, {"node_id": "has space"}, {"node_ttl": 0.1},
                   {"redis_url": "http://h"}, {"peer_transport": "carrier-pigeon"}, {"peer_compression": "zstd"},
                   {"redis_url": "redis+sentinel://s1:26379"}):
        with pytest.raises(kvstore.InvalidArgumentError):
            ClusterConfig(**{**ok, **change})
    meta = ObjectMeta(key="k", size=5, checksum=0xABC, version=9, user={"a": 1})
    entry = decode_entry("k", "n1", encode_entry("ep-1", meta), "tcp://x:1", "host")
    assert (entry.epoch, entry.checksum, entry.version, entry.size, entry.meta) == \
        ("ep-1", f"{0xABC:016x}", 9, 5, meta)
    assert decode_entry("k", "n1", b"garbage", "", "") is None


def test_cluster_client_takes_device_memory_and_reservations(cluster):
    """The cluster client supplies device memory (staged through the host) and in-place writes (staged and
    committed through its batch put), so CUDA tensors and reserve() work on a cluster as on one daemon."""
    import fake_cuda

    from kvstore.memory.device import DeviceBuffer

    a, b = cluster.client("A"), cluster.client("B")
    src = np.frombuffer(payload("dev", 70_000), np.uint8).copy()
    assert a.device_memory() is not None
    a.put("dev/k", DeviceBuffer(src.ctypes.data, src.nbytes, 0, 0, fake_cuda, owner=src))
    out = np.zeros_like(src)
    assert b.get_into("dev/k", DeviceBuffer(out.ctypes.data, out.nbytes, 0, 0, fake_cuda, owner=out),
                      verify=True) == src.nbytes
    assert np.array_equal(out, src)
    with a.batch_reserve([("res/1", 10), ("res/2", 5)]) as (x, y):
        x[:], y[:] = b"0123456789", b"abcde"
    assert bytes(b.get("res/1")) == b"0123456789" and bytes(b.get("res/2")) == b"abcde"
