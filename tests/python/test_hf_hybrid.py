"""Hybrid models of transformers through kvforge.hf: attention layers in a kvforge variant, linear-attention
and state-space layers' states in kvforge.StatePool slots. The reference is transformers' own
DynamicCache on the same model, random weights from a tiny config made here (nothing downloaded):

  - Qwen3-Next (gated delta net), Bamba (Mamba-2) and LFM2 (short convolutions) generate the same
    tokens for a batch of two prompts of different lengths, and every state ends bitwise equal to
    DynamicCache's;
  - a batch of sequences whose state slots are not consecutive, in either order, and a batch whose
    states lie in the cache's own pages: DynamicCache's tokens and states;
  - a fork: a prompt's sequence forked, each branch fed its own token, gives the logits of
    DynamicCache continuing each branch from a copy of the prompt's cache;
  - a prefix hit: a second prompt that shares the first's starts from the state checkpointed at its
    longest boundary, and its logits equal DynamicCache's computed from that boundary (bitwise) and
    the whole prompt's recomputation (within 1e-4);
  - a variant whose model spec names the linear layers and their state record: the record is what
    transformers' cache keeps for the model, and the model generates DynamicCache's tokens through it;
  - the real-size specs (Qwen3-Next-80B, Bamba-9B): their linear layers and records are what
    transformers' own layers of those configs keep, made on the meta device (no weights);
  - refusals, each naming its argument: prefix caching, a sequence past the state slots, a forward after
    a gathered batch's sequences changed, a layer type kvforge does not serve, and StatePool's own
    arguments (a page too small for the record among them).
"""

import copy

import pytest
import torch
import transformers
from transformers import DynamicCache

import kvforge
import kvforge.hf
from conftest import variants_where

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128)


def qwen3_next():
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **SMALL, num_hidden_layers=4, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32))


def bamba():
    return transformers.BambaForCausalLM(transformers.BambaConfig(
        **SMALL, num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=16))


def lfm2():
    return transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
        **SMALL, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"]))


def model(make):
    torch.manual_seed(0)
    return make().eval()


@pytest.mark.parametrize("make", [qwen3_next, bamba, lfm2])
def test_generates_the_same_tokens_and_states_as_dynamic_cache(make):
    m = model(make)
    ids = torch.randint(1, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4], ids[1, :4] = 0, 0  # the second prompt is 7 tokens, left-padded
    theirs = DynamicCache(config=m.config)
    ours = kvforge.hf.KvforgeCache.from_model(m, layout="flashinfer_paged_hnd", batch_size=2)
    with torch.no_grad():
        want = m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                          cache=theirs)
        got = m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, cache=ours)
    assert torch.equal(got, want)
    assert ours.state_layers, "the model's linear layers are served from state slots"
    for index, layer in enumerate(ours.layers):
        if isinstance(layer, kvforge.hf.KvforgeStateLayer):
            for (kind, state), (pool, at, part) in layer.pools.items():
                held = torch.from_dlpack(pool.view(at, part))[:2]
                assert torch.equal(held, getattr(theirs.layers[index], f"{kind}_states")[state]), (index, kind)


@pytest.mark.parametrize("seqs", [[0, 2], [2, 0]])
def test_a_batch_of_any_sequences_generates_dynamic_caches_tokens(seqs):
    """Sequences whose state slots are not consecutive (or not in order) are served from a gathered copy of
    their rows: the same tokens and states as DynamicCache, and the slot that no served sequence holds
    stays untouched."""
    m = model(qwen3_next)
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    theirs = DynamicCache(config=m.config)
    ours = kvforge.hf.KvforgeCache.from_model(m, layout="vllm_paged_nhd", batch_size=2, state_slots=3)
    ours.serve(seqs)
    with torch.no_grad():
        want = m.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, cache=theirs)
        got = m.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, cache=ours)
    assert torch.equal(got, want)
    ours.sync_states()  # the model updated the gathered rows in place, its conv kernels too
    for index, layer in enumerate(ours.layers):
        if isinstance(layer, kvforge.hf.KvforgeStateLayer):
            for (kind, state), (pool, at, part) in layer.pools.items():
                held = torch.from_dlpack(pool.view(at, part))
                assert torch.equal(held[seqs], getattr(theirs.layers[index], f"{kind}_states")[state]), (index, kind)
                assert not held[1].any(), "the slot that no served sequence holds moved"
    ours.free(seqs[1])  # the gathered batch changed under the layers: the next forward needs serve()
    with pytest.raises(kvforge.StateError, match=r"seqs: the served sequences changed since serve\(\)"):
        ours.state_layers[0].update_recurrent_state(torch.zeros(1))
    ours.serve([seqs[0]])
    assert ours.state_layers[0].gathered == {}, "a single sequence is a view again"


