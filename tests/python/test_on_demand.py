"""Variants on demand (kvforge.variant, kvforge.hf.KvforgeCache.from_model): shapes no default model has,
built in a cache folder of this test's own, checked against plain references.

  - a built variant's appends and gathers against a dict keyed by logical (layer, position) coordinates;
  - HF models of dimensions no spec names (head_dim 80 with one KV head, 5 KV heads of 24, a sliding
    window of 5 through a ring, Gemma-2's local and global layers through a hybrid layout) generate the
    same tokens as transformers' DynamicCache;
  - one compile at the level the process runs at: a library for x86-64-v2 uses no AVX register;
  - a hybrid model under tensor parallelism: each rank's variant holds its slice of the state parts;
  - the disk cache: a second process loads without building, a corrupt library is rebuilt, two
    processes asking at once build once, and a bad spec or a missing compiler is refused by name.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from transformers import (DynamicCache, Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM)

import kvforge
import kvforge.hf
import kvforge._paths
import kvforge.jit
from conftest import assert_reads_back, quantization_bound

VOCAB = 96


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    folder = tmp_path_factory.getbasetemp() / "kvforge-cache"
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(folder))
    return folder


def entry_of(variant_name):
    """The cache folder that holds the named variant's library (there is one per key)."""
    root = kvforge.jit.cache_dir()
    for name in os.listdir(root):
        path = os.path.join(root, name, "variants.so")
        if os.path.isfile(path) and variant_name.encode() in open(path, "rb").read():
            return os.path.join(root, name)
    raise AssertionError(f"no cache entry holds {variant_name}")


def test_a_built_variant_holds_what_was_appended():
    # The model of the first HF case below (same spec, same cache entry: built once for both).
    d = kvforge.variant("vllm_paged_nhd", kvforge.jit.model_spec(hf_model("llama", **LLAMA_80).config), "fp32")
    assert (d.layers, d.heads, d.head_dim, d.storage) == (2, 1, 80, "fp32")
    cache = kvforge.create(d.name, pages=8)
    rng = np.random.default_rng(3)
    slots = rng.permutation(8 * d.page_size)[:40].astype(np.int64)  # 40 positions over scattered slots
    held = {}
    for layer in range(d.layers):
        k, v = (rng.standard_normal((40, 1, 80)).astype(np.float32) for _ in range(2))  # [T, heads, head_dim]
        cache.append(layer, k, v, slots=slots)
        for t in range(40):
            held[layer, t] = (k[t, 0], v[t, 0])
    page_of = slots // d.page_size
    for layer in range(d.layers):
        for t in range(40):  # each position read back alone, through a one-page table
            k_out, v_out = (np.zeros((1, 1, 80), np.float32) for _ in range(2))
            begin = int(slots[t] % d.page_size)
            cache.gather(layer, k_out, v_out, pages=np.array([page_of[t]], np.int32), begin=begin, end=begin + 1)
            assert np.array_equal(k_out[0, 0], held[layer, t][0]) and np.array_equal(v_out[0, 0], held[layer, t][1])


# A record format written as a dict alone, on a model no spec names: K in e5m2 under bf16 scales per 16
# (exact, rounded up to bf16), V in fp16, each head's record whole ([.., head, kv, dim]).
RECORD_LAYOUT = {"name": "dict_records", "addressing": "paged", "page_size": 16, "axes": ["page", "slot", "head", "kv", "dim"],
                 "update": "eager", "records": [{"name": "k_e5m2_v_fp16", "parts": [
                     {"name": "k", "width": "head_dim", "dtype": "fp8_e5m2", "scale": {"group": 16, "dtype": "bf16"}},
                     {"name": "v", "width": "v_head_dim", "dtype": "fp16"}]}]}


