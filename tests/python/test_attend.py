"""Cache.attend from Python against PyTorch's own attention: torch's scaled_dot_product_attention in fp32
over the K and V that kvforge's dequantizing gather returns (GQA by repeating K/V heads; a causal chunk
by SDPA's own causal mask over the chunk's last positions). One variant of each addressing and storage
family of the tiny models, batches of two sequences of different lengths, each written through append
and, for a lazy variant, committed.

Tolerance: kvforge attends in fp32 and rounds its output once to the input dtype, so |out - SDPA| <=
u |V| + 1e-5 |V| (u: the input dtype's unit roundoff), plus where storage is coded the scores' rounding
of the gathered K to the input dtype: 2 delta |V|, delta = scale * sum |q||k| * u (test_attend.cpp
derives the same). torch.compile of the op and its fake are test_torch_ops.py's.
"""

import math

import pytest
import torch
from conftest import TORCH_DTYPE, variants_where

import kvforge
import kvforge.ops

UNIT_ROUNDOFF = {"fp32": 2.0 ** -24, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


def one_of_each_family():
    seen, out = set(), []
    for d in variants_where(model=lambda m: m == "tiny", mla=None):
        family = (d.addressing, d.storage, d.quant, d.lazy, bool(d.kv_widths), bool(d.record_parts))
        if family not in seen:
            seen.add(family)
            out.append(d)
    return out


FAMILIES = one_of_each_family()


class Written:
    """A cache of `d` holding random K/V for sequences of `lengths`, and the batch arrays that address them."""

    def __init__(self, d, lengths, seed=0):
        self.d, self.lengths = d, lengths
        g = torch.Generator().manual_seed(seed)
        self.dtype = TORCH_DTYPE[d.input]
        batch, longest = len(lengths), max(lengths)
        self.key_width = d.kv_widths[0] if d.kv_widths else d.head_dim
        self.value_width = d.kv_widths[1] if d.kv_widths else d.head_dim
        if d.paged:
            per = -(-longest // d.page_size)
            pages = torch.randperm(batch * per + 3, generator=g)[:batch * per].to(torch.int32)
            self.table = pages.view(batch, per).contiguous()
            self.cache = kvforge.create(d.name, pages=batch * per + 3, max_staged_tokens=sum(lengths))
        else:
            self.table = None
            self.cache = kvforge.create(d.name, rows=batch + 1, max_staged_tokens=sum(lengths))
        self.rows = torch.arange(1, batch + 1, dtype=torch.int32)  # row 0 left alone
        for layer in range(d.layers):
            for b, n in enumerate(lengths):
                pos = torch.arange(n, dtype=torch.int32)
                k = torch.randn(n, d.heads, self.key_width, generator=g).to(self.dtype)
                v = torch.randn(n, d.heads, self.value_width, generator=g).to(self.dtype)
                if d.paged:
                    slots = self.table[b, pos // d.page_size] * d.page_size + pos % d.page_size
                    where = dict(slots=slots.to(torch.int64))
                else:
                    where = dict(rows=self.rows[b].repeat(n), positions=pos)
                if d.kv_widths:
                    self.cache.append_record(layer, torch.cat([k, v], -1), **where)
                else:
                    self.cache.append(layer, k, v, **where)
        if d.lazy:
            self.cache.commit()

    def gathered(self, layer, b):
        """Sequence b's K [heads, n, kw] and V [heads, n, vw], in fp32, as kvforge's gather returns them."""
        n, d = self.lengths[b], self.d
        where = dict(pages=self.table[b]) if d.paged else dict(row=int(self.rows[b]))
        if d.kv_widths:
            rec = torch.empty(d.heads, n, self.key_width + self.value_width, dtype=self.dtype)
            self.cache.gather_record(layer, rec, begin=0, end=n, **where)
            return rec[..., :self.key_width].float(), rec[..., self.key_width:].float()
        k = torch.empty(d.heads, n, d.head_dim, dtype=self.dtype)
        v = torch.empty_like(k)
        self.cache.gather(layer, k, v, begin=0, end=n, **where)
        return k.float(), v.float()

    def addressing(self):
        return dict(page_table=self.table) if self.d.paged else dict(rows=self.rows)


def sdpa_reference(written, layer, q, queries, group, window=0):
    """fp32 SDPA per sequence over the gathered K/V: q [T, q_heads, kw] -> ([T, q_heads, vw], lse [T, q_heads])."""
    outs, lses, t = [], [], 0
    for b, n in enumerate(queries):
        k, v = written.gathered(layer, b)
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        length = written.lengths[b]
        qb = q[t:t + n].float().transpose(0, 1)  # [q_heads, n, kw]
        pos = torch.arange(length - n, length)[:, None]
        key = torch.arange(length)[None, :]
        visible = (key <= pos) & ((key > pos - window) if window else True)
        outs.append(torch.nn.functional.scaled_dot_product_attention(qb, k, v, attn_mask=visible).transpose(0, 1))
        scores = (qb @ k.transpose(1, 2)) / math.sqrt(k.shape[-1])
        lses.append(scores.masked_fill(~visible, -math.inf).logsumexp(-1).transpose(0, 1))
        t += n
    return torch.cat(outs), torch.cat(lses)


def check(written, queries, group, window=0, seed=1):
    d = written.d
    g = torch.Generator().manual_seed(seed)
    q_heads, tokens = d.heads * group, sum(queries)
    starts = torch.tensor([0] + list(torch.tensor(queries).cumsum(0)), dtype=torch.int32)
    lengths = torch.tensor(written.lengths, dtype=torch.int32)
    u = UNIT_ROUNDOFF[d.input]
    for layer in range(d.layers):
        q = (torch.randn(tokens, q_heads, written.key_width, generator=g) / 2).to(written.dtype)
        out = torch.full((tokens, q_heads, written.value_width), float("nan"), dtype=written.dtype)
        lse = torch.empty(tokens, q_heads, dtype=torch.float32)
        written.cache.attend(layer, q, out, query_start=starts, lengths=lengths, lse=lse, window=window,
                             **written.addressing())
        want, want_lse = sdpa_reference(written, layer, q, queries, group, window)
        largest = max(written.gathered(layer, b)[1].abs().max() for b in range(len(queries)))
        delta = 0.0
        if d.quantized or d.record_parts:
            for b in range(len(queries)):
                k = written.gathered(layer, b)[0].repeat_interleave(group, 0).abs()
                qs = q[int(starts[b]):int(starts[b + 1])].float().abs().transpose(0, 1)
                delta = max(delta, float((qs @ k.transpose(1, 2)).max()) / math.sqrt(written.key_width) * u)
        bound = float(largest) * (u + 2 * delta + 1e-5) + 1e-6
        err = (out.float() - want).abs().max()
        assert err <= bound, (layer, float(err), bound)
        assert (lse - want_lse).abs().max() <= 2 * delta + 1e-5


@pytest.mark.parametrize("d", FAMILIES, ids=lambda d: d.name)
def test_decodes_and_chunks_match_sdpa_over_the_gather(d):
    longest = min(d.max_seq_len, d.window if d.addressing == "ring" else 40)
    written = Written(d, [longest, 13])
    check(written, queries=[1, 1], group=1)
    check(written, queries=[5, 1], group=4)  # a chunk of 5 and a decode, GQA 4


@pytest.mark.parametrize("d", [d for d in FAMILIES if d.addressing != "ring"][:3], ids=lambda d: d.name)
def test_a_window_matches_sdpa_over_the_gather(d):
    written = Written(d, [min(d.max_seq_len, 37), 11])
    check(written, queries=[3, 2], group=2, window=6)


def test_bad_arguments_name_themselves_and_write_nothing():
    d = kvforge.describe("vllm_paged_nhd.tiny.fp32")
    written = Written(d, [20, 9])
    q = torch.randn(2, d.heads, d.head_dim)
    out = torch.full((2, d.heads, d.head_dim), 7.0)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    cases = [
        (dict(lengths=torch.tensor([20, 99], dtype=torch.int32)), "lengths"),
        (dict(lengths=torch.tensor([20, 9], dtype=torch.int32), scale=-1.0), "scale"),
        (dict(lengths=torch.tensor([20, 9], dtype=torch.int32), begins=torch.tensor([0, 9], dtype=torch.int32)), "begins"),
    ]
    for kwargs, argument in cases:
        with pytest.raises(kvforge.ArgumentError, match=argument):
            written.cache.attend(0, q, out, query_start=starts, page_table=written.table, **kwargs)
        assert torch.all(out == 7.0)
    with pytest.raises(kvforge.ShapeError, match="q"):
        written.cache.attend(0, q[:, :1], out, query_start=starts, lengths=torch.tensor([20, 9], dtype=torch.int32),
                             page_table=written.table)
