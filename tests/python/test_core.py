"""kvforge._native through its Python API: every non-hybrid default variant of the tiny model round-trips
strided torch and numpy input against a reference kept in logical coordinates; views are the cache's
own memory; a refused call raises the mapped exception and changes no byte."""

import gc

import numpy as np
import pytest
import torch
from conftest import TORCH_DTYPE, assert_reads_back, strided_tokens, variants_where

import kvforge

TINY = variants_where(model="tiny")
assert TINY, "no variant of the tiny model is registered"


class Driver:
    """Appends one sequence per row (contiguous, ring) or per page list (paged), and keeps the
    reference: ref[(layer, seq, position)] = (k [H, D], v [H, D]) as appended."""

    def __init__(self, d, sequences=3, generator=None):
        self.d, self.sequences, self.g = d, sequences, generator
        if d.addressing == "paged":
            self.pages_per_seq = -(-d.max_seq_len // d.page_size)
            self.cache = kvforge.create(d.name, pages=sequences * self.pages_per_seq)
            perm = torch.randperm(sequences * self.pages_per_seq, generator=generator).to(torch.int32)
            self.page_list = [perm[s * self.pages_per_seq:(s + 1) * self.pages_per_seq].contiguous()
                              for s in range(sequences)]
        else:
            self.cache = kvforge.create(d.name, rows=sequences, max_staged_tokens=64)
        if d.quant == "per_tensor":
            for layer in range(d.layers):
                self.cache.set_tensor_scale(layer, 0.05, 0.07)
        self.length = [0] * sequences
        self.ref = {}

    def append(self, layer, seq, count, order):
        d = self.d
        dtype = TORCH_DTYPE[d.input]
        k = strided_tokens(count, d.heads, d.head_dim, dtype, self.g, order)
        v = strided_tokens(count, d.heads, d.head_dim, dtype, self.g, order)
        positions = list(range(self.length[seq], self.length[seq] + count))
        if d.addressing == "paged":
            slots = torch.tensor([int(self.page_list[seq][p // d.page_size]) * d.page_size + p % d.page_size
                                  for p in positions], dtype=torch.int64)
            self.cache.append(layer, k, v, slots=slots)
        else:
            self.cache.append(layer, k, v, rows=np.full(count, seq, dtype=np.int32),
                              positions=np.array(positions, dtype=np.int32))
        for i, p in enumerate(positions):
            self.ref[(layer, seq, p)] = (k[i].float().clone(), v[i].float().clone())

    def expected(self, layer, seq, begin, end):
        k = torch.stack([self.ref[(layer, seq, p)][0] for p in range(begin, end)], dim=1)
        v = torch.stack([self.ref[(layer, seq, p)][1] for p in range(begin, end)], dim=1)
        return k, v

    def gather(self, layer, seq, begin, end):
        d = self.d
        dtype = TORCH_DTYPE[d.input]
        k_out = torch.empty(d.heads, end - begin, d.head_dim, dtype=dtype)
        v_out = torch.empty(d.heads, end - begin, d.head_dim, dtype=dtype)
        if d.addressing == "paged":
            self.cache.gather(layer, k_out, v_out, pages=self.page_list[seq], begin=begin, end=end)
        else:
            self.cache.gather(layer, k_out, v_out, row=seq, begin=begin, end=end)
        return k_out.float(), v_out.float()

    def readable(self, seq):
        end = self.length[seq]
        begin = max(0, end - self.d.window) if self.d.addressing == "ring" else 0
        return begin, end


@pytest.mark.parametrize("d", [d for d in TINY if not d.hybrid], ids=lambda d: d.name)
def test_round_trip_against_logical_reference(d, generator):
    drv = Driver(d, generator=generator)
    chunks = [5, 1, 1, 9, 2] if d.addressing != "ring" else [5, 1, 13, 1, 7]
    for step, count in enumerate(chunks):
        order = "heads_outside" if step % 2 else "padded"
        for seq in range(drv.sequences):
            if drv.length[seq] + count > d.max_seq_len:
                continue
            for layer in range(d.layers):
                drv.append(layer, seq, count, order)
            drv.length[seq] += count
        drv.cache.commit()
    for seq in range(drv.sequences):
        begin, end = drv.readable(seq)
        for layer in range(d.layers):
            got_k, got_v = drv.gather(layer, seq, begin, end)
            want_k, want_v = drv.expected(layer, seq, begin, end)
            assert_reads_back(d, got_k, got_v, want_k, want_v)


def pool_bytes(cache):
    return [np.from_dlpack(b).copy() for b in cache.buffers()]


@pytest.mark.parametrize("d", variants_where(model="tiny", addressing="paged", quantized=False, hybrid=False,
                                             storage="fp32"), ids=lambda d: d.name)
def test_view_is_the_cache_memory(d, generator):
    drv = Driver(d, generator=generator)
    for layer in range(d.layers):
        drv.append(layer, 0, 4, "padded")
    drv.length[0] = 4
    view = drv.cache.view(1)
    k = torch.from_dlpack(view["k"])
    pool = torch.from_dlpack(drv.cache.buffers()[0])
    assert k.shape == (drv.cache.config["pages"], d.page_size, d.heads, d.head_dim)
    # Zero-copy: the view points into the pool itself; layer 0's K starts the pool.
    assert pool.data_ptr() <= k.data_ptr() < pool.data_ptr() + pool.numel()
    assert torch.from_dlpack(drv.cache.view(0)["k"]).data_ptr() == pool.data_ptr()
    # A write through the exported tensor is what gather reads (position 2 of sequence 0, head 1).
    page, offset = int(drv.page_list[0][0]), 2
    k[page, offset, 1] = torch.arange(d.head_dim, dtype=k.dtype)
    got_k, _ = drv.gather(1, 0, 0, 4)
    assert torch.equal(got_k[1, 2], torch.arange(d.head_dim, dtype=torch.float32))
    assert torch.equal(got_k[0, 2], drv.ref[(1, 0, 2)][0][0])
    # The exported tensor keeps the cache alive.
    del view, drv
    gc.collect()
    assert torch.equal(k[page, offset, 1], torch.arange(d.head_dim, dtype=k.dtype))


@pytest.mark.parametrize("d", variants_where(model="tiny", quantized=True, hybrid=False), ids=lambda d: d.name)
def test_quantized_view_exports_codes_and_scales(d, generator):
    drv = Driver(d, generator=generator)
    drv.append(0, 0, 3, "padded")
    drv.cache.commit()
    view = drv.cache.view(0)
    codes = torch.from_dlpack(view["k"])
    assert codes.dtype == (torch.int8 if d.storage == "int8" else torch.uint8)
    scales = torch.from_dlpack(view["k_scales"])
    assert scales.dtype == TORCH_DTYPE[d.scale_dtype]
    assert scales.shape == codes.shape[:3] + ((2,) if d.zero_point else ())  # a zero-point entry: scale, zero
    # value = code * scale, read through the exported views at the coordinates the reference used.
    if d.storage == "int8":
        loc = (int(drv.page_list[0][0]), 1) if d.addressing == "paged" else (0, 1)
        got = codes[loc].float() * scales[loc].float()[..., None]
        want = drv.ref[(0, 0, 1)][0]
        assert ((got - want).abs() <= want.abs().amax() / 127.0 + 1e-2).all()


def test_refused_calls_raise_the_mapped_class_and_write_nothing(generator):
    d = variants_where(model="tiny", addressing="paged", storage="fp32", hybrid=False)[0]
    drv = Driver(d, generator=generator)
    drv.append(0, 0, 3, "padded")
    before = pool_bytes(drv.cache)
    k = torch.randn(2, d.heads, d.head_dim)
    bad = [
        (kvforge.OutOfRangeError, IndexError, dict(slots=torch.tensor([0, 10 ** 6]))),
        (kvforge.DtypeError, TypeError, dict(slots=torch.tensor([0, 1], dtype=torch.int32))),
        (kvforge.ShapeError, ValueError, dict(slots=torch.tensor([[0, 1]]))),
        (kvforge.ShapeError, ValueError, dict(slots=torch.tensor([0, 1, 2]))),
    ]
    for cls, builtin, targets in bad:
        with pytest.raises(cls) as caught:
            drv.cache.append(0, k, k, **targets)
        assert isinstance(caught.value, builtin) and caught.value.argument.startswith("targets.slots")
    with pytest.raises(kvforge.DtypeError) as caught:
        drv.cache.append(0, k.double(), k, slots=torch.tensor([0, 1]))
    assert caught.value.argument == "k" and "float64" not in str(caught.value)  # names DLPack's code
    with pytest.raises(kvforge.ShapeError, match="3 dimensions"):
        drv.cache.append(0, k[0], k[0], slots=torch.tensor([0]))
    with pytest.raises(kvforge.ArgumentError, match="__dlpack__"):
        drv.cache.append(0, [[0.0]], k, slots=torch.tensor([0, 1]))
    with pytest.raises(kvforge.OutOfRangeError) as caught:
        drv.cache.append(d.layers, k, k, slots=torch.tensor([0, 1]))
    assert caught.value.argument == "layer" and (caught.value.lo, caught.value.hi) == (0, d.layers)
    with pytest.raises(kvforge.OutOfRangeError) as caught:  # past C's int, still the layer's range
        drv.cache.append(2 ** 40, k, k, slots=torch.tensor([0, 1]))
    assert caught.value.argument == "layer" and caught.value.value == 2 ** 40
    rows, positions = torch.zeros(2, dtype=torch.int32), torch.arange(2, dtype=torch.int32)
    with pytest.raises(kvforge.ArgumentError, match="targets.slots: missing.*rows and positions address") as caught:
        drv.cache.append(0, k, k, rows=rows, positions=positions)
    assert type(caught.value) is kvforge.ArgumentError
    with pytest.raises(kvforge.UnsupportedError):
        drv.cache.reorder(torch.zeros(1, dtype=torch.int32))
    with pytest.raises(kvforge.ShapeError, match="packed"):
        drv.cache.pack_pages(torch.tensor([0, 1], dtype=torch.int32), torch.empty(10, dtype=torch.uint8))
    assert all(np.array_equal(a, b) for a, b in zip(before, pool_bytes(drv.cache)))


def test_hostile_physical_placements_are_refused_before_a_byte_is_written():
    # kvforge.nixl's sender writes a layer where a placement from another process says; one that a
    # hostile or faulty receiver made up must fail naming the field, never loop, crash or write. Every
    # unquantized eager variant with a placement: pages of one position (contiguous) and of many.
    checked = 0
    for d in variants_where(storage="fp32", update="eager", hybrid=False, quantized=False,
                            addressing=lambda a: a in ("contiguous", "paged")):
        cache = kvforge.create(d.name, pages=2) if d.paged else kvforge.create(d.name, rows=1, max_seq_len=8)
        pages = np.array([0], np.int32) if d.paged else None
        good = cache.physical_placement(1, pages)
        if good is None:
            continue  # a layout with one message a head row (physical_wire.cpp): no placement to abuse
        checked += 1
        wire = np.full(good["wire_bytes"], 7, np.uint8)
        cache.write_physical(0, 1, good, wire, pages=pages)
        assert not (wire == 7).all(), d.name
        wire[:] = 7
        bad = [(dict(good, page_size=2 ** 40, pages=1, slot_stride=0), "slots that overlap"),  # 2^40 slots at one offset
               (dict(good, page_size=max(good["page_size"], 2), pages=1, slot_stride=d.head_dim - 1), "slots that overlap"),
               (dict(good, page_size=2 ** 20, slot_stride=d.head_dim, pages=1), "more slots than the wire holds"),
               (dict(good, page_size="16"), r"placement\.page_size: must be an integer")]
        for placement, message in bad:
            with pytest.raises(kvforge.ArgumentError, match=message):
                cache.write_physical(0, 1, placement, wire, pages=pages)
        assert (wire == 7).all(), f"{d.name}: a refused placement wrote to the wire"
    assert checked, "no variant has a physical placement"
    # A hybrid cache has no one placement (each group has its own pages): None, as for a quantized one.
    for hybrid in variants_where(hybrid=True):
        assert kvforge.create(hybrid.name, pages=2).physical_placement(3) is None, hybrid.name


def read_only(array):
    """The same values in a read-only numpy array, as np.frombuffer and memory maps give them."""
    out = np.frombuffer(array.tobytes(), dtype=array.dtype).reshape(array.shape)
    assert not out.flags.writeable
    return out


def test_read_only_arrays_go_in_but_not_out(generator):
    d = variants_where(model="tiny", addressing="contiguous", storage="fp32", update="eager", hybrid=False)[0]
    cache = kvforge.create(d.name, rows=1, max_seq_len=8)
    k, v = (torch.randn(3, d.heads, d.head_dim, generator=generator).numpy() for _ in range(2))
    cache.append(0, read_only(k), read_only(v), rows=read_only(np.zeros(3, np.int32)),
                 positions=read_only(np.arange(3, dtype=np.int32)))
    k_out, v_out = (np.zeros((d.heads, 3, d.head_dim), np.float32) for _ in range(2))
    cache.gather(0, k_out, v_out, row=0, begin=0, end=3)
    for h in range(d.heads):  # gather's [heads, tokens, head_dim] against append's [tokens, heads, head_dim]
        for t in range(3):
            assert np.array_equal(k_out[h, t], k[t, h]) and np.array_equal(v_out[h, t], v[t, h])
    refused = read_only(np.full((d.heads, 3, d.head_dim), 7.0, np.float32))
    with pytest.raises(kvforge.ArgumentError, match="k_out: is read-only"):
        cache.gather(0, refused, v_out, row=0, begin=0, end=3)
    assert (refused == 7.0).all()


def test_none_for_an_array_names_the_argument():
    d = variants_where(model="tiny", addressing="contiguous", storage="fp32", update="eager", hybrid=False)[0]
    cache = kvforge.create(d.name, rows=1, max_seq_len=8)
    k = np.ones((1, d.heads, d.head_dim), np.float32)
    out = np.zeros((d.heads, 1, d.head_dim), np.float32)
    targets = dict(rows=np.zeros(1, np.int32), positions=np.zeros(1, np.int32))
    calls = {"k": lambda: cache.append(0, None, k, **targets), "v": lambda: cache.append(0, k, None, **targets),
             "k_out": lambda: cache.gather(0, None, out, row=0, begin=0, end=1),
             "v_out": lambda: cache.gather(0, out, None, row=0, begin=0, end=1)}
    for name, call in calls.items():
        with pytest.raises(kvforge.ArgumentError, match=f"^{name}: expected an array with __dlpack__.*got NoneType"):
            call()
    assert cache.row_length(0) == 0, "a refused append wrote something"


def test_cpu_thread_bound():
    own = kvforge.cpu_threads()
    with pytest.raises(kvforge.OutOfRangeError, match="threads"):
        kvforge.set_cpu_threads(-1)
    kvforge.set_cpu_threads(1)
    try:
        assert kvforge.cpu_threads() == 1
    finally:
        kvforge.set_cpu_threads(0)
    assert kvforge.cpu_threads() == own


def test_registry_and_creation_errors():
    with pytest.raises(kvforge.UnknownVariantError) as caught:
        kvforge.create("vllm_paged_nhd.tiny.fp33", pages=4)
    assert isinstance(caught.value, LookupError) and "vllm_paged_nhd.tiny.fp32" in caught.value.nearest
    with pytest.raises(kvforge.OutOfRangeError, match="pages"):
        kvforge.create("vllm_paged_nhd.tiny.fp32", pages=0)
    with pytest.raises(kvforge.ArgumentError, match="device"):
        kvforge.create("vllm_paged_nhd.tiny.fp32", pages=4, device="tpu")
    with pytest.raises(kvforge.ArgumentError, match="storage"):
        kvforge.variants(storage="fp64")
    names = [d.name for d in kvforge.variants(layout="vllm_paged_nhd", model="tiny")]
    assert names == sorted(names) and all(n.startswith("vllm_paged_nhd.tiny.") for n in names)
    d = kvforge.describe("vllm_paged_nhd.tiny.fp32")
    assert d.bytes_per_token == 2 * d.layers * d.heads * d.head_dim * 4
    # A layout and a model that were never expanded together are served by the generic path.
    eager = {d.layout: d for d in kvforge.variants() if d.update == "eager" and d.addressing == "contiguous"}
    models = {d.model: d.storage for d in kvforge.variants() if not d.hybrid and not d.quantized}
    expanded = {(d.layout, d.model) for d in kvforge.variants()}
    pairs = [(layout, model) for layout in eager for model in models if (layout, model) not in expanded]
    assert pairs, "the default matrix has no unexpanded layout x model pair to serve generically"
    layout, model = pairs[0]
    generic = kvforge.create(layout=layout, model=model, storage=models[model], max_seq_len=16)
    assert generic.descriptor.generic and generic.descriptor.name.startswith(f"{layout}.{model}")


def test_plan_memory():
    name = "vllm_paged_nhd.tiny.fp32"
    d = kvforge.describe(name)
    plan = kvforge.plan_memory(name, mode="reserve", budget_bytes=1 << 20, reserve_bytes=1 << 18)
    assert plan["page_bytes"] == d.bytes_per_token * d.page_size
    assert plan["pages"] == ((1 << 20) - (1 << 18)) // plan["page_bytes"]
    with pytest.raises(kvforge.ArgumentError, match="budget_bytes"):
        kvforge.plan_memory(name, mode="reserve")
    with pytest.raises(kvforge.UnsupportedError):
        kvforge.plan_memory("jetstream_contiguous.tiny.fp32", pages=4)


def test_sequence_manager_batch_arrays_and_offload(generator):
    d = kvforge.describe("vllm_paged_nhd.tiny.fp32")
    cache = kvforge.create(d.name, pages=12)
    manager = kvforge.SequenceManager(cache, host_blocks=8)
    # An empty batch, before any table exists: empty arrays (its table's stride was 0, and the
    # block_table's shape divided by it).
    empty = manager.step_on_device([])
    assert np.from_dlpack(empty["query_start"]).tolist() == [0] and np.from_dlpack(empty["slots"]).size == 0
    prompt = list(range(100, 140))
    assert manager.add(1, prompt) == 0
    batch = manager.step([1])
    pages = manager.pages(1)
    # Slots from plain page arithmetic over the page list.
    assert batch["slots"].tolist() == [pages[p // d.page_size] * d.page_size + p % d.page_size for p in range(40)]
    assert batch["page_table"].shape == (1, batch["max_pages"]) and batch["indptr"].tolist() == [0, len(pages)]
    assert batch["last_page_len"].tolist() == [40 - (len(pages) - 1) * d.page_size]
    k = torch.randn(40, d.heads, d.head_dim, generator=generator)
    for layer in range(d.layers):
        cache.append(layer, k, k + 1, slots=batch["slots"])
    # A second prompt sharing two full blocks is served from the prefix cache.
    assert manager.add(2, prompt[:32] + [7, 8]) == 32
    assert manager.stats["prefix_hits"] == 2
    manager.offload(1)
    with pytest.raises(kvforge.StateError):
        manager.append(1, [5])
    manager.restore(1)
    r = manager.range(1, 0, 40)
    k_out, v_out = torch.empty(d.heads, 40, d.head_dim), torch.empty(d.heads, 40, d.head_dim)
    cache.gather(1, k_out, v_out, pages=r["pages"], begin=0, end=40)
    assert torch.equal(k_out, k.transpose(0, 1)) and torch.equal(v_out, (k + 1).transpose(0, 1))
    # The same step's arrays built from the persistent device table equal the host-built ones.
    manager.append(1, [9])
    manager.append(2, [9])
    device = manager.step_on_device([1, 2], indices=True)
    for seq, length in ((1, 41), (2, 35)):
        assert np.from_dlpack(device["seq_lens"]).tolist()[seq - 1] == length
        table = np.from_dlpack(device["block_table"])[np.from_dlpack(device["rows"])[seq - 1]]
        assert table[:len(manager.pages(seq))].tolist() == manager.pages(seq)
    new_positions = [(1, 40), (2, 32), (2, 33), (2, 34)]  # sequence 2's prompt tail was never stepped
    assert np.from_dlpack(device["slots"]).tolist() == [
        manager.pages(s)[p // d.page_size] * d.page_size + p % d.page_size for s, p in new_positions]
    with pytest.raises(kvforge.CapacityError) as caught:
        manager.add(3, list(range(12 * d.page_size)))
    assert caught.value.needed > caught.value.available
    manager.check_invariants()


def test_hybrid_sequence_manager():
    d = variants_where(hybrid=True, model="tiny_hybrid")[0]
    cache = kvforge.create(d.name, pages=64)  # 30 tokens fit at any page size
    assert cache.num_groups == len(d.groups) == 2
    manager = kvforge.HybridSequenceManager(cache)
    manager.add(7, list(range(30)))
    steps = manager.step([7])
    assert len(steps) == 2 and all(len(s["slots"]) == 30 for s in steps)
    k = torch.randn(30, d.heads, d.head_dim).to(TORCH_DTYPE[d.input])
    for layer in range(d.layers):
        cache.append(layer, k, k, slots=steps[cache.group_of(layer)]["slots"])
    local_group = next(g for g in d.groups if g["sliding_window"])  # the group that keeps a window
    window = local_group["sliding_window"]
    local = local_group["layers"][0]
    r = manager.range(local, 7, 30 - window, 30)
    out = torch.empty(d.heads, window, d.head_dim, dtype=TORCH_DTYPE[d.input])
    cache.gather(local, out, out.clone(), pages=r["pages"], begin=r["begin"], end=r["end"])
    assert torch.equal(out, k[30 - window:].transpose(0, 1))


def test_pack_and_unpack_round_trip(generator):
    d = kvforge.describe("flashinfer_paged_hnd.tiny.int8_in_bf16")
    cache = kvforge.create(d.name, pages=4)
    k = torch.randn(2 * d.page_size, d.heads, d.head_dim, generator=generator).to(torch.bfloat16)
    slots = torch.arange(2 * d.page_size)
    for layer in range(d.layers):
        cache.append(layer, k, k, slots=slots)
    packed = torch.empty(2 * cache.packed_page_bytes(), dtype=torch.uint8)
    cache.pack_pages(torch.tensor([0, 1], dtype=torch.int32), packed)
    cache.unpack_pages(packed, torch.tensor([3, 2], dtype=torch.int32))
    a, b = (torch.empty(d.heads, d.page_size, d.head_dim, dtype=torch.bfloat16) for _ in range(2))
    c, e = (torch.empty_like(a) for _ in range(2))
    cache.gather(1, a, b, pages=torch.tensor([0], dtype=torch.int32), begin=0, end=d.page_size)
    cache.gather(1, c, e, pages=torch.tensor([3], dtype=torch.int32), begin=0, end=d.page_size)
    assert torch.equal(a, c) and torch.equal(b, e)


def test_spec_validation_reports_every_error(tmp_path):
    import kvforge.specs
    layouts, models = tmp_path / "layouts", tmp_path / "models"
    layouts.mkdir()
    models.mkdir()
    (models / "m.yaml").write_text("name: m\nlayers: 2\nkv_heads: 2\nhead_dim: 16\nmax_seq_len: 64\n")
    (layouts / "ok.yaml").write_text("name: ok\naddressing: paged\npage_size: 8\naxes: [page, slot, head, dim]\n"
                                     "update: eager\nexpand:\n  - models: [m]\n    dtypes: [fp32]\n")
    assert kvforge.specs.validate([str(layouts)], [str(models)], root=str(tmp_path)) == ["ok.m.fp32"]
    (layouts / "bad.yaml").write_text("name: bad\naddressing: pages\npage_size: thirty\naxes: [page, slot, head, dim]\n"
                                      "update: eager\nexpand:\n  - models: [m]\n    dtypes: [fp32]\n")
    with pytest.raises(kvforge.SpecError) as caught:
        kvforge.specs.validate([str(layouts)], [str(models)], root=str(tmp_path))
    errors = caught.value.errors
    assert any(e.startswith("layouts/bad.yaml:2: addressing:") and "allowed:" in e for e in errors)
    assert any(e.startswith("layouts/bad.yaml:3: page_size:") for e in errors)
    (layouts / "bad.yaml").write_bytes(b"\xff\xfe\x00garbage: [")
    with pytest.raises(kvforge.SpecError, match="bad.yaml:1"):
        kvforge.specs.validate([str(layouts)], [str(models)], root=str(tmp_path))


@pytest.mark.parametrize("d", variants_where(model="tiny", addressing=lambda a: a in ("contiguous", "ring"),
                                             storage="fp32", lazy=False), ids=lambda d: d.name)
def test_row_operations_against_the_reference(d, generator):
    drv = Driver(d, generator=generator)
    for seq, count in ((0, 5), (1, 3), (2, 7)):
        for layer in range(d.layers):
            drv.append(layer, seq, count, "padded")
        drv.length[seq] = count
    assert [drv.cache.row_length(r) for r in range(3)] == [5, 3, 7]
    # New row i takes old row beam[i].
    drv.cache.reorder(torch.tensor([2, 0, 0], dtype=torch.int32))
    moved = {(layer, new, p): drv.ref[(layer, old, p)] for layer in range(d.layers)
             for new, old in enumerate((2, 0, 0)) for p in range(drv.length[old])}
    drv.ref, drv.length = moved, [7, 5, 5]
    drv.cache.reset_row(1)
    assert drv.cache.row_length(1) == 0 and drv.cache.row_length(2) == 5
    for seq in (0, 2):
        begin, end = drv.readable(seq)
        for layer in range(d.layers):
            got_k, got_v = drv.gather(layer, seq, begin, end)
            want_k, want_v = drv.expected(layer, seq, begin, end)
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    with pytest.raises(kvforge.OutOfRangeError, match="beam"):
        drv.cache.reorder(torch.tensor([0, 1, 3], dtype=torch.int32))
    tuning = drv.cache.tuning
    drv.cache.set_tuning(cpu_chunk_items=64, cuda_items_per_thread=2)
    assert drv.cache.tuning["cpu_chunk_items"] == 64 and drv.cache.tuning["cuda_items_per_thread"] == 2
    with pytest.raises(kvforge.OutOfRangeError, match="cuda_items_per_thread"):
        drv.cache.set_tuning(cuda_items_per_thread=65)
    with pytest.raises(kvforge.OutOfRangeError):
        drv.cache.set_tuning(cpu_parallel_bytes=-1)
    assert drv.cache.tuning["cpu_parallel_bytes"] == tuning["cpu_parallel_bytes"]
    assert drv.cache.memory()["overhead_bytes"] < drv.cache.memory()["storage_bytes"]


@pytest.mark.parametrize("d", [d for d in TINY if not d.hybrid and d.addressing != "ring" and not d.lazy],
                         ids=lambda d: d.name)
def test_gather_batch_reads_every_sequence_of_a_batch_as_the_reference_holds_it(d, generator):
    # Sequences of one length (as a transformers batch), read in one call into a [B, H, n, D] view whose
    # positions axis is part of a longer tensor; each must equal the logical reference, and nothing
    # outside the range is written.
    drv = Driver(d, generator=generator)
    for seq in range(drv.sequences):
        for layer in range(d.layers):
            drv.append(layer, seq, 6, "padded")
        drv.length[seq] = 6
    dtype = TORCH_DTYPE[d.input]
    out = torch.full((2, drv.sequences, d.heads, 9, d.head_dim), -7.0, dtype=dtype)
    seqs = [2, 0, 1]
    if d.addressing == "paged":
        table = torch.stack([drv.page_list[s] for s in seqs])
        drv.cache.gather_batch(1, out[0, :, :, :4], out[1, :, :, :4], page_table=table, begin=2, end=6)
    else:
        drv.cache.gather_batch(1, out[0, :, :, :4], out[1, :, :, :4], rows=seqs, begin=2, end=6)
    for b, seq in enumerate(seqs):
        want_k, want_v = drv.expected(1, seq, 2, 6)
        assert_reads_back(d, out[0, b, :, :4], out[1, b, :, :4], want_k, want_v)
    assert (out[:, :, :, 4:] == -7.0).all(), "a position outside the range was written"
    with pytest.raises(kvforge.ShapeError, match="v_out"):
        drv.cache.gather_batch(1, out[0, :, :, :4], out[1, :2, :, :4], rows=seqs, page_table=None, begin=2, end=6)
    with pytest.raises(kvforge.ShapeError, match="k_out"):
        drv.cache.gather_batch(1, out[0, 0, :, :4], out[1, 0, :, :4], rows=seqs, begin=2, end=6)
    if d.addressing == "paged":
        with pytest.raises(kvforge.DtypeError, match="page_table"):
            drv.cache.gather_batch(1, out[0, :, :, :4], out[1, :, :, :4], page_table=table.long(), begin=2, end=6)
        if table.shape[1] > 1:  # a row of one page is contiguous whatever its stride
            with pytest.raises(kvforge.ShapeError, match="page_table: its rows must be contiguous"):
                drv.cache.gather_batch(1, out[0, :, :, :4], out[1, :, :, :4], page_table=table.t().contiguous().t(),
                                       begin=2, end=6)
        with pytest.raises(kvforge.ArgumentError, match="page_table"):
            drv.cache.gather_batch(1, out[0, :, :, :4], out[1, :, :, :4], begin=2, end=6)
    else:
        with pytest.raises(kvforge.ShapeError, match="rows"):
            drv.cache.gather_batch(1, out[0, :, :, :4], out[1, :, :, :4], rows=[0], begin=2, end=6)
