"""A layout's zero points (docs/specs.md, "Quantization"): uint4 codes around each group's zero point, their
scale entries twice a scale's bytes, and every misuse at once as file:line."""

import unittest

from kvforge_codegen.validate import load_specs
from test_codegen import MODELS, QUANT_LAYOUT, SpecDir, errors_of, plan_variants, render  # tests/codegen is on the path

ZERO = (QUANT_LAYOUT.replace("granularity: per_token\n", "granularity: per_token_head\n  zero_point: true\n")
        .replace("scale_dtype: fp32", "scale_dtype: bf16").replace("dtypes: [int8]", "dtypes: [uint4]"))


class ZeroPoint(unittest.TestCase):
    def test_a_zero_point_variant_keeps_a_scale_and_a_zero_a_head(self):
        d = SpecDir({"z.yaml": ZERO.format(name="z")})
        self.assertEqual(d.errors(), [])
        [v] = plan_variants(load_specs([d.layouts], [MODELS], d.tmp.name))
        header = render([v])[v.name + ".hpp"]
        self.assertEqual(v.name, "z.tiny.uint4_in_bf16")
        self.assertIn("using storage_t = kvforge::uint4x2;", header)
        self.assertIn("using scale_t = kvforge::ScaleZero<kvforge::bf16>;", header)
        self.assertIn("// quantization: per_token_head bf16 + zero in_page,", header)
        # tiny: K and V of 2 layers x 2 heads x 16 dims, two codes a byte, and per head a bf16 scale and a
        # bf16 zero point.
        self.assertEqual(v.bytes_per_token, 2 * 2 * 2 * (16 // 2 + 2 + 2))

    def test_groups_of_a_row_each_keep_theirs(self):
        text = ZERO.format(name="g").replace("per_token_head\n", "per_group\n  group_size: 16\n")
        text = text.replace("models: [tiny]", "models: [qwen2_5_0_5b]").replace("scale_dtype: bf16", "scale_dtype: fp32")
        d = SpecDir({"g.yaml": text})
        self.assertEqual(d.errors(), [])
        [v] = plan_variants(load_specs([d.layouts], [MODELS], d.tmp.name))
        self.assertIn("using scale_t = kvforge::ScaleZero<float>;", render([v])[v.name + ".hpp"])
        # 24 layers x 2 heads x 64 dims, K and V, and an 8-byte entry per 16 values.
        self.assertEqual(v.bytes_per_token, 24 * 2 * 2 * (64 // 2 + 4 * 8))

    def test_every_misuse_at_once(self):
        bad = ZERO.format(name="bad").replace("per_token_head\n", "per_token\n").replace("scale_dtype: bf16",
                                                                                       "scale_dtype: ue8m0")
        bad = bad.replace("zero_point: true", "zero_point: true\n  tensor_scale: fp32")
        self.assertEqual(errors_of(bad), [
            "layouts/bad.yaml:8: quantization.zero_point: a zero point is held in the scale's dtype, and ue8m0 cannot "
            "hold 0..15 (allowed: scale_dtype: fp32, bf16)",
            "layouts/bad.yaml:8: quantization.zero_point: a zero point is a group's, and per_token is not grouped by "
            "head (allowed: granularity: per_token_head, per_group)",
            "layouts/bad.yaml:8: quantization.zero_point: a zero-point group takes no second-level tensor scale "
            "(allowed: tensor_scale: none)",
            "layouts/bad.yaml:9: quantization.tensor_scale: a second-level tensor scale sits under group scales, and "
            "per_token has none (allowed: granularity: per_group)",
            "layouts/bad.yaml:11: quantization.scales: a layout's tensor scales live in its separate scale buffer "
            "(allowed: separate)"])
        self.assertEqual(errors_of(ZERO.format(name="bad").replace("zero_point: true", "zero_point: 1")), [
            "layouts/bad.yaml:8: quantization.zero_point: expected true or false, got 1 (allowed: true, false)"])

    def test_codes_and_zero_points_come_together(self):
        [error] = errors_of(ZERO.format(name="bad").replace("zero_point: true\n  ", ""))
        self.assertRegex(error, r"^layouts/bad\.yaml:\d+: expand\[0\]: bad\.tiny\.uint4_in_bf16: uint4 codes are read "
                                r"around a zero point, and the layout's quantization has none \(zero_point: true\)")
        [error] = errors_of(ZERO.format(name="bad").replace("dtypes: [uint4]", "dtypes: [int4]"))
        self.assertRegex(error, r"^layouts/bad\.yaml:\d+: expand\[0\]: bad\.tiny\.int4_in_bf16: the layout's zero_point "
                                r"is for asymmetric codes \(uint4\), not int4")


if __name__ == "__main__":
    unittest.main()
