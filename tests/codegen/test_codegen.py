"""Codegen tests: exact messages for each kind of bad spec, all errors at once, no partial output,
deterministic names that round-trip, write-only-when-changed."""

import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

from kvforge_codegen.diagnostics import SpecFailure
from kvforge_codegen.naming import parse_variant_name, variant_name, variant_symbol
from kvforge_codegen.plan import plan_variants
from kvforge_codegen.render import render, write_changed
from kvforge_codegen.validate import load_specs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(REPO, "specs", "models")
# Whatever models a user has added: messages that list them must not depend on the default set.
MODEL_NAMES = ", ".join(sorted(os.path.splitext(f)[0] for f in os.listdir(MODELS) if f.endswith((".yaml", ".yml"))))

GOOD_LAYOUT = """\
name: {name}
addressing: paged
page_size: 16
axes: [page, slot, head, dim]
update: eager
expand:
  - models: [tiny]
    dtypes: [bf16]
"""


class SpecDir:
    """A temporary layouts folder holding the given files."""

    def __init__(self, files):
        self.tmp = tempfile.TemporaryDirectory()
        self.layouts = os.path.join(self.tmp.name, "layouts")
        os.makedirs(self.layouts)
        for name, text in files.items():
            with open(os.path.join(self.layouts, name), "w") as f:
                f.write(textwrap.dedent(text))

    def errors(self):
        try:
            load_specs([self.layouts], [MODELS], self.tmp.name)
        except SpecFailure as failure:
            return [str(e) for e in failure.errors]
        return []


def errors_of(text, name="bad.yaml"):
    return SpecDir({name: text}).errors()


class BadSpecMessages(unittest.TestCase):
    def test_unknown_field(self):
        self.assertEqual(errors_of(GOOD_LAYOUT.format(name="bad") + "colour: blue\n"), [
            "layouts/bad.yaml:9: colour: unknown field "
            "(allowed: name, addressing, axes, page_size, window, update, quantization, state_axes, groups, "
            "records, expand)"])

    def test_duplicate_key(self):
        self.assertEqual(errors_of(GOOD_LAYOUT.format(name="bad") + "update: lazy\n"), [
            "layouts/bad.yaml:9: update: duplicate key (first given on line 5)"])

    def test_unknown_addressing(self):
        text = GOOD_LAYOUT.format(name="bad").replace("addressing: paged", "addressing: blocked")
        self.assertEqual(errors_of(text), [
            "layouts/bad.yaml:2: addressing: unknown value 'blocked' (allowed: contiguous, ring, paged)"])

    def test_unknown_axis_and_dtype_reported_together(self):
        text = GOOD_LAYOUT.format(name="bad").replace("[page, slot, head, dim]", "[page, slot, heads, dim]")
        text = text.replace("[bf16]", "[bf16, fp64]")
        self.assertEqual(errors_of(text), [
            "layouts/bad.yaml:4: axes: unknown value 'heads' "
            "(allowed: layer, row, seq, page, slot, kv, head, dim)",
            "layouts/bad.yaml:8: expand[0].dtypes: unknown value 'fp64' "
            "(allowed: fp32, fp16, bf16, int8, fp8_e4m3, fp8_e5m2, fp4_e2m1, int4, uint4)"])

    def test_wrong_type(self):
        text = GOOD_LAYOUT.format(name="bad").replace("page_size: 16", "page_size: sixteen")
        self.assertEqual(errors_of(text), [
            "layouts/bad.yaml:3: page_size: expected a positive integer, got 'sixteen' (allowed: 1..4096)"])

    def test_impossible_axes(self):
        text = GOOD_LAYOUT.format(name="bad").replace("[page, slot, head, dim]", "[row, slot, dim, head]")
        self.assertEqual(errors_of(text), [
            "layouts/bad.yaml:4: axes: paged addressing needs axis 'page' "
            "(allowed: page, slot, head, dim plus optional layer, kv)",
            "layouts/bad.yaml:4: axes: axis 'row' has no meaning with paged addressing "
            "(allowed: page, slot, head, dim plus optional layer, kv)",
            "layouts/bad.yaml:4: axes: 'dim' must be the last axis, so that each head's row is contiguous "
            "(allowed: [..., dim])"])

    def test_window_on_paged_and_missing_window_on_ring(self):
        text = GOOD_LAYOUT.format(name="bad") + "window: 16\n"
        self.assertEqual(errors_of(text), [
            "layouts/bad.yaml:9: window: only ring addressing has a window, not paged"])
        ring = """\
        name: ring
        addressing: ring
        axes: [row, head, seq, dim]
        update: eager
        expand:
          - models: [tiny]
            dtypes: [bf16]
        """
        self.assertEqual(errors_of(ring, "ring.yaml"), [
            "layouts/ring.yaml:1: window: required field is missing for ring addressing "
            "(allowed: a positive integer, model)"])

    def test_unknown_model_and_unsupported_combination(self):
        text = """\
        name: ring
        addressing: ring
        window: model
        axes: [row, head, seq, dim]
        update: eager
        expand:
          - models: [tiny, llama3_8b, gpt5]
            dtypes: [bf16]
        """
        self.assertEqual(errors_of(text, "ring.yaml"), [
            "layouts/ring.yaml:7: expand[0]: ring.llama3_8b.bf16: window: model needs a model with "
            "sliding_window, and llama3_8b has none",
            f"layouts/ring.yaml:7: expand[0].models: unknown model 'gpt5' (allowed: {MODEL_NAMES})"])

    def test_name_must_match_file(self):
        self.assertEqual(errors_of(GOOD_LAYOUT.format(name="other")), [
            "layouts/bad.yaml:1: name: 'other' differs from the file name (allowed: bad)"])

    def test_yaml_syntax_error(self):
        self.assertEqual(errors_of("name: [unclosed\n"), [
            "layouts/bad.yaml:2: (yaml): not valid YAML: expected ',' or ']', but got '<stream end>'"])

    def test_every_error_in_every_file_at_once(self):
        d = SpecDir({"a.yaml": GOOD_LAYOUT.format(name="a") + "x: 1\n",
                     "b.yaml": GOOD_LAYOUT.format(name="b").replace("update: eager", "update: sometimes")})
        errors = d.errors()
        self.assertEqual(len(errors), 2)
        self.assertTrue(errors[0].startswith("layouts/a.yaml:9: x: unknown field"))
        self.assertTrue(errors[1].startswith("layouts/b.yaml:5: update: unknown value 'sometimes'"))


