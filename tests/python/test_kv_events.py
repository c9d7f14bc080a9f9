"""KV events, the host tier and retention from Python: a router written here replays two instances'
msgpack event batches through a random trace and holds exactly each instance's cached blocks, per
medium (device and host tier), at every step; the block hashes it checks are computed here in plain
Python from docs/memory.md, kvforge's construction or vLLM's (SHA-256 of canonical CBOR, RFC 8949,
encoded here; and hashes recorded from vLLM v0.17.0's own code); its prefix lookups agree with each instance's own, and conversations
that return for another turn after other traffic come back from the host tier (the model-based C++
test checks their K/V); a system prompt at priority 100 outlives a flood; bad ranges are refused by
name."""

import hashlib
import random

import msgpack
import pytest

import kvforge
import kvforge.kv_events as kv_events

VARIANT = "vllm_paged_nhd.tiny.fp32"


def documented_hash(parent, salt, tokens):
    """docs/memory.md, "Block hashes", step by step."""
    mask = (1 << 64) - 1

    def mix(h, v):
        h ^= (v + 0x9E3779B97F4A7C15 + ((h << 6) & mask) + (h >> 2)) & mask
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & mask
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & mask
        return h ^ (h >> 31)

    h = mix(parent if parent is not None else 0, salt)
    for t in tokens:
        h = mix(h, t % (1 << 32))
    return h


def cbor(item):
    """RFC 8949's encoding of the few items vLLM's block hash holds, each head in its shortest form
    (section 4.2.1): unsigned and negative integers, byte and text strings, arrays, null."""
    def head(major, n):
        if n < 24:
            return bytes([32 * major + n])
        size = next(s for s in (1, 2, 4, 8) if n < 256 ** s)
        return bytes([32 * major + {1: 24, 2: 25, 4: 26, 8: 27}[size]]) + n.to_bytes(size, "big")
    if item is None:
        return b"\xf6"
    if isinstance(item, int):
        return head(0, item) if item >= 0 else head(1, -1 - item)
    if isinstance(item, bytes):
        return head(2, len(item)) + item
    if isinstance(item, str):
        return head(3, len(item.encode())) + item.encode()
    return head(4, len(item)) + b"".join(cbor(x) for x in item)


class VllmHash:
    """vLLM's sha256_cbor block hash (vllm/v1/core/kv_cache_utils.py, hash_block_tokens): SHA-256 of
    CBOR [parent digest, token ids, extra keys]; the chain starts at SHA-256 of CBOR(seed). Events carry
    a digest's low 64 bits; the router keeps each digest it computed to chain the next block."""

    def __init__(self, seed):
        self.none = hashlib.sha256(cbor(seed)).digest()
        self.digests = {}

    def __call__(self, parent, salt, tokens):
        digest = hashlib.sha256(cbor([self.none if parent is None else self.digests[parent], list(tokens),
                                      None if salt == 0 else [salt]])).digest()
        key = int.from_bytes(digest[24:], "big")
        self.digests[key] = digest
        return key


