"""DeepSeek-V3.2's fp8 index keys (`indexer_fp8`) as vLLM and SGLang page them, through Python:

  - appended keys lie in the layer's pages as vLLM's indexer_k_quant_and_cache writes them, checked by
    that kernel's formula written here in torch (torch's own float8_e4m3fn cast for the codes): a page's
    64 keys' codes, then their fp32 power-of-two scales; the views "pages" (SGLang's buffer), "codes" and
    "scales" (also "key" and "key_scales") are that memory, and a gather returns code * scale;
  - the keys of transformers' own DeepseekV32 (a tiny random config made here, index_head_dim 128) read
    back within e4m3's bound, beside FlashMLA's fp8 records in a companion cache over the same pages;
  - and the same model generates through kvforge.hf with index_keys="fp8" the tokens of a transformers
    cache whose indexer keeps each key as vLLM's rule, written here in torch, gives it back.
"""

import math

import pytest
import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicIndexedLayer

import kvforge
import kvforge.hf
from test_hf_mla import SMALL, generate  # transformers' MLA dimensions, scaled down

KEYS = "vllm_indexer.tiny_indexer.indexer_fp8_in_bf16"


def vllm_page_bytes(keys, slots, pages, page_size=64):
    """vLLM's cache after indexer_k_quant_and_cache(keys [T, 128], cache, slots, 128, "ue8m0")."""
    width = keys.shape[1]
    cache = torch.zeros(pages, page_size * (width + width // 32), dtype=torch.uint8)
    for key, slot in zip(keys.float(), slots.tolist()):
        block, offset = divmod(slot, page_size)
        for tile in range(width // 128):
            x = key[tile * 128:(tile + 1) * 128]
            scale = 2.0 ** math.ceil(math.log2(max(x.abs().max().item(), 1e-4) / 448.0))
            at = offset * width + tile * 128
            cache[block, at:at + 128] = (x / scale).to(torch.float8_e4m3fn).view(torch.uint8)
            at = page_size * width + (offset * width + tile * 128) * 4 // 128
            cache[block, at:at + 4] = torch.tensor([scale], dtype=torch.float32).view(torch.uint8)
    return cache


def test_keys_lie_where_vllm_writes_them_and_read_back_as_code_times_scale():
    cache = kvforge.create(KEYS, pages=3)
    keys = (torch.randn(70, 128, generator=torch.Generator().manual_seed(1)) *
            torch.logspace(-6, 3, 70)[:, None]).to(torch.bfloat16)
    slots = torch.randperm(3 * 64, generator=torch.Generator().manual_seed(2))[:70]
    cache.append(1, keys[:, None, :64], keys[:, None, 64:], slots=slots)
    view = {name: torch.from_dlpack(a) for name, a in cache.view(1).items() if name != "dtype"}
    want = vllm_page_bytes(keys, slots, 3)
    assert torch.equal(view["pages"], want)
    for codes, scales in (("codes", "scales"), ("key", "key_scales")):  # the latter, the part's own names
        assert torch.equal(view[codes], want[:, :64 * 128].view(3, 64, 128))
        assert torch.equal(view[scales], want[:, 64 * 128:].contiguous().view(torch.float32).view(3, 64, 1))
    k, v = torch.empty(1, 64, 64, dtype=torch.bfloat16), torch.empty(1, 64, 64, dtype=torch.bfloat16)
    cache.gather(1, k, v, pages=torch.tensor([2], dtype=torch.int32), end=64)
    codes = view["codes"][2].view(torch.float8_e4m3fn).float()
    assert torch.equal(torch.cat([k[0], v[0]], dim=-1), (codes * view["scales"][2]).to(torch.bfloat16))


def test_deepseek_v32s_keys_beside_flashmlas_records_within_e4m3s_bound():
    config = transformers.DeepseekV32Config(**{**SMALL, "kv_lora_rank": 256, "qk_rope_head_dim": 32,
                                               "num_hidden_layers": 2, "max_position_embeddings": 64,
                                               "q_lora_rank": 16, "index_n_heads": 2, "index_head_dim": 128,
                                               "index_topk": 4})
    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(config).eval()
    theirs = DynamicCache(config=config)
    with torch.no_grad():
        model(torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(3)), cache=theirs)
    pair = kvforge.create("flashmla_paged.tiny_mla_tiles.flashmla_fp8_in_bf16", pages=2, companion=KEYS)
    slots = torch.arange(64, 84)  # page 1 of both caches
    for layer in range(2):
        latent = torch.cat([theirs.layers[layer].keys, theirs.layers[layer].values], dim=-1)[0].transpose(0, 1)
        pair.append_latent(layer, latent.to(torch.bfloat16).contiguous(), slots=slots)  # [20, 1, 288]
        back = torch.empty(1, 20, 288, dtype=torch.bfloat16)
        pair.gather_latent(layer, back, pages=torch.tensor([1], dtype=torch.int32), end=20)
        assert ((back[0].float() - latent[:, 0].float()).abs() <= latent[:, 0].abs() / 8 + 1e-2).all()
        key = theirs.layers[layer].indexer_keys[0].to(torch.bfloat16)  # [20, 128]
        pair.companion.append(layer, key[:, None, :64], key[:, None, 64:], slots=slots)
        k, v = torch.empty(1, 20, 64, dtype=torch.bfloat16), torch.empty(1, 20, 64, dtype=torch.bfloat16)
        pair.companion.gather(layer, k, v, pages=torch.tensor([1], dtype=torch.int32), end=20)
        got, x = torch.cat([k[0], v[0]], dim=-1).float(), key.float()
        scale = torch.from_dlpack(pair.companion.view(layer)["scales"])[1, :20]
        # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of a value, or its subnormal step 2^-10 * scale;
        # the read-back is then rounded to bf16.
        bound = torch.maximum(x.abs() / 16, scale * 2.0 ** -10) * (1 + 2.0 ** -7)
        assert ((got - x).abs() <= bound).all(), ((got - x).abs() - bound).max()


def vllm_fp8_key(keys):
    """keys [.., W] as vLLM's fp8 index keys read back: per 128 values, a scale of the smallest power of two
    >= max(amax, 1e-4) / 448 (frexp, exactly), codes through torch's e4m3 cast, code * scale in keys' dtype."""
    tiles = keys.float().unflatten(-1, (-1, 128))
    wanted = tiles.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0
    mantissa, exponent = torch.frexp(wanted)  # wanted = mantissa * 2^exponent, mantissa in [0.5, 1)
    scale = torch.ldexp(torch.ones_like(wanted), torch.where(mantissa == 0.5, exponent - 1, exponent))
    return ((tiles / scale).to(torch.float8_e4m3fn).float() * scale).flatten(-2).to(keys.dtype)


class Fp8IndexKeys(DynamicIndexedLayer):
    """transformers' indexed layer, keeping each new index key as vLLM's fp8 rule gives it back."""

    def update_indexer(self, indexer_key_states):
        return super().update_indexer(vllm_fp8_key(indexer_key_states))


def test_hf_generates_with_fp8_index_keys_what_vllms_rule_gives():
    # The attention's records in bf16 (FlashMLA's pages of 64, exact), the index keys in vLLM's fp8 pages
    # beside them: the registered tiny_indexer keys serve this model's 2 layers of 128-value keys.
    config = transformers.DeepseekV32Config(**{**SMALL, "kv_lora_rank": 24, "qk_rope_head_dim": 8,
                                               "num_hidden_layers": 2, "max_position_embeddings": 64,
                                               "q_lora_rank": 16, "index_n_heads": 2, "index_head_dim": 128,
                                               "index_topk": 4})
    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(config).eval().to(torch.bfloat16)
    ours = kvforge.hf.KvforgeCache("flashmla_paged.tiny_mla.bf16", config, batch_size=2, index_keys="fp8")
    assert ours.kv.companion.descriptor.name == KEYS
    reference = Cache(layers=[Fp8IndexKeys() for _ in range(config.num_hidden_layers)])
    assert torch.equal(generate(model, ours), generate(model, reference))
    with pytest.raises(kvforge.ArgumentError, match="index_keys: 'fp4' .allowed: None, 'fp8'."):
        kvforge.hf.KvforgeCache("flashmla_paged.tiny_mla.bf16", config, index_keys="fp4")

