"""The table of operations (runtime/include/kvforge/cache_ops.hpp) is the one list: the C++ classes
declare and route from it, and this test holds the Python surface to it, both ways, so a row without
its binding, or a binding outside the table, fails here."""

import inspect

import torch

import kvforge
import kvforge.ops
from kvforge import _native

ROWS = {name: (route, python) for name, route, python, _family, _arguments in _native._cache_ops()}
FAMILIES = {name: (family, arguments) for name, _route, _python, family, arguments in _native._cache_ops()}

# kvforge.Cache's members that are not rows: Python's own, over the rows. gather_batch is a gather of each
# sequence of a batch (python/src/batch.hpp); buffers() and the physical wire (python/src/physical.hpp)
# read the storage C++ reads through the rows storage() and scale_storage(); companion is a PairedCache's
# second cache, which C++ reaches through its class.
NOT_ROWS = {"gather_batch", "buffers", "physical_placement", "write_physical", "companion"}


def public_members(cls):
    return {n for n in dir(cls) if not n.startswith("_")}


def test_table_rows_are_well_formed():
    assert {"append", "gather", "commit", "copy_blocks", "view", "reset"} <= set(ROWS)
    for name, (route, python) in ROWS.items():
        assert route in {"layer", "whole", "first", "pages", "packed", "own", "derived", "groups"}, name
        assert python in {"method", "torch", "property", "none"}, name


def test_cache_exposes_exactly_the_rows_python_names():
    exposed = {n for n, (_, py) in ROWS.items() if py != "none"}
    members = public_members(_native.Cache)
    assert exposed - members == set(), "rows without a binding"
    assert members - exposed - NOT_ROWS == set(), "bindings outside the table (add a row, or say why in NOT_ROWS)"
    hidden = {n for n, (_, py) in ROWS.items() if py == "none"}
    assert hidden & members == set(), "a row marked python=none is bound"
    for name, (_, python) in ROWS.items():
        if python == "none":
            continue
        attr = inspect.getattr_static(_native.Cache, name)
        is_property = isinstance(attr, property) or type(attr).__name__.endswith("property")
        assert is_property == (python == "property"), name


def test_every_bound_row_names_its_family_and_its_arguments():
    # The family is the binding its C++ signature picked (python/src/rows.hpp); the arguments are the
    # row's, as its errors name them.
    for name, (route, python) in ROWS.items():
        family, arguments = FAMILIES[name]
        assert (family is None) == (python == "none"), name
    assert FAMILIES["append"] == ("tensors_in", ["layer", "k", "v", "targets"])
    assert FAMILIES["gather_record"] == ("tensors_out", ["layer", "range", "record_out"])
    assert FAMILIES["copy_blocks"] == ("indices", ["pairs"])


def test_torch_ops_are_the_rows_marked_torch():
    marked = {n for n, (_, py) in ROWS.items() if py == "torch"}
    defined = {n for n, obj in vars(kvforge.ops).items()
               if isinstance(obj, torch._library.custom_ops.CustomOpDef)}
    assert defined == marked
    for name in marked:
        assert hasattr(torch.ops.kvforge, name), name
        assert callable(getattr(kvforge.ops.TorchCache, name)), name
        assert FAMILIES[name][0] in kvforge.ops.FAMILIES, name  # a family ops.py makes ops of


def test_a_hybrid_cache_routes_by_the_table():
    # A hybrid variant's routes, observed: a `pages` op is refused naming group(g); `memory`, its own,
    # is the groups' sum.
    hybrid = next(d for d in kvforge.variants() if d.hybrid)  # the default specs hold one
    cache = kvforge.create(hybrid.name, pages=4)
    assert ROWS["copy_blocks"][0] == "pages"
    try:
        cache.copy_blocks(torch.tensor([0, 1], dtype=torch.int32))
        raise AssertionError("a hybrid cache ran copy_blocks")
    except kvforge.UnsupportedError as e:
        assert "group(g)" in str(e)
    assert ROWS["memory"][0] == "own"
    total = cache.memory()["storage_bytes"]
    assert total == sum(cache.group(g).memory()["storage_bytes"] for g in range(cache.num_groups))
