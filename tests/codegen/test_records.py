"""A layout's record formats (`records`, docs/specs.md "Records of named parts"): every problem of a format
at once as file:line, every reason an expansion cannot hold one, and the bytes records.py places, which
for the default specs' two formats are FlashMLA's 656-byte record and vLLM's 132-byte index key."""

import os
import tempfile
import unittest

from kvforge_codegen.diagnostics import SpecFailure
from kvforge_codegen.validate import load_specs
from test_codegen import MODELS, REPO, errors_of, plan_variants  # tests/codegen is on the path

LAYOUT = """\
name: rec
addressing: paged
page_size: {page_size}
axes: {axes}
update: eager
records:
{records}
expand:
  - models: [{models}]
    dtypes: [{dtype}]
    input_dtypes: [bf16]
"""
FLASHMLA = """\
  - name: flashmla_fp8
    parts:
      - name: latent
        width: kv_lora_rank
        dtype: fp8_e4m3
        scale: {group: 128, dtype: fp32, rounding: pow2_up}
      - name: rope
        width: rest
        dtype: bf16"""
INDEX_KEY = """\
  - name: indexer_fp8
    parts:
      - name: key
        width: rest
        dtype: fp8_e4m3
        scale: {group: 128, dtype: fp32, rounding: pow2_up, amax_floor: 1.0e-4, nan: value, place: page_end}"""
KV_CODES = """\
  - name: kv_codes
    parts:
      - {name: k, width: head_dim, dtype: int8, scale: {group: 16, dtype: fp32, nan: value}}
      - {name: v, width: v_head_dim, dtype: fp8_e4m3, scale: {group: 16, dtype: fp32, rounding: pow2_up}}"""
NARROW = "name: narrow\nlayers: 2\nkv_heads: 1\nhead_dim: 32\nmax_seq_len: 256\n"


def layout(records, models, dtype, axes="[page, slot, kv, head, dim]", page_size=64):
    return LAYOUT.format(records=records, models=models, dtype=dtype, axes=axes, page_size=page_size)


def load(text, extra_model=NARROW):
    with tempfile.TemporaryDirectory() as tmp:
        for folder, name, body in (("layouts", "rec", text), ("models", "narrow", extra_model)):
            os.makedirs(os.path.join(tmp, folder), exist_ok=True)
            with open(os.path.join(tmp, folder, name + ".yaml"), "w") as f:
                f.write(body)
        return load_specs([os.path.join(tmp, "layouts")], [os.path.join(tmp, "models"), MODELS], tmp)


def errors(text, extra_model=NARROW):
    try:
        load(text, extra_model)
    except SpecFailure as failure:
        return [str(e) for e in failure.errors]
    return []


