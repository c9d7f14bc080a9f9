"""A model spec's `v_head_dim` (docs/specs.md, "K and V of different widths"): its problems as file:line,
and the variants holding each head's record, K then V, as the halves of a head of half its width."""

import os
import unittest

from kvforge_codegen.validate import load_specs
from test_codegen import MODELS, REPO, model_errors, plan_variants, render  # tests/codegen is on the path

HEAD = "name: m\nlayers: 2\nkv_heads: 2\nmax_seq_len: 64\nhead_dim: 24\n"


class KvWidths(unittest.TestCase):
    def test_every_problem_at_once(self):
        self.assertEqual(model_errors(HEAD + "v_head_dim: 0\n"), [
            "models/m.yaml:6: v_head_dim: expected a positive integer, got 0 (allowed: 1..4096)"])
        self.assertEqual(model_errors("name: m\nlayers: 2\nmax_seq_len: 64\nv_head_dim: 16\n"
                                      "mla:\n  kv_lora_rank: 24\n  qk_rope_head_dim: 8\n"), [
            "models/m.yaml:4: v_head_dim: an MLA model caches one latent record a token, with no heads; its shape "
            "is mla's (allowed: one of mla and kv_heads + head_dim)"])

    def test_one_width_is_a_plain_model(self):
        specs = load_specs([os.path.join(REPO, "specs", "layouts")], [MODELS], REPO)
        self.assertIsNone(specs.model("tiny").kv_widths)

    def test_the_variants_hold_k_then_v_as_the_halves_of_each_heads_record(self):
        specs = load_specs([os.path.join(REPO, "specs", "layouts")], [MODELS], REPO)
        model = specs.model("deepseek_v2_lite_decompressed")
        self.assertEqual((model.layers, model.kv_heads, model.head_dim, model.kv_widths), (27, 16, 160, (192, 128)))
        [v] = [v for v in plan_variants(specs) if v.name == "paged_head_records.tiny_kv_widths.bf16"]
        self.assertEqual(v.bytes_per_token, 2 * 2 * (20 + 12) * 2)  # no padding: K and V at their widths
        header = render([v])["paged_head_records.tiny_kv_widths.bf16.hpp"]
        self.assertIn("static constexpr int k_head_dim = 20;", header)
        self.assertIn("static constexpr int v_head_dim = 12;", header)
        shard = model.shard(4)  # a shard splits the heads; each head's record stays whole
        self.assertEqual((shard.kv_heads, shard.head_dim, shard.kv_widths), (4, 160, (192, 128)))


class GroupHeads(unittest.TestCase):
    """A layer group's `kv_heads`: its member variant's heads (MiMo-V2-Flash's sliding layers keep twice
    its full layers')."""

    def test_a_groups_heads_are_its_members(self):
        model = load_specs([os.path.join(REPO, "specs", "layouts")], [MODELS], REPO).model("tiny_kv_widths")
        from kvforge_codegen.spec import LayerGroup
        local = LayerGroup("local", (1, 2), 8, model.loc, kv_heads=4)
        glob = LayerGroup("global", (0,), None, model.loc)
        self.assertEqual((model.for_group(local).kv_heads, model.for_group(local).kv_widths), (4, (20, 12)))
        self.assertEqual(model.for_group(glob).kv_heads, 2)

    def test_refused_where_it_cannot_be(self):
        groups = "layer_groups:\n  - name: a\n    layers: [0]\n    kv_heads: {}\n  - name: b\n    layers: [1]\n"
        self.assertEqual(model_errors(HEAD + groups.format(0)), [
            "models/m.yaml:9: layer_groups[0].kv_heads: expected a positive integer, got 0 (allowed: 1..1024)"])
        mla = "name: m\nlayers: 2\nmax_seq_len: 64\nmla:\n  kv_lora_rank: 24\n  qk_rope_head_dim: 8\n"
        self.assertEqual(model_errors(mla + groups.format(2)), [
            "models/m.yaml:8: layer_groups[0].kv_heads: an MLA model caches one record a token, with no heads "
            "(allowed: no kv_heads in an MLA model's groups)"])