def test_a_record_format_written_as_a_dict_is_built_and_holds_each_part_as_its_rule_says():
    model = {"name": "records9", "layers": 2, "kv_heads": 2, "head_dim": 48, "max_seq_len": 64}
    d = kvforge.variant(RECORD_LAYOUT, model, "k_e5m2_v_fp16", "bf16")
    assert (d.storage, [p["name"] for p in d.record_parts]) == ("k_e5m2_v_fp16", ["k", "v"])
    cache = kvforge.create(d.name, pages=4)
    generator = torch.Generator().manual_seed(5)
    k, v = (torch.randn(20, 2, 48, generator=generator).mul(4).to(torch.bfloat16) for _ in range(2))
    for layer in range(d.layers):
        cache.append(layer, k, v, slots=torch.arange(20))
    k_out, v_out = (torch.empty(2, 20, 48, dtype=torch.bfloat16) for _ in range(2))
    cache.gather(1, k_out, v_out, pages=torch.arange(2, dtype=torch.int32), begin=0, end=20)
    # V is fp16 values, exact for these bf16 inputs of at most 8 significant bits and small magnitude.
    assert torch.equal(v_out, v.transpose(0, 1))
    assert_reads_back(d, k_out, v_out, k.transpose(0, 1).float(), v.transpose(0, 1).float())
    assert not torch.equal(k_out, k.transpose(0, 1)), "e5m2 codes keep 3 significant bits, bf16 inputs 8"
    # Refused at file:line where the parts do not fit the model: the widths are the record's.
    with pytest.raises(kvforge.SpecError, match="the parts' widths add up to"):
        bad = dict(RECORD_LAYOUT, records=[{"name": "short", "parts": [
            {"name": "k", "width": 16, "dtype": "fp8_e5m2", "scale": {"group": 16, "dtype": "bf16"}}]}])
        kvforge.variant(bad, model, "short", "bf16")


def test_sizes_at_run_time_serve_ring_and_quantized_layouts():
    # A ring of 5 positions over 3 heads of 40: positions 0..11 appended, the last 5 read back exactly.
    ring = kvforge.create(layout="jetstream_ring", storage="fp32", layers=2, kv_heads=3, head_dim=40, window=5, rows=1)
    d = ring.descriptor
    assert (d.addressing, d.window, d.heads, d.head_dim) == ("ring", 5, 3, 40)
    values = torch.randn(12, 3, 40, generator=torch.Generator().manual_seed(5))
    for p in range(12):
        ring.append(1, values[p:p + 1], -values[p:p + 1], rows=np.zeros(1, np.int32), positions=np.array([p], np.int32))
    k_out, v_out = torch.zeros(3, 5, 40), torch.zeros(3, 5, 40)
    ring.gather(1, k_out, v_out, row=0, begin=7, end=12)
    assert torch.equal(k_out, values[7:12].transpose(0, 1)) and torch.equal(v_out, -values[7:12].transpose(0, 1))
    # int8 pages over 5 heads of 24 from bf16: within the documented bound of the quantizer.
    q = kvforge.create(layout="flashinfer_paged_hnd", storage="int8", input="bf16", layers=1, kv_heads=5, head_dim=24,
                       pages=4)
    d = q.descriptor
    assert (d.storage, d.input, d.heads, d.head_dim) == ("int8", "bf16", 5, 24)
    k = torch.randn(2 * d.page_size, 5, 24, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    q.append(0, k, k, slots=np.arange(2 * d.page_size, dtype=np.int64))
    k_out, v_out = (torch.zeros(5, 2 * d.page_size, 24, dtype=torch.bfloat16) for _ in range(2))
    q.gather(0, k_out, v_out, pages=np.array([0, 1], np.int32), begin=0, end=2 * d.page_size)
    expected = k.transpose(0, 1)
    assert ((k_out.float() - expected.float()).abs() <= quantization_bound(d, expected)).all()


def hf_model(kind, seed=0, **dims):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=dims.pop("hidden_size", 96), intermediate_size=128,
                  max_position_embeddings=64, attn_implementation="sdpa", **dims)
    model = MistralForCausalLM(MistralConfig(**common)) if kind == "mistral" else LlamaForCausalLM(LlamaConfig(**common))
    return model.eval()


def generate(model, cache):
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              cache=cache, pad_token_id=0)


LLAMA_80 = dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=80)


@pytest.mark.parametrize("kind, layout, dims", [
    ("llama", "vllm_paged_nhd", LLAMA_80),
    ("llama", "flashinfer_paged_hnd", dict(num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=5,
                                           head_dim=24, hidden_size=120)),
    ("mistral", "jetstream_ring", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       sliding_window=5, hidden_size=64)),
])
def test_hf_models_of_any_dimensions_generate_as_with_dynamic_cache(kind, layout, dims):
    model = hf_model(kind, **dict(dims))
    expected = generate(model, DynamicCache(config=model.config))
    cache = kvforge.hf.KvforgeCache.from_model(model, layout=layout, batch_size=2)
    assert cache.descriptor.head_dim == dims["head_dim"] and cache.descriptor.heads == dims["num_key_value_heads"]
    if layout == "jetstream_ring":
        assert cache.descriptor.window == 5
    assert torch.equal(generate(model, cache), expected)


