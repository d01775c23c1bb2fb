// Device-side weight views: DMatrix (the device twin of format/matrix.h's Matrix: float f32/bf16/f16
// or MLX affine quantized codes + per-group scales and biases, bytes as stored or, for the 4-bit
// matrices the tensor-core kernels read, repacked into 16-row tiles: WLayout), and the routed expert
// record layout that the expert table points into. Plain structs, usable on host and device.
// Uploading a host Matrix lives in cuda/weights.h; the kernels that read these live in cuda/gemv*.cu.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cuda/common.h"

namespace ck::cuda {

enum class WKind : uint8_t { F32 = 0, BF16 = 1, F16 = 2, Q = 3 };

// Where a quantized matrix's bytes are (WFormat::layout).
//  - Rows: as MLX stores them: codes row by row, scales and biases in two [rows, cols/group] arrays.
//  - Tiles16 (4-bit codes, groups of 64, bf16 scales, rows a multiple of 16): data holds, for each
//    16-row tile and each 64-code group in that order, the 576 bytes the tensor-core kernels' lanes read
//    (mma.m16n8k16's A fragment order). Bytes [16 l, 16 l + 16) belong to lane l = 4 g + t (g < 8,
//    t < 4): code bytes [8 t, 8 t + 8) of the group in tile row g, then the same of row g + 8. Bytes
//    [512 + 8 g, + 8): bf16 scale and bias of row g, then of row g + 8. scales and biases are null.
//    A warp then reads one (tile, group) as one 16-byte and one 8-byte load per lane over 5 cache lines,
//    where the row layout takes 6 loads over ~48 lines: docs/design-notes.md ("CUDA weight tiles").
enum class WLayout : uint8_t { Rows = 0, Tiles16 = 1 };
constexpr int kTileRows = 16, kTileGroupBytes = 576;
// Words (uint2) of one activation row's compact B fragments per 64-code group (cuda/mma_q4.cuh
// tc4_one_frag_elem; cuda/ops.h Tc4Frags): 4 MMA steps x 12 lanes.
constexpr int kOneFragWords = 48;

// How a matrix is stored. For Q: `bits` per code (2, 3, 4, 8), `group` columns per scale/bias
// (32, 64, 128), `scale_kind` the float kind of scales and biases, `layout` a WLayout.
struct WFormat {
  uint8_t kind = 0;        // WKind
  uint8_t bits = 0;
  uint8_t scale_kind = 1;  // WKind::F32, BF16 or F16
  uint8_t layout = 0;      // WLayout
  uint16_t group = 0;
  // Tiles16 only: every scale s is 0 or 2^-17 <= |s| <= 2^12, so s (q - 8) is exact in fp16 for every
  // code q and the prefill products may take their fp16 form (cuda/weights.h tiles16_f16_exact).
  uint8_t f16_exact = 0;
  uint8_t reserved2 = 0;
};

CK_HD inline bool operator==(const WFormat& a, const WFormat& b) {
  return a.kind == b.kind && a.bits == b.bits && a.scale_kind == b.scale_kind && a.group == b.group &&
         a.layout == b.layout;
}
CK_HD inline int wkind_bytes(uint8_t kind) { return kind == static_cast<uint8_t>(WKind::F32) ? 4 : 2; }

// A [rows, cols] weight matrix in device memory. Quantized in the row layout: row r's codes are the
// little-endian bit stream data[r * cols*bits/8 ...], scales/biases are [rows, cols/group]; in tiles
// (tiled()): see WLayout::Tiles16. Float: row-major elements.
struct DMatrix {
  const uint8_t* data = nullptr;
  const uint8_t* scales = nullptr;
  const uint8_t* biases = nullptr;
  int32_t rows = 0, cols = 0;
  WFormat fmt;

