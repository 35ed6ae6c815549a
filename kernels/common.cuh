// Shared helpers for pycoll's CUDA C kernels (reduce.cu): element arithmetic per dtype,
// the reduction functors, and the grid-stride loop with its 16-byte vector path.
//
// Built two ways: by NVRTC through cupy.RawModule (cuda_c.py inlines this header into the
// source, so CuPy's kernel cache sees every change), and by nvcc in the tests. No standard
// library headers: NVRTC has none without extra include paths.
//
// Semantics match the host reducer (kernels/host.py) bit for bit, except for NaN payloads
// (min/max of a NaN give the canonical NaN) and for which zero min/max pick between +0 and
// -0 (numpy itself differs by dtype there):
// * integers wrap (two's complement) on sum/prod, computed in a wide unsigned type, since
//   signed overflow, and unsigned short * unsigned short promoted to int, are undefined in C++;
// * float32 add/mul/min/max go through inline PTX without .ftz: CuPy always compiles with
//   -ftz=true, which would flush subnormals that numpy keeps;
// * float16 and bfloat16 compute in float32 and round once to nearest even, exactly what
//   numpy and ml_dtypes do (float32 has more than 2p+2 bits, so the double rounding is exact);
// * min/max propagate NaN as numpy.minimum/maximum do (CUDA's fminf would drop it);
// * avg divides once at the end: floats take the float64 quotient rounded once to the
//   dtype, integers truncate toward zero (C division), as host.finish does.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace pycoll {

// Most source pointers reduce_n takes per launch; cuda_c.py chains launches beyond it.
constexpr int kMaxSources = 16;

// ---------------------------------------------------------------- float32 without ftz

// On the GPU, inline PTX; in a host build (tests/test_kernels_cuda.py runs these kernels
// on the CPU) plain C++, which on x86-64 keeps subnormals and rounds to nearest even too.
__device__ __forceinline__ float f32_add(float a, float b) {
#ifdef __CUDA_ARCH__
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a + b;
#endif
}

__device__ __forceinline__ float f32_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a * b;
#endif
}

__device__ __forceinline__ float f32_min(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;  // .NaN: a NaN operand gives NaN (PTX ISA 7.0, sm_80+)
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || a < b) ? a : b;  // pre-sm_80 (compares under CuPy's -ftz) and host builds
#endif
}

__device__ __forceinline__ float f32_max(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || a > b) ? a : b;
#endif
}

// float32 <-> float64 keeping subnormals: a plain C cast compiles to cvt.ftz under -ftz.
__device__ __forceinline__ double f32_to_f64(float x) {
#ifdef __CUDA_ARCH__
  double r;
  asm("cvt.f64.f32 %0, %1;" : "=d"(r) : "f"(x));
  return r;
#else
  return (double)x;
#endif
}

__device__ __forceinline__ float f64_to_f32(double x) {
#ifdef __CUDA_ARCH__
  float r;  // rounded to nearest even
  asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(x));
  return r;
#else
  return (float)x;
#endif
}

// ---------------------------------------------------------------- per-dtype arithmetic

// Num<T>: add, mul, min, max and avg's divide for one element type.
template <typename T>
struct Num;

// Integers: Wide is an unsigned type at least as wide as int, so arithmetic wraps instead
// of overflowing (undefined) after integer promotion; the narrowing cast back is modular.
template <typename T, typename Wide, typename Div>
struct IntNum {
  static __device__ __forceinline__ T add(T a, T b) { return (T)((Wide)a + (Wide)b); }
  static __device__ __forceinline__ T mul(T a, T b) { return (T)((Wide)a * (Wide)b); }
  static __device__ __forceinline__ T min(T a, T b) { return b < a ? b : a; }
  static __device__ __forceinline__ T max(T a, T b) { return b > a ? b : a; }
  // Div is long long for signed T (C division truncates toward zero) and unsigned long long
  // for unsigned T; a divisor above T's range gives 0 (or -1 for min / -min), like host.
  static __device__ __forceinline__ T div(T a, long long n) {
    return (T)((Div)a / (Div)n);
  }
};

template <> struct Num<signed char> : IntNum<signed char, unsigned int, long long> {};
template <> struct Num<short> : IntNum<short, unsigned int, long long> {};
template <> struct Num<int> : IntNum<int, unsigned int, long long> {};
template <> struct Num<long long> : IntNum<long long, unsigned long long, long long> {};
template <> struct Num<unsigned char>
    : IntNum<unsigned char, unsigned int, unsigned long long> {};
template <> struct Num<unsigned short>
    : IntNum<unsigned short, unsigned int, unsigned long long> {};
template <> struct Num<unsigned int>
    : IntNum<unsigned int, unsigned int, unsigned long long> {};
template <> struct Num<unsigned long long>
    : IntNum<unsigned long long, unsigned long long, unsigned long long> {};

template <>
struct Num<float> {
  static __device__ __forceinline__ float add(float a, float b) { return f32_add(a, b); }
  static __device__ __forceinline__ float mul(float a, float b) { return f32_mul(a, b); }
  static __device__ __forceinline__ float min(float a, float b) { return f32_min(a, b); }
  static __device__ __forceinline__ float max(float a, float b) { return f32_max(a, b); }
  static __device__ __forceinline__ float div(float a, long long n) {
    return f64_to_f32(f32_to_f64(a) / (double)n);
  }
};

template <>
struct Num<double> {  // -ftz never applies to float64
  static __device__ __forceinline__ double add(double a, double b) { return a + b; }
  static __device__ __forceinline__ double mul(double a, double b) { return a * b; }
  static __device__ __forceinline__ double min(double a, double b) {
    return (a != a || a < b) ? a : b;
  }
  static __device__ __forceinline__ double max(double a, double b) {
    return (a != a || a > b) ? a : b;
  }
  static __device__ __forceinline__ double div(double a, long long n) { return a / (double)n; }
};

