// Shared pieces of the CUDA engine: CUDA_CHECK (API errors abort with file and line, as STYLE.md
// "Errors" decides), RAII device and pinned buffers, a bump arena for weights, and the small device
// helpers (warp/block reductions, bf16/f16 loads) that every kernel file uses. Host code compiled by
// the C++ compiler may include this file; the device helpers are compiled only under nvcc.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#ifdef __CUDACC__
#define CK_HD __host__ __device__
#else
#define CK_HD
#endif

#define CUDA_CHECK(expr)                                                                          \
  do {                                                                                            \
    cudaError_t ck_err_ = (expr);                                                                 \
    if (ck_err_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d: CUDA error %s (%s) in %s\n", __FILE__, __LINE__,               \
                   cudaGetErrorName(ck_err_), cudaGetErrorString(ck_err_), #expr);                \
      std::abort();                                                                               \
    }                                                                                             \
  } while (0)

// CHECK for the .cu files (nvcc cannot compile util/status.h's fmt-based CHECK_MSG): printf-style.
#define CK_REQUIRE(cond, ...)                                                                     \
  do {                                                                                            \
    if (!(cond)) {                                                                                \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);               \
      std::fprintf(stderr, __VA_ARGS__);                                                          \
      std::fprintf(stderr, "\n");                                                                 \
      std::abort();                                                                               \
    }                                                                                             \
  } while (0)

// After a kernel launch: catches bad launch configurations at once (asynchronous faults surface
// at the next synchronising call, which CUDA_CHECK also catches).
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

namespace ck::cuda {

constexpr int kMaxRows = 8;  // rows of one row-path step (decode rows, MTP verification): GEMV, CUDA graph
// A session's default rows of one prefill chunk (the tensor-core path, cuda/gemm.cu): longer prompts
// run in chunks of this many rows, and every per-row buffer of a session holds its chunk's rows
// (Session's chunk_rows: ~0.8 MB of GPU memory per row at the released geometry, so ~1.6 GB at 2,048
// rows). 2,048 rather than 1,024: each expert's weights are read once per chunk and its tiles are
// fuller, prefill +7-8% at 2k and 8k tokens (docs/performance.md, eighteenth session).
constexpr int kChunkRows = 2048;
// The most rows a session's chunk may have (--prefill-chunk): larger chunks trade GPU memory for
// fewer reads of each expert (docs/performance.md, thirty-fourth session).
constexpr int kMaxChunkRows = 8192;
// Rows of one LM-head slice in a prefill chunk (bounds the logits buffer: kLmRows x vocab floats).
constexpr int kLmRows = 64;

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Number of CUDA devices; 0 when there is no driver or no device (never aborts).
int device_count();
// Whether launch() (below) uses programmatic dependent launch: on unless CK_PDL=0.
bool pdl_enabled();
// True when environment variable `name` is set to exactly `value` (the engine's CK_* switches that
// select another schedule to compare, read once by their callers).
bool env_is(const char* name, const char* value);
// Whether decode kernels read what no kernel of the step writes (the DeltaNet state and constants, the
// conv taps and state, the expert table) before their wait on the kernel before them, as the GEMVs
// and the mix do with their weights: on unless CK_PARAM_PREFETCH=0 (read once).
bool param_prefetch_on();
// An attribute of the current device (cudaDeviceGetAttribute; errors abort).
int device_attribute(cudaDeviceAttr attr);
// Streaming multiprocessors of the current device (asked once; call before any graph capture).
int sm_count();
// One line naming the device: name, SMs, memory, L2 (for the startup banner).
std::string device_banner();
// Why the CUDA engine cannot run on a device ("" when it can). Its kernels are built for sm_90 only
// (Hopper: wgmma, the copy engine's bulk copies, up to 227 KB of shared memory a block), so another
// compute capability, or a device that cannot load the build's kernel images, gets one clear error
// (cuda::Model::create) instead of an abort at the first kernel attribute. Pure, for tests.
std::string device_unsupported_reason(const std::string& name, int major, int minor, bool kernels_load);
// The reason for the current device (device_unsupported_reason with its properties).
std::string current_device_unsupported_reason();
// Whether this build's kernel images load on the current device (ops.cu; clears the error if not).
bool kernel_images_load();

// An owning device allocation.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) { resize(n); }
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; o.n_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) { reset(); p_ = o.p_; n_ = o.n_; o.p_ = nullptr; o.n_ = 0; }
    return *this;
  }
  void resize(size_t n) {
    reset();
    if (n) CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p_), n * sizeof(T)));
    n_ = n;
  }
  void reset() {
    if (p_) CUDA_CHECK(cudaFree(p_));
    p_ = nullptr;
    n_ = 0;
  }
  void zero(cudaStream_t s = nullptr) {
    if (n_) CUDA_CHECK(cudaMemsetAsync(p_, 0, n_ * sizeof(T), s));
  }
  T* get() const { return p_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

// An owning page-locked host allocation (H2D/D2H copies inside a captured graph read it at replay).
template <typename T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t n) { resize(n); }
  ~PinnedBuffer() { reset(); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  PinnedBuffer(PinnedBuffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; o.n_ = 0; }
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    if (this != &o) { reset(); p_ = o.p_; n_ = o.n_; o.p_ = nullptr; o.n_ = 0; }
    return *this;
  }
  void resize(size_t n) {
    reset();
    if (n) CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&p_), n * sizeof(T)));
    n_ = n;
  }
  void reset() {
    if (p_) CUDA_CHECK(cudaFreeHost(p_));
    p_ = nullptr;
    n_ = 0;
  }
  T* get() const { return p_; }
  T& operator[](size_t i) const { return p_[i]; }
  size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

