// Host-side device plumbing: whether a GPU is there, the startup banner, and the weight arena.
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "cuda/common.h"
#include "util/log.h"

namespace ck::cuda {

bool env_is(const char* name, const char* value) {
  const char* e = std::getenv(name);
  return e && std::strcmp(e, value) == 0;
}

namespace {
thread_local StepScratch* g_step_scratch = nullptr;  // ScratchScope's
}  // namespace

ScratchScope::ScratchScope(StepScratch* s) : prev_(g_step_scratch) {
  static const bool on = !env_is("CK_STEP_SCRATCH", "0");
  if (on && s && s->base) g_step_scratch = s;
}
ScratchScope::~ScratchScope() { g_step_scratch = prev_; }

void* scratch_alloc(size_t bytes, cudaStream_t s) {
  StepScratch* sc = g_step_scratch;
  const size_t need = (bytes + 255) / 256 * 256;  // cudaMalloc's alignment: kernels read it in 16-byte loads
  if (sc && sc->top + need <= sc->size) {
    void* p = sc->base + sc->top;
    sc->top += need;
    return p;
  }
  if (sc) {
    static bool warned = false;
    if (!warned)
      LOG_WRN("cuda", "step scratch of {} MB is full ({} bytes asked, {} taken): stream-ordered allocation instead",
              sc->size >> 20, bytes, sc->top);
    warned = true;
  }
  void* p = nullptr;
  CUDA_CHECK(cudaMallocAsync(&p, bytes, s));
  return p;
}

void scratch_free(void* p, cudaStream_t s) {
  StepScratch* sc = g_step_scratch;
  const uint8_t* b = static_cast<const uint8_t*>(p);
  if (sc && b >= sc->base && b < sc->base + sc->size) {
    sc->top = std::min(sc->top, static_cast<size_t>(b - sc->base));  // pops p and whatever came after it
    return;
  }
  CUDA_CHECK(cudaFreeAsync(p, s));
}

bool pdl_enabled() {
  static const bool on = !env_is("CK_PDL", "0");
  return on;
}

bool param_prefetch_on() {
  static const bool on = !env_is("CK_PARAM_PREFETCH", "0");
  return on;
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: clear the sticky error, report none
    return 0;
  }
  return n;
}

int device_attribute(cudaDeviceAttr attr) {
  int dev = 0, v = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&v, attr, dev));
  return v;
}

int sm_count() {
  static const int n = device_attribute(cudaDevAttrMultiProcessorCount);
  return n;
}

std::string device_banner() {
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp p{};
  CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return fmt::format("{} (sm_{}{}), {} SMs, {:.1f} GiB ({:.1f} free), L2 {} MB", p.name, p.major, p.minor,
                     p.multiProcessorCount, total_b / 1073741824.0, free_b / 1073741824.0, p.l2CacheSize >> 20);
}

std::string device_unsupported_reason(const std::string& name, int major, int minor, bool kernels_load) {
  if (major == 9 && kernels_load) return "";
  return fmt::format("{} is sm_{}{}, and this build's CUDA kernels are for sm_90 (Hopper: H100, H200, GH200){}; use "
                     "--backend cpu",
                     name, major, minor, kernels_load ? "" : ", whose images this device cannot load");
}

std::string current_device_unsupported_reason() {
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp p{};
  CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  // (On Hopper the images are this build's own: only another device is probed, so the engine's start on
  // the supported GPUs makes no call it did not make before.)
  return p.major == 9 ? "" : device_unsupported_reason(p.name, p.major, p.minor, kernel_images_load());
}

DeviceArena::~DeviceArena() {
  for (void* c : chunks_) cudaFree(c);  // no CHECK in a destructor that may run at exit
}

void* DeviceArena::alloc_or_null(size_t bytes) {
  bytes = footprint(bytes);
  auto device_malloc = [](size_t n) -> void* {
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, n);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not sticky: clear it, so the next call does not report it
      return nullptr;
    }
    CUDA_CHECK(e);
    return p;
  };
  if (bytes > left_) {
    if (bytes > chunk_ / 4) {  // large tensors get their own allocation; the current chunk stays open
      void* p = device_malloc(bytes);
      if (!p) return nullptr;
      chunks_.push_back(p);
      used_ += bytes;
      return p;
    }
    void* p = device_malloc(chunk_);
    if (!p) return nullptr;
    chunks_.push_back(p);
    cur_ = static_cast<uint8_t*>(p);
    left_ = chunk_;
  }
  void* r = cur_;
  cur_ += bytes;
  left_ -= bytes;
  used_ += bytes;
  return r;
}

void* DeviceArena::alloc(size_t bytes) {
  void* p = alloc_or_null(bytes);
  if (!p) CUDA_CHECK(cudaErrorMemoryAllocation);  // aborts, naming the error
  return p;
}

void* DeviceArena::upload(const void* host, size_t bytes) {
  void* d = alloc(bytes);
  if (bytes) CUDA_CHECK(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice));
  return d;
}

void* DeviceArena::try_upload(const void* host, size_t bytes) {
  void* d = alloc_or_null(bytes);
  if (d && bytes) CUDA_CHECK(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice));
  return d;
}

}  // namespace ck::cuda