  CK_HD bool quantized() const { return fmt.kind == static_cast<uint8_t>(WKind::Q); }
  CK_HD bool tiled() const { return fmt.layout == static_cast<uint8_t>(WLayout::Tiles16); }
  // Tiles16: the 576 bytes of 16-row tile `tile` and 64-code group G.
  CK_HD const uint8_t* tile_group(size_t tile, size_t G) const {
    return data + (tile * static_cast<size_t>(cols / 64) + G) * kTileGroupBytes;
  }
  CK_HD size_t data_bytes() const {
    return quantized() ? static_cast<size_t>(rows) * cols * fmt.bits / 8
                       : static_cast<size_t>(rows) * cols * wkind_bytes(fmt.kind);
  }
  CK_HD size_t scale_bytes() const {  // of scales, and again of biases
    return quantized() ? static_cast<size_t>(rows) * (cols / fmt.group) * wkind_bytes(fmt.scale_kind) : 0;
  }
  // Either layout holds the same bytes (Tiles16: codes, scales and biases all in data).
  CK_HD size_t stored_bytes() const { return data_bytes() + 2 * scale_bytes(); }
};

// One routed expert as a contiguous record in the device expert array: gate, up and down codes (or
// floats), then their scales and biases; every section 256-byte aligned. gate/up are [I, H], down
// [H, I]; all three share one format (the record's precision). In 16-row tiles (WLayout::Tiles16)
// each matrix is one section holding its codes, scales and biases (the *_s and *_b offsets unused).
struct ExpertLayout {
  uint64_t gate = 0, up = 0, down = 0;
  uint64_t gate_s = 0, gate_b = 0, up_s = 0, up_b = 0, down_s = 0, down_b = 0;
  uint64_t bytes = 0;  // the record's size, 256-byte aligned
};

CK_HD inline uint64_t align256(uint64_t v) { return (v + 255) / 256 * 256; }

CK_HD inline ExpertLayout expert_layout(WFormat f, int inter, int hidden) {
  DMatrix gu, dn;
  gu.rows = inter; gu.cols = hidden; gu.fmt = f;
  dn.rows = hidden; dn.cols = inter; dn.fmt = f;
  ExpertLayout l;
  uint64_t o = 0;
  if (f.layout == static_cast<uint8_t>(WLayout::Tiles16)) {
    l.gate = o; o = align256(o + gu.stored_bytes());
    l.up = o;   o = align256(o + gu.stored_bytes());
    l.down = o; o = align256(o + dn.stored_bytes());
    l.bytes = o;
    return l;
  }
  l.gate = o; o = align256(o + gu.data_bytes());
  l.up = o;   o = align256(o + gu.data_bytes());
  l.down = o; o = align256(o + dn.data_bytes());
  if (gu.quantized()) {
    l.gate_s = o; o = align256(o + gu.scale_bytes());
    l.gate_b = o; o = align256(o + gu.scale_bytes());
    l.up_s = o;   o = align256(o + gu.scale_bytes());
    l.up_b = o;   o = align256(o + gu.scale_bytes());
    l.down_s = o; o = align256(o + dn.scale_bytes());
    l.down_b = o; o = align256(o + dn.scale_bytes());
  }
  l.bytes = o;
  return l;
}

// The views of the record at `base`.
CK_HD inline void expert_views(const uint8_t* base, WFormat f, int inter, int hidden, DMatrix* gate, DMatrix* up,
                               DMatrix* down) {
  const ExpertLayout l = expert_layout(f, inter, hidden);
  const bool q = f.kind == static_cast<uint8_t>(WKind::Q) && f.layout == static_cast<uint8_t>(WLayout::Rows);
  gate->data = base + l.gate; up->data = base + l.up; down->data = base + l.down;
  gate->scales = q ? base + l.gate_s : nullptr; gate->biases = q ? base + l.gate_b : nullptr;
  up->scales = q ? base + l.up_s : nullptr;     up->biases = q ? base + l.up_b : nullptr;
  down->scales = q ? base + l.down_s : nullptr; down->biases = q ? base + l.down_b : nullptr;
  gate->rows = up->rows = inter; gate->cols = up->cols = hidden;
  down->rows = hidden; down->cols = inter;
  gate->fmt = up->fmt = down->fmt = f;
}

// One entry of the expert table: where (layer, expert) lives now and at which precision. Kernels
// reach routed experts only through this table (shared/DESIGN.md §2 "Block table").
struct ExpertSlot {
  const uint8_t* addr = nullptr;
  WFormat fmt;
};

// One (activation row, expert) product of a step: the routed slots of each row in top-k order, then
// the row's shared expert. `weight` is the routing weight (unused for the shared expert).
struct ExpertPair {
  DMatrix gate, up, down;
  int32_t x_row = 0;
  float weight = 0.0f;
  int32_t group = 0;  // the expert's index, n_experts for the shared expert (grouping for prefill)
};

// The decode MoE's pair layout (the route's write_route_pair), for work a kernel may do before its
// programmatic-launch wait: k1 pairs a row, x_row the pair's row, the last of each row the shared
// expert, whose matrices are these (constant, so readable before the route has run). k1 = 0: unknown.
struct SharedSlot {
  int32_t k1 = 0;
  DMatrix gate, up;
};

}  // namespace ck::cuda
