// fp8 e4m3 (torch.float8_e4m3fn) KV-cache codes for the paged-attention kernels (KVf8).
//
// fxc::e4m3 is one cache byte; converting it to float reads a 256-entry table built once from c10's exact
// decoder (every e4m3 value, subnormals included, is exact in fp32; NaN codes 0x7F/0xFF give NaN), so the
// kernels' generic loops (`static_cast<acc_t>(code)`) and the flash kernel's row buffers read the exact
// values.  e4m3_encode is the cache write: x / scale clamped to +-448 (NaN stays NaN), rounded to nearest
// even by c10's encoder: the bits torch's `.to(torch.float8_e4m3fn)` gives.
#pragma once

#include <c10/util/Float8_e4m3fn.h>

#include <cstdint>

namespace fxc {

struct E4M3Table {
  float v[256];
  E4M3Table() {
    for (int i = 0; i < 256; ++i) v[i] = c10::detail::fp8e4m3fn_to_fp32_value(static_cast<uint8_t>(i));
  }
};
inline const E4M3Table kE4M3{};

struct e4m3 {
  uint8_t bits;
  operator float() const { return kE4M3.v[bits]; }
};
static_assert(sizeof(e4m3) == 1, "an e4m3 code is one byte");

constexpr float kE4M3Max = 448.0f;

inline e4m3 e4m3_encode(float x) {
  x = x > kE4M3Max ? kE4M3Max : (x < -kE4M3Max ? -kE4M3Max : x);  // NaN compares false: passes through
  return e4m3{c10::detail::fp8e4m3fn_from_fp32_value(x)};
}

}  // namespace fxc
