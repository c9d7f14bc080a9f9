"""Reading a model spec's token record where it is not K and V of one width: an MLA model's latent
(`mla`, docs/specs.md "MLA models"), or K and V of different widths (`v_head_dim`). Either is stored as
each head's record [K | V] cut at its middle, the two halves a K and a V of head_dim = half the record.
A record of odd width takes one value of padding at its end (V's last), so head_dim = (width + 1) / 2."""

from __future__ import annotations

from typing import Optional, Tuple

from . import vocab
from .diagnostics import Diagnostics
from .spec import MLA_FIELDS
from .yamlnodes import Value


def parse_mla(value: Value, diags: Diagnostics, reader) -> Optional[Tuple[int, int]]:
    """(kv_lora_rank, qk_rope_head_dim), or None after recording every problem. `reader` is parse.py's
    _Reader, so that every field reads and reports the same way."""
    before = len(diags.errors)
    r = reader(diags, value, "mla", MLA_FIELDS)
    if not r.fields and not isinstance(value.data, dict):
        return None
    # Each half of the record is one head_dim of the K/V kernels.
    limit = 2 * vocab.MAX_HEAD_DIM
    rank = r.positive_int("kv_lora_rank", maximum=limit)
    rope = r.positive_int("qk_rope_head_dim", maximum=limit)
    if rank is not None and rope is not None:
        width = rank + rope
        if width > limit:
            diags.error(value.loc, "mla", f"the record of {width} values is too wide", f"a record of at most {limit}")
    if len(diags.errors) != before:
        return None
    return rank, rope


def parse_v_head_dim(r, head_dim: Optional[int], diags: Diagnostics) -> Optional[Tuple[int, int]]:
    """(head_dim, v_head_dim) of a model whose V is narrower or wider than its K (MiMo-V2-Flash: 192 and
    128); None where they are equal or a problem was recorded."""
    width = r.positive_int("v_head_dim", required=False, maximum=vocab.MAX_HEAD_DIM)
    if width is None or head_dim is None or width == head_dim:
        return None
    return head_dim, width


def stored_half(width: int) -> int:
    """head_dim of a record `width` values wide: its half, rounded up where one value pads it."""
    return (width + 1) // 2


def refuse_heads_beside_mla(r, diags: Diagnostics) -> None:
    """kv_heads and head_dim describe a K/V model; an MLA model's record has no heads."""
    for key in ("kv_heads", "head_dim", "v_head_dim"):
        if r.has(key):
            diags.error(r.loc_of(key), key, "an MLA model caches one latent record a token, with no heads; "
                        "its shape is mla's", "one of mla and kv_heads + head_dim")