// float16 and bfloat16: widen to float32 (exact), compute with the ftz-free helpers above
// (bfloat16 subnormals are float32 subnormals), round once. min/max give one of the
// operands, which converts back exactly (a NaN comes back as the canonical NaN).
template <typename H>
struct HalfConv;

template <>
struct HalfConv<__half> {
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ __half from_double(double x) { return __double2half(x); }
};

template <>
struct HalfConv<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) {
    return __bfloat162float(x);
  }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) {
    return __float2bfloat16_rn(x);
  }
  static __device__ __forceinline__ __nv_bfloat16 from_double(double x) {
    return __double2bfloat16(x);
  }
};

template <typename H>
struct HalfNum {
  using C = HalfConv<H>;
  static __device__ __forceinline__ H add(H a, H b) {
    return C::from_float(f32_add(C::to_float(a), C::to_float(b)));
  }
  static __device__ __forceinline__ H mul(H a, H b) {
    return C::from_float(f32_mul(C::to_float(a), C::to_float(b)));
  }
  static __device__ __forceinline__ H min(H a, H b) {
    return C::from_float(f32_min(C::to_float(a), C::to_float(b)));
  }
  static __device__ __forceinline__ H max(H a, H b) {
    return C::from_float(f32_max(C::to_float(a), C::to_float(b)));
  }
  // The float64 quotient rounded once to H; via float32 it would round twice.
  static __device__ __forceinline__ H div(H a, long long n) {
    return C::from_double(f32_to_f64(C::to_float(a)) / (double)n);
  }
};

template <> struct Num<__half> : HalfNum<__half> {};
template <> struct Num<__nv_bfloat16> : HalfNum<__nv_bfloat16> {};

// ---------------------------------------------------------------- reduction functors

struct Sum {
  template <typename T>
  static __device__ __forceinline__ T apply(T a, T b) { return Num<T>::add(a, b); }
};
struct Prod {
  template <typename T>
  static __device__ __forceinline__ T apply(T a, T b) { return Num<T>::mul(a, b); }
};
struct Min {
  template <typename T>
  static __device__ __forceinline__ T apply(T a, T b) { return Num<T>::min(a, b); }
};
struct Max {
  template <typename T>
  static __device__ __forceinline__ T apply(T a, T b) { return Num<T>::max(a, b); }
};

// ---------------------------------------------------------------- 16-byte vectors

// One 16-byte load or store moves kLanes elements: the widest single access a thread can
// make (ld.global.v4.u32), so each memory transaction carries 4x-16x fewer instructions
// than element-wise access for narrow types. It requires the address to be 16-byte
// aligned: a misaligned uint4 access faults (cudaErrorMisalignedAddress, sticky for the
// process), which is why every kernel checks its pointers before taking this path.
template <typename T>
union Vec {
  static constexpr int kLanes = 16 / sizeof(T);
  uint4 raw;
  T lane[kLanes];
  __device__ Vec() {}
};

// A host build (the tests run these kernels on the CPU, where a misaligned access works)
// defines this to count the accesses that would fault on the GPU.
#ifndef PYCOLL_CHECK_ALIGNED16
#define PYCOLL_CHECK_ALIGNED16(p)
#endif

template <typename T>
__device__ __forceinline__ Vec<T> load16(const T* p) {
  PYCOLL_CHECK_ALIGNED16(p);
  Vec<T> v;
  v.raw = *reinterpret_cast<const uint4*>(p);
  return v;
}

template <typename T>
__device__ __forceinline__ void store16(T* p, const Vec<T>& v) {
  PYCOLL_CHECK_ALIGNED16(p);
  *reinterpret_cast<uint4*>(p) = v.raw;
}

__device__ __forceinline__ unsigned long long addr(const void* p) {
  return reinterpret_cast<unsigned long long>(p);
}

// How [0, n) splits: [0, head) scalar, then nvec 16-byte vectors, then a scalar tail.
// The vector path needs every pointer at the same offset modulo 16: `mismatch` is the OR of
// (p ^ first) over all pointers, so its low 4 bits are 0 exactly then. If the common
// offset is not 0, the first `head` elements are done one by one until the pointers reach
// a 16-byte boundary together (so slices at any element offset still vectorize, provided
// all buffers share it); otherwise everything is scalar.
struct Split {
  long long head;
  long long nvec;
};

template <typename T>
__device__ __forceinline__ Split split16(long long n, unsigned long long first,
                                         unsigned long long mismatch) {
  constexpr int kLanes = Vec<T>::kLanes;
  if ((mismatch & 15) != 0 || first % sizeof(T) != 0) return Split{n, 0};
  long long head = (long long)(((16 - (first & 15)) & 15) / sizeof(T));
  if (head > n) head = n;
  return Split{head, (n - head) / kLanes};
}

// Grid-stride loop over [0, n): body.scalar(i) for one element at i, body.vector(i) for the
// kLanes elements starting at i (16-byte aligned for every pointer). Any grid size is
// correct; the launcher picks enough blocks to fill the GPU once.
template <typename T, typename Body>
__device__ __forceinline__ void for_each(long long n, Split s, const Body& body) {
  constexpr int kLanes = Vec<T>::kLanes;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (long long i = tid; i < s.head; i += stride) body.scalar(i);
  for (long long v = tid; v < s.nvec; v += stride) body.vector(s.head + v * kLanes);
  for (long long i = s.head + s.nvec * kLanes + tid; i < n; i += stride) body.scalar(i);
}

}  // namespace pycoll
