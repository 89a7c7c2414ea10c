// KVPILOT_X86: whether a CPU kernel's x86-64 code is compiled (GCC or Clang on x86-64, where
// the AVX-512 intrinsics are included); elsewhere its entry points only check their arguments.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#define KVPILOT_X86 1
#include <immintrin.h>
#else
#define KVPILOT_X86 0
#endif