class Router:
    """What a KV-aware router knows of each instance: the hashes its events say it holds."""

    def __init__(self, instances, hash=documented_hash, form="map"):
        # A CPU cache, its host tier and its disk tier.
        self.held = [{"CPU": set(), "HOST": set(), "DISK": set()} for _ in range(instances)]
        self.seen = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self.hash, self.form = hash, form

    def receive(self, instance, data):
        _, events, rank = kv_events.decode(data)
        assert rank == instance
        raw = msgpack.unpackb(data, raw=False)  # the wire: vLLM's tagged maps, or its positional arrays, tag first
        for event, item in zip(events, raw[1]):
            if self.form == "map":
                assert isinstance(item, dict) and item["type"] == event["type"]
                stored = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"]
                fields = [item[name] for name in stored] if event["type"] == "BlockStored" else None
            else:
                assert isinstance(item, list) and item[0] == event["type"]
                fields = item[1:8]
            self.seen[event["type"]] += 1
            if event["type"] == "BlockStored":
                size, salt = event["block_size"], (event["extra_keys"] or [[0]])[0][0]
                parent = event["parent_block_hash"]
                assert len(event["token_ids"]) == size * len(event["block_hashes"])
                held = self.held[instance][event["medium"]]
                assert fields == [event["block_hashes"], parent, event["token_ids"], size, None, event["medium"], None]
                for i, h in enumerate(event["block_hashes"]):
                    assert h == self.hash(parent, salt, event["token_ids"][i * size:(i + 1) * size])
                    assert h not in held, "stored twice"
                    held.add(h)
                    parent = h
            elif event["type"] == "BlockRemoved":
                for h in event["block_hashes"]:
                    self.held[instance][event["medium"]].remove(h)
            else:
                for held in self.held[instance].values():
                    held.clear()

    def cached_tokens(self, instance, prompt, block_size, salt):
        """Tokens of `prompt` this instance holds, leaving its last token to compute (as add() does)."""
        parent, covered = None, 0
        for start in range(0, len(prompt) - 1 - block_size + 1, block_size):
            parent = self.hash(parent, salt, prompt[start:start + block_size])
            if all(parent not in held for held in self.held[instance].values()):
                break
            covered += block_size
        return covered


@pytest.mark.parametrize("scheme,form", [("kvforge", "map"), ("vllm_sha256_cbor", "map"), ("kvforge", "array")])
def test_a_router_replaying_the_events_holds_each_instances_blocks_at_every_step(tmp_path, scheme, form):
    rng = random.Random(5)
    instances = []
    for i in range(2):
        cache = kvforge.create(VARIANT, pages=12)
        # Instance 0 demotes evicted blocks to a host tier of 4 pages and a disk tier of 16, and copies host-tier
        # hits back on its own thread (promote_ahead: the events are add()'s all the same); instance 1 has none.
        tiers = dict(host_blocks=4, disk_path=str(tmp_path / "blocks"), disk_blocks=16, promote_ahead=True) if i == 0 else {}
        instances.append(kvforge.SequenceManager(cache, kv_events=True, salt=7 * i, block_hash=scheme,
                                                 hash_seed="kvforge-test", **tiers))
    block = kvforge.describe(VARIANT).page_size
    systems = [[1000 * s + i for i in range(2 * block + 3)] for s in range(3)]
    router = Router(2, documented_hash if scheme == "kvforge" else VllmHash("kvforge-test"), form)
    live, next_id = [[], []], 0
    finished = [[], []]  # conversations that may return for another turn
    for step in range(300):
        i = rng.randrange(2)
        m = instances[i]
        if step % 150 == 149:  # now and then: drain the instance, then clear its cache (reset_prefix_cache)
            for seq in live[i]:
                m.free(seq)
            live[i] = []
            m.reset_prefix_cache()
        elif rng.random() < 0.5 or not live[i]:
            if finished[i] and rng.random() < 0.4:  # a conversation's next turn
                prompt = finished[i].pop(rng.randrange(len(finished[i]))) + [rng.randrange(50) for _ in range(3)]
            else:
                prompt = rng.choice(systems) + [rng.randrange(50) for _ in range(rng.randrange(1, 2 * block))]
            salt = 7 * i
            assert router.cached_tokens(i, prompt, block, salt) == m.cached_prefix(prompt)
            try:
                m.add(next_id, prompt)
                live[i].append(next_id)
                next_id += 1
            except kvforge.errors.CapacityError:
                pass
        elif rng.random() < 0.6:
            seq = rng.choice(live[i])
            try:
                m.append(seq, [rng.randrange(50) for _ in range(rng.randrange(1, block + 2))])
            except kvforge.errors.CapacityError:
                pass
        else:
            seq = live[i].pop(rng.randrange(len(live[i])))
            finished[i].append(list(m.tokens(seq)))
            m.free(seq)
        m.step(live[i])
        router.receive(i, kv_events.encode(m.take_kv_events(), ts=float(step), data_parallel_rank=i, form=form))
        for j in range(2):
            assert router.held[j]["CPU"] == set(instances[j].cached_block_hashes()), f"step {step}, instance {j}"
            assert router.held[j]["HOST"] == set(instances[j].host_cached_block_hashes()), f"step {step}, instance {j}"
            assert router.held[j]["DISK"] == set(instances[j].disk_cached_block_hashes()), f"step {step}, instance {j}"
    assert sum(m.stats["evictions"] for m in instances) > 0, "the trace never evicted"
    assert instances[0].stats["promoted_blocks"] > 0, "no prefix hit came back from a lower tier"
    assert instances[0].stats["disk_reads"] > 0, "no prefix hit came back from the disk tier"
    assert instances[0].stats["promoted_ahead"] > 0, "no host-tier hit was copied ahead"
    assert all(router.seen.values()), router.seen


