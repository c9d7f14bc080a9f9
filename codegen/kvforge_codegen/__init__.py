"""kvforge codegen: YAML layout and model specs -> typed spec objects -> variant plan -> C++/CUDA text.

Data moves one way. No template reads YAML; every template sees only the frozen objects of `spec` and
`plan`.
"""

VERSION = "0.1.0"
