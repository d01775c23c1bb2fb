// Weight upload (cuda/weights.h). Expert records are packed on the host into pinned staging buffers
// (two, alternating, so packing overlaps the copies) and copied into consecutive slots.
#include "cuda/weights.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "util/log.h"

namespace ck::cuda {

namespace {
WKind kind_of(DType t, bool* ok) {
  *ok = true;
  switch (t) {
    case DType::F32: return WKind::F32;
    case DType::BF16: return WKind::BF16;
    case DType::F16: return WKind::F16;
    default: *ok = false; return WKind::F32;
  }
}

// Bytes of the codes / floats, and of the scales (again for the biases), as stored on the host.
size_t host_data_bytes(const Matrix& m) {
  return m.quantized() ? static_cast<size_t>(m.rows) * m.row_code_bytes()
                       : static_cast<size_t>(m.rows * m.cols) * dtype_size(m.dtype);
}
size_t host_scale_bytes(const Matrix& m) {
  return m.quantized() ? static_cast<size_t>(m.rows * (m.cols / m.group_size)) * dtype_size(m.scale_dtype) : 0;
}
}  // namespace

bool nibble_split(const Matrix& w, NibbleSplit* out) {
  const int64_t gpg = w.group_size / 64;
  if (!w.quantized() || w.bits != 8 || w.group_size % 64 != 0 || (gpg & (gpg - 1)) != 0 || w.cols % w.group_size != 0 ||
      (w.scale_dtype != DType::BF16 && w.scale_dtype != DType::F16) || w.rows < 1)
    return false;
  const int64_t n = w.rows * w.cols, n_sc = w.rows * (w.cols / w.group_size);
  const size_t code_bytes = static_cast<size_t>(n) / 2, sc_bytes = static_cast<size_t>(n_sc) * 2;
  std::vector<uint8_t> st(2 * code_bytes + 2 * sc_bytes, 0);  // hi codes, lo codes, hi scales, hi biases (0)
  uint8_t* hi = st.data();
  uint8_t* lo = hi + code_bytes;
  uint8_t* hs = lo + code_bytes;
  for (int64_t i = 0; i < n_sc; ++i) {
    const float v = 16.0f * load_float(w.scale_dtype, w.scales, i);
    if (!std::isfinite(v)) return false;  // (f16 scales beyond 4,095)
    store_float(w.scale_dtype, hs, i, v);  // exact: a power of two times a finite value
  }
  for (int64_t r = 0; r < w.rows; ++r) {
    const uint8_t* row = w.data + static_cast<size_t>(r) * w.row_code_bytes();
    for (int64_t c = 0; c < w.cols; c += 2) {  // codes 2j and 2j + 1 share one byte of each 4-bit stream
      const uint8_t q0 = row[c], q1 = row[c + 1];
      const size_t at = static_cast<size_t>(r * w.cols + c) / 2;
      hi[at] = static_cast<uint8_t>((q0 >> 4) | (q1 & 0xF0));
      lo[at] = static_cast<uint8_t>((q0 & 0x0F) | (q1 << 4));
    }
  }
  out->storage = std::move(st);
  uint8_t* base = out->storage.data();
  Matrix h = w, l = w;
  h.bits = l.bits = 4;
  h.data = base;
  l.data = base + code_bytes;
  h.scales = base + 2 * code_bytes;
  h.biases = h.scales + sc_bytes;
  h.name = w.name + " (high nibbles)";
  l.name = w.name + " (low nibbles)";
  out->hi = h;
  out->lo = l;
  return true;
}

Result<WFormat> device_format(const Matrix& m) {
  WFormat f;
  bool ok = true;
  if (m.rows <= 0 || m.cols <= 0 || m.rows > INT32_MAX / 2 || m.cols > INT32_MAX / 2)
    return error("{}: shape [{}, {}] is not supported by the CUDA engine", m.name, m.rows, m.cols);
  if (m.quantized()) {
    if (m.bits != 2 && m.bits != 3 && m.bits != 4 && m.bits != 8)
      return error("{}: {}-bit codes are not supported by the CUDA engine (2, 3, 4, 8)", m.name, m.bits);
    if (m.group_size != 32 && m.group_size != 64 && m.group_size != 128)
      return error("{}: group size {} is not supported by the CUDA engine", m.name, m.group_size);
    if (m.cols % 32 != 0 || m.cols % m.group_size != 0)
      return error("{}: {} columns are not a multiple of the group ({})", m.name, m.cols, m.group_size);
    f.kind = static_cast<uint8_t>(WKind::Q);
    f.bits = static_cast<uint8_t>(m.bits);
    f.group = static_cast<uint16_t>(m.group_size);
    f.scale_kind = static_cast<uint8_t>(kind_of(m.scale_dtype, &ok));
    if (!ok) return error("{}: scales of dtype {} are not supported", m.name, dtype_name(m.scale_dtype));
  } else {
    f.kind = static_cast<uint8_t>(kind_of(m.dtype, &ok));
    if (!ok) return error("{}: dtype {} is not supported by the CUDA engine", m.name, dtype_name(m.dtype));
  }
  return f;
}

bool tiles16_fit(const Matrix& m) {
  return m.quantized() && m.bits == 4 && m.group_size == 64 && m.scale_dtype == DType::BF16 && m.rows > 0 &&
         m.rows % kTileRows == 0 && m.cols >= 256 && m.cols % 64 == 0;
}

void pack_tiles16(const Matrix& m, uint8_t* out) {
  CK_REQUIRE(tiles16_fit(m), "pack_tiles16: %s does not fit 16-row tiles", m.name.c_str());
  const int64_t groups = m.cols / 64, tiles = m.rows / kTileRows;
  const size_t row_bytes = m.row_code_bytes();
  const auto* sc = reinterpret_cast<const uint16_t*>(m.scales);
  const auto* bi = reinterpret_cast<const uint16_t*>(m.biases);
  // Tiles in parallel: at ~4 GB/s a thread, a resident model's experts took seconds more to load.
#pragma omp parallel for schedule(static) if (tiles * groups > 4096)
  for (int64_t T = 0; T < tiles; ++T)
    for (int64_t G = 0; G < groups; ++G) {
      uint8_t* blk = out + (T * groups + G) * kTileGroupBytes;
      for (int g = 0; g < 8; ++g) {
        const int64_t ra = T * kTileRows + g, rb = ra + 8;
        for (int t = 0; t < 4; ++t) {  // lane 4 g + t: its 8 code bytes of row g, then of row g + 8
          std::memcpy(blk + 16 * (4 * g + t), m.data + ra * row_bytes + G * 32 + 8 * t, 8);
          std::memcpy(blk + 16 * (4 * g + t) + 8, m.data + rb * row_bytes + G * 32 + 8 * t, 8);
        }
        const uint16_t words[4] = {sc[ra * groups + G], bi[ra * groups + G], sc[rb * groups + G], bi[rb * groups + G]};
        std::memcpy(blk + 512 + 8 * g, words, sizeof(words));
      }
    }
}

bool tiles16_f16_exact(const Matrix& m) {
  if (!tiles16_fit(m)) return false;
  const auto* sc = reinterpret_cast<const uint16_t*>(m.scales);
  const int64_t n = m.rows * (m.cols / 64);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(sc[i]) << 16;  // bf16 -> fp32
    float v;
    std::memcpy(&v, &bits, sizeof(v));
    v = std::fabs(v);
    if (v != 0.0f && !(v >= 0x1p-17f && v <= 0x1p12f)) return false;  // (a NaN fails too)
  }
  return true;
}