def test_a_hybrid_layout_serves_local_and_global_layers_of_any_dimensions():
    # Gemma-2's pattern over dimensions no default has: 3 layers (local, global, local), a window of 6,
    # 3 KV heads of 24. hybrid_paged's groups name vllm_paged_nhd and deepspeed_blocked, built with it.
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=VOCAB, hidden_size=72, intermediate_size=128, num_hidden_layers=3, num_attention_heads=3,
        num_key_value_heads=3, head_dim=24, query_pre_attn_scalar=24, max_position_embeddings=64, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attn_implementation="eager")).eval()  # softcapping has no SDPA path
    expected = generate(model, DynamicCache(config=model.config))
    cache = kvforge.hf.KvforgeCache.from_model(model, layout="hybrid_paged", batch_size=2)
    d = cache.descriptor
    assert d.hybrid and {g["name"]: (g["layers"], g["sliding_window"]) for g in d.groups} == {
        "local": ([0, 2], 6), "global": ([1], 0)}
    assert torch.equal(generate(model, cache), expected)


def test_a_cache_of_another_dtype_returns_the_models_dtype():
    model = hf_model("llama", num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    expected = generate(model, DynamicCache(config=model.config))
    # fp32 model, bf16 storage: states are stored in bf16 and come back to the model in fp32.
    cache = kvforge.hf.KvforgeCache.from_model(model, dtype="bf16", batch_size=2)
    assert cache.descriptor.storage == "bf16" and cache.descriptor.input == "fp32"
    assert generate(model, cache).shape == expected.shape
    with pytest.raises(kvforge.DtypeError, match="input: .*bf16.*fp32"):
        kvforge.hf.KvforgeCache.from_model(model, input="bf16")


def run_python(code, **env):
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env=dict(os.environ, **env))
    assert out.returncode == 0, out.stderr
    return out.stdout


SMALL = '{"name": "small9", "layers": 1, "kv_heads": 3, "head_dim": 8, "max_seq_len": 32}'
ASK = f"""
    import kvforge, kvforge.jit
    d = kvforge.variant("jetstream_contiguous", {SMALL}, "fp32")
    print(d.name, kvforge.jit.builds)
"""


def test_the_disk_cache_builds_once_serves_other_processes_and_rebuilds_a_corrupt_entry():
    # Two processes ask at once: one builds, the other waits on the lock and loads what it built.
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(ASK)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate() for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    assert sorted(int(o[0].split()[1]) for o in outs) == [0, 1], outs
    name = outs[0][0].split()[0]
    assert run_python(ASK).split() == [name, "0"], "a later process built again"
    with open(os.path.join(entry_of(name), "variants.so"), "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 64)  # corrupt: never loaded, rebuilt
    assert run_python(ASK).split() == [name, "1"]
    # Shared as the umask says (022 here): another user of the folder can read the entry and its library
    # (mkdtemp's 0700 kept them from it).
    entry = entry_of(name)
    assert os.stat(entry).st_mode & 0o055 == 0o055 and os.stat(os.path.join(entry, "variants.so")).st_mode & 0o044 == 0o044
    # An entry replaced by a file, or by a folder with a key of another library: rebuilt in its place, in
    # the next process and every one after.
    shutil.rmtree(entry)
    with open(entry, "w") as f:
        f.write("not an entry")
    assert run_python(ASK).split() == [name, "1"] and run_python(ASK).split() == [name, "0"]
    with open(os.path.join(entry, "key"), "w") as f:
        f.write("0" * 64 + " " + "0" * 64 + "\n")
    assert run_python(ASK).split() == [name, "1"] and run_python(ASK).split() == [name, "0"]
    # A build killed before it finished left its scratch folder: the next build sweeps it.
    root = os.path.dirname(entry)
    stale = os.path.join(root, ".build-" + os.path.basename(entry) + "-killed")
    os.makedirs(os.path.join(stale, "generated"))
    shutil.rmtree(entry)
    assert run_python(ASK).split() == [name, "1"]
    assert not [n for n in os.listdir(root) if n.startswith(".build-")], os.listdir(root)


def test_a_cache_folder_that_cannot_hold_entries_is_a_kvforge_error_naming_it(tmp_path, monkeypatch):
    where = tmp_path / "a_file"
    where.write_text("")
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(where))
    with pytest.raises(kvforge.BackendError, match="a_file"):
        kvforge.variant("jetstream_contiguous", {"name": "nowhere9", "layers": 1, "kv_heads": 1, "head_dim": 8,
                                                 "max_seq_len": 8}, "fp32")