def test_the_packaged_hash_is_the_documented_one():
    tokens = list(range(-3, 40))
    assert kv_events.prompt_hashes(tokens, 16, salt=9) == [
        documented_hash(None, 9, tokens[0:16]), documented_hash(documented_hash(None, 9, tokens[0:16]), 9, tokens[16:32])]
    vllm = VllmHash(kv_events.VLLM_SEED)
    big = [0, 23, 24, 255, 256, 65535, 65536, 2 ** 32 - 1, 2 ** 31 - 1, 70000, 5, 6, 7, 8, 9, 10] * 2  # every head size
    assert kv_events.prompt_hashes(big + [1], 16, salt=2 ** 40, scheme="vllm_sha256_cbor") == [
        vllm(None, 2 ** 40, big[:16]), vllm(vllm(None, 2 ** 40, big[:16]), 2 ** 40, big[16:])]
    with pytest.raises(ValueError, match="scheme"):
        kv_events.prompt_hashes(tokens, 16, scheme="md5")


def test_vllm_hashes_are_those_recorded_from_vllms_own_code():
    """vLLM v0.17, PYTHONHASHSEED=0, sha256_cbor, 16-token blocks (loxilb-inference-gateway's
    kv_hash_vectors.json): NONE_HASH, and two chained blocks' integer hashes as its events carry them."""
    assert VllmHash("0").none.hex() == "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    prompt = [101 * i for i in range(1, 33)] + [1]
    published = [7876691182959014722, 8769878286166771163]
    assert kv_events.prompt_hashes(prompt, 16, scheme="vllm_sha256_cbor", seed="0") == published
    manager = kvforge.SequenceManager(kvforge.create(VARIANT, pages=4), kv_events=True, block_hash="vllm_sha256_cbor",
                                      hash_seed="0")
    manager.add(0, prompt)
    manager.step([0])
    (stored,) = manager.take_kv_events()
    assert stored["block_hashes"] == published and stored["parent_block_hash"] is None
    with pytest.raises(kvforge.errors.ArgumentError, match="block_hash.*allowed: kvforge, vllm_sha256_cbor"):
        kvforge.SequenceManager(kvforge.create(VARIANT, pages=4), block_hash="sha1")


def test_a_system_prompt_at_priority_100_outlives_a_flood():
    cache = kvforge.create(VARIANT, pages=16)
    m = kvforge.SequenceManager(cache)
    block = kvforge.describe(VARIANT).page_size
    system = list(range(2 * block + 1))
    m.add(0, system)
    m.set_retention(0, [(0, 2 * block, 100)])
    m.step([0])
    m.free(0)
    for r in range(1, 12):  # 11 requests of 4 pages, 3 of them cached at priority 0: the pool twice
        prompt = [10000 * r + i for i in range(3 * block + 1)]
        m.add(r, prompt)
        m.set_retention(r, [(0, len(prompt), 0, 30.0)])
        m.step([r])
        m.free(r)
    assert m.stats["evictions"] > 16
    assert m.cached_prefix(system) == 2 * block
    m.check_invariants()


