"""K and V of different widths through kvforge (a model spec's v_head_dim): transformers' MiMo-V2-Flash,
whose attention caches K of head_dim and V of v_head_dim a head (192 and 128 at full size). Random weights
from tiny configs made here (nothing downloaded):

  - it generates DynamicCache's tokens through kvforge.hf, for a batch of two prompts of different lengths,
    over the default specs of tiny_kv_widths' shape (heads' records whole in pages, and contiguous rows)
    and, built on demand, over a layout of split K/V tensors for dimensions no spec has;
  - append_record and gather_record move each head's K then V, which come back as torch wrote them;
  - refusals name the argument: a record of the wrong width, a variant of another width.
"""

import pytest
import torch
import transformers
from transformers import DynamicCache

import kvforge
import kvforge.hf

TINY = dict(head_dim=24, v_head_dim=16, num_key_value_heads=2, num_hidden_layers=2,
            max_position_embeddings=64)  # tiny_kv_widths.yaml
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
             n_routed_experts=4, num_experts_per_tok=2)


def mimo(**dims):
    """MiMo-V2-Flash with every layer full attention: its sliding layers keep twice the KV heads, which one
    variant's heads cannot hold."""
    torch.manual_seed(0)
    dims = {**SMALL, **TINY, **dims}
    dims["layer_types"] = ["full_attention"] * dims["num_hidden_layers"]
    return transformers.MiMoV2FlashForCausalLM(transformers.MiMoV2FlashConfig(**dims)).eval()


def generate(m, cache):
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3], ids[1, :3] = 0, 0  # the second prompt is 6 tokens, left-padded
    with torch.no_grad():
        return m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, cache=cache)


@pytest.mark.parametrize("variant", ["paged_head_records.tiny_kv_widths.fp32", "jetstream_contiguous.tiny_kv_widths.fp32"])
def test_generates_the_same_tokens_as_dynamic_cache(variant):
    m = mimo()
    ours = kvforge.hf.KvforgeCache(variant, m.config, batch_size=2)
    assert ours.descriptor.kv_widths == (24, 16)
    assert torch.equal(generate(m, ours), generate(m, DynamicCache(config=m.config)))


def test_any_dimensions_on_demand():
    # 3 KV heads of K 20 and V 12 (no spec has them), on vLLM's split K/V tensors.
    m = mimo(head_dim=20, v_head_dim=12, num_key_value_heads=3, num_attention_heads=6, num_hidden_layers=3)
    ours = kvforge.hf.KvforgeCache.from_model(m, layout="vllm_paged_nhd", batch_size=2)
    d = ours.descriptor
    assert (d.kv_widths, d.heads, d.head_dim, d.bytes_per_token) == ((20, 12), 3, 16, 3 * 3 * (20 + 12) * 4)
    assert torch.equal(generate(m, ours), generate(m, DynamicCache(config=m.config)))


def test_records_come_back_as_k_then_v_and_refusals_name_the_argument():
    cache = kvforge.create("paged_head_records.tiny_kv_widths.fp32", pages=3)
    k, v = torch.randn(21, 2, 24), torch.randn(21, 2, 16)
    slots = torch.randperm(48, generator=torch.Generator().manual_seed(2))[:21]
    cache.append_record(1, torch.cat([k, v], dim=-1), slots=slots)
    out = torch.zeros(2, 48, 40)
    cache.gather_record(1, out, pages=torch.arange(3, dtype=torch.int32), end=48)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(out[:, slot, :24], k[t]) and torch.equal(out[:, slot, 24:], v[t]), t
    with pytest.raises(kvforge.ShapeError, match=r"^record: .*24 \+ 16 = 40"):
        cache.append_record(0, torch.zeros(3, 2, 48), slots=slots[:3])
    with pytest.raises(kvforge.UnsupportedError, match="^latent: .*append_record"):
        cache.append_latent(0, torch.zeros(3, 1, 40), slots=slots[:3])
    with pytest.raises(kvforge.UnsupportedError, match="^record: .*one width"):
        kvforge.create("vllm_paged_nhd.tiny.fp32", pages=2).append_record(0, torch.zeros(3, 2, 32), slots=slots[:3])
    with pytest.raises(kvforge.ArgumentError, match=r"^variant: .*\(2, 2, \(24, 16\)\), the model has \(2, 2, \(24, 12\)\)"):
        kvforge.hf.KvforgeCache("paged_head_records.tiny_kv_widths.fp32", mimo(v_head_dim=12).config)
    with pytest.raises(kvforge.ArgumentError, match=r"^variant: .*\(2, 2, None\), the model has \(2, 2, \(16, 8\)\)"):
        kvforge.hf.KvforgeCache("vllm_paged_nhd.tiny.fp32", mimo(head_dim=16, v_head_dim=8).config)