AT_LEVEL = """
    import numpy as np, kvforge
    d = kvforge.variant("vllm_paged_nhd", {"name": "level9", "layers": 1, "kv_heads": 2, "head_dim": 16,
                                           "max_seq_len": 32}, "fp32")
    cache = kvforge.create(d.name, pages=2)
    k = np.random.default_rng(0).standard_normal((5, 2, 16), dtype=np.float32)
    cache.append(0, k, -k, slots=np.arange(5, dtype=np.int64))
    out, out_v = np.zeros((2, 5, 16), np.float32), np.zeros((2, 5, 16), np.float32)
    cache.gather(0, out, out_v, pages=np.array([0], np.int32), begin=0, end=5)
    assert np.array_equal(out, k.transpose(1, 0, 2)) and np.array_equal(out_v, -out)
    print(kvforge.cpu_level())
"""


def test_the_key_moves_with_a_header_in_any_folder_of_the_include_tree(tmp_path):
    # A library built from other kernel headers (kvforge/detail/, kvforge/backends/cpu/: a kvforge upgrade)
    # must never be loaded: every header of the tree is in the key, not only the top folder's.
    from kvforge_codegen import on_demand
    include = tmp_path / "include"
    shutil.copytree(kvforge._paths.INCLUDE, include)
    compiler = on_demand.compiler_identity(kvforge._paths.CXX)
    layouts = [{"name": "vllm_paged_nhd"}]
    model = {"name": "m", "layers": 1, "kv_heads": 1, "head_dim": 16, "max_seq_len": 64}

    def key():
        on_demand._digest_of_sources.cache_clear()  # read once a process: here the files do change
        return on_demand.key_of(layouts, model, str(include), compiler, [])

    before = key()
    assert key() == before
    for header in ("kvforge/cache.hpp", "kvforge/detail/attend/attend_ops.hpp", "kvforge/backends/cpu/exec_cpu.hpp"):
        path = include / header
        text = path.read_bytes()
        path.write_bytes(text + b"\n")
        assert key() != before, header
        path.write_bytes(text)
        assert key() == before, header


def test_a_library_holds_the_kernels_of_the_level_its_process_runs_at(tmp_path):
    # One compile, for the level the asking process runs at (KVFORGE_CPU_LEVEL narrows it where the build has
    # every level): x86-64-v2's library uses no AVX register, so it runs on any CPU kvforge serves; the
    # widest level's is another library, which does. A build of one level runs that level only; the v2
    # library then comes from the spec compiler's build-variant, which the C++ kvforge::variant runs.
    widest = kvforge.cpu_level()
    root = kvforge.jit.cache_dir()
    avx_registers = {}

    def new_library(before):
        (entry,) = {e for e in os.listdir(root) if os.path.isdir(os.path.join(root, e))} - before
        code = subprocess.run(["objdump", "-d", os.path.join(root, entry, "variants.so")], capture_output=True,
                              text=True, check=True).stdout
        return code.count("%ymm") + code.count("%zmm")

    for level in sorted({2, widest} & set(kvforge.cpu_levels_built())):
        before = set(os.listdir(root)) if os.path.isdir(root) else set()
        assert run_python(AT_LEVEL, KVFORGE_CPU_LEVEL=str(level)).split() == [str(level)]
        avx_registers[level] = new_library(before)
    if 2 not in avx_registers:
        before = set(os.listdir(root)) if os.path.isdir(root) else set()
        out = subprocess.run([sys.executable, "-m", "kvforge_codegen", "build-variant", "--layout", "vllm_paged_nhd",
                              "--model", str(write_model(tmp_path, "level2")), "--dtype", "fp32",
                              "--include", kvforge._paths.INCLUDE, "--compiler", kvforge._paths.CXX, "--cpu-level", "2",
                              "--link", kvforge._native.__file__,
                              f"--link=-Wl,-rpath,{os.path.dirname(kvforge._native.__file__)}"],
                             capture_output=True, text=True,
                             env=dict(os.environ, PYTHONPATH=kvforge._paths.CODEGEN, KVFORGE_CACHE_DIR=root))
        assert out.returncode == 0, out.stderr
        avx_registers[2] = new_library(before)
    assert avx_registers[2] == 0
    if widest == 2:
        pytest.skip("this CPU runs x86-64-v2 only, so there is no wider level's library to compare")
    assert avx_registers[widest] > 0, avx_registers


