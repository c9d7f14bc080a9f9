"""HF transformers' own models generate through kvforge caches (kvforge.hf.KvforgeCache).

Tiny configs with random weights and fixed seeds, built here; nothing is downloaded. Every default
variant of the tiny models generates a batch of two prompts of different lengths (left padding), and
its tokens and logits are held to transformers' own cache:
  - float storage: the same tokens as DynamicCache, logits within rounding of the storage dtype
    (LOGIT_BOUND; fp32 within fp32 rounding);
  - quantized storage (int8 and fp8 on the tiny models; MXFP4, NVFP4 and grouped int8 and int4 on a
    24-layer model of qwen2.5-0.5b's K/V shape): the same tokens and logits (QUANTIZED_LOGIT_BOUND)
    as DynamicCache layers that apply docs/quantization.md's rule, written here independently, to
    every token they keep; so the documented per-element bound is carried to the logits exactly. Against DynamicCache's own
    unquantized run, teacher-forced on its tokens, the logits move by at most DEVIATION_BOUND: the
    storage error flips near-tied tokens of a random-weight model, so tokens are not compared there.
Generation is cross-checked against recomputation of the whole sequence, with no cache, by PyTorch's
scaled_dot_product_attention (Gemma-2: transformers' eager attention, its softcapping has no SDPA path); and a paged cache serves sequences at different times over one pool,
with a shared prefix and a fork, against the same recomputation.
"""

import pytest
import torch
from conftest import TORCH_DTYPE, variants_where
from transformers import (DynamicCache, Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, StaticCache)
from transformers.cache_utils import Cache, DynamicLayer

import kvforge
import kvforge.hf

# |logits - DynamicCache's logits| <= bound * max |logits|, per storage dtype (observed: 0 for each).
LOGIT_BOUND = {"fp32": 1e-6, "fp16": 2 ** -10, "bf16": 2 ** -7}
QUANTIZED_LOGIT_BOUND = 2 ** -7  # against the reference quantizer, bf16 rounding of the logits (observed: 0)
# Teacher-forced against unquantized DynamicCache, relative to max |logits|: what the storage's error
# (docs/quantization.md) costs this model. Measured: int8 0.0064 (one bf16 step of the logits), fp8
# e4m3 and e5m2 0.022; on the 24-layer model, grouped int8 0.0025, int4 per 16 0.059, MXFP4 0.081
# and NVFP4 0.061.
DEVIATION_BOUND = {"int8": 0.01, "fp8_e4m3": 0.05, "fp8_e5m2": 0.05, "int4": 0.1, "uint4": 0.1, "fp4_e2m1": 0.15}
VOCAB, PROMPT, NEW = 128, 9, 30


def shared(d):
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=d.heads, head_dim=d.head_dim, num_hidden_layers=d.layers,
                max_position_embeddings=d.max_seq_len, attn_implementation="sdpa")


def model_for(d, seed=0, dtype=None):
    """The transformers model whose attention the variant serves: Gemma-2 for a hybrid variant (its
    local groups' window), Mistral for a ring (the ring's window), Llama otherwise; in the variant's
    input dtype unless `dtype` is given (KvforgeCache converts to it)."""
    torch.manual_seed(seed)
    if d.hybrid:
        windows = {g["sliding_window"] for g in d.groups if g["sliding_window"]}
        layer_types = ["full_attention"] * d.layers
        for g in d.groups:
            for layer in g["layers"]:
                layer_types[layer] = "sliding_attention" if g["sliding_window"] else "full_attention"
        # Gemma-2's attention softcapping has no SDPA path in transformers: its eager attention.
        config = Gemma2Config(sliding_window=windows.pop(), layer_types=layer_types, query_pre_attn_scalar=d.head_dim,
                              **{**shared(d), "attn_implementation": "eager"})
        model = Gemma2ForCausalLM(config)
    elif d.addressing == "ring":
        model = MistralForCausalLM(MistralConfig(sliding_window=d.window, **shared(d)))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shared(d)))
    return model.eval().to(dtype or TORCH_DTYPE[d.input])


def prompts(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second prompt is 3 tokens shorter, padded on the left
    return ids, mask


def generate(model, cache, new=NEW):
    ids, mask = prompts()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, cache=cache,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits).float()