class CommandLine(unittest.TestCase):
    def run_codegen(self, *args):
        env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "codegen"))
        return subprocess.run([sys.executable, "-m", "kvforge_codegen", *args], capture_output=True, text=True,
                              env=env)

    def test_bad_spec_gives_file_line_no_traceback_and_writes_nothing(self):
        d = SpecDir({"bad.yaml": GOOD_LAYOUT.format(name="bad").replace("page_size: 16", "page_size: 0")})
        out = os.path.join(d.tmp.name, "out")
        r = self.run_codegen("generate", "--layouts", d.layouts, "--models", MODELS, "--source-root", d.tmp.name,
                             "--out", out)
        self.assertEqual(r.returncode, 1)
        self.assertIn("layouts/bad.yaml:3: page_size: expected a positive integer, got 0", r.stderr)
        self.assertNotIn("Traceback", r.stderr)
        self.assertFalse(os.path.exists(out))

    def test_unknown_filter_value_is_refused(self):
        r = self.run_codegen("list", "--dtype", "fp64")
        self.assertEqual(r.returncode, 2)
        self.assertIn("filter dtype: unknown dtype 'fp64' (allowed: fp32, fp16, bf16, int8, fp8_e4m3, fp8_e5m2, fp4_e2m1, int4, uint4, "
                      "flashmla_fp8, indexer_fp8)",
                      r.stderr)
        self.assertNotIn("Traceback", r.stderr)

    def test_dropping_a_spec_file_adds_a_variant(self):
        d = SpecDir({"mine.yaml": GOOD_LAYOUT.format(name="mine")})
        r = self.run_codegen("outputs", "--layouts", d.layouts, "--models", MODELS)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("mine.tiny.bf16.cpp", r.stdout.split())


