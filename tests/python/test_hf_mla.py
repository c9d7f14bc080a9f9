"""MLA models of transformers through kvforge: each token caches one latent record (kv_lora_rank values
after kv_a_layernorm, then the RoPE'd qk_rope_head_dim part), which transformers' DeepseekV3 and V2
pass their cache as (kv_nope, k_rot). Random weights from tiny configs made here (nothing downloaded):

  - DeepseekV3, DeepseekV2 and GLM-4-MoE-Lite generate DynamicCache's tokens through kvforge.hf, and so
    does Kimi-Linear, a hybrid whose linear layers keep states beside its MLA layer, for a batch of two
    prompts of different lengths, over the default MLA specs (vLLM's record tensor, FlashMLA's pages
    of 64) and over layouts of split K/V tensors, paged and contiguous, built on demand for dimensions
    no spec has;
  - DeepSeek-V3.2 generates DynamicCache's tokens, its indexer keys in a companion cache over the main
    cache's pages (kvforge.create(..., companion=)), each key bitwise DynamicCache's;
  - an absorbed-MLA step written here the way vLLM computes it (queries absorbed through kv_b_proj,
    attention over the latent records kvforge gathers, values expanded after) reproduces HF's own
    logits, the prompt's and the next token's (at most 0.47 here): within 1e-5 over fp32 records, 2e-3 over
    bf16, and 2e-2 over fp8 per-tensor codes and over FlashMLA's fp8 records (measured 1e-7, 3.3e-4,
    4.9e-3, and 8.9e-3 for a model whose latent is two 128-value tiles); and so it does reading
    the records in place, as FlashInfer's MLA kernel does, from the "ckv" and "kpe" views at the page
    table's pages (vLLM's pages of 16 and FlashMLA's of 64);
  - the record's bytes sit in the pool as vLLM's [blocks, block_size, kv_lora_rank + rope] tensor,
    addressed here by that formula alone, and the views ("record", "ckv", "kpe") are that memory;
  - refusals name the argument: a record of the wrong width or dtype, and a K/V variant asked for one.
"""

import ctypes
import math

import pytest
import torch
import transformers
from transformers import DynamicCache
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds3

import kvforge
import kvforge.hf
from conftest import variants_where

TINY_MLA = dict(kv_lora_rank=24, qk_rope_head_dim=8, num_hidden_layers=2, max_position_embeddings=64)  # tiny_mla.yaml
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
             num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
             first_k_dense_replace=1, q_lora_rank=None, qk_nope_head_dim=16, v_head_dim=16)


def deepseek_v3(**dims):
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**SMALL, **TINY_MLA, **dims})).eval()


def deepseek_v2(**dims):
    torch.manual_seed(0)
    config = transformers.DeepseekV2Config(**{**SMALL, **TINY_MLA, "n_shared_experts": 1, **dims})
    return transformers.DeepseekV2ForCausalLM(config).eval()


def glm4_moe_lite():
    torch.manual_seed(0)
    return transformers.Glm4MoeLiteForCausalLM(transformers.Glm4MoeLiteConfig(**{**SMALL, **TINY_MLA,
                                                                                 "q_lora_rank": 16})).eval()


def kimi_linear():  # a hybrid: Kimi delta attention in layers 1 and 3, MLA in layer 2
    torch.manual_seed(0)
    kda = {"kda_layers": [1, 3], "full_attn_layers": [2], "num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4}
    config = transformers.KimiLinearConfig(**{**SMALL, **TINY_MLA, "num_hidden_layers": 3}, pad_token_id=0, bos_token_id=1,
                                           eos_token_id=2, num_experts=4, num_experts_per_token=2, linear_attn_config=kda)
    return transformers.KimiLinearForCausalLM(config).eval()


def generate(m, cache):
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3], ids[1, :3] = 0, 0  # the second prompt is 6 tokens, left-padded
    with torch.no_grad():
        return m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, cache=cache)