def teacher_forced(model, cache, tokens):
    """The logits of each step when the cache is fed `tokens` (prompt, then one token a step):
    [steps, batch, vocab], as generate() reports them."""
    ids, mask = prompts()
    out = []
    with torch.no_grad():
        for end in range(PROMPT, PROMPT + NEW):
            step = tokens[:, :end] if end == PROMPT else tokens[:, end - 1:end]
            full_mask = torch.cat([mask, torch.ones(2, end - PROMPT, dtype=mask.dtype)], 1)
            out.append(model(step, attention_mask=full_mask, cache=cache).logits[:, -1].float())
    return torch.stack(out)


def next_bf16_up(s):
    """The smallest bf16 >= s (positive s): a bf16 scale is rounded up (docs/quantization.md, rule 2)."""
    b = s.to(torch.bfloat16)
    above = (b.view(torch.int16) + 1).view(torch.bfloat16)
    return torch.where(b.float() >= s, b.float(), above.float())


def next_e4m3_up(s):
    """The smallest e4m3 value >= s, within [2^-9, 448] (docs/quantization.md, NVFP4's group scales)."""
    b = s.clamp(max=448.0).to(torch.float8_e4m3fn)
    above = (b.view(torch.uint8) + 1).view(torch.float8_e4m3fn)
    up = torch.where(b.float() >= s, b.float(), above.float()).clamp(max=448.0)
    return up.clamp(min=2.0 ** -9)


def next_power_of_two_up(s):
    """ue8m0: the smallest power of two >= s."""
    m, e = torch.frexp(s)  # s = m 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(s), torch.where(m == 0.5, e - 1, e))


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # OCP e2m1 magnitudes, codes 0..7


def round_to_e2m1(v):
    """Nearest e2m1 value, ties to the even code; v already within +-6."""
    distance = (v.abs()[..., None] - E2M1).abs()
    tied = distance == distance.amin(-1, keepdim=True)
    code = torch.where(tied, torch.arange(8) % 2, 2).argmin(-1)  # among the nearest, the even code
    return torch.copysign(E2M1[code], v)


QMAX = {"int8": 127.0, "int4": 7.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "fp4_e2m1": 6.0}  # rule 2
ROUND_UP = {"fp32": lambda s: s, "bf16": next_bf16_up, "ue8m0": next_power_of_two_up, "fp8_e4m3": next_e4m3_up}