def test_states_in_the_caches_pages_generate_dynamic_caches_tokens():
    """states_in_pages: each sequence's states take a page of the cache from the manager's free list
    (slots that are pages, so the batch is a gathered one): the same tokens and states as DynamicCache."""
    m = model(qwen3_next)
    d = next(d for d in kvforge.variants(model="tiny_gdn", storage="fp32")
             if d.paged and 0 < kvforge.state_page_size(d) <= d.page_size)
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    theirs = DynamicCache(config=m.config)
    ours = kvforge.hf.KvforgeCache(d.name, m.config, batch_size=2, states_in_pages=True)
    for seq in range(2):
        ours.add(seq, ids[seq].tolist())
    pool, manager = ours.states.pools[0], ours.sequence_manager
    assert pool.in_pages and manager.taken_pages == 2
    with torch.no_grad():
        want = m.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, cache=theirs)
        got = m.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, cache=ours)
    assert torch.equal(got, want)
    ours.sync_states()
    slots = [ours.states.slot(seq) for seq in range(2)]
    assert not set(slots) & {p for seq in range(2) for p in manager.pages(seq)}, "a state's page is also K/V's"
    for index, layer in enumerate(ours.layers):
        if isinstance(layer, kvforge.hf.KvforgeStateLayer):
            for (kind, state), (_, at, part) in layer.pools.items():
                held = torch.from_dlpack(pool.view(at, part))[slots]
                assert torch.equal(held, getattr(theirs.layers[index], f"{kind}_states")[state]), (index, kind)
    ours.free(0)
    assert manager.taken_pages == 1


def forward(m, cache, seq, tokens):
    cache.serve([seq])
    with torch.no_grad():
        return m(torch.tensor([tokens]), cache=cache, use_cache=True).logits[0, -1]


def test_a_fork_continues_each_branch():
    m = model(qwen3_next)
    prompt, a, b = [5, 17, 99, 3, 42, 8, 61], 23, 77
    ours = kvforge.hf.KvforgeCache.from_model(m, layout="vllm_paged_nhd", batch_size=2)
    ours.add(0, prompt)
    forward(m, ours, 0, prompt)
    ours.fork(0, 1)
    ours.extend(0, [a])
    got_a = forward(m, ours, 0, [a])
    ours.extend(1, [b])
    got_b = forward(m, ours, 1, [b])
    theirs = DynamicCache(config=m.config)
    with torch.no_grad():
        m(torch.tensor([prompt]), cache=theirs, use_cache=True)
        branch = copy.deepcopy(theirs)
        want_a = m(torch.tensor([[a]]), cache=theirs, use_cache=True).logits[0, -1]
        want_b = m(torch.tensor([[b]]), cache=branch, use_cache=True).logits[0, -1]
    assert torch.equal(got_a, want_a)
    assert torch.equal(got_b, want_b)
    ours.free(1)
    for layer in ours.state_layers:  # a freed sequence's slot is zeros for the next one
        for pool, at, part in layer.pools.values():
            assert not torch.from_dlpack(pool.view(at, part))[1].any()


def test_a_prefix_hit_starts_from_the_checkpoint_of_its_longest_boundary():
    m = model(qwen3_next)
    ours = kvforge.hf.KvforgeCache.from_model(m, layout="vllm_paged_nhd", batch_size=2, prefix_caching=True,
                                              checkpoint_every=2)
    boundary = 2 * ours.descriptor.page_size
    prompt = [(7 * i + 3) % 120 + 1 for i in range(2 * boundary + 6)]
    # The first request prefills in chunks that end on boundaries, as an engine aligns them.
    ours.add(0, prompt[:boundary])
    forward(m, ours, 0, prompt[:boundary])
    for begin, end in ((boundary, 2 * boundary), (2 * boundary, len(prompt))):
        ours.extend(0, prompt[begin:end])
        forward(m, ours, 0, prompt[begin:end])
    ours.free(0)
    assert ours.states.slots.stats["checkpoints"] == 2
    # The second shares the first 2 * boundary + 6 tokens: its K/V are cached up to the last full page, and
    # its state was kept at 2 * boundary.
    second = prompt + [11, 12, 13]
    assert ours.add(1, second) == 2 * boundary
    got = forward(m, ours, 1, second[2 * boundary:])
    theirs = DynamicCache(config=m.config)
    with torch.no_grad():
        for begin, end in ((0, boundary), (boundary, 2 * boundary), (2 * boundary, len(second))):
            want = m(torch.tensor([second[begin:end]]), cache=theirs, use_cache=True).logits[0, -1]
        whole = m(torch.tensor([second])).logits[0, -1]
    assert torch.equal(got, want), "the same computation as DynamicCache's from the same boundary"
    assert torch.allclose(got, whole, atol=1e-4, rtol=1e-4), (got - whole).abs().max()


