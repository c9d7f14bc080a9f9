"""A model spec's linear_layers (docs/specs.md, "Hybrid models with linear layers"): every problem at
once as file:line, and the variants' attention layers and state record."""

import os
import unittest

from kvforge_codegen.validate import load_specs
from test_codegen import GOOD_LAYOUT, MODELS, REPO, SpecDir, model_errors, plan_variants, render  # on the path

SHARDED = """\
name: m
layers: 4
kv_heads: 4
head_dim: 16
max_seq_len: 64
tensor_parallel: [2, 4]
linear_layers:
  layers: [0, 2]
  states:
    - name: conv
      shape: [96, 3]
      dtype: bf16
      shard_axis: 0
    - name: recurrent
      shape: [8, 16, 4]
      dtype: fp32
      shard_axis: 0
    - name: norm
      shape: [12]
      dtype: fp32
    - name: mamba_conv
      shape: [40, 3]
      dtype: bf16
      shard_shapes: {2: [24, 3], 4: [16, 3]}
"""


class LinearLayers(unittest.TestCase):
    """A hybrid model's linear layers: every problem at once, file:line, and the attention layers the
    variants hold."""

    def test_every_problem_of_linear_layers_at_once(self):
        text = """\
        name: m
        layers: 4
        kv_heads: 2
        head_dim: 16
        max_seq_len: 64
        linear_layers:
          layers: [0, 1, 9, 1]
          states:
            - name: conv
              shape: [64, 0]
              dtype: int8
            - name: ssm
              shape: [2, 2, 2, 2, 2]
              dtype: fp32
            - name: conv
              shape: [3]
              dtype: bf16
            - name: big
              shape: [1048576, 1048576]
              dtype: fp32
        """
        self.assertEqual(model_errors(text), [
            "models/m.yaml:7: linear_layers.layers: 9 is not a layer of this model (allowed: 0..3)",
            "models/m.yaml:7: linear_layers.layers: layer 1 is listed twice",
            "models/m.yaml:10: linear_layers.states[0].shape: expected an extent >= 1, got 0 (allowed: 1 to 4 "
            "extents >= 1, at most 1099511627776 bytes in all)",
            "models/m.yaml:11: linear_layers.states[0].dtype: unknown value 'int8' (allowed: fp32, fp16, bf16)",
            "models/m.yaml:13: linear_layers.states[1].shape: expected a list of 1 to 4 extents (allowed: 1 to 4 "
            "extents >= 1, at most 1099511627776 bytes in all)",
            "models/m.yaml:19: linear_layers.states[3].shape: is too large (allowed: 1 to 4 extents >= 1, at most "
            "1099511627776 bytes in all)"])

    def test_every_layer_linear_or_with_layer_groups_is_refused(self):
        head = "name: m\nlayers: 2\nkv_heads: 2\nhead_dim: 16\nmax_seq_len: 64\n"
        states = "  states:\n    - name: conv\n      shape: [4]\n      dtype: fp32\n"
        self.assertEqual(model_errors(head + "linear_layers:\n  layers: [0, 1]\n" + states), [
            "models/m.yaml:7: linear_layers.layers: every layer is linear: there is no K/V to cache (allowed: layer "
            "indices 0..1, leaving at least one attention layer)"])
        groups = "layer_groups:\n  - name: a\n    layers: [0, 1]\n"
        self.assertEqual(model_errors(head + groups + "linear_layers:\n  layers: [0]\n" + states), [
            "models/m.yaml:10: linear_layers: cannot be combined with layer_groups yet (allowed: one of "
            "linear_layers and layer_groups)"])

    def test_tensor_parallel_splits_the_parts_that_name_a_shard_axis(self):
        # Each rank holds extent / tp of a part's shard_axis (vLLM's per-rank conv channels and state
        # heads); a part without one, whole on every rank.
        d = SpecDir({"ok.yaml": GOOD_LAYOUT.format(name="ok").replace("[tiny]", "[m]")})
        self.addCleanup(d.tmp.cleanup)
        models = os.path.join(d.tmp.name, "models")
        os.makedirs(models)
        with open(os.path.join(models, "m.yaml"), "w") as f:
            f.write(SHARDED)
        specs = load_specs([d.layouts], [models], d.tmp.name)
        written = {"conv": (96, 3), "recurrent": (8, 16, 4), "norm": (12,), "mamba_conv": (40, 3)}
        for v in plan_variants(specs):
            tp = v.model.tp
            # mamba_conv: Mamba-2's 32 channels and one group's B and C (2 x 4), which vLLM copies to
            # every rank where there are fewer groups than ranks.
            expected = {"conv": (96 // tp, 3), "recurrent": (8 // tp, 16, 4), "norm": (12,),
                        "mamba_conv": (32 // tp + 2 * 4, 3)}
            self.assertEqual({p.name: p.shape for p in v.model.states}, expected if tp > 1 else written, v.name)
            self.assertEqual(v.model.kv_heads, 4 // tp)
        header = render([v for v in plan_variants(specs) if v.model.tp == 4])["ok.m_tp4.bf16.hpp"]
        self.assertIn('{"conv", 2, {24, 3, 0, 0}, kvforge::DType::bf16, 0}', header)  # split on axis 0
        self.assertIn('{"norm", 1, {12, 0, 0, 0}, kvforge::DType::f32}', header)  # whole on every rank
        self.assertIn('{"mamba_conv", 2, {16, 3, 0, 0}, kvforge::DType::bf16, kvforge::StatePartSpec::kShapesPerDegree}',
                      header)

    def test_a_shard_axis_that_tensor_parallel_cannot_split_is_refused(self):
        bad = SHARDED.replace("shape: [96, 3]", "shape: [6, 3]").replace(
            "      dtype: fp32\n      shard_axis: 0", "      dtype: fp32\n      shard_axis: 3").replace(
            "shape: [12]\n      dtype: fp32", "shape: [12]\n      dtype: fp32\n      shard_axis: x")
        self.assertEqual(model_errors(bad), [
            "models/m.yaml:13: linear_layers.states[0].shard_axis: extent 6 does not split evenly over 4 ranks "
            "(tensor_parallel) (allowed: an axis whose extent every tensor_parallel degree divides)",
            "models/m.yaml:17: linear_layers.states[1].shard_axis: expected an axis of the shape, got 3 (allowed: "
            "an axis 0..2 of the shape)",
            "models/m.yaml:21: linear_layers.states[2].shard_axis: expected an axis of the shape, got 'x' (allowed: "
            "an axis 0..0 of the shape)"])

    def test_shard_shapes_must_give_each_degree_a_shape_of_the_parts_rank(self):
        one_way = SHARDED.replace("shard_shapes: {2: [24, 3], 4: [16, 3]}",
                                  "shard_shapes: {2: [24, 3], 4: [16, 3]}\n      shard_axis: 0")
        self.assertEqual(model_errors(one_way), [
            "models/m.yaml:24: linear_layers.states[3].shard_shapes: a part gives its ranks' shapes one way "
            "(allowed: one of shard_axis and shard_shapes)"])
        bad = SHARDED.replace("{2: [24, 3], 4: [16, 3]}", "{2: [24], one: [16, 3]}")
        self.assertEqual(model_errors(bad), [
            "models/m.yaml:24: linear_layers.states[3].shard_shapes: 'one' is not a degree above 1 (allowed: a "
            "mapping of each tensor_parallel degree to a shape of 2 extents)",
            "models/m.yaml:24: linear_layers.states[3].shard_shapes.2: expected a list of 2 extents (allowed: a "
            "mapping of each tensor_parallel degree to a shape of 2 extents)"])
        self.assertEqual(model_errors(SHARDED.replace("{2: [24, 3], 4: [16, 3]}", "{2: [24, 3]}")), [
            "models/m.yaml:24: linear_layers.states[3].shard_shapes: gives no shape for degree 4 (allowed: a "
            "mapping of each tensor_parallel degree to a shape of 2 extents)"])

    def test_the_variants_hold_the_attention_layers_and_state_the_record(self):
        specs = load_specs([os.path.join(REPO, "specs", "layouts")], [MODELS], REPO)
        model = specs.model("tiny_gdn")
        self.assertEqual((model.layers, model.model_layers, model.linear_layers), (1, 4, (0, 1, 2)))
        [v] = [v for v in plan_variants(specs) if v.name == "vllm_paged_nhd.tiny_gdn.fp32"]
        self.assertEqual(v.bytes_per_token, 2 * 1 * 2 * 16 * 4)  # K and V of the one attention layer
        header = render([v])["vllm_paged_nhd.tiny_gdn.fp32.hpp"]
        self.assertIn("static constexpr int layers = 1;", header)
        self.assertIn("static constexpr int linear_layers[] = {0, 1, 2};", header)
        self.assertIn('{"recurrent", 3, {4, 8, 8, 0}, kvforge::DType::f32, 0}', header)
        self.assertEqual(model.state_bytes_per_sequence, 3 * (64 * 4 * 4 + 4 * 8 * 8 * 4))


class StateAxes(unittest.TestCase):
    """A layout's state_axes: the order of a state pool of its own, every problem at once, and the
    traits that carry it."""

    def test_every_problem_of_state_axes_at_once(self):
        from test_codegen import errors_of
        bad = GOOD_LAYOUT.format(name="bad").replace("update: eager\n", "update: eager\nstate_axes: [slot, page, slot]\n")
        self.assertEqual(errors_of(bad), [
            "layouts/bad.yaml:6: state_axes: unknown value 'page' (allowed: slot, layer, part)",
            "layouts/bad.yaml:6: state_axes: 'slot' is listed twice"])
        short = GOOD_LAYOUT.format(name="bad").replace("update: eager\n", "update: eager\nstate_axes: [layer, slot]\n")
        self.assertEqual(errors_of(short), [
            "layouts/bad.yaml:6: state_axes: a state pool's memory needs every one of its axes (allowed: an order "
            "of slot, layer, part)"])
        hybrid = "name: bad\ngroups:\n  local: ok\nstate_axes: [layer, slot, part]\nexpand:\n  - models: [tiny_hybrid]\n" \
                 "    dtypes: [bf16]\n"
        self.assertIn("layouts/bad.yaml:4: state_axes: a hybrid layout takes its storage from the layouts its "
                      "groups name (allowed: name, groups, expand)", errors_of(hybrid))

    def test_a_layouts_state_axes_reach_its_variants_traits(self):
        specs = load_specs([os.path.join(REPO, "specs", "layouts")], [MODELS], REPO)
        [v] = [v for v in plan_variants(specs) if v.name == "vllm_paged_nhd.tiny_gdn.fp32"]
        self.assertEqual(v.layout.state_axes, ("layer", "slot", "part"))
        header = render([v])["vllm_paged_nhd.tiny_gdn.fp32.hpp"]
        self.assertIn("static constexpr kvforge::StateAxis state_axes[] = {kvforge::StateAxis::layer, "
                      "kvforge::StateAxis::slot, kvforge::StateAxis::part};", header)
        [w] = [w for w in plan_variants(specs) if w.name == "paged_state_pages.tiny_gdn.fp32"]
        self.assertIsNone(w.layout.state_axes)  # the default order, slot-major, says nothing
        self.assertNotIn("state_axes", render([w])["paged_state_pages.tiny_gdn.fp32.hpp"])
