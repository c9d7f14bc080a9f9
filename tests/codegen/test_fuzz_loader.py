"""Property-based fuzzing of the spec loader with hypothesis: random bytes, mutated default specs and
random YAML documents must give either a valid spec set or `file:line: field: problem` diagnostics,
never an exception of another kind. A valid result must also render.

KVFORGE_FUZZ_EXAMPLES sets the examples per strategy (the test command runs 100, about 10 s; hypothesis
draws new ones every run, with no database, so runs add up; raise it to soak)."""

import os
import re
import tempfile
import unittest

from kvforge_codegen.diagnostics import SpecFailure
from kvforge_codegen.plan import plan_variants
from kvforge_codegen.render import render
from kvforge_codegen.validate import load_specs

try:
    import yaml
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError as exc:  # tools/setup installs hypothesis; say so rather than pass silently
    raise unittest.SkipTest(f"hypothesis is not installed ({exc}); run tools/setup") from None

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.path.join(REPO, "specs", "models")
EXAMPLES = int(os.environ.get("KVFORGE_FUZZ_EXAMPLES", "100"))
# file:line: field: problem, on one line (a field that is not a plain name comes quoted, so it may hold
# colons of its own).
DIAGNOSTIC = re.compile(r"\A(layouts|models)/[^:\n]+:\d+: [^\n]*: [^\n]+\Z")


def _default_specs():
    out = []
    for kind in ("layouts", "models"):
        folder = os.path.join(REPO, "specs", kind)
        for name in sorted(os.listdir(folder)):
            with open(os.path.join(folder, name), "rb") as f:
                out.append((kind, name, f.read()))
    return out


DEFAULTS = _default_specs()
# Pieces of YAML syntax that stress the parser and the converter: anchors, aliases, tags, flow
# collections, document markers, odd scalars.
TOKENS = [b"&a ", b"*a", b"[", b"]", b"{", b"}", b": ", b"- ", b"\n", b"  ", b"!!int ", b"!!str ", b"!!binary ",
          b"---\n", b"...\n", b"? ", b"0x1F", b"0o17", b"1_000", b"1e400", b".nan", b"~", b"null", b"yes",
          b"9" * 40, b"\t", b"\xff", b"\x00", b"'", b'"', b"#", b"|\n", b">\n", b"%YAML 1.1\n", b"<<: *a\n",
          b"model", b"paged", b"page_size: ", b"axes: ", b"expand:\n  - models: [tiny]\n    dtypes: [int8]\n",
          b"quantization: {granularity: per_token, scales: in_page}\n", b"window: ", b"layer_groups: "]

mutation = st.tuples(st.integers(min_value=0, max_value=4000), st.integers(min_value=0, max_value=40),
                     st.one_of(st.sampled_from(TOKENS), st.binary(max_size=8)))


@st.composite
def mutated_default(draw):
    kind, name, data = draw(st.sampled_from(DEFAULTS))
    for at, cut, insert in draw(st.lists(mutation, min_size=1, max_size=6)):
        at %= len(data) + 1
        data = data[:at] + insert + data[at + cut:]
    return kind, name, data


scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True), st.text(max_size=12),
                    st.sampled_from(["paged", "ring", "contiguous", "model", "tiny", "bf16", "int8", "page",
                                     "slot", "head", "dim", "row", "seq", "layer", "kv", "lazy", "eager"]))
field_names = st.sampled_from(["name", "addressing", "axes", "page_size", "window", "update", "quantization",
                               "groups", "expand", "models", "dtypes", "input_dtypes", "granularity",
                               "scale_dtype", "scales", "layers", "kv_heads", "head_dim", "max_seq_len",
                               "sliding_window", "layer_groups"])
documents = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.one_of(field_names, st.text(max_size=6)), inner, max_size=6)),
    max_leaves=30)


@st.composite
def random_document(draw):
    doc = draw(documents)
    kind = draw(st.sampled_from(["layouts", "models"]))
    if isinstance(doc, dict) and draw(st.booleans()):
        doc["name"] = "fuzz"
    return kind, "fuzz.yaml", yaml.safe_dump(doc).encode()


class LoaderNeverThrows(unittest.TestCase):
    def check(self, kind, name, data):
        with tempfile.TemporaryDirectory() as root:
            layouts, models = os.path.join(root, "layouts"), os.path.join(root, "models")
            os.makedirs(layouts)
            if kind == "models":
                # A fuzzed model beside copies of the default models, so the layouts can use it.
                os.makedirs(models)
                for k, n, d in DEFAULTS:
                    if k == "models" and n != name:
                        with open(os.path.join(models, n), "wb") as f:
                            f.write(d)
                for k, n, d in DEFAULTS:
                    if k == "layouts":
                        with open(os.path.join(layouts, n), "wb") as f:
                            f.write(d)
            with open(os.path.join(models if kind == "models" else layouts, name), "wb") as f:
                f.write(data)
            try:
                specs = load_specs([layouts], [models if kind == "models" else MODELS], root)
            except SpecFailure as failure:
                self.assertTrue(failure.errors)
                for e in failure.errors:
                    self.assertRegex(str(e), DIAGNOSTIC, data)
                return
            render(plan_variants(specs))

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.binary(max_size=3000))
    def test_random_bytes(self, data):
        self.check("layouts", "fuzz.yaml", data)

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(mutated_default())
    def test_mutated_default_specs(self, case):
        self.check(*case)

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(random_document())
    def test_random_documents(self, case):
        self.check(*case)


if __name__ == "__main__":
    unittest.main()
