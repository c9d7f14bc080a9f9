"""Typed, frozen spec objects, parsed and validated (parse.py) before any template sees them."""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass, replace
from typing import Optional, Tuple

from . import vocab
from .diagnostics import Loc


@dataclass(frozen=True)
class LayerGroup:
    """Layers of a model that share an attention pattern (Gemma-2's local and global layers)."""

    name: str
    layers: Tuple[int, ...]
    sliding_window: Optional[int]
    loc: Loc
    # The group's KV heads where they are not the model's (MiMo-V2-Flash's sliding layers keep twice the
    # full layers' heads); None: the model's kv_heads.
    kv_heads: Optional[int] = None


# Launch parameters baked into a model's variants: measured winners, or the defaults. One field per
# vocab.TUNABLES entry, named <backend>_<name> (cpu_parallel_bytes, ...), and the tuning file they came
# from (`source`, None for the defaults).
Tuning = make_dataclass(
    "Tuning", [(f"{section}_{name}", int, field(default=entry[0]))
               for section, entries in vocab.TUNABLES.items() for name, entry in entries.items()] +
    [("source", Optional[str], field(default=None))], frozen=True)


def shard_model_name(model: str, tp: int) -> str:
    return f"{model}_tp{tp}"


def tp_divides(kv_heads: int, tp: int) -> bool:
    """Heads split evenly over the ranks, or each head is replicated on a whole number of them."""
    return kv_heads % tp == 0 or tp % kv_heads == 0


