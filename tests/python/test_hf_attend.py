"""HF transformers' models attending through kvforge (attn_implementation="kvforge", Cache.attend): the
layer's update appends and gathers nothing, and the attention reads the cache where it lies.

Every default variant of the tiny models but MLA's (transformers decompresses MLA's latent per head;
kvforge attends the latent itself, which test_attend.cpp checks) generates test_hf's batch of two
prompts, the second left-padded, through kvforge's attention. The reference is transformers' own model
(SDPA; Gemma-2's eager attention for the hybrid variant, its soft-cap) over transformers' own cache:
  - float storage: DynamicCache;
  - quantized storage: DynamicCache layers that apply docs/quantization.md's rule, written in test_hf.py
    from the text, to every token, this step's included: an attention that reads the cache sees its own
    tokens as stored.
Teacher-forced on kvforge's tokens, the logits agree within LOGIT_BOUND of max |logits|: kvforge attends
in fp32 and rounds its output once to the input dtype, where SDPA and the reference's own rounding of
the dequantized values differ by a unit or two of the input dtype over two to four layers. The generated
tokens are equal where the input dtype is fp32 or fp16; bf16's rounding flips near-tied tokens of a
random-weight model, so there the teacher-forced logits carry the check.
"""

import pytest
import torch
from conftest import variants_where
from test_hf import NEW, PROMPT, prompts, QUANTIZED_LOGIT_BOUND, QuantizedReferenceLayer, generate, model_for, teacher_forced
from transformers import DynamicCache
from transformers.cache_utils import Cache

import kvforge
import kvforge.hf

# Observed: fp32 2.0e-7, fp16 8.0e-4, bf16 6.4e-3 (float storage, one bf16 step of the logits) to 0.012
# (Gemma-2); coded storage in bf16 up to 6.4e-3, int4 records in fp16 5.8e-3 (the reference rounds each
# dequantized value to fp16 before its SDPA; kvforge keeps it in fp32). Coded storage takes test_hf's
# bound against the same rule, QUANTIZED_LOGIT_BOUND, where that is the looser.
LOGIT_BOUND = {"fp32": 2e-6, "fp16": 2 ** -8, "bf16": 2 ** -5}

ATTENDING = [d for d in variants_where(model=lambda m: m in ("tiny", "tiny_hybrid")) if not d.mla]


def attending_model(d):
    """model_for(d) (the same seed, so the same weights) with kvforge's attention."""
    return kvforge.hf.use_kvforge_attention(model_for(d))


def reference_cache(d, model, tensor_scales):
    if not (d.quantized or d.record_parts):
        return DynamicCache(config=model.config)
    window = d.window if d.addressing == "ring" else None
    return Cache(layers=[QuantizedReferenceLayer(d, tensor_scales, i, window, reads_its_own_write=True)
                         for i in range(d.layers)])


@pytest.mark.parametrize("d", ATTENDING, ids=lambda d: d.name)
def test_generates_what_transformers_attention_over_the_stored_values_generates(d):
    fast = attending_model(d)
    cache = kvforge.hf.KvforgeCache(d.name, fast.config, batch_size=2)
    assert cache.attends()
    got_tokens, _ = generate(fast, cache)  # also calibrates a per-tensor variant's scales, which the reference takes
    assert cache.get_seq_length() == PROMPT + NEW - 1
    model = model_for(d)
    want = teacher_forced(model, reference_cache(d, model, cache.tensor_scales), got_tokens)
    got = teacher_forced(fast, kvforge.hf.KvforgeCache(d.name, fast.config, batch_size=2), got_tokens)
    deviation = float((got - want).abs().max() / want.abs().max())
    coded = d.quantized or d.record_parts
    assert deviation <= max(LOGIT_BOUND[d.input], QUANTIZED_LOGIT_BOUND if coded else 0), deviation
    if d.input != "bf16":
        want_tokens, _ = generate(model, reference_cache(d, model, cache.tensor_scales))
        assert torch.equal(got_tokens, want_tokens)


def chunked_logits(model, cache, cut):
    """The logits [2, PROMPT - cut, vocab] of the prompt's tokens from `cut` on, the prompt fed as two
    forwards: tokens [0, cut) (the first chunk), then [cut, PROMPT) over that history (chunked prefill)."""
    ids, mask = prompts()
    with torch.no_grad():
        model(ids[:, :cut], attention_mask=mask[:, :cut], cache=cache)
        return model(ids[:, cut:], attention_mask=mask, cache=cache).logits.float()


