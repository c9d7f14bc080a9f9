"""kvforge.vllm in vLLM's CPU engine: the tokens of a multi-turn trace served from kvforge's store equal a
run without the connector (greedy), the hits show in vLLM's own metrics, a quantized store holds what HF
transformers' own model computes for the same tokens, retention priorities hold, and the KV events
reach a subscriber through vLLM's own publisher."""
import numpy as np
import pytest
import torch

from conftest import BLOCK, make_llm, metric, run_trace

CONVERSATIONS = [70, 100, 33]  # prompt lengths: a partial block, three full ones and a bit, one and a bit
TURNS = 3


def worker_store():
    """The worker's store, where the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    return get_kv_transfer_group()._store


# The exact-tokens runs prefill in chunks of 64 tokens, so that a prompt's blocks fill over several steps.
CHUNKED = {"max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = make_llm(model_dir, **CHUNKED)
    answers, _ = run_trace(llm, CONVERSATIONS, TURNS)
    assert metric(llm, "vllm:external_prefix_cache_hits") == 0
    llm.llm_engine.engine_core.shutdown()
    return answers


def previous_prompt_blocks(answers):
    """Tokens of full blocks of each turn's prompt, which the next turn's prompt starts with."""
    total, lengths = 0, list(CONVERSATIONS)
    for turn in answers[:-1]:
        total += sum(n // BLOCK * BLOCK for n in lengths)
        lengths = [n + len(a) + 20 for n, a in zip(lengths, turn)]
    return total


def test_a_bf16_store_serves_vllm_the_same_tokens_and_vllm_counts_the_hits(model_dir, reference, tmp_path,
                                                                          monkeypatch):
    import msgspec
    import zmq
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import KVEventBatch

    import kvforge.kv_events
    endpoint = f"ipc://{tmp_path}/events"
    # vLLM's default: the engine core and its worker each in a process of their own, the scheduler's
    # shadow of the store apart from the worker's store.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    llm = make_llm(model_dir, {"host_bytes": 8 << 20}, **CHUNKED,
                   kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    import time
    time.sleep(0.5)  # a subscriber joins before the first event is published
    answers, _ = run_trace(llm, CONVERSATIONS, TURNS)
    assert answers == reference
    hits = metric(llm, "vllm:external_prefix_cache_hits")
    assert hits % BLOCK == 0 and hits >= previous_prompt_blocks(answers) > 0

    # vLLM's own publisher wrote both vLLM's events (its own cache, "GPU") and the store's ("CPU"), in its
    # current wire form: kvforge.kv_events.decode reads each batch as vLLM's own decoder does.
    vllm_decoder = msgspec.msgpack.Decoder(KVEventBatch)
    seen = {}
    while sub.poll(500):
        payload = sub.recv_multipart()[-1]
        theirs = vllm_decoder.decode(payload)
        _, ours, _ = kvforge.kv_events.decode(payload)
        assert [e["type"] for e in ours] == [type(e).__name__ for e in theirs.events]
        for mine, vllms in zip(ours, theirs.events):
            if mine["type"] != "AllBlocksCleared":
                assert mine["block_hashes"] == list(vllms.block_hashes) and mine["medium"] == vllms.medium
            seen.setdefault((mine["type"], mine.get("medium")), 0)
            seen[(mine["type"], mine.get("medium"))] += 1
    assert seen.get(("BlockStored", "CPU"), 0) > 0, seen  # the store's
    assert seen.get(("BlockStored", "GPU"), 0) > 0, seen  # vLLM's own cache's (its name for it, on a CPU too)
    # And what kvforge encodes, vLLM's decoder reads.
    events = [{"type": "BlockStored", "block_hashes": [5, 6], "parent_block_hash": None, "token_ids": list(range(64)),
               "block_size": BLOCK, "lora_id": None, "medium": "CPU", "lora_name": None},
              {"type": "BlockRemoved", "block_hashes": [6], "medium": "CPU"}, {"type": "AllBlocksCleared"}]
    batch = vllm_decoder.decode(kvforge.kv_events.encode(events, ts=1.5))
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert batch.events[0].block_hashes == [5, 6] and batch.events[0].token_ids == list(range(64))
    assert batch.events[1].medium == "CPU" and batch.ts == 1.5
    llm.llm_engine.engine_core.shutdown()


def test_an_int8_store_holds_what_hf_computes_and_keeps_high_priority_blocks(model_dir, reference):
    llm = make_llm(model_dir, {"storage": "int8", "host_bytes": 2 << 20})
    store = worker_store()
    assert not store.shadow and store.descriptor.storage == "int8" and store.descriptor.layout == "flashinfer_paged_hnd"
    answers, prompts = run_trace(llm, CONVERSATIONS, 2)
    assert metric(llm, "vllm:external_prefix_cache_hits") >= previous_prompt_blocks(answers) > 0

    # Retention: a prompt kept at priority 100 outlives a flood that evicts one at the default priority.
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    rng = np.random.default_rng(5)
    kept, dropped = ([int(t) for t in rng.integers(1, 500, 4 * BLOCK + 1)] for _ in range(2))
    for prompt, priority in ((kept, 100), (dropped, None)):
        extra = {"kv_transfer_params": {"kvforge_priority": priority}} if priority else {}
        llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                     SamplingParams(max_tokens=1, detokenize=False, extra_args=extra), use_tqdm=False)
    assert store.cached(kept) == store.cached(dropped) == 4 * BLOCK
    capacity = store.manager.available_blocks * store.page_size
    flood = [[int(t) for t in rng.integers(1, 500, 8 * BLOCK + 1)] for _ in range(capacity // (8 * BLOCK) + 2)]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in flood], SamplingParams(max_tokens=1, detokenize=False),
                 use_tqdm=False)
    assert store.cached(dropped) < 4 * BLOCK
    assert store.cached(kept) == 4 * BLOCK
    # A priority out of range is said in the log and the default kept: the engine serves on.
    odd = [int(t) for t in rng.integers(1, 500, 2 * BLOCK + 1)]
    out = llm.generate([TokensPrompt(prompt_token_ids=odd)], SamplingParams(
        max_tokens=2, detokenize=False, extra_args={"kv_transfer_params": {"kvforge_priority": 500}}), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2 and store.cached(odd) == 2 * BLOCK
    # The store's K/V of the kept prompt's blocks, against HF transformers' own Llama in fp32 (last: a pin
    # here changes the worker's replica of the store alone). int8's scale is per token and head: half a
    # step each way is amax / 254, and vLLM's own bf16 arithmetic adds its share.
    assert_store_holds_what_hf_computes(model_dir, store, kept, lambda amax: amax / 127 + 0.03 * amax + 1e-3)
    llm.llm_engine.engine_core.shutdown()


def assert_store_holds_what_hf_computes(model_dir, store, tokens, bound_of):
    import transformers
    seq, end = 1 << 40, len(tokens) // BLOCK * BLOCK  # a sequence id apart from the scheduler's log's
    covered = min(store.manager.add(seq, tokens[:end] + [0]), end)  # the worker replica's own manager, directly
    assert covered >= BLOCK
    pages = store.manager.pages(seq)
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        cache = model(torch.tensor([tokens[:covered]]), use_cache=True).past_key_values
    d = store.descriptor
    for layer in range(d.layers):
        k = torch.empty((d.heads, covered, d.head_dim), dtype=torch.bfloat16)
        v = torch.empty_like(k)
        store.cache.gather(layer, k, v, row=0, pages=torch.tensor(pages, dtype=torch.int32), begin=0, end=covered)
        for got, want in ((k, cache.layers[layer].keys[0]), (v, cache.layers[layer].values[0])):
            bound = bound_of(want.abs().amax(dim=-1, keepdim=True))  # from each token and head's [H, T, 1] amax
            err = (got.float() - want).abs()
            assert (err <= bound).all(), f"{d.name} layer {layer}: {(err / bound).max():.2f}x the bound"
    store.manager.free(seq)


@pytest.mark.parametrize("storage,layout,step", [("fp8_e4m3", "flashinfer_paged_hnd", 1 / 16),
                                                 ("fp4_e2m1", "paged_nvfp4", 1 / 5)])
def test_fp8_and_nvfp4_stores_hold_what_hf_computes(model_dir, storage, layout, step):
    # fp8 e4m3 keeps 3 mantissa bits under a scale a token and head: half a step is 1/16 of a value at
    # most. NVFP4 keeps e2m1 codes (0.5 .. 6) under an fp8 scale a block of 16: half a step is at most a
    # sixth of the block's amax, and its fp8 scale's own rounding adds to it.
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    llm = make_llm(model_dir, {"storage": storage, "host_bytes": 1 << 20})
    store = worker_store()
    assert store.descriptor.layout == layout
    prompt = [int(t) for t in np.random.default_rng(9).integers(1, 500, 4 * BLOCK + 1)]
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    assert_store_holds_what_hf_computes(model_dir, store, prompt, lambda amax: amax * step + 0.03 * amax + 1e-3)
    llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("extra,message", [
    ({"host_byte": 1 << 20}, r"kv_connector_extra_config\.host_byte: not a kvforge.vllm setting \(allowed: "),
    ({"host_bytes": "1GB"}, r"kv_connector_extra_config\.host_bytes: '1GB' is not a size in bytes \(allowed: "),
    ({"priority": 101}, r"kv_connector_extra_config\.priority: 101 \(allowed: an integer in \[0, 100\]\)"),
    ({"storage": 8}, r"kv_connector_extra_config\.storage: 8 is not a dtype name \(allowed: "),
])
def test_a_bad_setting_is_refused_with_the_key_and_what_is_allowed(model_dir, extra, message):
    with pytest.raises(Exception, match=message):
        make_llm(model_dir, extra)


def test_vllms_own_sha256_cbor_block_hashes_are_those_kvforge_computes(monkeypatch):
    # kvforge.kv_events.vllm_block_hash against vLLM's own hash_block_tokens and sha256_cbor, seeded as
    # vLLM seeds them where PYTHONHASHSEED is unset and where it is set; a salt goes in extra_keys.
    import random

    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    import kvforge.kv_events as kv_events
    sha256_cbor = get_hash_fn_by_name("sha256_cbor")
    tokens = [random.Random(4).randrange(0, 2 ** 31) for _ in range(3 * BLOCK + 5)]
    for seed in (None, "0", "1234"):
        if seed is None:
            monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        else:
            monkeypatch.setenv("PYTHONHASHSEED", seed)
        kv_cache_utils.init_none_hash(sha256_cbor)
        for salt in (0, 2 ** 40 + 3):
            parent, theirs = None, []
            for i in range(0, len(tokens) - BLOCK + 1, BLOCK):
                parent = kv_cache_utils.hash_block_tokens(sha256_cbor, parent, tokens[i:i + BLOCK],
                                                          (salt,) if salt else None)
                theirs.append(int.from_bytes(parent, "big") & kv_events.MASK)
            ours = kv_events.prompt_hashes(tokens, BLOCK, salt=salt, scheme="vllm_sha256_cbor",
                                           seed=seed or kv_events.VLLM_SEED)
            assert ours == theirs and len(ours) == 3
