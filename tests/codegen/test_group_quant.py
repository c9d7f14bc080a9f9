"""A layout's per_group quantization (docs/specs.md, "Quantization"): every problem at once as
file:line, and the variants' group and scale count."""

import unittest

from kvforge_codegen.validate import load_specs
from test_codegen import MODELS, QUANT_LAYOUT, SpecDir, errors_of, plan_variants, render  # tests/codegen is on the path

GROUPED = QUANT_LAYOUT.replace("granularity: per_token\n", "granularity: per_group\n  group_size: 16\n")


class GroupQuant(unittest.TestCase):
    def test_a_grouped_variant_states_its_group_and_scales(self):
        text = GROUPED.format(name="g").replace("scale_dtype: fp32", "scale_dtype: ue8m0")
        text = text.replace("models: [tiny]", "models: [qwen2_5_0_5b]").replace("page_size: 16", "page_size: 4")
        d = SpecDir({"g.yaml": text})
        self.assertEqual(d.errors(), [])
        [v] = plan_variants(load_specs([d.layouts], [MODELS], d.tmp.name))
        header = render([v])[v.name + ".hpp"]
        self.assertIn("static constexpr kvforge::Quant quant = kvforge::Quant::per_group;", header)
        self.assertIn("static constexpr int quant_group = 16;", header)
        self.assertIn("using scale_t = kvforge::ue8m0;", header)
        # 24 layers x 2 heads x 64 dims x 2 (K, V) int8 codes, and a 1-byte scale per 16 of them.
        self.assertEqual(v.bytes_per_token, 24 * 2 * 64 * 2 + 24 * 2 * 2 * 4)

    def test_every_problem_of_a_group_at_once(self):
        no_size = QUANT_LAYOUT.format(name="bad").replace("granularity: per_token\n", "granularity: per_group\n")
        self.assertEqual(errors_of(no_size), [
            "layouts/bad.yaml:7: quantization.group_size: required field is missing"])
        odd = GROUPED.format(name="bad").replace("group_size: 16", "group_size: 24")
        self.assertEqual(errors_of(odd), [
            "layouts/bad.yaml:8: quantization.group_size: 24 is not a supported group size (allowed: 16, 32, 64, 128)"])
        stray = QUANT_LAYOUT.format(name="bad").replace("granularity: per_token\n",
                                                         "granularity: per_token\n  group_size: 32\n")
        self.assertEqual(errors_of(stray), [
            "layouts/bad.yaml:8: quantization.group_size: only per_group quantization has groups, not per_token "
            "(allowed: granularity: per_group)"])
        tensor = QUANT_LAYOUT.format(name="bad").replace("granularity: per_token", "granularity: per_tensor")
        tensor = tensor.replace("scale_dtype: fp32", "scale_dtype: ue8m0").replace("  scales: in_page\n", "")
        self.assertEqual(errors_of(tensor), [
            "layouts/bad.yaml:8: quantization.scale_dtype: a per_tensor scale is set by the user, and ue8m0 rounds "
            "a scale up to its next value (allowed: fp32, bf16)"])

    def test_a_tensor_scaled_variant_states_its_second_level(self):
        text = GROUPED.format(name="nv").replace("scale_dtype: fp32", "scale_dtype: fp8_e4m3\n  tensor_scale: fp32")
        text = text.replace("  scales: in_page\n", "").replace("dtypes: [int8]", "dtypes: [fp4_e2m1]")
        d = SpecDir({"nv.yaml": text})
        self.assertEqual(d.errors(), [])
        [v] = plan_variants(load_specs([d.layouts], [MODELS], d.tmp.name))
        header = render([v])[v.name + ".hpp"]
        self.assertIn("static constexpr bool tensor_scaled = true;", header)
        self.assertIn("using scale_t = kvforge::fp8_e4m3;", header)
        self.assertIn("// quantization: per_group 16 fp8_e4m3 x fp32 tensor separate,", header)
        # tiny: K and V of 2 layers x 2 heads x 16 dims, two fp4 codes a byte, and a 1-byte scale per 16
        # values; the tensor scales are per layer, not per token.
        self.assertEqual(v.bytes_per_token, 2 * 2 * (2 * 16 // 2 + 2 * 1))

    def test_a_tensor_scale_only_under_separate_group_scales(self):
        per_token = QUANT_LAYOUT.format(name="bad").replace("scale_dtype: fp32", "scale_dtype: fp32\n  tensor_scale: fp32")
        self.assertEqual(errors_of(per_token), [
            "layouts/bad.yaml:9: quantization.tensor_scale: a second-level tensor scale sits under group scales, and "
            "per_token has none (allowed: granularity: per_group)",
            "layouts/bad.yaml:10: quantization.scales: a layout's tensor scales live in its separate scale buffer "
            "(allowed: separate)"])
        unknown = GROUPED.format(name="bad").replace("scale_dtype: fp32", "scale_dtype: fp32\n  tensor_scale: bf16")
        self.assertEqual(errors_of(unknown), [
            "layouts/bad.yaml:10: quantization.tensor_scale: unknown value 'bf16' (allowed: none, fp32)"])
        e4m3 = QUANT_LAYOUT.format(name="bad").replace("granularity: per_token", "granularity: per_tensor")
        e4m3 = e4m3.replace("scale_dtype: fp32", "scale_dtype: fp8_e4m3").replace("  scales: in_page\n", "")
        self.assertEqual(errors_of(e4m3), [
            "layouts/bad.yaml:8: quantization.scale_dtype: a per_tensor scale is set by the user, and fp8_e4m3 rounds "
            "a scale up to its next value (allowed: fp32, bf16)"])

    def test_a_group_that_does_not_divide_the_row_is_refused_per_expansion(self):
        wide = GROUPED.format(name="bad").replace("group_size: 16", "group_size: 32")
        [error] = errors_of(wide)
        self.assertRegex(error, r"^layouts/bad\.yaml:12: expand\[0\]: bad\.tiny\.int8_in_bf16: group_size 32 does not "
                                r"divide tiny's head_dim 16")


if __name__ == "__main__":
    unittest.main()