@pytest.mark.parametrize("make,variant,dtype", [
    (deepseek_v3, "vllm_mla.tiny_mla.fp32", torch.float32),
    (deepseek_v3, "flashmla_paged.tiny_mla.bf16", torch.bfloat16),
    (deepseek_v2, "vllm_mla.tiny_mla.fp32", torch.float32),
    (glm4_moe_lite, "vllm_mla.tiny_mla.fp32", torch.float32),
])
def test_generates_the_same_tokens_as_dynamic_cache(make, variant, dtype):
    m = make().to(dtype)
    ours = kvforge.hf.KvforgeCache(variant, m.config, batch_size=2)
    assert ours.descriptor.mla == (24, 8)
    assert torch.equal(generate(m, ours), generate(m, DynamicCache(config=m.config)))


def test_a_hybrid_of_linear_attention_and_mla():
    m = kimi_linear()
    ours = kvforge.hf.KvforgeCache.from_model(m, layout="vllm_mla", batch_size=2)
    assert (ours.descriptor.layers, ours.descriptor.mla, len(ours.state_layers)) == (1, (24, 8), 2)
    assert torch.equal(generate(m, ours), generate(m, DynamicCache(config=m.config)))


def test_deepseek_v32s_indexer_keys_live_in_a_companion_cache_over_the_same_pages():
    # DeepSeek sparse attention: each layer's indexer keeps an index key a token, from which it picks the
    # index_topk tokens the attention sees (4 of up to 15 here, so wrong keys pick other tokens).
    config = transformers.DeepseekV32Config(**{**SMALL, **TINY_MLA, "q_lora_rank": 16, "index_n_heads": 2,
                                               "index_head_dim": 16, "index_topk": 4})
    torch.manual_seed(0)
    m = transformers.DeepseekV32ForCausalLM(config).eval()
    ours, theirs = kvforge.hf.KvforgeCache("vllm_mla.tiny_mla.fp32", config, batch_size=2), DynamicCache(config=config)
    assert torch.equal(generate(m, ours), generate(m, theirs))
    companion = ours.kv.companion
    assert (companion.descriptor.heads, companion.descriptor.head_dim) == (1, 8)
    for layer in range(config.num_hidden_layers):  # every key DynamicCache holds, bitwise
        want = theirs.layers[layer].indexer_keys
        for row in range(2):
            got = torch.empty(1, want.shape[1], 16)
            pages = ours.sequence_manager.range(row, 0, want.shape[1])["pages"]
            companion.gather(layer, *got.chunk(2, dim=-1), pages=pages, end=want.shape[1])
            assert torch.equal(got[0], want[row]), (layer, row)


@pytest.mark.parametrize("layout", ["vllm_paged_nhd", "jetstream_contiguous"])
def test_any_dimensions_on_demand_over_split_k_v_tensors(layout):
    # A record no spec has (20 + 6), on layouts whose K and V halves are tensors of their own: paged, and
    # contiguous rows.
    m = deepseek_v3(kv_lora_rank=20, qk_rope_head_dim=6, num_hidden_layers=3)
    ours = kvforge.hf.KvforgeCache.from_model(m, layout=layout, batch_size=2)
    assert (ours.descriptor.mla, ours.descriptor.heads, ours.descriptor.head_dim) == ((20, 6), 1, 13)
    assert torch.equal(generate(m, ours), generate(m, DynamicCache(config=m.config)))


