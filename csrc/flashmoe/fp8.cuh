// The fp8 quantisation rule on the device (plugin/flashmoe/fp8.py defines it and says where it comes from):
//   scale = max(amax, 1e-4) / 448 (fp32, correctly rounded), q = e4m3_rne(satfinite(v * (1 / scale)))
// with IEEE division and reciprocal, so the kernel's e4m3 values and scales equal the reference's bit for bit.
// IEEE division has a called slow path: use these outside the functions that issue wgmma (a call there
// serialises the wgmmas), i.e. in dispatch and in epilogues.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace flashmoe {

constexpr int kFp8Group = 128;       // activation group along K = weight block edge
constexpr float kFp8Max = 448.0f;    // largest finite e4m3
constexpr float kFp8AmaxFloor = 1e-4f;

struct Fp8Scale {
  float scale;    // stored: dequantised value = q * scale
  float inverse;  // multiplies each value before rounding
};

__device__ __forceinline__ Fp8Scale fp8_scale(float amax) {
  const float scale = __fdiv_rn(fmaxf(amax, kFp8AmaxFloor), kFp8Max);
  return {scale, __frcp_rn(scale)};
}

// Two values to e4m3 (round to nearest even, saturating to +-448), `lo` in the low byte (memory order).
__device__ __forceinline__ uint16_t e4m3x2(float lo, float hi) {
  uint16_t out;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(out) : "f"(hi), "f"(lo));
  return out;
}

// Four values quantised with `inverse`, packed in memory order.
__device__ __forceinline__ uint32_t quantize4(float a, float b, float c, float d, float inverse) {
  const uint32_t lo = e4m3x2(__fmul_rn(a, inverse), __fmul_rn(b, inverse));
  const uint32_t hi = e4m3x2(__fmul_rn(c, inverse), __fmul_rn(d, inverse));
  return lo | hi << 16;
}

}  // namespace flashmoe