QUANT_LAYOUT = """\
name: {name}
addressing: paged
page_size: 16
axes: [page, kv, head, slot, dim]
update: eager
quantization:
  granularity: per_token
  scale_dtype: fp32
  scales: in_page
expand:
  - models: [tiny]
    dtypes: [int8]
    input_dtypes: [bf16]
"""


class Quantization(unittest.TestCase):
    def test_one_line_switches_a_layout_to_per_token_head(self):
        text = QUANT_LAYOUT.format(name="q")
        switched = text.replace("granularity: per_token\n", "granularity: per_token_head\n")
        self.assertEqual(sum(a != b for a, b in zip(text.splitlines(), switched.splitlines())), 1)
        for spec, want in ((text, "Quant::per_token;"), (switched, "Quant::per_token_head;")):
            d = SpecDir({"q.yaml": spec})
            self.assertEqual(d.errors(), [])
            variants = plan_variants(load_specs([d.layouts], [MODELS], d.tmp.name))
            self.assertEqual([v.name for v in variants], ["q.tiny.int8_in_bf16"])
            header = render(variants)["q.tiny.int8_in_bf16.hpp"]
            self.assertIn("static constexpr kvforge::Quant quant = kvforge::" + want, header)
        # 2 layers x 2 heads x 16 dims x 2 (K, V) int8 codes, plus per_token_head fp32 scales.
        self.assertEqual(variants[0].bytes_per_token, 2 * 2 * 16 * 2 + 2 * 2 * 2 * 4)

    def test_bad_quantization_fields(self):
        text = QUANT_LAYOUT.format(name="bad").replace("granularity: per_token", "granularity: per_channel")
        text = text.replace("scale_dtype: fp32", "scale_dtype: fp8")
        self.assertEqual(errors_of(text), [
            "layouts/bad.yaml:7: quantization.granularity: unknown value 'per_channel' "
            "(allowed: per_tensor, per_token, per_token_head, per_group)",
            "layouts/bad.yaml:8: quantization.scale_dtype: unknown value 'fp8' (allowed: fp32, bf16, ue8m0, "
            "fp8_e4m3)"])

    def test_in_page_scales_that_cannot_be(self):
        per_tensor = QUANT_LAYOUT.format(name="bad").replace("granularity: per_token", "granularity: per_tensor")
        self.assertEqual(errors_of(per_tensor), [
            "layouts/bad.yaml:9: quantization.scales: a per_tensor scale is one value per layer, "
            "not one per page (allowed: separate)"])
        head_outside = QUANT_LAYOUT.format(name="bad").replace("[page, kv, head, slot, dim]",
                                                               "[head, page, kv, slot, dim]")
        self.assertEqual(errors_of(head_outside), [
            "layouts/bad.yaml:9: quantization.scales: in_page scales need the axes that vary within a page "
            "after 'page', and head come before it (allowed: [..., page, ..., slot, ..., head, ..., dim])"])
        contiguous = """\
        name: bad
        addressing: contiguous
        axes: [row, head, seq, dim]
        update: eager
        quantization:
          granularity: per_token
          scales: in_page
        expand:
          - models: [tiny]
            dtypes: [int8]
            input_dtypes: [bf16]
        """
        self.assertEqual(errors_of(contiguous), [
            "layouts/bad.yaml:7: quantization.scales: in_page scales need paged addressing, not contiguous "
            "(allowed: separate)"])

    def test_quantized_dtype_needs_a_block_and_a_float_input(self):
        text = GOOD_LAYOUT.format(name="bad").replace("[bf16]", "[int8]")
        self.assertEqual(errors_of(text), [
            "layouts/bad.yaml:7: expand[0]: bad.tiny.int8: int8 storage quantizes a float input; "
            "give input_dtypes (fp32, fp16, bf16)",
            "layouts/bad.yaml:7: expand[0]: bad.tiny.int8: int8 storage needs a quantization block "
            "(granularity: per_tensor, per_token, per_token_head, per_group)"])
        unused = QUANT_LAYOUT.format(name="bad").replace("dtypes: [int8]", "dtypes: [bf16]")
        unused = unused.replace("    input_dtypes: [bf16]\n", "")
        self.assertEqual(errors_of(unused), [
            "layouts/bad.yaml:6: quantization: no expansion stores a quantized dtype, so it applies to nothing "
            "(allowed: int8, fp8_e4m3, fp8_e5m2, fp4_e2m1, int4, uint4 in expand[].dtypes)"])