// Scratch memory for the kernels of one step of up to kMaxRows rows (split-K partials, activation
// fragments, the decode attention's splits). Taken with cudaMallocAsync inside a captured graph it
// becomes memory nodes, and a kernel after such a node depends on it fully: it loses its programmatic
// (early) launch, and with it the prologue that overlaps the kernel before (asking L2 for its weights,
// filling its ring). While a ScratchScope is active on this thread, scratch_alloc takes memory from the
// scope's StepScratch instead: a stack (freed in reverse order of allocation, as every caller does), so
// a step's graph keeps kernel-to-kernel edges. Outside a scope (prefill chunks, tests), or when the
// stack is full or CK_STEP_SCRATCH=0, it is cudaMallocAsync / cudaFreeAsync. Reuse within a step is
// safe because kernels touch scratch only after their pdl_begin(), when every kernel before them in
// the stream has finished (as the stream-ordered allocator's own reuse already assumed). Measured
// (H200 2026-12-02 02:04Z, against CK_STEP_SCRATCH=0 in the same call): decode at 4 rows 1,310.0 /
// 1,324.9 tok/s against 1,244.9 / 1,247.9 (+5.7%: its GEMVs' split-K partials had an allocation and a
// free around every call), one row level (628.8 / 633.7 against 631.4 / 631.3: four attention layers'
// splits were its only allocations).
struct StepScratch {
  uint8_t* base = nullptr;
  size_t size = 0, top = 0;
};
constexpr size_t kStepScratchBytes = size_t{16} << 20;  // a session's (Session::buffer_bytes counts it)
class ScratchScope {
 public:
  explicit ScratchScope(StepScratch* s);
  ~ScratchScope();
  ScratchScope(const ScratchScope&) = delete;
  ScratchScope& operator=(const ScratchScope&) = delete;

 private:
  StepScratch* prev_;
};
void* scratch_alloc(size_t bytes, cudaStream_t s);
void scratch_free(void* p, cudaStream_t s);

// Bump allocator over large device chunks: thousands of small weight tensors without thousands of
// cudaMalloc calls. Every allocation is 256-byte aligned. Frees everything at destruction.
class DeviceArena {
 public:
  explicit DeviceArena(size_t chunk_bytes = size_t{256} << 20) : chunk_(chunk_bytes) {}
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  void* alloc(size_t bytes);
  // What an allocation of `bytes` takes from the arena (bytes_used counts this): whole 256-byte lines.
  static size_t footprint(size_t bytes) { return ((bytes == 0 ? 1 : bytes) + 255) / 256 * 256; }
  // Copies host bytes into a fresh allocation (synchronously) and returns the device pointer.
  void* upload(const void* host, size_t bytes);
  // The same, but nullptr when the GPU has no room for it (any other CUDA error still aborts): for the
  // model's weights, whose loader turns it into an error naming the tensor.
  void* try_upload(const void* host, size_t bytes);
  size_t bytes_used() const { return used_; }

 private:
  void* alloc_or_null(size_t bytes);  // nullptr when cudaMalloc finds no room
  size_t chunk_;
  std::vector<void*> chunks_;
  uint8_t* cur_ = nullptr;
  size_t left_ = 0;
  size_t used_ = 0;
};

}  // namespace ck::cuda

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace ck::cuda {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the whole block (any blockDim that is a multiple of 32, at most 1024). `scratch` holds 32
// floats of shared memory. Every thread gets the result. Contains __syncthreads: call from all
// threads. Deterministic: warps are added in a fixed order.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = 0.0f;
  for (int w = 0; w < n_warps; ++w) t += scratch[w];
  return t;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = -INFINITY;
  for (int w = 0; w < n_warps; ++w) t = fmaxf(t, scratch[w]);
  return t;
}

