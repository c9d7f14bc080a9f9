"""A compiled decode loop compiles once for every step, through every op the table makes torch ops of.

A decoder step written here runs two sequences of different lengths: a ragged prefill (7 and 4 tokens),
then 20 decode steps, the per-sequence lengths a Python list. It appends each layer's new K/V (or record,
or MLA latent) through the table's torch ops, commits a lazy variant, and attends either through the
gather ops and PyTorch's SDPA, or through torch.ops.kvforge.attend. Under torch.compile(fullgraph=True)
and the default dynamic=None, torch compiles the prefill and the first decode step, finds the sizes
changed, and makes them symbolic: at most 2 graphs for all 21 steps, since every integer of the ops'
schemas is a SymInt (with `int` ones, dynamo guards on each length and compiles again every step until
its recompile limit). aot_eager's run is bitwise equal to eager's, outputs and cache bytes alike; one
family runs under inductor too, within fp32 rounding.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kvforge
import kvforge.ops

Q_HEADS = 4
PREFILL, DECODES = (7, 4), 20

# One variant of each storage family, and the lazy and ring forms: float, int8, fp8, zero-point int4,
# named record parts, K/V of other widths, MLA's latent.
VARIANTS = ["vllm_paged_nhd.tiny.fp32", "jetstream_contiguous.tiny.bf16", "flashinfer_paged_hnd.tiny.int8_in_bf16",
            "vllm_paged_nhd.tiny.fp8_e4m3_in_bf16", "paged_zero_point.tiny.uint4_in_bf16",
            "user_record_parts.tiny.kv_int8_e4m3_in_bf16", "paged_head_records.tiny_kv_widths.fp32",
            "vllm_mla.tiny_mla.fp32", "jetstream_stacked_lazy.tiny.bf16", "jetstream_ring.tiny.fp32"]


class Step(torch.nn.Module):
    """One step of layers of attention over the cache: x [T, hidden] (sequence 0's new tokens, then
    sequence 1's) -> [T, hidden]. `attend`: torch.ops.kvforge.attend; else the gather ops and SDPA."""

    def __init__(self, d, attend):
        super().__init__()
        torch.manual_seed(0)
        # Plain values: compiled code reads no native object.
        self.layers, self.lazy, self.paged, self.attend = d.layers, d.lazy, d.paged, attend
        self.ring_window = d.window if d.addressing == "ring" else 0
        self.form = "latent" if d.mla else "record" if d.kv_widths else "kv"
        self.heads = 1 if d.mla else d.heads
        self.kw = sum(d.mla) if d.mla else d.kv_widths[0] if d.kv_widths else d.head_dim
        self.vw = d.mla[0] if d.mla else d.kv_widths[1] if d.kv_widths else d.head_dim
        self.record = sum(d.mla) if d.mla else sum(d.kv_widths) if d.kv_widths else 0
        hidden = 64
        make = lambda n: torch.nn.Linear(hidden, n, bias=False)  # noqa: E731
        self.q = torch.nn.ModuleList(make(Q_HEADS * self.kw) for _ in range(d.layers))
        self.k = torch.nn.ModuleList(make(self.heads * self.kw) for _ in range(d.layers))
        self.v = torch.nn.ModuleList(make(self.heads * self.vw) for _ in range(d.layers))
        self.o = torch.nn.ModuleList(torch.nn.Linear(Q_HEADS * self.vw, hidden, bias=False) for _ in range(d.layers))

    def write(self, tc, layer, k, v, where):
        if self.form == "kv":
            tc.append(layer, k, v, **where)
        elif self.form == "record":
            tc.append_record(layer, torch.cat([k, v], -1), **where)
        else:  # MLA: the latent (K's first vw values) and its RoPE part are the record; V is the latent
            tc.append_latent(layer, k, **where)

    def read(self, tc, layer, begin, end, seq, pages):
        where = dict(pages=pages[seq]) if self.paged else dict(row=seq)
        if self.form == "kv":
            return tc.gather(layer, begin, end, **where)
        if self.form == "record":
            rec = tc.gather_record(layer, begin, end, **where)
            return rec[..., :self.kw], rec[..., self.kw:self.kw + self.vw]
        latent = tc.gather_latent(layer, begin, end, **where)
        return latent, latent[..., :self.vw]

    def forward(self, tc, x, lens: list[int], new: list[int], where, pages, query_start, lengths, rows):
        T = x.shape[0]
        for layer in range(self.layers):
            q = self.q[layer](x).view(T, Q_HEADS, self.kw)
            k = self.k[layer](x).view(T, self.heads, self.kw)
            v = self.v[layer](x).view(T, self.heads, self.vw)
            if self.form == "latent":
                k = torch.cat([v, k[..., self.vw:]], -1)  # the latent first, then its RoPE part
            self.write(tc, layer, k, v, where)
            if self.lazy:
                tc.commit()
            if self.attend:
                at = dict(page_table=pages) if self.paged else dict(rows=rows)
                out, _ = tc.attend(layer, q, query_start, lengths, window=self.ring_window, **at)
            else:
                outs, first = [], 0
                for seq in range(2):
                    end = lens[seq] + new[seq]
                    begin = max(0, end - self.ring_window) if self.ring_window else 0
                    k_all, v_all = self.read(tc, layer, begin, end, seq, pages)
                    qs = q[first:first + new[seq]].transpose(0, 1)
                    mask = torch.ones(new[seq], end - begin, dtype=torch.bool).tril(end - begin - new[seq])
                    attn = F.scaled_dot_product_attention(qs.float(), k_all.float(), v_all.float(), attn_mask=mask,
                                                          enable_gqa=True)
                    outs.append(attn.transpose(0, 1).to(x.dtype))
                    first += new[seq]
                out = torch.cat(outs)
            x = x + self.o[layer](out.reshape(T, -1).to(x.dtype))
        return x


def run(d, step, forward):
    """The prefill and DECODES steps; returns every step's output and the cache's bytes at the end."""
    cache = kvforge.create(d.name, pages=16, max_staged_tokens=16) if d.paged else \
        kvforge.create(d.name, rows=2, max_staged_tokens=16)
    tc = kvforge.ops.TorchCache(cache)
    dtype = tc.dtype
    g = torch.Generator().manual_seed(1)
    per = 8  # pages of a sequence: sequence s holds pages 8 s .. 8 s + 7
    pages = torch.arange(16, dtype=torch.int32).view(2, per) if d.paged else None
    lens, outputs = [0, 0], []
    for new in [list(PREFILL)] + [[1, 1]] * DECODES:
        pos = torch.cat([torch.arange(lens[s], lens[s] + new[s]) for s in range(2)])
        seq = torch.cat([torch.full((new[s],), s) for s in range(2)])
        if d.paged:
            where = dict(slots=(pages[seq, pos // d.page_size].long() * d.page_size + pos % d.page_size))
        else:
            where = dict(rows=seq.to(torch.int32), positions=pos.to(torch.int32))
        query_start = torch.tensor([0, new[0], new[0] + new[1]], dtype=torch.int32)
        lengths = torch.tensor([lens[0] + new[0], lens[1] + new[1]], dtype=torch.int32)
        x = torch.randn(sum(new), 64, generator=g).to(dtype)
        outputs.append(forward(tc, x, list(lens), new, where, pages, query_start, lengths,
                               torch.arange(2, dtype=torch.int32)))
        lens = [lens[s] + new[s] for s in range(2)]
    return outputs, [np.from_dlpack(b).copy() for b in cache.buffers()]


def compiled_run(d, attend, backend):
    torch._dynamo.reset()
    step = Step(kvforge.describe(d), attend).to(kvforge.ops.TORCH_DTYPES[kvforge.describe(d).input]).eval()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    with torch.no_grad():
        want = run(kvforge.describe(d), step, step)
        got = run(kvforge.describe(d), step, torch.compile(step, backend=counting, fullgraph=True))
    return want, got, graphs


@pytest.mark.parametrize("attend", [False, True], ids=["gather", "attend"])
@pytest.mark.parametrize("name", VARIANTS)
def test_21_steps_compile_at_most_twice_and_equal_eager(name, attend):
    (want_out, want_cache), (got_out, got_cache), graphs = compiled_run(name, attend, "aot_eager")
    assert 1 <= len(graphs) <= 2, f"{len(graphs)} graphs for a prefill and {DECODES} decode steps"
    ops = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert ("kvforge.attend" in ops) == attend, ops
    for a, b in zip(want_out, got_out):
        assert torch.equal(a, b)
    for a, b in zip(want_cache, got_cache):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("attend", [False, True], ids=["gather", "attend"])
def test_inductor_compiles_at_most_twice_within_rounding(attend):
    (want_out, _), (got_out, _), graphs = compiled_run("vllm_paged_nhd.tiny.fp32", attend, "inductor")
    assert 1 <= len(graphs) <= 2, len(graphs)
    for a, b in zip(want_out, got_out):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
