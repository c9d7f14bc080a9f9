"""A model spec's `mla` (docs/specs.md, "MLA models"): every problem at once as file:line, and the
variants' one head holding a token's latent record as its K and V halves."""

import os
import tempfile
import unittest

from kvforge_codegen.validate import load_specs
from test_codegen import GOOD_LAYOUT, MODELS, REPO, model_errors, plan_variants, render  # tests/codegen is on the path


class Mla(unittest.TestCase):
    def test_every_problem_of_mla_at_once(self):
        text = """\
        name: m
        layers: 2
        kv_heads: 2
        head_dim: 16
        max_seq_len: 64
        mla:
          kv_lora_rank: 0
          qk_rope_head_dim: 8
          q_lora_rank: 3
        """
        self.assertEqual(model_errors(text), [
            "models/m.yaml:3: kv_heads: an MLA model caches one latent record a token, with no heads; its shape is "
            "mla's (allowed: one of mla and kv_heads + head_dim)",
            "models/m.yaml:4: head_dim: an MLA model caches one latent record a token, with no heads; its shape is "
            "mla's (allowed: one of mla and kv_heads + head_dim)",
            "models/m.yaml:7: mla.kv_lora_rank: expected a positive integer, got 0 (allowed: 1..8192)",
            "models/m.yaml:9: mla.q_lora_rank: unknown field (allowed: kv_lora_rank, qk_rope_head_dim)"])

    def test_a_too_wide_record_and_a_missing_field(self):
        head = "name: m\nlayers: 2\nmax_seq_len: 64\n"
        self.assertEqual(model_errors(head + "mla:\n  kv_lora_rank: 8192\n  qk_rope_head_dim: 64\n"), [
            "models/m.yaml:5: mla: the record of 8256 values is too wide (allowed: a record of at most 8192)"])
        self.assertEqual(model_errors(head + "mla:\n  kv_lora_rank: 512\n"), [
            "models/m.yaml:5: mla.qk_rope_head_dim: required field is missing"])
        self.assertEqual(model_errors(head + "mla: [512, 64]\n"), [
            "models/m.yaml:4: mla: expected a mapping of fields (allowed: kv_lora_rank, qk_rope_head_dim)"])

    def test_the_variants_hold_the_record_as_one_heads_k_and_v(self):
        specs = load_specs([os.path.join(REPO, "specs", "layouts")], [MODELS], REPO)
        model = specs.model("deepseek_v3")
        self.assertEqual((model.layers, model.kv_heads, model.head_dim, model.mla), (61, 1, 288, (512, 64)))
        [v] = [v for v in plan_variants(specs) if v.name == "vllm_mla.deepseek_v3.bf16"]
        self.assertEqual(v.bytes_per_token, 61 * (512 + 64) * 2)  # 1152 bytes a layer, as vLLM's MLA cache
        header = render([v])["vllm_mla.deepseek_v3.bf16.hpp"]
        self.assertIn("static constexpr int mla_kv_lora_rank = 512;", header)
        self.assertIn("static constexpr int mla_rope_dim = 64;", header)
        # A shard replicates the record: it has no heads to split.
        shard = model.shard(8)
        self.assertEqual((shard.kv_heads, shard.head_dim, shard.mla), (1, 288, (512, 64)))


class OddRecords(unittest.TestCase):
    """A record of odd width (kv_lora_rank 21 + RoPE 6, or K 24 + V 15) is stored with one zero after it."""

    def specs(self, model, layout=GOOD_LAYOUT.format(name="ok")):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        for folder, text in (("models", model), ("layouts", layout)):
            os.makedirs(os.path.join(tmp.name, folder))
            name = text.split("\n")[0].split(": ")[1]
            with open(os.path.join(tmp.name, folder, name + ".yaml"), "w") as f:
                f.write(text)
        return load_specs([os.path.join(tmp.name, "layouts")], [os.path.join(tmp.name, "models")], tmp.name)

    def test_the_stored_halves_take_one_value_of_padding(self):
        mla = self.specs("name: tiny\nlayers: 2\nmax_seq_len: 64\nmla:\n  kv_lora_rank: 21\n  qk_rope_head_dim: 6\n")
        model = mla.model("tiny")
        self.assertEqual((model.kv_heads, model.head_dim, model.mla), (1, 14, (21, 6)))
        [v] = plan_variants(mla)
        self.assertEqual(v.bytes_per_token, 2 * 28 * 2)  # 27 values a layer and the pad, in bf16
        widths = self.specs("name: tiny\nlayers: 2\nkv_heads: 2\nmax_seq_len: 64\nhead_dim: 24\nv_head_dim: 15\n")
        self.assertEqual((widths.model("tiny").head_dim, widths.model("tiny").kv_widths), (20, (24, 15)))
