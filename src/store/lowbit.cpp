// Low-bit conversion of quantized groups (lowbit.h). A Q4 group's targets are t = s·q + b with only
// 2^src_bits distinct q, so the fit runs on the histogram of q (16 bins), not on the 64 values: in
// units of the old scale it minimises Σ_q n_q (α·c_q + β − q)², i.e. new scale α·s, new bias b + β·s.
// Refit alternates "codes given (α, β)" and "least-squares (α, β) given codes" from two starts (the
// top-bits solution and the min/max span of the codes present), then rounds the scale and bias to the
// stored dtype and re-picks the codes for the rounded values; it keeps the best candidate seen, so
// its error never exceeds TopBits'.
#include "store/lowbit.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "util/half.h"
#include "util/status.h"

namespace ck::store {

const char* lowbit_method_name(LowBitMethod m) { return m == LowBitMethod::TopBits ? "topbits" : "refit"; }

bool parse_lowbit_method(const std::string& s, LowBitMethod* out) {
  if (s == "topbits") { *out = LowBitMethod::TopBits; return true; }
  if (s == "refit") { *out = LowBitMethod::Refit; return true; }
  return false;
}

namespace {

float round_to(DType t, float v) {
  if (t == DType::BF16) return bf16_to_f32(f32_to_bf16(v));
  if (t == DType::F16) return f16_to_f32(f32_to_f16(v));
  return v;
}


// The group's histogram and targets, in absolute units: level l (a source code) decodes to t[l].
struct Hist {
  int levels = 0;
  int n[256];
  double t[256];
};

// Error of codes `code` (per level) with scale and bias (the stored values).
double error_of(const Hist& h, const uint8_t* code, float scale, float bias) {
  double err = 0;
  for (int l = 0; l < h.levels; ++l) {
    double d = static_cast<double>(scale) * code[l] + bias - h.t[l];
    err += h.n[l] * d * d;  // empty levels weigh 0 (branch-free loops run ~2x faster than skipping them)
  }
  return err;
}

// Round half to even without a libm call (the baseline x86-64 target has no roundsd): exact for
// |x| < 2^51, far beyond any code here.
inline double round_even(double x) { return (x + 0x1.8p52) - 0x1.8p52; }

inline int clamp_code(double c, double dst_max) { return static_cast<int>(std::min(std::max(c, 0.0), dst_max)); }

// Best codes for a stored scale and bias (the nearest level, clamped) and their error, in one pass.
double assign(const Hist& h, float scale, float bias, int dst_max, uint8_t* code) {
  const double inv = scale != 0 ? 1.0 / scale : 0.0, sd = scale, bd = bias;
  double err = 0;
  for (int l = 0; l < h.levels; ++l) {
    int c = clamp_code(round_even((h.t[l] - bd) * inv), dst_max);
    code[l] = static_cast<uint8_t>(c);
    double d = sd * c + bd - h.t[l];
    err += h.n[l] * d * d;
  }
  return err;
}

// The per-level code table (code[l] for source level l), scale and bias for one group.
void fit_group(const Hist& h, int src_bits, float s, float b, int dst_bits, LowBitMethod m, DType scale_dtype,
               uint8_t* best_code, float* best_scale, float* best_bias) {
  const int levels = h.levels, dst_max = (1 << dst_bits) - 1, shift = src_bits - dst_bits;
  // TopBits: c = q >> shift; the bucket [c·2^shift, (c+1)·2^shift − 1] decodes at its middle.
  float bs = round_to(scale_dtype, s * static_cast<float>(1 << shift));
  float bb = round_to(scale_dtype, b + s * static_cast<float>((1 << shift) - 1) * 0.5f);
  for (int l = 0; l < levels; ++l) best_code[l] = static_cast<uint8_t>(l >> shift);
  double best = error_of(h, best_code, bs, bb);
  if (m == LowBitMethod::Refit) {
    int lo = 0, hi = levels - 1;
    while (lo < levels - 1 && !h.n[lo]) ++lo;
    while (hi > 0 && !h.n[hi]) --hi;
    double sw = 0, sq = 0;  // Σn and Σn·q: fixed for the group
    for (int l = 0; l < levels; ++l) { sw += h.n[l]; sq += static_cast<double>(h.n[l]) * l; }
    // Starts in units of q: (alpha, beta) = top bits, and the span of the codes present.
    const double starts[2][2] = {{static_cast<double>(1 << shift), ((1 << shift) - 1) * 0.5},
                                 {hi > lo ? static_cast<double>(hi - lo) / dst_max : 1.0, static_cast<double>(lo)}};
    uint8_t code[256], cand[256];
    for (const auto& st : starts) {
      double alpha = st[0], beta = st[1];
      for (int iter = 0; iter < 16; ++iter) {  // converges in 2-3 iterations on bell-shaped groups
        // Codes given (alpha, beta), in units of the source scale, and the sums of the weighted least
        // squares of q ~ alpha·c + beta, in one pass.
        const double inv_alpha = 1.0 / alpha;
        int changed = iter == 0;
        double sc = 0, scc = 0, scq = 0;
        for (int l = 0; l < levels; ++l) {
          int c = clamp_code(round_even((l - beta) * inv_alpha), dst_max);
          changed |= c != code[l];
          code[l] = static_cast<uint8_t>(c);
          const double w = h.n[l];
          sc += w * c;
          scc += w * c * c;
          scq += w * c * l;
        }
        if (!changed) break;
        double det = sw * scc - sc * sc;
        if (det <= 1e-12 * sw * sw) {
          beta = sq / sw - alpha * (sc / sw);  // one code for the whole group: the bias fits the mean
        } else {
          alpha = (sw * scq - sc * sq) / det;
          beta = (sq - alpha * sc) / sw;
        }
        if (!(alpha > 1e-6)) break;
        // The candidate at the stored precision, codes re-picked for the rounded scale and bias.
        float cs = round_to(scale_dtype, static_cast<float>(alpha * s));
        float cb = round_to(scale_dtype, static_cast<float>(b + beta * s));
        double err = assign(h, cs, cb, dst_max, cand);
        if (err < best) {
          best = err;
          bs = cs;
          bb = cb;
          std::memcpy(best_code, cand, levels);
        }
      }
    }
  }
  *best_scale = bs;
  *best_bias = bb;
}

Hist make_hist(const uint32_t* q, int g, int src_bits, float s, float b) {
  Hist h;
  h.levels = 1 << src_bits;
  std::memset(h.n, 0, sizeof(int) * h.levels);
  for (int i = 0; i < g; ++i) ++h.n[q[i]];
  for (int l = 0; l < h.levels; ++l) h.t[l] = static_cast<double>(s) * l + b;  // the Q4-dequantized targets
  return h;
}

}  // namespace

void lowbit_group(const uint32_t* q, int g, int src_bits, float s, float b, int dst_bits, LowBitMethod m,
                  DType scale_dtype, uint32_t* out_codes, float* out_scale, float* out_bias) {
  CHECK(src_bits > dst_bits && src_bits <= 8 && dst_bits >= 1);
  Hist h = make_hist(q, g, src_bits, s, b);
  uint8_t code[256];
  fit_group(h, src_bits, s, b, dst_bits, m, scale_dtype, code, out_scale, out_bias);
  for (int i = 0; i < g; ++i) out_codes[i] = code[q[i]];
}

void lowbit_matrix(const Matrix& src, int dst_bits, LowBitMethod m, uint8_t* codes, uint8_t* scales, uint8_t* biases) {
  CHECK(src.quantized() && src.bits > dst_bits);
  const int64_t n_groups = src.cols / src.group_size;
  const int gs = src.group_size;
  const size_t dst_row_bytes = static_cast<size_t>(src.cols) * dst_bits / 8;
  std::vector<uint32_t> q(src.cols);
  std::vector<uint8_t> c(src.cols);
  uint8_t table[256];
  for (int64_t r = 0; r < src.rows; ++r) {
    const uint8_t* row = src.data + static_cast<size_t>(r) * src.row_code_bytes();
    if (src.bits == 4) {
      for (int64_t i = 0; i < src.cols; i += 2) { q[i] = row[i / 2] & 15; q[i + 1] = row[i / 2] >> 4; }
    } else {
      for (int64_t i = 0; i < src.cols; ++i) q[i] = get_code(row, i, src.bits);
    }
    for (int64_t gi = 0; gi < n_groups; ++gi) {
      const float s = load_float(src.scale_dtype, src.scales, r * n_groups + gi);
      const float b = load_float(src.scale_dtype, src.biases, r * n_groups + gi);
      Hist h = make_hist(q.data() + gi * gs, gs, src.bits, s, b);
      float ns, nb;
      fit_group(h, src.bits, s, b, dst_bits, m, src.scale_dtype, table, &ns, &nb);
      for (int i = 0; i < gs; ++i) c[gi * gs + i] = table[q[gi * gs + i]];
      store_float(src.scale_dtype, scales, r * n_groups + gi, ns);
      store_float(src.scale_dtype, biases, r * n_groups + gi, nb);
    }
    // Pack the row's codes lowest bits first (the MLX bit stream; rows are whole bytes).
    uint8_t* out = codes + static_cast<size_t>(r) * dst_row_bytes;
    uint64_t acc = 0;
    int nbits = 0;
    for (int64_t i = 0; i < src.cols; ++i) {
      acc |= static_cast<uint64_t>(c[i]) << nbits;
      nbits += dst_bits;
      while (nbits >= 8) { *out++ = static_cast<uint8_t>(acc); acc >>= 8; nbits -= 8; }
    }
  }
}

double matrix_sq_error(const Matrix& a, const Matrix& b, int64_t* n) {
  CHECK(a.rows == b.rows && a.cols == b.cols);
  std::vector<float> ra(a.cols), rb(b.cols);
  double err = 0;
  for (int64_t r = 0; r < a.rows; ++r) {
    matrix_row(a, r, ra.data());
    matrix_row(b, r, rb.data());
    for (int64_t c = 0; c < a.cols; ++c) {
      double d = static_cast<double>(ra[c]) - rb[c];
      err += d * d;
    }
  }
  if (n) *n = a.rows * a.cols;
  return err;
}

}  // namespace ck::store