def quantize_dequantize(x, d, tensor_scale):
    """docs/quantization.md's rules on x [batch, heads, tokens, head_dim], written from the text, as the
    cache holds them: in its input dtype, and back in x's."""
    held = TORCH_DTYPE[d.input]
    xf = x.to(held).float()
    if d.quant == "per_group":  # [.., groups, group]: a scale per group of a head's row
        xf = xf.unflatten(-1, (d.head_dim // d.quant_group, d.quant_group))
    if d.zero_point:  # uint4: the range widened to hold 0, in 15 steps, around a zero point
        lo, hi = xf.amin(-1, keepdim=True).clamp(max=0), xf.amax(-1, keepdim=True).clamp(min=0)
        s = ROUND_UP[d.scale_dtype](hi / 15 - lo / 15)
        s = torch.where(s == 0, torch.ones_like(s), s)
        zero = torch.round(-lo / s).clamp(0, 15)
        codes = torch.clamp(torch.round(xf / s) + zero, 0, 15) - zero
        return (codes * s).flatten(-2 if d.quant == "per_group" else -1).to(held).to(x.dtype)
    qmax = QMAX[d.storage]
    under = tensor_scale if d.tensor_scaled else 1.0  # a second level under the group scales
    if d.quant == "per_tensor":
        s = torch.tensor(tensor_scale)
    else:  # dynamic: a token over all heads, one head of a token, or one group of a head's row
        group = (1, 3) if d.quant == "per_token" else (-1,)
        s = ROUND_UP[d.scale_dtype](xf.abs().amax(dim=group, keepdim=True) / qmax / under)
        s = torch.where(s == 0, torch.ones_like(s), s) * under
    if d.storage in ("int8", "int4"):
        codes = torch.clamp(torch.round(xf / s), -qmax, qmax)  # torch.round: half to even
    elif d.storage == "fp4_e2m1":
        codes = round_to_e2m1(torch.clamp(xf / s, -qmax, qmax))
    else:  # saturate to +-qmax, then round to the fp8 grid
        fp8 = torch.float8_e4m3fn if d.storage == "fp8_e4m3" else torch.float8_e5m2
        codes = torch.clamp(xf / s, -qmax, qmax).to(fp8).float()
    return (codes * s).flatten(-2 if d.quant == "per_group" else -1).to(held).to(x.dtype)


def record_dequantize(keys, values, d):
    """docs/quantization.md's rules for a record format's parts (d.record_parts), written from the text, on
    K and V [batch, heads, tokens, head_dim]: each head's record is its K then its V, cut into the parts
    in order; a coded part's groups take amax (at least the part's floor) / the code's largest value,
    rounded up to a power of two where the part says so and to the scale's dtype, 1 for a group of
    zeros; a float part is rounded to its dtype. As the cache holds them: in its input dtype, and back."""
    held = TORCH_DTYPE[d.input]
    record = torch.cat([keys, values], -1).to(held).float()
    out = torch.empty_like(record)
    for p in d.record_parts:
        x = record[..., p["values_at"]:p["values_at"] + p["width"]]
        if "group" not in p:
            out[..., p["values_at"]:p["values_at"] + p["width"]] = x.to(TORCH_DTYPE[p["dtype"]]).float()
            continue
        groups = x.unflatten(-1, (p["width"] // p["group"], p["group"]))
        qmax = QMAX[p["dtype"]]
        amax = groups.abs().amax(-1, keepdim=True).clamp(min=p["amax_floor"])
        s = amax / qmax
        s = next_power_of_two_up(s) if p["rounding"] == "pow2_up" else s
        s = ROUND_UP[p["scale_dtype"]](s)
        s = torch.where(amax == 0, torch.ones_like(s), s)
        if p["dtype"] in ("int8", "int4"):
            codes = torch.clamp(torch.round(groups / s), -qmax, qmax)
        elif p["dtype"] == "fp4_e2m1":
            codes = round_to_e2m1(torch.clamp(groups / s, -qmax, qmax))
        else:
            fp8 = torch.float8_e4m3fn if p["dtype"] == "fp8_e4m3" else torch.float8_e5m2
            codes = torch.clamp(groups / s, -qmax, qmax).to(fp8).float()
        out[..., p["values_at"]:p["values_at"] + p["width"]] = (codes * s).flatten(-2)
    out = out.to(held).to(keys.dtype)
    return out[..., :d.head_dim], out[..., d.head_dim:]


class QuantizedReferenceLayer(DynamicLayer):
    """DynamicCache's layer, keeping each token as the quantization rule (or a record format's) would read
    it back."""

    def __init__(self, d, scales, layer, window=None, reads_its_own_write=False):
        super().__init__()
        self.d, self.scales, self.layer, self.window = d, scales, layer, window
        # An attention that reads the cache (attn_implementation="kvforge", every serving engine) sees this
        # step's tokens as stored; transformers' own attends them as they came.
        self.reads_its_own_write = reads_its_own_write
        self.seen = 0  # tokens ever cached (a sliding layer keeps fewer)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # This step's own tokens attend as they are, in the cache's input dtype.
        held = lambda x: x.to(TORCH_DTYPE[self.d.input]).to(x.dtype)  # noqa: E731
        keys, values = torch.cat([self.keys, held(key_states)], -2), torch.cat([self.values, held(value_states)], -2)
        k_scale, v_scale = self.scales.get(self.layer, (None, None))
        self.seen += key_states.shape[-2]
        if self.d.record_parts:
            stored_k, stored_v = record_dequantize(key_states, value_states, self.d)
        else:
            stored_k = quantize_dequantize(key_states, self.d, k_scale)
            stored_v = quantize_dequantize(value_states, self.d, v_scale)
        if self.reads_its_own_write:
            keys, values = torch.cat([self.keys, stored_k], -2), torch.cat([self.values, stored_v], -2)
        self.keys = torch.cat([self.keys, stored_k], -2)
        self.values = torch.cat([self.values, stored_v], -2)
        if self.window:  # DynamicSlidingWindowLayer keeps the last window - 1 positions
            self.keys, self.values = self.keys[:, :, 1 - self.window:], self.values[:, :, 1 - self.window:]
        return keys, values

    def get_mask_sizes(self, query_length):
        if not self.window:
            return super().get_mask_sizes(query_length)
        cached = self.seen
        return min(cached, self.window - 1) + query_length, max(cached - self.window + 1, 0)

    def get_seq_length(self):
        return self.seen if self.window else super().get_seq_length()


TINY = variants_where(model=lambda m: m in ("tiny", "tiny_hybrid"))
# Block-scaled storage of a small model: MXFP4, grouped int8 and int4, NVFP4 (its tensor scales
# calibrated by kvforge.hf).
GROUPED = variants_where(quant="per_group", layers=lambda n: n <= 24)


# Stored as they are (no codes, no record format of codes).
@pytest.mark.parametrize("d", [d for d in TINY if not d.quantized and not d.record_parts], ids=lambda d: d.name)
def test_generates_what_dynamic_cache_generates(d):
    model = model_for(d)
    want_tokens, want_logits = generate(model, DynamicCache(config=model.config))
    cache = kvforge.hf.KvforgeCache(d.name, model.config, batch_size=2)
    got_tokens, got_logits = generate(model, cache)
    assert torch.equal(got_tokens, want_tokens)
    assert (got_logits - want_logits).abs().max() <= LOGIT_BOUND[d.storage] * want_logits.abs().max()
    assert cache.get_seq_length() == PROMPT + NEW - 1


@pytest.mark.parametrize("d", [d for d in TINY if d.quantized or d.record_parts] + GROUPED, ids=lambda d: d.name)
def test_quantized_generates_what_the_documented_rule_gives(d):
    # A 24-layer model's bf16 linears take 3x as long as fp32 ones on this CPU: the model runs in fp32
    # there, and the cache keeps its input dtype.
    model = model_for(d, dtype=torch.float32 if d.layers > 4 else None)
    cache = kvforge.hf.KvforgeCache(d.name, model.config, batch_size=2)
    got_tokens, got_logits = generate(model, cache)
    window = d.window if d.addressing == "ring" else None
    reference = Cache(layers=[QuantizedReferenceLayer(d, cache.tensor_scales, i, window) for i in range(d.layers)])
    want_tokens, want_logits = generate(model, reference)
    assert torch.equal(got_tokens, want_tokens)
    assert (got_logits - want_logits).abs().max() <= QUANTIZED_LOGIT_BOUND * want_logits.abs().max()
    # Teacher-forced on DynamicCache's own tokens: how far quantized storage moves the logits.
    plain_tokens, _ = generate(model, DynamicCache(config=model.config))
    plain_logits = teacher_forced(model, DynamicCache(config=model.config), plain_tokens)
    logits = teacher_forced(model, kvforge.hf.KvforgeCache(d.name, model.config, batch_size=2), plain_tokens)
    deviation = (logits - plain_logits).abs().max() / plain_logits.abs().max()
    # A record format's parts each cost what their dtype does; the loosest bounds the record.
    bound = max(DEVIATION_BOUND.get(p["dtype"], 0.0) for p in d.record_parts) if d.record_parts else \
        DEVIATION_BOUND[d.storage]
    assert deviation <= bound, float(deviation)


def test_static_cache_agrees():
    d = kvforge.describe("jetstream_contiguous.tiny.fp32")
    model = model_for(d)
    want, _ = generate(model, StaticCache(config=model.config, max_cache_len=d.max_seq_len))
    got, _ = generate(model, kvforge.hf.KvforgeCache(d.name, model.config, batch_size=2))
    assert torch.equal(got, want)


def recompute_logits(model, tokens, mask):
    """Logits of every position from the whole sequence, no cache: scaled_dot_product_attention."""
    with torch.no_grad():
        return model(tokens, attention_mask=mask, use_cache=False).logits.float()


@pytest.mark.parametrize("d", [kvforge.describe(n) for n in ("flashinfer_paged_hnd.tiny.fp32", "jetstream_ring.tiny.fp32",
                                                              "hybrid_paged.tiny_hybrid.bf16")], ids=lambda d: d.name)
def test_generation_equals_full_recomputation(d):
    model = model_for(d)
    tokens, logits = generate(model, kvforge.hf.KvforgeCache(d.name, model.config, batch_size=2))
    _, mask = prompts()
    full_mask = torch.cat([mask, torch.ones(2, NEW, dtype=mask.dtype)], 1)
    full = recompute_logits(model, tokens, full_mask)[:, PROMPT - 1:-1]
    # bf16 activations round differently when a whole sequence is one GEMM: a few bf16 steps.
    bound = 1e-4 if d.input == "fp32" else 2 ** -5
    assert (full - logits.transpose(0, 1)).abs().max() <= bound * full.abs().max()


def test_sliding_window_frees_pages_of_a_paged_cache():
    ring = kvforge.describe("jetstream_ring.tiny.fp32")
    model = model_for(ring)  # Mistral, every layer sliding over the tiny model's window
    want, _ = generate(model, DynamicCache(config=model.config))
    cache = kvforge.hf.KvforgeCache("vllm_paged_nhd.tiny.fp32", model.config, batch_size=2)
    got, _ = generate(model, cache)
    assert torch.equal(got, want)
    assert -1 in cache.sequence_manager.pages(0)  # pages wholly before the window went back to the pool


def test_continuous_batching_with_a_shared_prefix_and_a_fork():
    d = kvforge.describe("vllm_paged_nhd.tiny.fp32")
    model = model_for(d)
    cache = kvforge.hf.KvforgeCache(d.name, model.config, pages=12, prefix_caching=True)
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(1, VOCAB, (d.page_size + 4,), generator=g).tolist()
    held = {}  # sequence -> every token fed so far

    def feed(seq, tokens):
        """One forward of `seq` alone over its new tokens; checks the logits against recomputation."""
        cache.serve([seq])
        with torch.no_grad():
            logits = model(torch.tensor([tokens]), cache=cache).logits.float()[0]
        held[seq] = held.get(seq, []) + tokens
        full = recompute_logits(model, torch.tensor([held[seq]]), None)[0, -len(tokens):]
        assert (logits - full).abs().max() <= 1e-4 * full.abs().max()
        return int(logits[-1].argmax())

    def start(seq, prompt):
        covered = cache.add(seq, prompt)
        held[seq] = prompt[:covered]
        return feed(seq, prompt[covered:]), covered

    a_next, a_covered = start(0, prefix + [3, 4, 5])
    b_next, b_covered = start(1, prefix + [9])  # arrives later, shares the prefix's full page
    assert (a_covered, b_covered) == (0, d.page_size)
    assert cache.sequence_manager.stats["prefix_hits"] == 1
    for _ in range(3):  # decode both, one at a time, over one pool
        cache.extend(0, [a_next])
        a_next = feed(0, [a_next])
        cache.extend(1, [b_next])
        b_next = feed(1, [b_next])
    cache.fork(0, 2)
    held[2] = list(held[0])
    cache.extend(2, [7])  # the fork takes another token and diverges: copy-on-write of the last page
    feed(2, [7])
    cache.extend(0, [a_next])
    feed(0, [a_next])
    assert cache.sequence_manager.stats["copies_on_write"] >= 1
    cache.free(1)
    cache.sequence_manager.check_invariants()


def test_mismatched_model_is_refused():
    d = kvforge.describe("vllm_paged_nhd.tiny.fp32")
    config = LlamaConfig(**{**shared(d), "num_key_value_heads": 4})
    with pytest.raises(kvforge.ArgumentError, match="kv heads"):
        kvforge.hf.KvforgeCache(d.name, config)
    ring = kvforge.describe("jetstream_ring.tiny.fp32")
    with pytest.raises(kvforge.ArgumentError, match="window"):
        kvforge.hf.KvforgeCache(ring.name, LlamaConfig(**shared(ring)))
    hybrid = variants_where(hybrid=True, model="tiny_hybrid")[0]
    window = max(g["sliding_window"] for g in hybrid.groups)
    wider = model_for(hybrid).config
    wider.sliding_window = window + 8  # the model attends further back than the local group keeps
    with pytest.raises(kvforge.ArgumentError, match="keeps the last"):
        kvforge.hf.KvforgeCache(hybrid.name, wider)
