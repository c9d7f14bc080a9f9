"""torch.ops.kvforge.* under torch.compile(fullgraph=True): a small attention decoder that appends to and
reads from a kvforge cache compiles with no graph break, and compiled and eager runs leave identical
caches and give identical outputs. The attention itself is PyTorch's scaled_dot_product_attention."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import variants_where

import kvforge
import kvforge.ops
from kvforge.torch_dtypes import TORCH_DTYPES

torch.manual_seed(0)


class Decoder(torch.nn.Module):
    """Layers of single-sequence attention over the cache: x [T, hidden] -> [T, hidden]."""

    def __init__(self, d, q_heads=4):
        super().__init__()
        # Plain ints: compiled code reads no native object (dynamo cannot trace nanobind properties).
        self.layers, self.heads, self.head_dim, self.lazy = d.layers, d.heads, d.head_dim, d.lazy
        self.q_heads = q_heads
        hidden = q_heads * d.head_dim
        make = lambda out: torch.nn.Linear(hidden, out, bias=False)  # noqa: E731
        self.q = torch.nn.ModuleList(make(hidden) for _ in range(d.layers))
        self.k = torch.nn.ModuleList(make(d.heads * d.head_dim) for _ in range(d.layers))
        self.v = torch.nn.ModuleList(make(d.heads * d.head_dim) for _ in range(d.layers))
        self.o = torch.nn.ModuleList(make(hidden) for _ in range(d.layers))

    def forward(self, tc, x, start: int, rows, positions, slots, pages):
        T = x.shape[0]
        end = start + T
        for layer in range(self.layers):
            q = self.q[layer](x).view(T, self.q_heads, self.head_dim).transpose(0, 1)
            k = self.k[layer](x).view(T, self.heads, self.head_dim)
            v = self.v[layer](x).view(T, self.heads, self.head_dim)
            tc.append(layer, k, v, rows=rows, positions=positions, slots=slots)
            if self.lazy:
                tc.commit()
            k_all, v_all = tc.gather(layer, 0, end, pages=pages)
            mask = torch.ones(T, end, dtype=torch.bool).tril(diagonal=start)
            attn = F.scaled_dot_product_attention(q.unsqueeze(0), k_all.unsqueeze(0), v_all.unsqueeze(0),
                                                  attn_mask=mask, enable_gqa=True)
            x = x + self.o[layer](attn.squeeze(0).transpose(0, 1).reshape(T, -1))
        return x


def targets(d, start, count):
    """Append targets for positions [start, start + count) of sequence 0: row 0, or pages 0, 1, ... ."""
    positions = torch.arange(start, start + count, dtype=torch.int32)
    if d.paged:
        return None, None, positions.to(torch.int64), torch.arange(d.max_seq_len // d.page_size, dtype=torch.int32)
    return torch.zeros(count, dtype=torch.int32), positions, None, None


def run(d, model, forward, steps):
    cache = kvforge.create(d.name, pages=8) if d.paged else kvforge.create(d.name, rows=1, max_staged_tokens=16)
    tc = kvforge.ops.TorchCache(cache)
    outputs, start = [], 0
    for x in steps:
        rows, positions, slots, pages = targets(d, start, x.shape[0])
        outputs.append(forward(tc, x, start, rows, positions, slots, pages))
        start += x.shape[0]
    assert int(tc.version) == len(steps) * d.layers * (2 if d.lazy else 1)  # every append and commit counted
    return outputs, [np.from_dlpack(b).copy() for b in cache.buffers()]


CASES = [variants_where(model="tiny", addressing="paged", storage="fp32", layout="vllm_paged_nhd")[0],
         variants_where(model="tiny", addressing="contiguous", storage="fp32", lazy=False, stacked=False)[0],
         variants_where(model="tiny", addressing="contiguous", storage="fp32", lazy=True)[0]]


@pytest.mark.parametrize("d", CASES, ids=lambda d: d.name)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager(d, backend):
    torch._dynamo.reset()
    model = Decoder(d).eval()
    hidden = model.q_heads * d.head_dim
    steps = [torch.randn(6, hidden)] + [torch.randn(1, hidden) for _ in range(4)]
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    compiled = torch.compile(model, backend=counting, fullgraph=True, dynamic=True)
    with torch.no_grad():
        eager_out, eager_cache = run(d, model, model, steps)
        compiled_out, compiled_cache = run(d, model, compiled, steps)
    assert graphs, "torch.compile produced no graph"
    ops = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert {"kvforge.append", "kvforge.gather"} <= ops, ops
    for a, b in zip(eager_cache, compiled_cache):
        if backend == "aot_eager":
            assert np.array_equal(a, b)
        else:  # inductor may fuse the projections' rounding differently: equal within fp32 rounding
            np.testing.assert_allclose(a.view(np.float32), b.view(np.float32), rtol=1e-5, atol=1e-6)
    for a, b in zip(eager_out, compiled_out):
        if backend == "aot_eager":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_writing_ops_mark_the_version_mutated():
    schema = {name: str(getattr(torch.ops.kvforge, name).default._schema)
              for name in ("append", "gather", "commit", "copy_blocks")}
    for name in ("append", "commit", "copy_blocks"):
        assert "Tensor(a0!) version" in schema[name], schema[name]
    assert "!" not in schema["gather"], schema["gather"]


def test_copy_blocks_op_and_errors():
    d = CASES[0]
    tc = kvforge.ops.TorchCache(kvforge.create(d.name, pages=4))
    k = torch.randn(d.page_size, d.heads, d.head_dim)
    for layer in range(d.layers):
        tc.append(layer, k, -k, slots=torch.arange(d.page_size))
    tc.copy_blocks(torch.tensor([0, 2], dtype=torch.int32))
    got_k, got_v = tc.gather(1, 0, d.page_size, pages=torch.tensor([2], dtype=torch.int32))
    assert torch.equal(got_k, k.transpose(0, 1)) and torch.equal(got_v, -k.transpose(0, 1))
    with pytest.raises(kvforge.OutOfRangeError, match="pairs"):
        tc.copy_blocks(torch.tensor([0, 9], dtype=torch.int32))


# A paged float variant of each record kind, the smallest: K and V of other widths, and an MLA latent.
RECORD_CASES = [min((d for d in variants_where(paged=True, hybrid=False, **{kind: lambda v: v is not None})
                     if d.storage == d.input and d.input in ("fp32", "bf16")),
                    key=lambda d: (d.bytes_per_token, d.name))
                for kind in ("kv_widths", "mla")]


@pytest.mark.parametrize("d", RECORD_CASES, ids=lambda d: d.name)
def test_record_ops_compile_and_give_back_what_was_written(d):
    """A whole record a head (K then V of other widths, or an MLA latent and its RoPE part) through the
    torch ops under torch.compile(fullgraph=True): the gather returns each token's record at its
    position, as written, and each write counts once in the version."""
    torch._dynamo.reset()
    append, gather = ("append_latent", "gather_latent") if d.mla else ("append_record", "gather_record")
    width = sum(d.mla or d.kv_widths)
    n = 2 * d.page_size
    records = torch.randn(n, d.heads, width).to(TORCH_DTYPES[d.input])  # stored as given: storage == input

    def step(tc, records, slots, pages):
        getattr(tc, append)(0, records, slots=slots)
        return getattr(tc, gather)(0, 0, records.shape[0], pages=pages)

    tc = kvforge.ops.TorchCache(kvforge.create(d.name, pages=4))
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(
        tc, records, torch.arange(n), torch.tensor([0, 1], dtype=torch.int32))
    assert torch.equal(got, records.transpose(0, 1))  # written [n, H, W], read back [H, n, W]
    assert int(tc.version) == 1


def test_a_write_given_the_wrong_tensors_names_them():
    d = CASES[0]
    tc = kvforge.ops.TorchCache(kvforge.create(d.name, pages=4))
    with pytest.raises(kvforge.ArgumentError, match="k, v"):
        tc.append(0, torch.zeros(1, d.heads, d.head_dim), slots=torch.zeros(1, dtype=torch.int64))
    assert int(tc.version) == 0  # nothing was written