def write_model(folder, name):
    """A 1-layer model spec file of 2 heads of 16 named `name` in `folder`."""
    path = pathlib.Path(folder) / f"{name}.yaml"
    path.write_text(f"name: {name}\nlayers: 1\nkv_heads: 2\nhead_dim: 16\nmax_seq_len: 32\n")
    return path


def test_a_sharded_hybrid_model_gives_each_rank_its_slice_of_the_states():
    # Qwen3-Next's pattern at a small size, under tensor parallelism 2 and 4: a rank holds its KV heads and
    # 1/tp of each state part that names a shard_axis (vLLM's per-rank GDN shapes), all of one that names
    # none.
    states = [{"name": "conv", "shape": [96, 3], "dtype": "bf16", "shard_axis": 0},
              {"name": "recurrent", "shape": [8, 16, 4], "dtype": "fp32", "shard_axis": 0},
              {"name": "norm", "shape": [6], "dtype": "fp32"}]
    model = {"name": "sharded_gdn", "layers": 4, "kv_heads": 4, "head_dim": 16, "max_seq_len": 64,
             "tensor_parallel": [2, 4], "linear_layers": {"layers": [0, 1, 2], "states": states}}
    kvforge.variant("vllm_paged_nhd", model, "fp32")
    for tp in (2, 4):
        d = kvforge.describe(f"vllm_paged_nhd.sharded_gdn_tp{tp}.fp32")
        assert (d.heads, d.layers, d.linear_layers) == (4 // tp, 1, [0, 1, 2])
        assert d.state_parts == [("conv", (96 // tp, 3), "bf16"), ("recurrent", (8 // tp, 16, 4), "fp32"),
                                 ("norm", (6,), "fp32")]
        pool = kvforge.StatePool.for_variant(d, slots=2)
        assert torch.from_dlpack(pool.view(2, "recurrent")).shape == (2, 8 // tp, 16, 4)


def test_refusals_name_what_is_wrong(monkeypatch):
    with pytest.raises(kvforge.SpecError, match="head_dim"):
        kvforge.variant("vllm_paged_nhd", {"name": "bad", "layers": 1, "kv_heads": 1, "head_dim": 0,
                                           "max_seq_len": 8}, "fp32")
    with pytest.raises(kvforge.ArgumentError, match="layout: 'no_such_layout' is neither"):
        kvforge.variant("no_such_layout", "tiny", "fp32")
    with pytest.raises(kvforge.ArgumentError, match="registered already"):
        kvforge.variant("vllm_paged_nhd", {"name": "tiny", "layers": 1, "kv_heads": 1, "head_dim": 8,
                                           "max_seq_len": 8}, "fp32")
    assert kvforge.variant("vllm_paged_nhd", "tiny", "fp32").name == "vllm_paged_nhd.tiny.fp32"  # no build
    monkeypatch.setattr(kvforge.jit, "CXX", "/nonexistent/c++")
    with pytest.raises(kvforge.BackendError, match="compiler: /nonexistent/c\\+\\+ was not found"):
        kvforge.variant("vllm_paged_nhd", {"name": "nocompiler", "layers": 1, "kv_heads": 1, "head_dim": 8,
                                           "max_seq_len": 8}, "fp32")


def test_create_with_sizes_takes_a_hybrid_layouts_layer_groups():
    # Sizes at run time over hybrid_paged: its groups (local, global) from layer_groups, each a member cache
    # of its own layers, and the local one's window; without layer_groups, a refusal that says what to give.
    groups = [{"name": "local", "layers": [0, 2], "sliding_window": 4}, {"name": "global", "layers": [1, 3]}]
    cache = kvforge.create(layout="hybrid_paged", storage="fp32", layers=4, kv_heads=2, head_dim=8, pages=8,
                           layer_groups=groups)
    assert cache.num_groups == 2 and [cache.group_of(layer) for layer in range(4)] == [0, 1, 0, 1]
    assert cache.group(0).descriptor.layout == "vllm_paged_nhd" and cache.group(1).descriptor.layout == "deepspeed_blocked"
    with pytest.raises(kvforge.ArgumentError, match="layer_groups: hybrid_paged keeps a member cache for each of the "
                                                    "layer groups local, global"):
        kvforge.create(layout="hybrid_paged", storage="fp32", layers=4, kv_heads=2, head_dim=8, pages=8)