HYBRID_LAYOUT = """\
name: hyb
groups:
  local: {local}
  global: vllm_paged_nhd
expand:
  - models: [tiny_hybrid]
    dtypes: [bf16]
"""


def model_errors(text, name="m.yaml"):
    """Errors of one extra model file next to the default models and a trivial layout."""
    d = SpecDir({"ok.yaml": GOOD_LAYOUT.format(name="ok")})
    models = os.path.join(d.tmp.name, "models")
    os.makedirs(models)
    with open(os.path.join(models, name), "w") as f:
        f.write(textwrap.dedent(text))
    try:
        load_specs([d.layouts], [models], d.tmp.name)
    except SpecFailure as failure:
        return [str(e) for e in failure.errors if str(e).startswith("models/")]
    return []


def with_repo_layouts(d, *names):
    for n in names:
        os.symlink(os.path.join(REPO, "specs", "layouts", n + ".yaml"), os.path.join(d.layouts, n + ".yaml"))
    return d


class HybridLayouts(unittest.TestCase):
    def test_layer_groups_must_split_the_layers(self):
        text = """\
        name: m
        layers: 4
        kv_heads: 2
        head_dim: 16
        max_seq_len: 64
        layer_groups:
          - name: local
            layers: [0, 2, 2]
            sliding_window: 100
          - name: global
            layers: [1, 7]
        """
        self.assertEqual(model_errors(text), [
            "models/m.yaml:8: layer_groups[0].layers: layer 2 is already in group 'local'",
            "models/m.yaml:9: layer_groups[0].sliding_window: 100 is too large (allowed: 1..64)",
            "models/m.yaml:11: layer_groups[1].layers: 7 is not a layer of this model (allowed: 0..3)"])

    def test_a_hybrid_variant_has_one_member_per_group(self):
        d = with_repo_layouts(SpecDir({"hyb.yaml": HYBRID_LAYOUT.format(local="jetstream_paged_copy"),
                                       "jetstream_paged_copy.yaml": GOOD_LAYOUT.format(name="jetstream_paged_copy")}),
                              "vllm_paged_nhd")
        specs = load_specs([d.layouts], [MODELS], d.tmp.name)
        [v] = [v for v in plan_variants(specs) if v.name == "hyb.tiny_hybrid.bf16"]
        self.assertEqual([(g.name, m.layout.name, m.model.layers, g.sliding_window) for g, m in v.members],
                         [("local", "jetstream_paged_copy", 2, 24), ("global", "vllm_paged_nhd", 2, None)])
        self.assertEqual(v.bytes_per_token, sum(m.bytes_per_token for _, m in v.members))
        header = render([v])["hyb.tiny_hybrid.bf16.hpp"]
        self.assertIn("hyb__tiny_hybrid__bf16__local_traits", header)
        self.assertIn("static constexpr kvforge::HybridDescriptor hybrid{2, groups};", header)
        self.assertIn("return kvforge::describe_hybrid<hyb__tiny_hybrid__bf16_traits>();", header)

    def test_hybrid_groups_need_paged_layouts_and_matching_groups(self):
        d = with_repo_layouts(SpecDir({"hyb.yaml": HYBRID_LAYOUT.format(local="jetstream_ring")}),
                              "jetstream_ring", "vllm_paged_nhd")
        self.assertEqual(d.errors(), [
            "layouts/hyb.yaml:6: expand[0]: hyb.tiny_hybrid.bf16: group local: jetstream_ring is ring; a group's "
            "window is kept by freeing pages, so hybrid groups need paged layouts"])
        text = HYBRID_LAYOUT.format(local="vllm_paged_nhd").replace("tiny_hybrid", "tiny") + "axes: [page]\n"
        d = with_repo_layouts(SpecDir({"hyb.yaml": text}), "vllm_paged_nhd")
        self.assertEqual(d.errors(), [
            "layouts/hyb.yaml:8: axes: a hybrid layout takes its storage from the layouts its groups name "
            "(allowed: name, groups, expand)"])
        d = with_repo_layouts(SpecDir({"hyb.yaml": text.replace("axes: [page]\n", "")}), "vllm_paged_nhd")
        self.assertEqual(d.errors(), [
            "layouts/hyb.yaml:6: expand[0]: hyb.tiny.bf16: groups local, global do not match tiny's "
            "layer_groups (none)"])


