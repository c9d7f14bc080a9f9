// The two function qualifiers that element code (dtype.hpp's conversions, the codecs) is written with:
// KVF_HD, callable from host and device code, and KVF_INLINE, inlined into every kernel body. A backend
// with a compiler of its own defines them in its target header (backends/<name>/target.*), which its
// sources include first; everything else gets the host's, here, and no more of a target than these two.
#pragma once

#ifndef KVF_HD
#define KVF_HD                                             // host and device function: the host has one kind
#define KVF_INLINE inline __attribute__((always_inline))  // inlined into every kernel body
#endif
