"""fp8 index keys (`indexer_fp8`, docs/specs.md "DeepSeek-V3.2's indexer keys"): the expansions that cannot
hold them are refused at file:line with every reason, and the default variants take vLLM's 132 bytes a
key."""

import os
import tempfile
import unittest

from kvforge_codegen.diagnostics import SpecFailure
from kvforge_codegen.validate import load_specs
from test_codegen import MODELS, REPO, plan_variants  # tests/codegen is on the path

LAYOUT = """\
name: keys
addressing: paged
page_size: 64
axes: {axes}
update: eager
expand:
  - models: [{models}]
    dtypes: [indexer_fp8]
    input_dtypes: [bf16]
"""
NARROW = "name: narrow\nlayers: 2\nkv_heads: 1\nhead_dim: 32\nmax_seq_len: 256\n"


def errors(models, axes="[page, slot, kv, head, dim]"):
    with tempfile.TemporaryDirectory() as tmp:
        for folder, name, text in (("layouts", "keys", LAYOUT.format(axes=axes, models=models)),
                                   ("models", "narrow", NARROW)):
            os.makedirs(os.path.join(tmp, folder), exist_ok=True)
            with open(os.path.join(tmp, folder, name + ".yaml"), "w") as f:
                f.write(text)
        try:
            load_specs([os.path.join(tmp, "layouts")], [os.path.join(tmp, "models"), MODELS], tmp)
        except SpecFailure as failure:
            return [str(e) for e in failure.errors]
    return []


class IndexKeys(unittest.TestCase):
    def test_every_reason_at_once(self):
        at = "layouts/keys.yaml:7: expand[0]: "
        self.assertEqual(errors("tiny, narrow, tiny_mla"), [
            at + "keys.tiny.indexer_fp8_in_bf16: indexer_fp8 stores one index key a token, a head of K then V; "
                 "tiny is not a model of kv_heads: 1",
            at + "keys.narrow.indexer_fp8_in_bf16: indexer_fp8 scales a key in tiles of 128, and narrow's key of 64 "
                 "values (head_dim 32, K then V) is not a multiple of 128",
            at + "keys.tiny_mla.indexer_fp8_in_bf16: indexer_fp8 stores one index key a token, a head of K then V; "
                 "tiny_mla is not a model of kv_heads: 1"])
        self.assertEqual(errors("tiny_indexer", "[kv, page, slot, head, dim]"), [
            at + "keys.tiny_indexer.indexer_fp8_in_bf16: indexer_fp8 places a page's codes, then its scales: it "
                 "takes a paged, eager layout whose axes end [page, slot, kv, head, dim]"])

    def test_a_key_takes_vllms_132_bytes_a_layer(self):
        specs = load_specs([os.path.join(REPO, "specs", "layouts")], [MODELS], REPO)
        sizes = {v.name: v.bytes_per_token for v in plan_variants(specs) if v.layout.name == "vllm_indexer"}
        self.assertEqual(sizes["vllm_indexer.deepseek_v32_indexer.indexer_fp8_in_bf16"], 61 * 132)
        self.assertEqual(sizes["vllm_indexer.deepseek_v32_indexer.bf16"], 61 * 256)
