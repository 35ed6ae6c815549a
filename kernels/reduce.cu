// pycoll's element-wise CUDA C kernels, templated on the element type T and the reduction
// functor Op (common.cuh). Instantiated from kernels/table.py: by CuPy's RawModule through
// name_expressions, by explicit instantiation in the nvcc test. Every kernel takes n
// (elements, long long), uses a grid-stride loop, and takes the 16-byte vector path when
// its pointers allow it (common.cuh, split16), with scalar head and tail otherwise.
//
// Memory traffic per element, in units of sizeof(T):
//   reduce_inplace  dst = dst op src                       2 reads + 1 write
//   reduce_pair     dst = a op b (fused seed copy)          2 reads + 1 write
//   reduce_n        dst = s0 op s1 op ... op s(k-1)         k reads + 1 write
//   reduce_copy     dst = peer = a op b (ring step)         2 reads + 2 writes
//   copy            dst = src                               1 read  + 1 write
//   copy_pair       dst = peer = src (ring step, gathering) 1 read  + 2 writes
//   divide          x = x / nranks (avg's finish)           1 read  + 1 write
// Outputs may alias inputs element for element (dst == a, say): each element is read
// before it is written, by the same thread. Partial overlap at an offset is not allowed.
#include "common.cuh"

namespace pycoll {

// kPeer: also write to peer (reduce_copy); a template flag, so reduce_pair pays nothing.
template <typename T, typename Op, bool kPeer>
struct PairBody {
  T* dst;
  T* peer;
  const T* a;
  const T* b;
  __device__ void scalar(long long i) const {
    const T r = Op::apply(a[i], b[i]);
    dst[i] = r;
    if (kPeer) peer[i] = r;
  }
  __device__ void vector(long long i) const {
    Vec<T> x = load16(a + i);
    const Vec<T> y = load16(b + i);
#pragma unroll
    for (int l = 0; l < Vec<T>::kLanes; ++l) x.lane[l] = Op::apply(x.lane[l], y.lane[l]);
    store16(dst + i, x);
    if (kPeer) store16(peer + i, x);
  }
};

// Up to kMaxSources source pointers, passed by value in the kernel's parameter space (one
// launch, no device-side pointer array to allocate and copy). The host packs a 128-byte
// numpy record of uint64 addresses; unused slots are ignored.
template <typename T>
struct Sources {
  const T* ptr[kMaxSources];
};

template <typename T, typename Op>
struct NaryBody {
  T* dst;
  Sources<T> srcs;
  int k;
  // The j loops unroll fully with a guard, so every srcs.ptr[j] index is a constant and the
  // pointers stay in registers (a runtime index would copy the struct to local memory).
  __device__ void scalar(long long i) const {
    T acc = srcs.ptr[0][i];
#pragma unroll
    for (int j = 1; j < kMaxSources; ++j) {
      if (j < k) acc = Op::apply(acc, srcs.ptr[j][i]);
    }
    dst[i] = acc;
  }
  __device__ void vector(long long i) const {
    Vec<T> acc = load16(srcs.ptr[0] + i);
#pragma unroll
    for (int j = 1; j < kMaxSources; ++j) {
      if (j < k) {
        const Vec<T> y = load16(srcs.ptr[j] + i);
#pragma unroll
        for (int l = 0; l < Vec<T>::kLanes; ++l) acc.lane[l] = Op::apply(acc.lane[l], y.lane[l]);
      }
    }
    store16(dst + i, acc);
  }
};

// kPeer: also write to peer (copy_pair); a template flag, so copy pays nothing.
template <typename T, bool kPeer>
struct CopyBody {
  T* dst;
  T* peer;
  const T* src;
  __device__ void scalar(long long i) const {
    const T v = src[i];
    dst[i] = v;
    if (kPeer) peer[i] = v;
  }
  __device__ void vector(long long i) const {
    const Vec<T> v = load16(src + i);
    store16(dst + i, v);
    if (kPeer) store16(peer + i, v);
  }
};

template <typename T>
struct DivideBody {
  T* x;
  long long nranks;
  __device__ void scalar(long long i) const { x[i] = Num<T>::div(x[i], nranks); }
  __device__ void vector(long long i) const {
    Vec<T> v = load16(x + i);
#pragma unroll
    for (int l = 0; l < Vec<T>::kLanes; ++l) v.lane[l] = Num<T>::div(v.lane[l], nranks);
    store16(x + i, v);
  }
};

// dst = dst op src.
template <typename T, typename Op>
__global__ void reduce_inplace(T* dst, const T* src, long long n) {
  const Split s = split16<T>(n, addr(dst), addr(dst) ^ addr(src));
  for_each<T>(n, s, PairBody<T, Op, false>{dst, nullptr, dst, src});  // a = dst
}

// dst = a op b: the first reduction of a chunk, which also seeds dst (no separate copy).
template <typename T, typename Op>
__global__ void reduce_pair(T* dst, const T* a, const T* b, long long n) {
  const Split s = split16<T>(n, addr(dst), (addr(dst) ^ addr(a)) | (addr(dst) ^ addr(b)));
  for_each<T>(n, s, PairBody<T, Op, false>{dst, nullptr, a, b});
}

// dst = s0 op s1 op ... op s(k-1), folded left to right (the host's order), 1 <= k <= 16:
// the direct schedules' reduce of every rank's piece in one pass.
template <typename T, typename Op>
__global__ void reduce_n(T* dst, Sources<T> srcs, int k, long long n) {
  unsigned long long mismatch = 0;
#pragma unroll
  for (int j = 0; j < kMaxSources; ++j) {
    if (j < k) mismatch |= addr(dst) ^ addr(srcs.ptr[j]);
  }
  const Split s = split16<T>(n, addr(dst), mismatch);
  for_each<T>(n, s, NaryBody<T, Op>{dst, srcs, k});
}

// dst = peer = a op b: the ring's receive-reduce-send, writing the reduced chunk locally and
// into the next rank's buffer (a peer pointer from CUDA IPC) in one pass over the inputs.
template <typename T, typename Op>
__global__ void reduce_copy(T* dst, T* peer, const T* a, const T* b, long long n) {
  const unsigned long long d = addr(dst);
  const Split s = split16<T>(n, d, (d ^ addr(peer)) | (d ^ addr(a)) | (d ^ addr(b)));
  for_each<T>(n, s, PairBody<T, Op, true>{dst, peer, a, b});
}

// dst = src.
template <typename T>
__global__ void copy(T* dst, const T* src, long long n) {
  const Split s = split16<T>(n, addr(dst), addr(dst) ^ addr(src));
  for_each<T>(n, s, CopyBody<T, false>{dst, nullptr, src});
}

// dst = peer = src: the ring's receive-copy-send (AllGather, Broadcast), writing the
// received chunk locally and into the next rank's buffer in one pass over it.
template <typename T>
__global__ void copy_pair(T* dst, T* peer, const T* src, long long n) {
  const unsigned long long d = addr(dst);
  const Split s = split16<T>(n, d, (d ^ addr(peer)) | (d ^ addr(src)));
  for_each<T>(n, s, CopyBody<T, true>{dst, peer, src});
}

// x = x / nranks, avg's finish: floats round the float64 quotient once, integers truncate.
template <typename T>
__global__ void divide(T* x, long long n, long long nranks) {
  const Split s = split16<T>(n, addr(x), 0);
  for_each<T>(n, s, DivideBody<T>{x, nranks});
}

}  // namespace pycoll