class TuningFiles(unittest.TestCase):
    def tuned(self, text, name="tiny.yaml"):
        d = SpecDir({"ok.yaml": GOOD_LAYOUT.format(name="ok")})
        tuning = os.path.join(d.tmp.name, "tuning")
        os.makedirs(tuning)
        with open(os.path.join(tuning, name), "w") as f:
            f.write(textwrap.dedent(text))
        return d, tuning

    def test_a_tuning_file_is_baked_into_its_models_variants(self):
        d, tuning = self.tuned("model: tiny\ncpu:\n  parallel_bytes: 16384\n  chunk_items: 8\n"
                               "cuda:\n  items_per_thread: 4\n")
        specs = load_specs([d.layouts], [MODELS], d.tmp.name, [tuning])
        [v] = plan_variants(specs)
        self.assertEqual((v.model.tuning.cpu_parallel_bytes, v.model.tuning.cpu_chunk_items,
                          v.model.tuning.cuda_block_threads, v.model.tuning.cuda_items_per_thread), (16384, 8, 256, 4))
        header = render([v])["ok.tiny.bf16.hpp"]
        for line in ("// Launch parameters: tuning/tiny.yaml.", "static constexpr int64_t cpu_parallel_bytes = 16384;",
                     "static constexpr int64_t cpu_chunk_items = 8;", "static constexpr int64_t cuda_block_threads = 256;",
                     "static constexpr int64_t cuda_items_per_thread = 4;"):
            self.assertIn(line, header)

    def test_bad_tuning_files(self):
        d, tuning = self.tuned("model: tiny\ncpu:\n  parallel_bytes: -1\ncuda:\n  block_threads: 100\n"
                               "  items_per_thread: 0\ngpu: {}\n")
        with self.assertRaises(SpecFailure) as caught:
            load_specs([d.layouts], [MODELS], d.tmp.name, [tuning])
        self.assertEqual([str(e) for e in caught.exception.errors], [
            "tuning/tiny.yaml:3: cpu.parallel_bytes: expected an integer in 0..1073741824, got -1 "
            "(allowed: 0..1073741824)",
            "tuning/tiny.yaml:5: cuda.block_threads: 100 is not a multiple of 32 (allowed: multiples of 32 in 32..1024)",
            "tuning/tiny.yaml:6: cuda.items_per_thread: expected an integer in 1..64, got 0 (allowed: 1..64)",
            "tuning/tiny.yaml:7: gpu: unknown field (allowed: model, cpu, cuda)"])
        d, tuning = self.tuned("model: tiny\n", name="other.yaml")
        with self.assertRaises(SpecFailure) as caught:
            load_specs([d.layouts], [MODELS], d.tmp.name, [tuning])
        self.assertEqual([str(e) for e in caught.exception.errors], [
            "tuning/other.yaml:1: model: 'tiny' differs from the file name (allowed: other)"])


class Naming(unittest.TestCase):
    def test_names_round_trip_and_symbols_are_identifiers(self):
        specs = load_specs([os.path.join(REPO, "specs", "layouts")], [MODELS], REPO)
        variants = plan_variants(specs)
        self.assertGreater(len(variants), 0)
        names = [v.name for v in variants]
        self.assertEqual(len(names), len(set(names)))
        for v in variants:
            fields = parse_variant_name(v.name)
            self.assertEqual(fields, (v.layout.name, v.model.name, v.storage, v.input))
            self.assertEqual(variant_name(*fields), v.name)
            self.assertTrue(v.symbol.isidentifier())
            self.assertNotIn("___", v.symbol)
        self.assertEqual(variant_name("paged_nhd", "llama3_8b", "bf16", "bf16"), "paged_nhd.llama3_8b.bf16")
        self.assertEqual(variant_name("q", "tiny", "fp16", "fp32"), "q.tiny.fp16_in_fp32")
        self.assertEqual(parse_variant_name("q.tiny.fp16_in_fp32"), ("q", "tiny", "fp16", "fp32"))
        self.assertEqual(variant_symbol("q.tiny.fp16"), "q__tiny__fp16")

    def test_rendering_is_deterministic_and_writes_only_changes(self):
        specs = load_specs([os.path.join(REPO, "specs", "layouts")], [MODELS], REPO)
        variants = plan_variants(specs)
        first, second = render(variants), render(variants)
        self.assertEqual(first, second)
        for name, text in first.items():
            if name.endswith((".hpp", ".cpp", ".cu")):
                self.assertIn("DO NOT EDIT", text.splitlines()[1], name)
        with tempfile.TemporaryDirectory() as out:
            self.assertEqual(len(write_changed(first, out)), len(first))
            self.assertEqual(write_changed(second, out), [])