Result<DMatrix> DenseUploader::matrix(const Matrix& m, WLayout layout) {
  if (m.empty()) return DMatrix{};
  if (layout == WLayout::Tiles16 && !tiles16_fit(m)) layout = WLayout::Rows;
  auto it = seen_.find({m.data, layout});
  if (it != seen_.end() && it->second.rows == m.rows && it->second.cols == m.cols) return it->second;
  ASSIGN_OR_RETURN(DMatrix d, transient_matrix(m, layout));
  seen_[{m.data, layout}] = d;
  return d;
}

Result<DMatrix> DenseUploader::padded_tiles(const Matrix& m) {
  if (m.empty() || !m.quantized()) return DMatrix{};
  Matrix pad = m;
  pad.rows = (m.rows + kTileRows - 1) / kTileRows * kTileRows;
  if (!tiles16_fit(pad)) return DMatrix{};
  const size_t code_bytes = host_data_bytes(m), sc_bytes = host_scale_bytes(m);
  std::vector<uint8_t> codes(host_data_bytes(pad), 0), scales(host_scale_bytes(pad), 0), biases(host_scale_bytes(pad), 0);
  std::memcpy(codes.data(), m.data, code_bytes);  // the padding rows: codes, scales and biases zero
  std::memcpy(scales.data(), m.scales, sc_bytes);
  std::memcpy(biases.data(), m.biases, sc_bytes);
  pad.data = codes.data();
  pad.scales = scales.data();
  pad.biases = biases.data();
  ASSIGN_OR_RETURN(DMatrix d, transient_matrix(pad, WLayout::Tiles16));
  d.rows = static_cast<int32_t>(m.rows);
  return d;
}