@pytest.mark.parametrize("make, spec", [(qwen3_next, "tiny_gdn"), (bamba, "tiny_mamba2")])
def test_a_variant_whose_spec_names_the_linear_layers_serves_the_model(make, spec):
    m = model(make)
    linear = [i for i, t in enumerate(m.config.layer_types) if t == "linear_attention"]
    # The default spec written for this model (a user's spec of the same shape may state another record),
    # in any paged fp32 layout that expands it.
    d = next(d for d in kvforge.variants(model=spec, storage="fp32") if d.paged)
    assert (d.linear_layers, d.model_layers, d.heads, d.head_dim) == (linear, m.config.num_hidden_layers, 2, 16)
    # The spec's record is what transformers' own cache keeps for this model (from its DynamicCache).
    probed = kvforge.hf.probe_record(m)
    assert [(shape, dtype) for _, shape, dtype in d.state_parts] == [(shape, dtype) for _, shape, dtype in probed]
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    ours = kvforge.hf.KvforgeCache(d.name, m.config, batch_size=2, prefix_caching=True)
    with torch.no_grad():
        want = m.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, cache=DynamicCache(config=m.config))
        for seq in range(2):
            ours.add(seq, ids[seq].tolist())
        got = m.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, cache=ours)
    assert torch.equal(got, want)
    assert len(ours.states.pools) == 1 and ours.states.pools[0].layers == len(linear)


def test_real_size_specs_hold_what_transformers_keeps_for_those_models():
    """Each real-size default spec against transformers' config of that model and its own mixer module,
    made on the meta device: which layers are linear, the attention layers' heads, each state's shape,
    and the dtypes that transformers' cache keeps for the model in bf16 (probed on the tiny model)."""
    from transformers.models.bamba.modeling_bamba import BambaMixer
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    bamba_9b = transformers.BambaConfig(attn_layer_indices=[9, 18, 27], mamba_d_state=128)  # the rest: defaults
    cases = [("qwen3_next_80b", transformers.Qwen3NextConfig(), qwen3_next,
              lambda mixer: [(mixer.conv_dim, mixer.conv_kernel_size),
                             (mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim)], Qwen3NextGatedDeltaNet),
             ("bamba_9b", bamba_9b, bamba,
              lambda mixer: [(mixer.conv_dim, mixer.conv_kernel_size),
                             (mixer.num_heads, mixer.head_dim, mixer.ssm_state_size)], BambaMixer)]
    for spec, config, tiny, shapes, Mixer in cases:
        d = next(d for d in kvforge.variants(model=spec) if d.paged)
        linear = [i for i, t in enumerate(config.layer_types) if t == "linear_attention"]
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        assert (d.linear_layers, d.model_layers) == (linear, config.num_hidden_layers), spec
        assert (d.heads, d.head_dim) == (config.num_key_value_heads, head_dim), spec
        with torch.device("meta"):
            mixer = Mixer(config, layer_idx=linear[0])
        probed = kvforge.hf.probe_record(model(tiny).to(torch.bfloat16))
        assert [(tuple(shape), dtype) for _, shape, dtype in d.state_parts] == \
            [(shape, dtype) for shape, (_, _, dtype) in zip(shapes(mixer), probed)], spec


def test_refusals_name_the_argument():
    m = model(qwen3_next)
    name = kvforge.hf.KvforgeCache.from_model(m).descriptor.name
    with pytest.raises(kvforge.UnsupportedError, match="prefix_caching: a hybrid model's linear layers need one state"):
        kvforge.hf.KvforgeCache(name, m.config, prefix_caching=True)  # no probed record
    cache = kvforge.hf.KvforgeCache.from_model(m, batch_size=2, state_slots=3)
    with pytest.raises(kvforge.OutOfRangeError, match=r"seq = 5 is outside \[0, 3\)"):
        cache.add(5, [1, 2, 3])
    config = transformers.Qwen3NextConfig(**SMALL, num_hidden_layers=2, head_dim=16,
                                          layer_types=["linear_attention", "hybrid"])
    with pytest.raises(kvforge.UnsupportedError, match=r"config.layer_types\[1\]: 'hybrid' is no layer type"):
        kvforge.jit.model_spec(config)


