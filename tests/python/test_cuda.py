"""kvforge from Python on a CUDA device (tools/gpu-check runs this file on a GPU; without one every case
skips, saying why). Each case holds the CUDA cache to an independent answer: the logical values appended
(float storage), or the CPU backend's bytes for the same inputs (quantized storage and FlashMLA's fp8
records: docs/quantization.md's rules are the same on both backends, bit for bit), or transformers'
DynamicCache (HF generation).

  - create, append and gather with torch CUDA tensors, the index arrays on the device too;
  - view(): zero-copy tensors on cuda:0 that are the pool's memory;
  - host index arrays handed to a CUDA cache raise DeviceError naming the argument, and write nothing;
  - fp8 storage, and quantized paged variants, equal to the CPU backend byte for byte;
  - FlashMLA's fp8 record equal to the CPU backend's bytes;
  - an HF Llama generates on CUDA through kvforge the tokens of DynamicCache, paged and contiguous.
"""

import numpy as np
import pytest
import torch

import kvforge
import kvforge.hf
from conftest import variants_where
from kvforge.torch_dtypes import TORCH_DTYPES

pytestmark = pytest.mark.skipif(not (kvforge.cuda_available() and torch.cuda.is_available()),
                                reason="no CUDA device (or this build has no CUDA backend): run tools/gpu-check")


def pool(cache):
    """Every buffer of the pool, as host bytes."""
    return [np.from_dlpack(torch.from_dlpack(b).cpu()).copy() for b in cache.buffers()]


def traffic(d, device, seed=0, tokens=11):
    """A paged cache of `d` on `device` after the same two appends into scattered pages, with every index
    array on that device; returns the cache, the page list and the values appended."""
    g = torch.Generator().manual_seed(seed)
    pages = -(-tokens // d.page_size) + 2
    cache = kvforge.create(d.name, pages=pages, device=device)
    if d.quant == "per_tensor" or d.tensor_scaled:
        for layer in range(d.layers):
            cache.set_tensor_scale(layer, 0.05, 0.07)
    order = torch.randperm(pages, generator=g)[:-(-tokens // d.page_size)].to(torch.int32)
    slots = torch.tensor([int(order[p // d.page_size]) * d.page_size + p % d.page_size for p in range(tokens)],
                         dtype=torch.int64)
    dtype = TORCH_DTYPES[d.input]
    k = torch.randn(tokens, d.heads, d.head_dim, generator=g).to(dtype)
    v = torch.randn(tokens, d.heads, d.head_dim, generator=g).to(dtype)
    for layer in range(d.layers):
        cache.append(layer, k[:7].to(device), v[:7].to(device), slots=slots[:7].to(device))
        cache.append(layer, k[7:].to(device), v[7:].to(device), slots=slots[7:].to(device))
    cache.commit()
    cache.synchronize()
    return cache, order.to(device), k, v


@pytest.mark.parametrize("d", variants_where(model="tiny", addressing="paged", quantized=False, hybrid=False,
                                             lazy=False), ids=lambda d: d.name)
def test_append_and_gather_on_the_device_give_back_what_went_in(d):
    cache, pages, k, v = traffic(d, "cuda")
    out_k = torch.empty(d.heads, 11, d.head_dim, dtype=TORCH_DTYPES[d.input], device="cuda")
    out_v = torch.empty_like(out_k)
    cache.gather(0, out_k, out_v, pages=pages, end=11)
    assert torch.equal(out_k.cpu(), k.transpose(0, 1)) and torch.equal(out_v.cpu(), v.transpose(0, 1))
    batch = torch.empty(2, 1, d.heads, 11, d.head_dim, dtype=out_k.dtype, device="cuda")
    cache.gather_batch(0, batch[0], batch[1], page_table=pages[None], end=11)
    assert torch.equal(batch[0, 0].cpu(), k.transpose(0, 1)) and torch.equal(batch[1, 0].cpu(), v.transpose(0, 1))


@pytest.mark.parametrize("d", variants_where(model="tiny", addressing="paged", quantized=False, hybrid=False,
                                             lazy=False)[:2], ids=lambda d: d.name)
def test_views_are_the_pool_on_the_device(d):
    cache, _, _, _ = traffic(d, "cuda")
    view = torch.from_dlpack(cache.view(0)["k"])
    assert view.device == torch.device("cuda", 0)
    before = pool(cache)
    view.view(torch.uint8).fill_(0x3c)
    torch.cuda.synchronize()
    assert any(not np.array_equal(a, b) for a, b in zip(before, pool(cache))), "a write to the view is not in the pool"


def test_host_index_arrays_are_refused_by_name_and_write_nothing():
    (d,) = variants_where(name="vllm_paged_nhd.tiny.fp32")
    cache, _, k, v = traffic(d, "cuda")
    before = pool(cache)
    with pytest.raises(kvforge.DeviceError, match="slots"):
        cache.append(0, k[:2].cuda(), v[:2].cuda(), slots=torch.arange(2))
    with pytest.raises(kvforge.DeviceError, match="k"):
        cache.append(0, k[:2], v[:2].cuda(), slots=torch.arange(2, device="cuda"))
    with pytest.raises(kvforge.DeviceError, match="pages"):
        cache.gather(0, torch.empty(d.heads, 2, d.head_dim, device="cuda"),
                     torch.empty(d.heads, 2, d.head_dim, device="cuda"), pages=torch.zeros(1, dtype=torch.int32), end=2)
    assert all(np.array_equal(a, b) for a, b in zip(before, pool(cache)))


def coded(d):
    return d.storage != d.input and not d.hybrid and d.addressing == "paged" and not d.lazy


@pytest.mark.parametrize("d", [d for d in variants_where(model=lambda m: m.startswith("tiny")) if coded(d)],
                         ids=lambda d: d.name)
def test_coded_storage_is_the_cpu_backends_byte_for_byte(d):
    # fp8, int8, 4-bit, block-scaled, zero-point codes, FlashMLA's records and index keys: one rule a
    # format, the same bytes on both backends.
    gpu, _, _, _ = traffic(d, "cuda", seed=3)
    cpu, _, _, _ = traffic(d, "cpu", seed=3)
    for a, b in zip(pool(gpu), pool(cpu)):
        assert np.array_equal(a, b)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval().cuda(), config


@pytest.mark.parametrize("layout", ["vllm_paged_nhd", "jetstream_contiguous"])
def test_hf_generates_dynamic_caches_tokens_on_the_device(layout):
    from transformers import DynamicCache
    model, config = tiny_llama()
    ids = torch.randint(0, 96, (3, 9), device="cuda")
    cache = kvforge.hf.KvforgeCache.from_model(model, layout=layout, batch_size=3, max_seq_len=64, device="cuda")
    got = model.generate(ids, max_new_tokens=12, do_sample=False, **kvforge.hf.cache_kwarg(cache))
    want = model.generate(ids, max_new_tokens=12, do_sample=False, **kvforge.hf.cache_kwarg(DynamicCache(config=config)))
    assert torch.equal(got, want)