# By the property: float storage in the model's dtype (its first chunk is torch's, over the K/V in hand;
# the second reads the first's through Cache.attend), quantized and record storage (both chunks through
# Cache.attend), and every addressing.
CHUNKED = [d for d in ATTENDING if d.model == "tiny" and not d.lazy and (
    d.name in ("vllm_paged_nhd.tiny.fp32", "vllm_paged_nhd.tiny.bf16", "jetstream_contiguous.tiny.fp32")
    or d.addressing == "ring" or d.quant == "per_token_head" or d.record_parts)]


@pytest.mark.parametrize("d", CHUNKED, ids=lambda d: d.name)
def test_a_prompt_in_two_chunks_attends_its_first_chunk_where_the_cache_holds_it(d):
    cut = PROMPT // 2 + 1  # the second chunk starts within a page of the tiny paged variants
    fast = attending_model(d)
    cache = kvforge.hf.KvforgeCache(d.name, fast.config, batch_size=2)
    got = chunked_logits(fast, cache, cut)
    model = model_for(d)
    want = chunked_logits(model, reference_cache(d, model, cache.tensor_scales), cut)
    deviation = float((got - want).abs().max() / want.abs().max())
    coded = d.quantized or d.record_parts
    assert deviation <= max(LOGIT_BOUND[d.input], QUANTIZED_LOGIT_BOUND if coded else 0), deviation


def test_a_float_caches_first_chunk_needs_no_cache_read_and_equals_attend():
    """The first chunk over K/V in hand (first_chunk_attention) against Cache.attend over the same chunk
    where the cache holds it, left padding and a window included: one rule, two kernels."""
    from kvforge._hf_attention import _PaddingMask, first_chunk_attention
    d = kvforge.describe("vllm_paged_nhd.tiny.fp32")
    g = torch.Generator().manual_seed(3)
    batch, new, heads, q_heads = 2, 11, d.heads, 2 * d.heads
    q = torch.randn(batch, q_heads, new, d.head_dim, generator=g)
    k, v = (torch.randn(batch, heads, new, d.head_dim, generator=g) for _ in range(2))
    padding = torch.ones(batch, new, dtype=torch.bool)
    padding[1, :4] = False
    cache = kvforge.create(d.name, pages=2 * -(-new // d.page_size))
    per = -(-new // d.page_size)
    table = torch.arange(2 * per, dtype=torch.int32).view(2, per)
    pos = torch.arange(new)
    for b in range(batch):
        slots = table[b, pos // d.page_size].long() * d.page_size + pos % d.page_size
        cache.append(0, k[b].transpose(0, 1).contiguous(), v[b].transpose(0, 1).contiguous(), slots=slots)
    for window in (0, 5):
        layer = type("Layer", (), {"sliding_window": window or None})()
        got = first_chunk_attention(layer, q, k, v, _PaddingMask(padding), None, None)
        out = torch.empty(batch * new, q_heads, d.head_dim)
        cache.attend(0, q.transpose(1, 2).reshape(batch * new, q_heads, d.head_dim), out,
                     query_start=torch.arange(0, batch * new + 1, new, dtype=torch.int32),
                     lengths=torch.full((batch,), new, dtype=torch.int32), page_table=table, window=window,
                     begins=torch.tensor([0, 4], dtype=torch.int32))
        want = out.view(batch, new, q_heads, d.head_dim)
        real = padding[:, :, None, None].expand_as(want)  # a pad row's output is never read
        assert torch.allclose(got[real], want[real], atol=1e-5, rtol=1e-5)


def test_attention_without_a_kvforge_cache_is_refused():
    fast = attending_model(kvforge.describe("vllm_paged_nhd.tiny.fp32"))
    with pytest.raises(kvforge.StateError, match="KvforgeCache"):
        generate(fast, DynamicCache(config=fast.config), new=2)


def test_an_mla_model_is_refused_naming_the_attention():
    from test_hf_mla import deepseek_v3
    fast = kvforge.hf.use_kvforge_attention(deepseek_v3())
    cache = kvforge.hf.KvforgeCache("vllm_mla.tiny_mla.fp32", fast.config, batch_size=2)
    with pytest.raises(kvforge.UnsupportedError, match="attn_implementation"):
        generate(fast, cache, new=2)