def test_state_slots_attach_a_sequence_whose_pages_came_another_way():
    d = variants_where(paged=True, quantized=False, hybrid=False, model="tiny")[0]
    cache = kvforge.create(d.name, pages=8)
    manager = kvforge.SequenceManager(cache)
    blocks = manager.available_blocks
    pool = kvforge.StatePool([("h", (4,), "fp32")], layers=1, slots=1)
    slots = kvforge.StateSlots(manager, pool, 1)
    pool.write(0, 0, "h", torch.ones(4))
    manager.add(3, [5, 6, 7])
    assert (slots.free_slots, slots.attach(3), slots.free_slots) == (1, 0, 0)
    out = torch.ones(4)
    pool.read(0, 0, "h", out)
    assert torch.equal(out, torch.zeros(4))
    with pytest.raises(kvforge.StateError, match="seq: sequence 4 is not in the manager"):
        slots.attach(4)
    slots.free(3)
    assert slots.free_slots == 1 and manager.available_blocks == blocks


def test_state_pool_from_python():
    pool = kvforge.StatePool([("conv", (6, 3), "bf16"), ("ssm", (2, 4, 4), "fp32")], layers=3, slots=4, checkpoints=1)
    assert (pool.slot_bytes, pool.padding_bytes) == (768, 5 * 276)  # 5 records: 4 slots and a checkpoint
    x = torch.arange(32, dtype=torch.float32).view(2, 4, 4)
    pool.write(2, 1, "ssm", x)
    assert torch.equal(torch.from_dlpack(pool.view(1, "ssm"))[2], x)
    pool.checkpoint(2, 0)
    pool.restore(0, 3)
    out = torch.zeros_like(x)
    pool.read(3, 1, "ssm", out)
    assert torch.equal(out, x)
    with pytest.raises(kvforge.ShapeError, match=r"src: must be a contiguous array of part 'ssm''s shape \[2, 4, 4\]"):
        pool.write(0, 0, "ssm", torch.zeros(4, 4, 2))
    with pytest.raises(kvforge.DtypeError, match="src: must be fp32"):
        pool.write(0, 0, "ssm", torch.zeros(2, 4, 4, dtype=torch.float16))
    with pytest.raises(kvforge.ArgumentError, match=r"part: 'state' is not a part of this record \(allowed: conv, ssm\)"):
        pool.view(0, "state")
    with pytest.raises(kvforge.OutOfRangeError, match=r"slot = 4 is outside \[0, 4\)"):
        pool.zero_slot(4)
    with pytest.raises(kvforge.DtypeError, match=r"parts\[0\].dtype: int8 is not a state dtype"):
        kvforge.StatePool([("conv", (2,), "int8")], layers=1, slots=1)
    with pytest.raises(kvforge.ShapeError, match=r"parts\[0\].shape: has 0 extents"):
        kvforge.StatePool([("conv", (), "fp32")], layers=1, slots=1)


def test_a_state_pool_in_sglangs_order_from_python():
    # SGLang's MambaPool: a tensor a part, [layers, slots, *shape]; conv's 36 bytes take 64.
    pool = kvforge.StatePool([("conv", (6, 3), "bf16"), ("ssm", (2, 4, 4), "fp32")], layers=3, slots=4,
                             axes=("part", "layer", "slot"))
    assert pool.axes == ("part", "layer", "slot") and pool.slot_stride(1, "conv") == 64
    assert pool.offset(2, 1, "ssm") == 3 * 4 * 64 + 1 * 4 * 128 + 2 * 128
    x = torch.arange(32, dtype=torch.float32).view(2, 4, 4)
    pool.write(2, 1, "ssm", x)
    raw = torch.from_dlpack(pool.buffer())
    at = pool.offset(2, 1, "ssm")
    assert torch.equal(raw[at:at + 128].view(torch.float32).view(2, 4, 4), x)
    assert torch.equal(torch.from_dlpack(pool.view(1, "ssm"))[2], x)
    d = next(d for d in kvforge.variants(model="tiny_gdn") if d.layout == "vllm_paged_nhd")
    assert d.state_axes == ("layer", "slot", "part")  # its spec's state_axes
    assert kvforge.StatePool.for_variant(d, slots=1).axes == d.state_axes
    with pytest.raises(kvforge.ArgumentError, match=r"axes: 'page' is not a state axis \(allowed: an order of slot"):
        kvforge.StatePool([("conv", (2,), "fp32")], layers=1, slots=1, axes=("page", "slot", "part"))
    with pytest.raises(kvforge.ArgumentError, match=r"axes: \[slot, layer, slot\] does not name 'slot' once"):
        kvforge.StatePool([("conv", (2,), "fp32")], layers=1, slots=1, axes=("slot", "layer", "slot"))