// Programmatic dependent launch (Hopper; docs/roofline-cuda.md "Fifth session"). Every kernel that
// launch() starts calls pdl_begin() first: it waits until the kernel before it in the stream has
// finished and its writes are visible (griddepcontrol.wait), then lets the next kernel's blocks be
// scheduled (launch_dependents), so they are resident, waiting at their own pdl_begin, when this one
// ends: the launch latency and the block ramp-up of ~400 kernels per decode step overlap the kernel
// before. Both instructions are no-ops when the kernel was launched without the attribute.
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float bf16_bits_to_float(uint16_t h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }
__device__ __forceinline__ float f16_bits_to_float(uint16_t h) { return __half2float(__ushort_as_half(h)); }

// The same formulas as src/cpu/ops.h, so both engines round alike.
__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x * sigmoidf_(x); }
__device__ __forceinline__ float softplusf_(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// sigmoidf_ of four values with the same bits, for kernels whose time is their sigmoids (the prefill
// mix's gate mean: 84 M a call at 8k tokens). Why: the compiler wraps each 1 / y in a branch on y's
// exponent (its slow path for results near the subnormal range), and that region keeps it from
// interleaving independent sigmoids: each is a ~24-instruction dependent chain issued alone (Nsight
// Compute, docs/roofline-cuda.md, forty-ninth session). Here the four take the division's fast path
// unconditionally (reciprocal approximation, then one Newton step: the instructions the compiler emits
// for 1 / y when y's exponent is in range) and the library's division only where some y leaves that
// range: 1 + exp(-x) >= 1, so that is y >= 2^126 (x below about -87.3), an infinity or a NaN.
// test_cuda_ops SigmoidFourGivesTheLibraryBits checks every one of the 2^32 inputs.
__device__ __forceinline__ float rcp_in_range(float y) {  // 1 / y, correctly rounded, for 2^-126 <= |y| < 2^126
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
  const float e = -fmaf(y, r, -1.0f);
  return fmaf(r, e, r);
}
__device__ __forceinline__ float4 sigmoid4_(float4 v) {
  const float y0 = 1.0f + expf(-v.x), y1 = 1.0f + expf(-v.y), y2 = 1.0f + expf(-v.z), y3 = 1.0f + expf(-v.w);
  float4 r = make_float4(rcp_in_range(y0), rcp_in_range(y1), rcp_in_range(y2), rcp_in_range(y3));
  constexpr float kTop = 0x1p126f;
  if (!(y0 < kTop && y1 < kTop && y2 < kTop && y3 < kTop)) r = make_float4(1.0f / y0, 1.0f / y1, 1.0f / y2, 1.0f / y3);
  return r;
}

// A measuring switch, never for results: with CK_HOLLOW=s1,s2,... the kernels whose (mangled) name
// contains one of the strings are launched as an empty kernel (pdl_begin only) with the same grid,
// block, shared memory and launch attributes. A step's time with a kernel hollowed, against without,
// is what that kernel's work costs inside the step (its launch and its place in the chain stay).
// Outputs are garbage. Returns the kernel to launch in place of `kernel` (itself when not hollowed).
const void* hollow_or(const void* kernel);

// cudaLaunchKernelEx(cfg, kernel, args...), or the empty kernel under CK_HOLLOW (hollow_or).
template <typename... Params, typename... Args>
void launch_cfg(const cudaLaunchConfig_t& cfg, void (*kernel)(Params...), Args&&... args) {
  const void* k = hollow_or(reinterpret_cast<const void*>(kernel));
  if (k != reinterpret_cast<const void*>(kernel)) {
    void* none[1] = {nullptr};
    CUDA_CHECK(cudaLaunchKernelExC(&cfg, k, none));
    return;
  }
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// launch() (below) with the blocks grouped into thread-block clusters of `cluster` (a launch without
// the attribute when it is 1 x 1 x 1).
template <typename... Params, typename... Args>
void launch_cluster(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, dim3 cluster,
                    Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (pdl_enabled() && stream != nullptr) {  // as launch(): the kernel starts with pdl_begin()
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster.x;
    attr[n].val.clusterDim.y = cluster.y;
    attr[n++].val.clusterDim.z = cluster.z;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  launch_cfg(cfg, kernel, std::forward<Args>(args)...);
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization (the kernel
// must call pdl_begin() before it touches memory), unless CK_PDL=0 or the stream is the legacy default
// stream (the op tests' direct launches). Launch errors abort (CUDA_CHECK).
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  launch_cluster(kernel, grid, block, smem, stream, dim3(1, 1, 1), std::forward<Args>(args)...);
}

}  // namespace ck::cuda
#endif
