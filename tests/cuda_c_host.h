// The host build of kernels/reduce.cu (tests/test_kernels_cuda.py, "cuda_c-on-host"): each
// kernel runs on the CPU as a plain function, once per (block, thread) of a small grid, one
// after the other. That is faithful here because the kernels' threads are independent (no
// shared memory, no barriers, each element read and written by one thread), so the CUDA C
// source itself (splits, vector and scalar paths, per-dtype arithmetic) is checked against
// numpy without a GPU. What it cannot check: the inline PTX (common.cuh uses plain C++ in
// host builds), the hardware's float16/bfloat16 conversions, and timing.
#pragma once

#include <cstdint>

#define __host__
#define __device__
#define __global__

struct PycollHostDim3 {
  unsigned x = 1, y = 1, z = 1;
};
inline PycollHostDim3 gridDim, blockDim, blockIdx, threadIdx;

// 16-byte accesses at addresses the GPU would fault on (x86 does not).
inline long long pycoll_host_misaligned = 0;
#define PYCOLL_CHECK_ALIGNED16(p) \
  (pycoll_host_misaligned += (reinterpret_cast<std::uintptr_t>(p) & 15) != 0)

#include "reduce.cu"

extern "C" long long pycoll_host_misaligned_count() { return pycoll_host_misaligned; }

template <typename Kernel, typename... Args>
void pycoll_host_launch(unsigned grid, unsigned block, Kernel kernel, Args... args) {
  gridDim.x = grid;
  blockDim.x = block;
  for (unsigned b = 0; b < grid; ++b) {
    for (unsigned t = 0; t < block; ++t) {
      blockIdx.x = b;
      threadIdx.x = t;
      kernel(args...);
    }
  }
}

// One adapter per kernel, all with one C signature: p holds the kernel's pointers in its
// parameter order (reduce_n: dst, then its 16 source slots), k reduce_n's source count,
// n the element count, r divide's rank count.
#define PYCOLL_HOST_ARGS unsigned g, unsigned b, void* const* p, int k, long long n, long long r

template <typename T, typename Op>
void host_reduce_inplace(PYCOLL_HOST_ARGS) {
  pycoll_host_launch(g, b, pycoll::reduce_inplace<T, Op>, (T*)p[0], (const T*)p[1], n);
}

template <typename T, typename Op>
void host_reduce_pair(PYCOLL_HOST_ARGS) {
  pycoll_host_launch(g, b, pycoll::reduce_pair<T, Op>, (T*)p[0], (const T*)p[1],
                     (const T*)p[2], n);
}

template <typename T, typename Op>
void host_reduce_n(PYCOLL_HOST_ARGS) {
  pycoll::Sources<T> sources;
  for (int j = 0; j < pycoll::kMaxSources; ++j) sources.ptr[j] = (const T*)p[1 + j];
  pycoll_host_launch(g, b, pycoll::reduce_n<T, Op>, (T*)p[0], sources, k, n);
}

template <typename T, typename Op>
void host_reduce_copy(PYCOLL_HOST_ARGS) {
  pycoll_host_launch(g, b, pycoll::reduce_copy<T, Op>, (T*)p[0], (T*)p[1], (const T*)p[2],
                     (const T*)p[3], n);
}

template <typename T>
void host_copy(PYCOLL_HOST_ARGS) {
  pycoll_host_launch(g, b, pycoll::copy<T>, (T*)p[0], (const T*)p[1], n);
}

template <typename T>
void host_copy_pair(PYCOLL_HOST_ARGS) {
  pycoll_host_launch(g, b, pycoll::copy_pair<T>, (T*)p[0], (T*)p[1], (const T*)p[2], n);
}

template <typename T>
void host_divide(PYCOLL_HOST_ARGS) {
  pycoll_host_launch(g, b, pycoll::divide<T>, (T*)p[0], n, r);
}
