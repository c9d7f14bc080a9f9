"""K and V of different widths through kvforge (a model spec's v_head_dim): transformers' MiMo-V2-Flash,
whose attention caches K of head_dim and V of v_head_dim a head (192 and 128 at full size). Random weights
from tiny configs made here (nothing downloaded):

  - it generates DynamicCache's tokens through kvforge.hf, for a batch of two prompts of different lengths,
    over the default specs of tiny_kv_widths' shape (heads' records whole in pages, and contiguous rows)
    and, built on demand, over a layout of split K/V tensors for dimensions no spec has;
  - MiMo-V2-Flash as transformers builds it, its sliding layers keeping twice the full layers' KV heads:
    from_model reads each layer's heads from one token through DynamicCache and builds, on demand, a
    member cache of vLLM's layout for each group of heads, and generates DynamicCache's tokens;
  - append_record and gather_record move each head's K then V, which come back as torch wrote them, and
    lie in the pool where its views of K's and V's own widths ("k_part", "v_part") say;
  - refusals name the argument: a record of the wrong width, a variant of another width.
"""

import pytest
import torch
import transformers
from transformers import DynamicCache

import kvforge
import kvforge.hf
import kvforge.jit
from test_hf_mla import generate  # two prompts of different lengths, 6 new tokens

TINY = dict(head_dim=20, v_head_dim=12, num_key_value_heads=2, num_hidden_layers=2,
            max_position_embeddings=64)  # tiny_kv_widths.yaml
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
             n_routed_experts=4, num_experts_per_tok=2)


def mimo(sliding=False, **dims):
    """MiMo-V2-Flash, every layer full attention unless `sliding`: then transformers' own pattern, whose
    sliding layers keep twice the full layers' KV heads."""
    torch.manual_seed(0)
    dims = {**SMALL, **TINY, **dims}
    if not sliding:
        dims["layer_types"] = ["full_attention"] * dims["num_hidden_layers"]
    return transformers.MiMoV2FlashForCausalLM(transformers.MiMoV2FlashConfig(**dims)).eval()


@pytest.mark.parametrize("variant", ["paged_head_records.tiny_kv_widths.fp32", "jetstream_contiguous.tiny_kv_widths.fp32"])
def test_generates_the_same_tokens_as_dynamic_cache(variant):
    m = mimo()
    ours = kvforge.hf.KvforgeCache(variant, m.config, batch_size=2)
    assert ours.descriptor.kv_widths == (20, 12)
    assert torch.equal(generate(m, ours), generate(m, DynamicCache(config=m.config)))


@pytest.mark.parametrize("v_head_dim", [12, 11])
def test_any_dimensions_on_demand(v_head_dim):
    # 3 KV heads of K 28 and V 12 or 11 (no spec has them), on vLLM's split K/V tensors. A record of 39
    # values is stored as halves of 20, its last value a zero.
    m = mimo(head_dim=28, v_head_dim=v_head_dim, num_key_value_heads=3, num_attention_heads=6, num_hidden_layers=3)
    ours = kvforge.hf.KvforgeCache.from_model(m, layout="vllm_paged_nhd", batch_size=2)
    d = ours.descriptor
    assert (d.kv_widths, d.heads, d.head_dim, d.bytes_per_token) == ((28, v_head_dim), 3, 20, 3 * 3 * 40 * 4)
    assert torch.equal(generate(m, ours), generate(m, DynamicCache(config=m.config)))


def test_sliding_layers_of_twice_the_heads_get_a_member_cache_of_their_own():
    m = mimo(sliding=True, num_hidden_layers=6, sliding_window=5)  # layers 1-4 slide, over 4 heads; 0 and 5: 2
    ours = kvforge.hf.KvforgeCache.from_model(m, layout="vllm_paged_nhd", batch_size=2)
    d = ours.descriptor
    assert d.hybrid and d.kv_widths == (20, 12)
    assert [(g["name"], g["layers"], g["heads"], g["sliding_window"]) for g in d.groups] == [
        ("local", [1, 2, 3, 4], 4, 5), ("global", [0, 5], 2, 0)]
    assert torch.equal(generate(m, ours), generate(m, DynamicCache(config=m.config)))
    with pytest.raises(kvforge.ArgumentError, match=r"\[2, 4, 4, 4, 4, 2\], \(20, 12\)\), the model has "
                                                    r"\(6, 2, \(20, 12\)\); give kv_heads_per_layer="):
        kvforge.hf.KvforgeCache(d.name, m.config)
    # The member cache a group needs a layout by name; a hybrid layout already has its members.
    with pytest.raises(kvforge.UnsupportedError, match="^layout: .*give the layout as a default's name"):
        kvforge.jit.by_group({"name": "mine", "addressing": "paged", "page_size": 16}, d.groups)
    assert kvforge.jit.by_group("hybrid_paged", d.groups) == "hybrid_paged"


def test_records_come_back_as_k_then_v_and_refusals_name_the_argument():
    cache = kvforge.create("paged_head_records.tiny_kv_widths.fp32", pages=3)
    k, v = torch.randn(21, 2, 20), torch.randn(21, 2, 12)
    slots = torch.randperm(48, generator=torch.Generator().manual_seed(2))[:21]
    cache.append_record(1, torch.cat([k, v], dim=-1), slots=slots)
    out = torch.zeros(2, 48, 32)
    cache.gather_record(1, out, pages=torch.arange(3, dtype=torch.int32), end=48)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(out[:, slot, :20], k[t]) and torch.equal(out[:, slot, 20:], v[t]), t
    # The same records in place, as SGLang's k_buffer and v_buffer shapes: views of the pool at page, slot.
    view = {key: torch.from_dlpack(a) for key, a in cache.view(1).items() if key in ("k_part", "v_part", "record")}
    page = cache.descriptor.page_size
    assert view["k_part"].shape == (3, page, 2, 20) and view["v_part"].shape == (3, page, 2, 12)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(view["k_part"][slot // page, slot % page], k[t]), t
        assert torch.equal(view["v_part"][slot // page, slot % page], v[t]), t
        assert torch.equal(view["record"][slot // page, slot % page], torch.cat([k[t], v[t]], dim=-1)), t
    # Where the layout splits the record (K's and V's halves apart), there is no record to view.
    assert "record" not in kvforge.create("jetstream_contiguous.tiny_kv_widths.fp32", rows=1).view(0)
    with pytest.raises(kvforge.ShapeError, match=r"^record: .*20 \+ 12 = 32"):
        cache.append_record(0, torch.zeros(3, 2, 40), slots=slots[:3])
    with pytest.raises(kvforge.UnsupportedError, match="^latent: .*append_record"):
        cache.append_latent(0, torch.zeros(3, 1, 32), slots=slots[:3])
    with pytest.raises(kvforge.UnsupportedError, match="^record: .*one width"):
        kvforge.create("vllm_paged_nhd.tiny.fp32", pages=2).append_record(0, torch.zeros(3, 2, 32), slots=slots[:3])
    with pytest.raises(kvforge.ArgumentError, match=r"^variant: .*\(2, 2, \(20, 12\)\), the model has \(2, 2, \(20, 8\)\)"):
        kvforge.hf.KvforgeCache("paged_head_records.tiny_kv_widths.fp32", mimo(v_head_dim=8).config)
    with pytest.raises(kvforge.ArgumentError, match=r"^variant: .*\(2, 2, None\), the model has \(2, 2, \(16, 8\)\)"):
        kvforge.hf.KvforgeCache("vllm_paged_nhd.tiny.fp32", mimo(head_dim=16, v_head_dim=8).config)