class RecordSpecs(unittest.TestCase):
    def test_every_problem_of_a_format_at_once(self):
        records = """\
  - name: bf16
    parts:
      - {name: a, width: rest, dtype: fp8_e4m3}
      - {name: a, width: rest, dtype: bf16, scale: {group: 16}}
  - name: odd
    parts:
      - {name: c, width: wide, dtype: fp6, scale: {group: 24, dtype: ue8m0, amax_floor: -1, nan: maybe, colour: red}}"""
        text = layout(records, "tiny", "bf16")
        self.assertEqual(errors(text), [
            "layouts/rec.yaml:7: records[0].name: bf16 is a storage dtype already (allowed: a name that is no dtype)",
            "layouts/rec.yaml:9: records[0].parts: only one part can take the rest of the record's values "
            "(allowed: width: rest on one part)",
            "layouts/rec.yaml:9: records[0].parts[0].scale: fp8_e4m3 holds codes, which need a scale "
            "(allowed: scale: {group, dtype, rounding, amax_floor, nan, place})",
            "layouts/rec.yaml:10: records[0].parts[1].name: a part named a is listed twice",
            "layouts/rec.yaml:10: records[0].parts[1].scale: bf16 values are stored as they are, with no scale "
            "(allowed: fp8_e4m3, fp8_e5m2, int8, fp4_e2m1, int4)",
            "layouts/rec.yaml:13: records[1].parts[0].dtype: unknown value 'fp6' "
            "(allowed: fp8_e4m3, fp8_e5m2, int8, fp4_e2m1, int4, bf16, fp16, fp32)",
            "layouts/rec.yaml:13: records[1].parts[0].scale.amax_floor: expected a number, got -1 "
            "(allowed: a finite number, 0..1e30)",
            "layouts/rec.yaml:13: records[1].parts[0].scale.colour: unknown field "
            "(allowed: group, dtype, rounding, amax_floor, nan, place)",
            "layouts/rec.yaml:13: records[1].parts[0].scale.group: 24 is not a supported group size "
            "(allowed: 8, 16, 32, 64, 128)",
            "layouts/rec.yaml:13: records[1].parts[0].scale.nan: unknown value 'maybe' (allowed: group, value)",
            "layouts/rec.yaml:13: records[1].parts[0].scale.rounding: a ue8m0 scale is a power of two, so it is "
            "rounded up to one (allowed: pow2_up)",
            "layouts/rec.yaml:13: records[1].parts[0].width: unknown value 'wide' "
            "(allowed: kv_lora_rank, qk_rope_head_dim, head_dim, v_head_dim, rest)"])

    def test_an_expansion_names_a_format_of_its_own_layout(self):
        self.assertEqual(errors(layout(KV_CODES, "tiny", "flashmla_fp8")), [
            "layouts/rec.yaml:13: expand[0].dtypes: unknown value 'flashmla_fp8' (allowed: fp32, fp16, bf16, int8, "
            "fp8_e4m3, fp8_e5m2, fp4_e2m1, int4, uint4, kv_codes)"])

    def test_every_reason_a_model_cannot_hold_a_format(self):
        at = "layouts/rec.yaml:17: expand[0]: "
        self.assertEqual(errors(layout(FLASHMLA, "tiny, tiny_mla", "flashmla_fp8")), [
            at + "rec.tiny.flashmla_fp8_in_bf16: part latent's width kv_lora_rank is not a field of tiny",
            at + "rec.tiny_mla.flashmla_fp8_in_bf16: part latent: group 128 does not divide its 24 values"])
        at = "layouts/rec.yaml:14: expand[0]: "
        self.assertEqual(errors(layout(INDEX_KEY, "tiny, narrow", "indexer_fp8")), [
            at + "rec.tiny.indexer_fp8_in_bf16: part key: group 128 does not divide its 32 values",
            at + "rec.tiny.indexer_fp8_in_bf16: indexer_fp8 places scales at the page's end, a token's after the "
                 "page's records, which takes one record a token: tiny has 2 KV heads",
            at + "rec.narrow.indexer_fp8_in_bf16: part key: group 128 does not divide its 64 values"])
        self.assertEqual(errors(layout(INDEX_KEY, "tiny_indexer", "indexer_fp8", "[kv, page, slot, head, dim]")), [
            at + "rec.tiny_indexer.indexer_fp8_in_bf16: indexer_fp8 places a page's records, then their scales: it "
                 "takes a paged, eager layout whose axes end [page, slot, kv, head, dim]"])
        odd = "name: narrow\nlayers: 2\nmax_seq_len: 64\nmla:\n  kv_lora_rank: 128\n  qk_rope_head_dim: 7\n"
        at = "layouts/rec.yaml:17: expand[0]: rec.narrow.flashmla_fp8_in_bf16: "
        self.assertEqual(errors(layout(FLASHMLA, "narrow", "flashmla_fp8"), odd), [
            at + "flashmla_fp8 keeps a record as two halves of bytes, and narrow's record of 135 values is odd",
            at + "a record of 146 bytes (and 0 at the page's end) is not a multiple of its widest element's 4 bytes, "
                 "so the next token's parts would be misaligned"])
        misaligned = KV_CODES.replace("{group: 16, dtype: fp32, nan: value}", "{group: 16, dtype: bf16}")
        self.assertEqual(errors(layout(misaligned, "tiny", "kv_codes", "[page, slot, head, kv, dim]", 7)), [
            "layouts/rec.yaml:12: expand[0]: rec.tiny.kv_codes_in_bf16: part v's fp32 scales would start at byte 34 "
            "of the record, not a multiple of 4",
            "layouts/rec.yaml:12: expand[0]: rec.tiny.kv_codes_in_bf16: a record of 38 bytes (and 0 at the page's "
            "end) is not a multiple of its widest element's 4 bytes, so the next token's parts would be misaligned"])
        short = KV_CODES.replace("width: v_head_dim", "width: 8")
        self.assertEqual(errors(layout(short, "tiny", "kv_codes", "[page, slot, head, kv, dim]", 7)), [
            "layouts/rec.yaml:12: expand[0]: rec.tiny.kv_codes_in_bf16: the parts' widths add up to 24, and tiny's "
            "record holds 32 values"])
        no_input = layout(KV_CODES, "tiny", "kv_codes").replace("    input_dtypes: [bf16]\n", "")
        self.assertEqual(errors(no_input), [
            "layouts/rec.yaml:12: expand[0]: rec.tiny.kv_codes: kv_codes storage encodes a float input; give "
            "input_dtypes (fp32, fp16, bf16)"])

    def test_the_default_formats_take_flashmlas_and_vllms_bytes(self):
        specs = load_specs([os.path.join(REPO, "specs", "layouts")], [MODELS], REPO)
        placed = {v.name: v for v in plan_variants(specs) if v.record is not None}
        flashmla = placed["flashmla_paged.deepseek_v3.flashmla_fp8_in_bf16"].record
        # FlashMLA's README: 512 e4m3 codes, 4 fp32 scales, 64 bf16 RoPE values.
        self.assertEqual((flashmla.record_bytes, flashmla.tail_bytes), (656, 0))
        self.assertEqual([(p.name, p.bytes_at, p.scales_at) for p in flashmla.parts], [("latent", 0, 512), ("rope", 528, 0)])
        keys = placed["vllm_indexer.deepseek_v32_indexer.indexer_fp8_in_bf16"]
        # vLLM's indexer page: a key's 128 codes, and after the page's codes its one fp32 scale.
        self.assertEqual((keys.record.record_bytes, keys.record.tail_bytes, keys.bytes_per_token), (128, 4, 61 * 132))
        self.assertEqual(placed["flashmla_paged.deepseek_v3.flashmla_fp8_in_bf16"].bytes_per_token, 61 * 656)

    def test_a_format_of_its_own_places_each_part(self):
        specs = load(layout(KV_CODES, "tiny", "kv_codes", "[page, slot, head, kv, dim]", 7))
        [v] = plan_variants(specs)
        # K: 16 int8 codes and one fp32 scale; V: 16 e4m3 codes and one fp32 scale; 20 bytes a half.
        self.assertEqual([(p.name, p.values_at, p.bytes_at, p.scales_at) for p in v.record.parts],
                         [("k", 0, 0, 16), ("v", 16, 20, 36)])
        self.assertEqual((v.stored_row, v.bytes_per_token), (20, 2 * 2 * 2 * 20))


if __name__ == "__main__":
    unittest.main()
