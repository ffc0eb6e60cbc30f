// The one CPUID + XCR0 check of the AVX kernels (dense/gemv.cpp, int4/int4_avx.cpp,
// int8/w8a8_avx.cpp): which of their code paths this CPU and its OS can run.
// cpu_ext.build_key hashes this header with every source that includes it.
#pragma once

#include <cpuid.h>

#include <cstdint>

namespace quantkit_isa {

// 1: AVX2 + FMA, 2: AVX-512 F, DQ, BW and VL too (and VNNI when `vnni`); 0: neither, or the OS
// does not save the registers. F, DQ, BW, VL: the sources build with -march=native, so their
// avx512 namespaces may use more than F.
inline int64_t level(bool vnni = false) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  const bool fma = c >> 12 & 1, osxsave = c >> 27 & 1, avx = c >> 28 & 1;
  if (!(fma && osxsave && avx) || __get_cpuid_max(0, nullptr) < 7) return 0;
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & 0x6) != 0x6) return 0;  // the OS saves xmm and ymm
  __cpuid_count(7, 0, a, b, c, d);
  if (!(b >> 5 & 1)) return 0;  // AVX2
  const bool avx512 = (b >> 16 & 1) && (b >> 17 & 1) && (b >> 30 & 1) && (b >> 31 & 1) && (!vnni || (c >> 11 & 1));
  return avx512 && (lo & 0xE6) == 0xE6 ? 2 : 1;  // and the OS saves opmask and zmm
}

}  // namespace quantkit_isa
