"""What kvforge.hf needs of transformers across the versions it runs on, 5.17 (the GPU machine's) to the
pin in tools/requirements.txt: a check at import, the placeholder layer later versions name DummyLayer,
and the keyword that takes a Cache."""

import transformers
import transformers.generation.utils

from kvforge.errors import UnsupportedError

# Older versions lack the per-layer cache interface kvforge.hf implements.
OLDEST_TRANSFORMERS = (5, 17)
if tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit()) < OLDEST_TRANSFORMERS:
    raise UnsupportedError(f"kvforge.hf needs transformers >= {'.'.join(map(str, OLDEST_TRANSFORMERS))} "
                           f"(found {transformers.__version__}): pip install 'transformers>=5.17'")
try:
    from transformers.cache_utils import DummyLayer
except ImportError:  # before 5.2x: no placeholder class for a layer that keeps no cache

    class DummyLayer:
        """A layer that keeps no cache (an MLP-only layer), as later transformers' DummyLayer is."""

        is_compileable = is_croppable = True

        def __init__(self, **kwargs):
            self.is_initialized, self.keys, self.values = True, None, None

        def update(self, key_states, value_states, *args, **kwargs):
            if key_states is None and value_states is None:
                return None, None
            raise UnsupportedError("update: this layer keeps no cache")

        def reset(self):
            pass

        def get_max_length(self):
            return -1


# The keyword a model's forward and generate take a Cache by: `cache` where this transformers has it
# (it deprecates `past_key_values`), else `past_key_values` (5.17).
_TAKES_CACHE = 'new_name="cache"' in open(transformers.generation.utils.__file__).read()


def cache_kwarg(cache):
    """{keyword: cache} for this transformers version: model.generate(ids, **kvforge.hf.cache_kwarg(c))."""
    return {"cache" if _TAKES_CACHE else "past_key_values": cache}
