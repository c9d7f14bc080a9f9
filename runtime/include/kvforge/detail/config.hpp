// The target a translation unit compiles kernel code for: its function qualifiers (KVF_HD,
// KVF_INLINE, KVF_UNROLL), its 16-byte vector type and the hardware hooks that shared kernel code
// calls (namespace kvforge::target). The host's unless a backend's header came first and named its
// own (backends/<name>/target.*).
#pragma once

#ifndef KVF_TARGET
#include "kvforge/backends/cpu/target.hpp"
#endif