Result<DMatrix> DenseUploader::transient_matrix(const Matrix& m, WLayout layout) {
  if (m.empty()) return DMatrix{};
  if (layout == WLayout::Tiles16 && !tiles16_fit(m)) layout = WLayout::Rows;
  ASSIGN_OR_RETURN(WFormat f, device_format(m));
  DMatrix d;
  d.rows = static_cast<int32_t>(m.rows);
  d.cols = static_cast<int32_t>(m.cols);
  d.fmt = f;
  if (layout == WLayout::Tiles16) {
    d.fmt.layout = static_cast<uint8_t>(WLayout::Tiles16);
    d.fmt.f16_exact = tiles16_f16_exact(m) ? 1 : 0;
    std::vector<uint8_t> packed(d.stored_bytes());
    pack_tiles16(m, packed.data());
    ASSIGN_OR_RETURN(d.data, put(packed.data(), packed.size(), m.name));
    ++tiled_;
  } else {
    ASSIGN_OR_RETURN(d.data, put(m.data, host_data_bytes(m), m.name));
    if (m.quantized()) {
      ASSIGN_OR_RETURN(d.scales, put(m.scales, host_scale_bytes(m), m.name + " (scales)"));
      ASSIGN_OR_RETURN(d.biases, put(m.biases, host_scale_bytes(m), m.name + " (biases)"));
    }
  }
  CHECK(d.data_bytes() == host_data_bytes(m) && d.scale_bytes() == host_scale_bytes(m));
  bytes_ += d.stored_bytes();
  return d;
}

Result<const uint8_t*> DenseUploader::put(const void* host, size_t bytes, const std::string& name) {
  if (void* d = arena_->try_upload(host, bytes)) return static_cast<const uint8_t*>(d);
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return error("CUDA engine: no GPU memory left for {} ({:.1f} MB) after {:.2f} GB of dense weights ({:.2f} of the "
               "GPU's {:.2f} GB free): this model's dense weights do not fit; use --backend cpu",
               name.empty() ? "a weight" : name, bytes / 1e6, bytes_ / 1e9, free_b / 1e9, total_b / 1e9);
}

const float* DenseUploader::vector(const std::vector<float>& v) {
  if (!vector_status_.ok()) return nullptr;
  auto d = put(v.data(), v.size() * sizeof(float), "a norm or gate vector");
  if (!d.ok()) {
    vector_status_ = d.status();
    return nullptr;
  }
  bytes_ += v.size() * sizeof(float);
  return reinterpret_cast<const float*>(*d);
}

Status check_device_room(int n_layers, int n_expert, uint64_t stride, uint64_t session_bytes) {
  const size_t need = static_cast<size_t>(n_layers) * n_expert * stride;
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const char* cap = std::getenv("CK_DEVICE_MEMORY_GB");  // count at most this much as free (GB of 1e9 bytes)
  if (cap) {
    char* end = nullptr;
    const double gb = std::strtod(cap, &end);
    if (end == cap || *end != '\0' || !(gb >= 0))
      return error("CK_DEVICE_MEMORY_GB={}: expected a number of GB, 0 or more", cap);
    if (gb < 1e9) free_b = std::min(free_b, static_cast<size_t>(gb * 1e9));  // (inf: no cap)
  }
  // A session's buffers, and 256 MiB for the kernels' scratch and the CUDA context's own allocations.
  const size_t headroom = session_bytes + (size_t{256} << 20);
  if (need + headroom <= free_b) return {};
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  return error(
      "CUDA engine: the routed experts need {:.2f} GiB of GPU memory ({} layers x {} experts x {:.2f} MiB) and "
      "{:.2f} GiB of the GPU's {:.2f} GiB are free{} ({:.2f} GiB is kept for a session and scratch). This version "
      "keeps every expert on the GPU; use --backend cpu, or a smaller model",
      need / kGiB, n_layers, n_expert, stride / (1024.0 * 1024.0), free_b / kGiB, total_b / kGiB,
      cap ? " as capped by CK_DEVICE_MEMORY_GB" : "", headroom / kGiB);
}