def test_a_record_of_odd_width_is_stored_with_a_zero_after_it():
    # kv_lora_rank 21 + RoPE 6 = 27 values: the halves are 14 wide, the last stored value a zero pad. HF's
    # tokens through the record layout (vLLM's tensor, on demand), then the C++ calls with 27-value records.
    m = deepseek_v3(kv_lora_rank=21, qk_rope_head_dim=6)
    ours = kvforge.hf.KvforgeCache.from_model(m, layout="vllm_mla", batch_size=2)
    d = ours.descriptor
    assert (d.mla, d.heads, d.head_dim, d.input) == ((21, 6), 1, 14, "fp32")
    assert torch.equal(generate(m, ours), generate(m, DynamicCache(config=m.config)))
    cache, page = kvforge.create(d.name, pages=3), d.page_size
    latent = torch.randn(11, 1, 27, generator=torch.Generator().manual_seed(5))
    slots = torch.randperm(3 * page, generator=torch.Generator().manual_seed(6))[:11]
    cache.append_latent(1, latent, slots=slots)
    start = torch.from_dlpack(cache.view(1)["k"]).data_ptr()  # the layer's tensor: [pages, page_size, 28]
    pool = torch.frombuffer((ctypes.c_float * (3 * page * 28)).from_address(start), dtype=torch.float32)
    pool = pool.view(3, page, 28)
    for t, slot in enumerate(slots.tolist()):  # vLLM's formula, a token 28 values apart
        assert torch.equal(pool[slot // page, slot % page, :27], latent[t, 0])
        assert pool[slot // page, slot % page, 27] == 0
    view = {key: torch.from_dlpack(a) for key, a in cache.view(1).items() if key in ("record", "kpe")}
    assert torch.equal(view["record"][:, :, 0], pool[..., :27]) and torch.equal(view["kpe"], pool[..., 21:27])
    table = torch.tensor([slots[0] // page], dtype=torch.int32)
    out = torch.full((1, page, 27), 7.0)
    cache.gather_latent(1, out, pages=table, end=page)
    assert torch.equal(out[0], pool[table[0], :, :27])
    with pytest.raises(kvforge.ShapeError, match=r"^latent: .*21 \+ 6 = 27 contiguous values \(or 28 with its pad\)"):
        cache.append_latent(1, latent[..., :26], slots=slots)


class LatentStore:
    """One sequence's latent records in a kvforge paged MLA cache, page i of the sequence in pool page
    pages[i]. They are read back by gather_latent, or (in_place) where FlashInfer's MLA kernel reads them:
    the "ckv" and "kpe" views of the pool, at the page table's pages."""

    def __init__(self, variant, dtype, in_place=False):
        self.cache = kvforge.create(variant, pages=4)
        self.length, self.dtype, self.in_place = {}, dtype, in_place
        self.pages, self.page_size = torch.tensor([2, 0, 3, 1], dtype=torch.int32), self.cache.descriptor.page_size

    def append(self, layer, latent):  # latent [T, R + P]
        begin = self.length.get(layer, 0)
        positions = torch.arange(begin, begin + latent.shape[0])
        slots = self.pages[positions // self.page_size].long() * self.page_size + positions % self.page_size
        self.cache.append_latent(layer, latent.to(self.dtype)[:, None].contiguous(), slots=slots)
        self.length[layer] = begin + latent.shape[0]
        if self.in_place:
            view = self.cache.view(layer)
            positions = torch.arange(self.length[layer])
            page, slot = self.pages[positions // self.page_size].long(), positions % self.page_size
            return torch.cat([torch.from_dlpack(view[part])[page, slot] for part in ("ckv", "kpe")], dim=-1).float()
        out = torch.empty(1, self.length[layer], latent.shape[1], dtype=self.dtype)
        self.cache.gather_latent(layer, out, pages=self.pages, end=self.length[layer])
        return out[0].float()


def absorbed_attention(attn, store, hidden_states, position_embeddings, *args, **kwargs):
    """vLLM's MLA over a latent cache: q_nope absorbed through kv_b_proj's K part into the latent space,
    scores against each cached record, the latent sum expanded by kv_b_proj's V part, then o_proj."""
    batch, new, _ = hidden_states.shape
    heads, nope, rope, v_dim, rank = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim, \
        attn.kv_lora_rank
    q = attn.q_proj(hidden_states).view(batch, new, heads, nope + rope).transpose(1, 2)
    q_nope, q_rot = q.split([nope, rope], dim=-1)
    kv_nope, k_rot = attn.kv_a_proj_with_mqa(hidden_states).split([rank, rope], dim=-1)
    kv_nope = attn.kv_a_layernorm(kv_nope)
    cos, sin = position_embeddings
    rotate = ds3.apply_rotary_pos_emb_interleave if attn.config.rope_interleave else ds3.apply_rotary_pos_emb
    q_rot, k_rot = rotate(q_rot, k_rot.view(batch, 1, new, rope), cos, sin)
    records = store.append(attn.layer_idx, torch.cat([kv_nope[0], k_rot[0, 0]], dim=-1))  # [L, R + P]
    ckv, kpe = records.split([rank, rope], dim=-1)
    w = attn.kv_b_proj.weight.view(heads, nope + v_dim, rank)
    q_latent = torch.einsum("hqn,hnr->hqr", q_nope[0], w[:, :nope])
    scores = (q_latent @ ckv.T + q_rot[0] @ kpe.T) * attn.scaling  # [H, new, L]
    cached = records.shape[0] - new
    causal = torch.arange(records.shape[0])[None, :] > cached + torch.arange(new)[:, None]
    weights = scores.masked_fill(causal, -math.inf).softmax(-1)
    out = torch.einsum("hqr,hvr->qhv", weights @ ckv, w[:, nope:])  # [new, H, V]
    return attn.o_proj(out.reshape(batch, new, heads * v_dim)), None


@pytest.mark.parametrize("variant,bound,in_place", [
    ("vllm_mla.tiny_mla.fp32", 1e-5, False), ("vllm_mla.tiny_mla.bf16", 2e-3, False),
    ("vllm_mla.tiny_mla.fp8_e4m3_in_bf16", 2e-2, False),
    ("vllm_mla.tiny_mla.fp32", 1e-5, True), ("flashmla_paged.tiny_mla.bf16", 2e-3, True),
    # FlashMLA's fp8 record: a latent of two 128-value tiles, each under its own power-of-two scale.
    ("flashmla_paged.tiny_mla_tiles.flashmla_fp8_in_bf16", 2e-2, False)])
def test_an_absorbed_mla_step_over_kvforge_records_gives_hf_logits(variant, bound, in_place):
    d = kvforge.describe(variant)
    m = deepseek_v3(kv_lora_rank=d.mla[0], qk_rope_head_dim=d.mla[1])
    prompt, step = [5, 17, 99, 3, 42, 8, 61], 23
    with torch.no_grad():
        theirs = DynamicCache(config=m.config)
        want = [m(torch.tensor([prompt]), cache=theirs).logits[0, -1],
                m(torch.tensor([[step]]), cache=theirs).logits[0, -1]]
    store = LatentStore(variant, {"fp32": torch.float32, "bf16": torch.bfloat16}[d.input], in_place)
    if d.quant == "per_tensor":  # one scale a half, for records within +-8 (kv_a_layernorm keeps them there)
        for layer in range(d.layers):
            store.cache.set_tensor_scale(layer, 8.0 / kvforge.quant_max(d.storage), 8.0 / kvforge.quant_max(d.storage))
    for layer in m.model.layers:
        attn = layer.self_attn
        attn.forward = lambda *a, attn=attn, **k: absorbed_attention(attn, store, *a, **k)
    with torch.no_grad():
        got = [m(torch.tensor([prompt]), use_cache=False).logits[0, -1],
               m(torch.tensor([[step]]), position_ids=torch.tensor([[len(prompt)]]), use_cache=False).logits[0, -1]]
    for g, w in zip(got, want):
        assert (g - w).abs().max() < bound, (g - w).abs().max()


def test_records_lie_in_the_pool_as_vllms_mla_tensor():
    # vLLM's MLA cache: per layer [blocks, block_size, R + P], token t of block b at b * P * W + slot * W.
    d = kvforge.describe("vllm_mla.tiny_mla.fp32")
    width, page = sum(d.mla), d.page_size
    cache = kvforge.create(d.name, pages=5)
    latent = torch.randn(23, 1, width, generator=torch.Generator().manual_seed(3))
    slots = torch.randperm(5 * page, generator=torch.Generator().manual_seed(4))[:23]
    cache.append_latent(1, latent, slots=slots)
    start = torch.from_dlpack(cache.view(1)["k"]).data_ptr()  # the layer's tensor starts with page 0's K
    pool = torch.frombuffer((ctypes.c_float * (5 * page * width)).from_address(start), dtype=torch.float32)
    pool = pool.view(5, page, width)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(pool[slot // page, slot % page], latent[t, 0])
    # The views engines hand their kernels are that memory: the record as vLLM's tensor (and FlashMLA's,
    # with its one head), its parts as FlashInfer's ckv_cache and kpe_cache.
    # The parts also go by their names in the record, "latent" and "rope".
    view = {key: torch.from_dlpack(a) for key, a in cache.view(1).items() if not isinstance(a, str)}
    assert view["record"].data_ptr() == start and torch.equal(view["record"][:, :, 0], pool)
    for latent_view, rope_view in (("ckv", "kpe"), ("latent", "rope")):
        assert view[latent_view].data_ptr() == start and torch.equal(view[latent_view], pool[..., :d.mla[0]])
        assert torch.equal(view[rope_view], pool[..., d.mla[0]:])


@pytest.mark.parametrize("d", variants_where(storage="flashmla_fp8"), ids=lambda d: d.name)
def test_flashmla_fp8_records_parts_are_views_by_name(d):
    # FlashMLA's fp8 record as its kv_cache_format defines it, read from the record's bytes by that
    # definition alone: R e4m3 codes, then an fp32 power-of-two scale per 128 of them, then P bf16 RoPE
    # values. The views by part name ("latent", "latent_scales", "rope") are those bytes.
    (rank, rope), page, tiles = d.mla, d.page_size, d.mla[0] // 128
    pages = -(-40 // page) + 1  # 40 tokens and room to spare, whatever the page size
    cache = kvforge.create(d.name, pages=pages)
    g = torch.Generator().manual_seed(11)
    latent = (torch.randn(40, 1, rank + rope, generator=g) * 3).to(torch.bfloat16)
    slots = torch.randperm(pages * page, generator=g)[:40]
    cache.append_latent(d.layers - 1, latent, slots=slots)  # the last layer: a model of one has it too
    view = {key: torch.from_dlpack(a) for key, a in cache.view(d.layers - 1).items() if not isinstance(a, str)}
    assert view["latent"].dtype == torch.uint8 and view["latent"].shape == (pages, page, rank)  # e4m3 bits, as SGLang's fp8
    assert view["latent_scales"].shape == (pages, page, tiles) and view["rope"].shape == (pages, page, rope)
    for t, slot in enumerate(slots.tolist()):
        where = (slot // page, slot % page)
        record = view["record"][where][0]  # this token's bytes
        assert record.numel() == rank + 4 * tiles + 2 * rope
        codes, scales = record[:rank], record[rank:rank + 4 * tiles].view(torch.float32)
        rope_values = record[rank + 4 * tiles:].view(torch.bfloat16)
        assert torch.equal(view["latent"][where], codes) and torch.equal(view["latent_scales"][where], scales)
        assert torch.equal(view["rope"][where], rope_values)
        # What they hold: the RoPE part as given, and the latent within e4m3's half step (3 mantissa bits) of
        # each value under its tile's scale, a power of two.
        assert torch.equal(rope_values, latent[t, 0, rank:])
        assert bool((torch.frexp(scales).mantissa == 0.5).all())
        decoded = codes.view(torch.float8_e4m3fn).float().view(tiles, 128) * scales.view(tiles, 1)
        want = latent[t, 0, :rank].float().view(tiles, 128)
        assert ((decoded - want).abs() <= want.abs() / 16 + scales.view(tiles, 1) * 2.0 ** -10).all(), t


def test_refusals_name_the_argument():
    cache = kvforge.create("vllm_mla.tiny_mla.fp32", pages=2)
    slots = torch.arange(3, dtype=torch.int64)
    with pytest.raises(kvforge.ShapeError, match=r"^latent: .*24 \+ 8 = 32"):
        cache.append_latent(0, torch.zeros(3, 1, 30), slots=slots)
    with pytest.raises(kvforge.DtypeError, match="^latent: "):
        cache.append_latent(0, torch.zeros(3, 1, 32, dtype=torch.float16), slots=slots)
    with pytest.raises(kvforge.ShapeError, match="^latent: has 2 heads"):
        cache.append_latent(0, torch.zeros(3, 2, 32), slots=slots)
    with pytest.raises(kvforge.ShapeError, match="^latent_out: "):
        cache.gather_latent(0, torch.zeros(1, 3, 16), pages=torch.zeros(1, dtype=torch.int32), end=3)
    with pytest.raises(kvforge.ShapeError, match=r"^latent_out: holds 3 positions, the range \[0, 5\) reads 5"):
        cache.gather_latent(0, torch.zeros(1, 3, 32), pages=torch.zeros(1, dtype=torch.int32), end=5)
    with pytest.raises(kvforge.UnsupportedError, match="^latent: .* caches K and V"):
        kvforge.create("vllm_paged_nhd.tiny.fp32", pages=2).append_latent(0, torch.zeros(3, 1, 32), slots=slots)
    m = deepseek_v3()
    with pytest.raises(kvforge.ArgumentError, match=r"^variant: .*MLA record\) = \(2, None\)"):
        kvforge.hf.KvforgeCache("vllm_paged_nhd.tiny.fp32", m.config)
