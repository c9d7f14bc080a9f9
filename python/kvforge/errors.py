"""kvforge's typed errors as Python exceptions, with the runtime's own messages.

Each C++ error class (runtime/include/kvforge/errors.hpp) becomes the class of the same name here, and
also derives from the built-in exception a Python caller would catch for it: an index or value out of
range is an IndexError, a wrong dtype a TypeError, a wrong shape or a bad argument a ValueError, an
unknown variant a LookupError, an operation a layout lacks a NotImplementedError. The fields the C++
error carries (`argument`, `value`, `lo`, `hi`, `index`, `needed`, `available`, `name`, `nearest`)
are attributes of the exception.
"""


class Error(Exception):
    """Every error kvforge raises."""


class ArgumentError(Error, ValueError):
    """An argument is wrong; `argument` names it."""

    argument = None


class OutOfRangeError(ArgumentError, IndexError):
    """A value lies outside [lo, hi); for an index array, `index` is the first offending element."""


class ShapeError(ArgumentError):
    """An array has the wrong number of dimensions, sizes or strides."""


class DtypeError(ArgumentError, TypeError):
    """An array has the wrong element type."""


class DeviceError(ArgumentError):
    """An array lives on the wrong device, or the device is not available."""


class CapacityError(ArgumentError):
    """An allocation cannot be met (`needed` against `available`); nothing was allocated."""


class StateError(ArgumentError):
    """The object an argument names is in the wrong state for the call; nothing changed."""


class UnknownVariantError(Error, LookupError):
    """No registered variant has that name or matches that query; `nearest` lists the closest names."""


class UnsupportedError(Error, NotImplementedError):
    """The operation does not exist for this layout."""


class BackendError(Error, RuntimeError):
    """A CUDA call failed, or CUDA was asked for where it is not built or no device is present."""


class SpecError(Error, ValueError):
    """A spec is invalid. `errors` lists every `file:line: field: problem (allowed: ...)` at once."""

    def __init__(self, errors):
        super().__init__("\n".join(errors))
        self.errors = list(errors)