Status upload_experts(ExpertSource& src, int n_layers, int n_expert, int inter, int hidden, uint64_t session_bytes,
                      ExpertPool* pool, bool tiles) {
  pool->n_layers = n_layers;
  pool->n_expert = n_expert;
  std::vector<uint8_t> scratch;
  ExpertMatrices ex;
  TRY(src.get(0, 0, &ex, &scratch));
  ASSIGN_OR_RETURN(pool->fmt, device_format(ex.gate));
  const bool tiled = tiles && tiles16_fit(ex.gate) && tiles16_fit(ex.down);
  if (tiled) pool->fmt.layout = static_cast<uint8_t>(WLayout::Tiles16);
  const ExpertLayout lay = expert_layout(pool->fmt, inter, hidden);
  pool->stride = lay.bytes;
  const size_t n_slots = static_cast<size_t>(n_layers) * n_expert;
  // Every expert is resident until the streaming expert pool lands: say so plainly when they cannot
  // fit (the released model's experts are ~100 GB), instead of failing inside cudaMalloc.
  TRY(check_device_room(n_layers, n_expert, pool->stride, session_bytes));
  pool->slots.resize(n_slots * pool->stride);
  pool->table_h.resize(n_slots);

  // Staging: two pinned buffers of whole records, alternating; an event per buffer says when its
  // copy has finished so it can be refilled.
  const size_t per_buf = std::max<size_t>(1, (size_t{64} << 20) / pool->stride);
  PinnedBuffer<uint8_t> stage[2] = {PinnedBuffer<uint8_t>(per_buf * pool->stride),
                                    PinnedBuffer<uint8_t>(per_buf * pool->stride)};
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t done[2];
  for (auto& e : done) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  bool pending[2] = {false, false};

  auto pack = [&](const Matrix& m, uint8_t* rec, uint64_t off_data, uint64_t off_s, uint64_t off_b, int rows,
                  int cols, const std::string& what) -> Status {
    ASSIGN_OR_RETURN(WFormat f, device_format(m));
    f.layout = pool->fmt.layout;
    if (!(f == pool->fmt) || m.rows != rows || m.cols != cols)
      return error("{}: expert {} has format/shape [{}, {}] unlike expert (0, 0)'s; the CUDA pool needs one format",
                   m.name, what, m.rows, m.cols);
    if (tiled) {
      pack_tiles16(m, rec + off_data);
      return {};
    }
    std::memcpy(rec + off_data, m.data, host_data_bytes(m));
    if (m.quantized()) {
      std::memcpy(rec + off_s, m.scales, host_scale_bytes(m));
      std::memcpy(rec + off_b, m.biases, host_scale_bytes(m));
    }
    return {};
  };

  // The fill loop; on an error the copies in flight finish before the staging buffers go away.
  auto fill = [&]() -> Status {
  size_t slot = 0;
  int buf = 0;
  while (slot < n_slots) {
    if (pending[buf]) CUDA_CHECK(cudaEventSynchronize(done[buf]));
    const size_t n = std::min(per_buf, n_slots - slot);
    uint8_t* base = stage[buf].get();
    std::memset(base, 0, n * pool->stride);
    for (size_t i = 0; i < n; ++i) {
      const int layer = static_cast<int>((slot + i) / n_expert), e = static_cast<int>((slot + i) % n_expert);
      TRY(src.get(layer, e, &ex, &scratch));
      uint8_t* rec = base + i * pool->stride;
      const std::string what = std::to_string(layer) + "/" + std::to_string(e);
      TRY(pack(ex.gate, rec, lay.gate, lay.gate_s, lay.gate_b, inter, hidden, what));
      TRY(pack(ex.up, rec, lay.up, lay.up_s, lay.up_b, inter, hidden, what));
      TRY(pack(ex.down, rec, lay.down, lay.down_s, lay.down_b, hidden, inter, what));
      pool->table_h[slot + i].addr = pool->slots.get() + (slot + i) * pool->stride;
      pool->table_h[slot + i].fmt = pool->fmt;
    }
    CUDA_CHECK(cudaMemcpyAsync(pool->slots.get() + slot * pool->stride, base, n * pool->stride,
                               cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaEventRecord(done[buf], s));
    pending[buf] = true;
    slot += n;
    buf ^= 1;
  }
  return {};
  };
  Status st = fill();
  CUDA_CHECK(cudaStreamSynchronize(s));
  for (auto& e : done) CUDA_CHECK(cudaEventDestroy(e));
  CUDA_CHECK(cudaStreamDestroy(s));
  TRY(st);
  DMatrix g, d;
  g.rows = inter; g.cols = hidden; g.fmt = pool->fmt;
  d.rows = hidden; d.cols = inter; d.fmt = pool->fmt;
  pool->record_bytes = 2 * g.stored_bytes() + d.stored_bytes();
  pool->table.resize(n_slots);
  CUDA_CHECK(cudaMemcpy(pool->table.get(), pool->table_h.data(), n_slots * sizeof(ExpertSlot), cudaMemcpyHostToDevice));
  LOG_INF("cuda", "experts: {} records of {:.2f} MB (slot stride {} B), {:.2f} GB resident", n_slots,
          pool->record_bytes / 1e6, pool->stride, n_slots * pool->stride / 1e9);
  return {};
}

}  // namespace ck::cuda