@dataclass(frozen=True)
class StatePartSpec:
    """One part of the per-sequence state a hybrid model's linear layers keep (a conv window, a
    recurrent state): kvforge::StatePart."""

    name: str
    shape: Tuple[int, ...]
    dtype: str
    loc: Loc
    # The axis tensor parallelism splits among ranks (a conv window's channels, a recurrent state's
    # heads), each rank holding extent / tp of it, as vLLM's per-rank Mamba and GDN shapes do; None: every
    # rank holds the whole part.
    shard_axis: Optional[int] = None
    # Or each degree's shape on a rank, given whole (`shard_shapes`), where a plain split is not it.
    shard_shapes: Tuple[Tuple[int, Tuple[int, ...]], ...] = ()

    def sharded(self, tp: int) -> "StatePartSpec":
        """One rank's part at degree tp."""
        if self.shard_shapes:
            return replace(self, shape=dict(self.shard_shapes)[tp])
        if self.shard_axis is None:
            return self
        shape = list(self.shape)
        shape[self.shard_axis] //= tp
        return replace(self, shape=tuple(shape))


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    max_seq_len: int
    sliding_window: Optional[int]
    loc: Loc
    layer_groups: Tuple[LayerGroup, ...] = ()
    tuning: Tuning = Tuning()
    # Tensor-parallel degrees (above 1) to expand: each becomes the shard model `<name>_tp<N>`.
    tensor_parallel: Tuple[int, ...] = ()
    # A shard: the full model's name and KV heads, and the degree; None and 1 for a whole model.
    shard_of: Optional[str] = None
    model_kv_heads: int = 0
    tp: int = 1
    # A hybrid model's linear-attention or state-space layers (`linear_layers`): their indices among the
    # model's `model_layers` layers, and the state record each keeps per sequence. `layers` then counts
    # the attention layers only, which are all the K/V variants hold.
    linear_layers: Tuple[int, ...] = ()
    states: Tuple[StatePartSpec, ...] = ()
    model_layers: int = 0
    # An MLA model (`mla`): each token caches one latent record, kv_lora_rank values then the
    # qk_rope_head_dim RoPE part, with no heads. Its variants store the record as one KV head whose K is
    # the record's first half and V its second (head_dim = half the record), so a layout whose axes end
    # [.., slot, kv, head, dim] keeps each token's record whole, as vLLM's MLA cache does.
    mla: Optional[Tuple[int, int]] = None
    # K and V of different widths (`v_head_dim` beside `head_dim`): (K's, V's). Each head's record, K then
    # V, is stored as the halves of an MLA record are (head_dim = half the record), so a layout whose axes
    # end [.., head, kv, dim] keeps a head's K and V adjacent. None where they are one width.
    kv_widths: Optional[Tuple[int, int]] = None

    @property
    def state_bytes_per_sequence(self) -> int:
        """Bytes of every linear layer's state record, unpadded."""
        total = 0
        for part in self.states:
            n = vocab.DTYPES[part.dtype]["bytes"]
            for extent in part.shape:
                n *= extent
            total += n
        return total * len(self.linear_layers)

    def shard(self, tp: int) -> "ModelSpec":
        """One rank's model at degree tp: its slice of the KV heads, or one head where there are
        fewer heads than ranks (replicated, as vLLM does: each head lives on tp / kv_heads ranks), and its
        slice of each state part that names a shard_axis."""
        return replace(self, name=shard_model_name(self.name, tp), kv_heads=max(self.kv_heads // tp, 1),
                       tensor_parallel=(), shard_of=self.name, model_kv_heads=self.kv_heads, tp=tp,
                       states=tuple(part.sharded(tp) for part in self.states))

    def with_shards(self) -> Tuple["ModelSpec", ...]:
        return (self,) + tuple(self.shard(tp) for tp in self.tensor_parallel)

    def group(self, name: str) -> LayerGroup:
        return next(g for g in self.layer_groups if g.name == name)

    def for_group(self, group: LayerGroup) -> "ModelSpec":
        """The model as one layer group sees it: the group's layers, sliding window and KV heads."""
        return replace(self, layers=len(group.layers), sliding_window=group.sliding_window, layer_groups=(),
                       kv_heads=group.kv_heads or self.kv_heads)


@dataclass(frozen=True)
class Expansion:
    models: Tuple[str, ...]
    dtypes: Tuple[str, ...]
    input_dtypes: Optional[Tuple[str, ...]]  # None: input dtype equals storage dtype
    loc: Loc


@dataclass(frozen=True)
class Quantization:
    """How the layout's quantized dtypes (int8, fp8) are scaled; float dtypes ignore it."""

    granularity: str  # vocab.GRANULARITIES
    scale_dtype: str  # vocab.SCALE_DTYPES
    scales: str       # separate or in_page
    loc: Loc
    group_size: int = 0  # per_group: consecutive values of a head's row that share a scale; else 0
    tensor_scale: str = "none"  # vocab.TENSOR_SCALES: a per_group layout's second-level scale
    zero_point: bool = False  # asymmetric codes (uint4): each scale entry is a scale and a zero point

    @property
    def summary(self) -> str:
        """One line for listings and generated comments: "per_group 16 fp8_e4m3 x fp32 tensor separate"."""
        group = f" {self.group_size}" if self.group_size else ""
        tensor = f" x {self.tensor_scale} tensor" if self.tensor_scale != "none" else ""
        zero = " + zero" if self.zero_point else ""
        return f"{self.granularity}{group} {self.scale_dtype}{zero}{tensor} {self.scales}"

    @property
    def scale_entry(self) -> str:
        """The key of vocab.SCALE_ENTRIES that one stored scale is: the scale dtype, or it with a zero point."""
        return f"{self.scale_dtype}_zero" if self.zero_point else self.scale_dtype


@dataclass(frozen=True)
class RecordScale:
    """How a coded part of a record is scaled (vocab.RECORD_SCALE_FIELDS)."""

    group: int         # values that share a scale
    dtype: str         # vocab.RECORD_SCALE_DTYPES
    rounding: str      # vocab.RECORD_SCALE_ROUNDINGS
    amax_floor: float  # amax is at least this; 0: an all-zero group gets scale 1
    nan: str           # vocab.RECORD_NAN_RULES
    place: str         # vocab.RECORD_SCALE_PLACES


@dataclass(frozen=True)
class RecordPartSpec:
    """One named part of a token's record: its width (values, or a model field, or `rest`), its dtype,
    and its scale where it holds codes."""

    name: str
    width: int | str
    dtype: str
    scale: Optional[RecordScale]
    loc: Loc


@dataclass(frozen=True)
class RecordFormat:
    """A layout's record format (`records`): a token's record, K then V of a head, as named parts in
    order. Its name is a storage the layout's expansions can list (plan.py places its bytes per model)."""

    name: str
    parts: Tuple[RecordPartSpec, ...]
    loc: Loc


@dataclass(frozen=True)
class LayoutSpec:
    name: str
    addressing: str
    axes: Tuple[str, ...]
    page_size: Optional[int]
    window: Optional[str | int]  # an int, or "model" for the model's sliding window
    update: str
    quantization: Optional[Quantization]
    expand: Tuple[Expansion, ...]
    loc: Loc
    # A hybrid layout names a layout per layer group instead of a storage of its own.
    groups: Tuple[Tuple[str, str], ...] = ()
    # The order of a state pool of its own for a model with linear layers, outermost first (vocab.STATE_AXES);
    # None: the default, vocab.STATE_AXES.
    state_axes: Optional[Tuple[str, ...]] = None
    # The record formats the layout defines, each a storage its expansions may name.
    records: Tuple[RecordFormat, ...] = ()

    @property
    def hybrid(self) -> bool:
        return bool(self.groups)

    def record(self, storage: str) -> Optional[RecordFormat]:
        """The record format `storage` names, or None where it is a dtype."""
        return next((r for r in self.records if r.name == storage), None)


@dataclass(frozen=True)
class SpecSet:
    layouts: Tuple[LayoutSpec, ...]
    models: Tuple[ModelSpec, ...]

    def model(self, name: str) -> ModelSpec:
        return next(m for m in self.models if m.name == name)


MODEL_FIELDS = ("name", "layers", "kv_heads", "head_dim", "v_head_dim", "mla", "max_seq_len", "sliding_window", "layer_groups",
                "tensor_parallel", "linear_layers")
MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim")
LINEAR_FIELDS = ("layers", "states")
STATE_PART_FIELDS = ("name", "shape", "dtype", "shard_axis", "shard_shapes")
LAYER_GROUP_FIELDS = ("name", "layers", "sliding_window", "kv_heads")
LAYOUT_FIELDS = ("name", "addressing", "axes", "page_size", "window", "update", "quantization", "state_axes", "groups",
                 "records", "expand")
STORAGE_FIELDS = ("addressing", "axes", "page_size", "window", "update", "quantization", "state_axes", "records")
QUANTIZATION_FIELDS = ("granularity", "scale_dtype", "scales", "group_size", "tensor_scale", "zero_point")
EXPANSION_FIELDS = ("models", "dtypes", "input_dtypes")