if __name__ == "__main__":
    unittest.main()


class TensorParallel(unittest.TestCase):
    MODEL = """\
    name: m
    layers: 2
    kv_heads: 8
    head_dim: 16
    max_seq_len: 64
    tensor_parallel: {degrees}
    """

    def test_degrees_that_cannot_share_the_heads_are_refused_with_the_ones_that_can(self):
        errors = model_errors(self.MODEL.format(degrees="[1, 3, 2, 2, 0, x]"))
        self.assertEqual(errors, [
            "models/m.yaml:6: tensor_parallel: 3 ranks cannot share 8 KV heads: it neither divides them nor is a "
            "multiple of them (allowed: 1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)",
            "models/m.yaml:6: tensor_parallel: 2 is listed twice",
            "models/m.yaml:6: tensor_parallel: expected a degree, got 0 (allowed: 1..64, dividing kv_heads or a multiple of it)",
            "models/m.yaml:6: tensor_parallel: expected a degree, got 'x' (allowed: 1..64, dividing kv_heads or a multiple of it)"])

    def test_shards_are_generated_per_degree_with_their_slice_of_heads(self):
        d = SpecDir({"ok.yaml": GOOD_LAYOUT.format(name="ok").replace("[tiny]", "[m]")})
        models = os.path.join(d.tmp.name, "models")
        os.makedirs(models)
        with open(os.path.join(models, "m.yaml"), "w") as f:
            f.write(textwrap.dedent(self.MODEL.format(degrees="[1, 2, 16]")))
        variants = plan_variants(load_specs([d.layouts], [models], d.tmp.name))
        got = {v.name: (v.model.kv_heads, v.model.tp, v.model.shard_of, v.bytes_per_token) for v in variants}
        whole = 2 * 2 * 8 * 16 * 2
        self.assertEqual(got, {"ok.m.bf16": (8, 1, None, whole), "ok.m_tp2.bf16": (4, 2, "m", whole // 2),
                               "ok.m_tp16.bf16": (1, 16, "m", whole // 8)})


class Cover(unittest.TestCase):
    """--cover keeps, per layout and (storage, input), the variants of the narrowest and widest stored head,
    computed here from the full plan's own fields rather than by the function under test."""

    def test_each_layout_and_dtype_pair_keeps_its_narrowest_and_widest_head(self):
        from kvforge_codegen.plan import Filters
        specs = load_specs([os.path.join(REPO, "specs", "layouts")], [MODELS], REPO)
        every = plan_variants(specs)
        kept = {v.name for v in plan_variants(specs, Filters(cover=True))}
        pairs = {}
        for v in every:
            pairs.setdefault((v.layout.name, v.storage, v.input), []).append(v)
        for pair, group in pairs.items():
            heads = [v.stored_row * v.model.kv_heads for v in group]
            mine = [v for v in group if v.name in kept]
            self.assertTrue(mine, f"{pair}: no variant kept")
            self.assertLessEqual(len(mine), 2, pair)
            self.assertEqual({v.stored_row * v.model.kv_heads for v in mine} >= {min(heads), max(heads)}, True, pair)
        self.assertLess(len(kept), len(every))

    def test_the_cover_applies_after_the_filters(self):
        from kvforge_codegen.plan import Filters
        specs = load_specs([os.path.join(REPO, "specs", "layouts")], [MODELS], REPO)
        kept = plan_variants(specs, Filters(models=("tiny",), cover=True))
        self.assertTrue(kept)
        self.assertTrue(all(v.model.name == "tiny" for v in kept))