def test_states_in_a_caches_pages_share_its_free_list():
    """StatePool.in_pages_of: a state takes a page of the cache from the manager's free list, its views are
    over the cache's memory, and a page too small for the record is refused naming the page that fits."""
    fits = [d for d in kvforge.variants(model="tiny_gdn", storage="fp32")
            if d.paged and 0 < kvforge.state_page_size(d) <= d.page_size]
    small = [d for d in kvforge.variants(model="tiny_gdn", storage="fp32")
             if d.paged and kvforge.state_page_size(d) > d.page_size]
    assert fits and small
    cache = kvforge.create(fits[0].name, pages=6)
    manager = kvforge.SequenceManager(cache)
    pool = kvforge.StatePool.in_pages_of(cache, checkpoints=1)
    assert (pool.in_pages, pool.bytes, pool.slots, [p[0] for p in pool.parts]) == (True, 0, 6, ["conv", "recurrent"])
    slots = kvforge.StateSlots(manager, pool, 1)
    slots.add(0, list(range(1, 10)))  # one K/V page, one state page
    assert (manager.available_blocks, manager.taken_pages) == (4, 1)
    x = torch.randn(4, 8, 8)
    torch.from_dlpack(pool.view(2, "recurrent"))[slots.slot(0)] = x  # the model's own update, in place
    out = torch.zeros_like(x)
    pool.read(slots.slot(0), 2, "recurrent", out)
    assert torch.equal(out, x)
    slots.free(0)
    assert (manager.available_blocks, manager.taken_pages) == (6, 0)
    with pytest.raises(kvforge.UnsupportedError, match="buffer: the states lie in the cache's pages"):
        pool.buffer()
    need = kvforge.state_page_size(small[0])
    with pytest.raises(kvforge.ShapeError, match=rf"cache: .* \(a page of {need} tokens would hold it\)"):
        kvforge.StatePool.in_pages_of(kvforge.create(small[0].name, pages=2))
    # A record of the caller's: the hint is that record's page, not the variant's own (twice the recurrent
    # state needs a larger page), and a page of the hinted size does hold it.
    bigger = [("conv", (64, 4), "fp32"), ("recurrent", (16, 8, 8), "fp32")]
    own, theirs = kvforge.state_page_size(fits[0]), kvforge.state_page_size(fits[0], parts=bigger, layers=2)
    assert theirs > own > 0, (theirs, own)
    with pytest.raises(kvforge.ShapeError, match=rf"cache: .* \(a page of {theirs} tokens would hold it\)"):
        kvforge.StatePool.in_pages_of(kvforge.create(fits[0].name, pages=2), parts=bigger, layers=2)
    layout = {"name": "state_hint_pages", "addressing": "paged", "page_size": theirs, "update": "eager",
              "axes": ["page", "slot", "kv", "head", "dim"], "expand": [{"models": ["x"], "dtypes": ["fp32"]}]}
    d = kvforge.variant(layout, {"name": "state_hint_model", "layers": fits[0].layers, "kv_heads": fits[0].heads,
                                 "head_dim": fits[0].head_dim, "max_seq_len": 64}, "fp32")
    assert kvforge.StatePool.in_pages_of(kvforge.create(d.name, pages=2), parts=bigger, layers=2).in_pages


def test_a_state_record_of_another_dtype_than_the_models_is_refused():
    # The model keeps fp32 states; a record declaring bf16 would store them at lower precision, unsaid.
    m = model(qwen3_next)
    record = [(name, shape, "bf16") for name, shape, _ in kvforge.hf.probe_record(m)]
    ours = kvforge.hf.KvforgeCache.from_model(m, batch_size=1, state_record=record)
    with pytest.raises(kvforge.DtypeError, match=r"_states: the model keeps fp32, the state_record's part .* is bf16"):
        with torch.no_grad():
            m(torch.randint(1, 128, (1, 5)), use_cache=True, **kvforge.hf.cache_kwarg(ours))