def test_bad_ranges_are_refused_by_name():
    m = kvforge.SequenceManager(kvforge.create(VARIANT, pages=4))
    m.add(0, [1, 2, 3])
    for ranges, argument in (([(0, 2, 101)], "ranges[0].priority"), ([(0, 2, 5), (3, 1, 5)], "ranges[1]"),
                             ([(0, 2)], "ranges[0]"), ([("a", 2, 5)], "ranges[0]"), ([(0, 2, 5, -1.0)], "ranges[0].seconds"),
                             ("x", "ranges")):
        with pytest.raises(kvforge.errors.ArgumentError) as e:
            m.set_retention(0, ranges)
        assert e.value.argument == argument
    with pytest.raises(ValueError):
        kv_events.encode([{"type": "Nothing"}])
    with pytest.raises(ValueError, match="form"):
        kv_events.encode([], form="tuple")


def test_prefetch_reads_disk_blocks_ahead_of_the_add_that_promotes_them(tmp_path):
    cache = kvforge.create(VARIANT, pages=6)
    m = kvforge.SequenceManager(cache, host_blocks=4, disk_path=str(tmp_path / "blocks"), disk_blocks=32)
    block = kvforge.describe(VARIANT).page_size
    prompts = [[1000 * p + i for i in range(2 * block + 1)] for p in range(10)]
    for seq, prompt in enumerate(prompts):  # through 6 device pages and 4 host pages: the first ones end on disk
        m.add(seq, prompt)
        m.step([seq])
        m.free(seq)
    assert set(kv_events.prompt_hashes(prompts[0], block)) <= set(m.disk_cached_block_hashes())
    assert m.prefetch(prompts[0]) == 2 and m.prefetch(prompts[0]) == 0
    assert m.add(100, prompts[0]) == 2 * block
    assert m.stats["read_ahead_hits"] == 2 and m.stats["disk_reads"] == 2
    m.check_invariants()


def test_decode_reads_a_batch_as_todays_vllm_publishes_it_and_the_older_form_beside_it():
    # An event as vLLM 0.26 published it (captured in volcano-sh/kthena#1535): a tagged map with fields
    # kvforge does not write (extra_keys, group_idx, kv_cache_spec_kind), beside the positional form.
    published = {"type": "BlockStored", "block_hashes": [15760518052499183552], "parent_block_hash": None,
                 "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
                 "extra_keys": [None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    older = ["BlockRemoved", [15760518052499183552], "GPU"]
    ts, events, rank = kv_events.decode(msgpack.packb([1789095808.8, [published, older, {"type": "AllBlocksCleared"}], 0]))
    assert (ts, rank) == (1789095808.8, 0)
    assert events[0] == published
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [15760518052499183552], "medium": "GPU", "group_idx": None}
    assert events[2] == {"type": "AllBlocksCleared"}
    with pytest.raises(ValueError, match="not a KV event"):
        kv_events.decode(msgpack.packb([1.0, [{"type": "Nothing"}]]))
    # And what encode writes in each form reads back the same.
    for form in ("map", "array"):
        _, again, _ = kv_events.decode(kv_events.encode(events[:2], ts=1.0, form=form))
        assert again[1] == events[1] and again[0]["block_hashes"] == published["block_hashes"]


def test_vllms_own_classes_decode_both_forms():
    kv = pytest.importorskip("vllm.distributed.kv_events",
                             reason="vLLM is not installed in this environment (its CPU wheel pins a torch that PyPI does not serve; this test runs where vLLM is)")
    import msgspec
    decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
    m = kvforge.SequenceManager(kvforge.create(VARIANT, pages=8), kv_events=True)
    m.add(0, list(range(3 * kvforge.describe(VARIANT).page_size + 1)))
    m.step([0])
    m.free(0)
    m.reset_prefix_cache()
    events = m.take_kv_events()
    for form in ("map", "array"):
        batch = decoder.decode(kv_events.encode(events, ts=2.0, data_parallel_rank=1, form=form))
        assert [type(e).__name__ for e in batch.events] == [e["type"] for e in events]
        stored = next(e for e in batch.events if type(e).__name__ == "BlockStored")
        assert list(stored.block_hashes) == events[0]["block_hashes"] and stored.medium == events[0]["medium"]
