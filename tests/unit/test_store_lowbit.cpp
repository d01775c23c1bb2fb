// Low-bit expert records (src/store/lowbit.h): TopBits vs Refit, measured. Weight RMSE against the Q4
// values (and against the bf16 originals where the fixture has them), and the logit error of a whole
// forward with 3- or 2-bit experts against the Q4 store. The figures printed here are the ones in
// docs/performance.md "Low-bit expert records"; the assertions hold the ordering and loose bounds.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cpu/qwen4_exp.h"
#include "format/weights.h"
#include "store/lowbit.h"
#include "store/pack.h"
#include "store/store.h"
#include "store/synth.h"
#include "util/npy.h"

using namespace ck;

namespace {

const std::string kSrc = CK_SOURCE_DIR;

std::string tmpdir() {
  char tmpl[] = "/tmp/ck_lowbit_XXXXXX";
  return mkdtemp(tmpl);
}
void rm_rf(const std::string& d) { std::system(("rm -rf '" + d + "'").c_str()); }

struct Err {
  double sq = 0, ref_sq = 0;
  int64_t n = 0;
  double rmse() const { return std::sqrt(sq / n); }
  double rel() const { return std::sqrt(sq / ref_sq); }
};

// Converts every expert matrix of `q4` (a Q4 ExpertSource view) to `bits` with method m and measures
// the error against `ref` (the Q4 matrix itself, or the original floats).
void add_error(const Matrix& q4, const Matrix& ref, int bits, store::LowBitMethod m, Err* e) {
  const size_t groups = static_cast<size_t>(q4.rows * (q4.cols / q4.group_size));
  std::vector<uint8_t> codes(static_cast<size_t>(q4.rows * q4.cols * bits / 8)), s(groups * 2), b(groups * 2);
  store::lowbit_matrix(q4, bits, m, codes.data(), s.data(), b.data());
  Matrix d = q4;
  d.bits = bits;
  d.data = codes.data();
  d.scales = s.data();
  d.biases = b.data();
  int64_t n;
  e->sq += store::matrix_sq_error(d, ref, &n);
  e->n += n;
  std::vector<float> row(ref.cols);
  for (int64_t r = 0; r < ref.rows; ++r) {
    matrix_row(ref, r, row.data());
    for (float v : row) e->ref_sq += static_cast<double>(v) * v;
  }
}

struct Case { int bits; store::LowBitMethod m; };
const Case kCases[] = {{3, store::LowBitMethod::TopBits}, {3, store::LowBitMethod::Refit},
                       {2, store::LowBitMethod::TopBits}, {2, store::LowBitMethod::Refit}};

// Weight errors over all experts of a checkpoint; `orig` (optional) holds the unquantized experts.
std::vector<Err> weight_errors(const std::string& dir, const std::string& orig_dir, int max_experts) {
  auto ck = open_checkpoint(dir);
  EXPECT_TRUE(ck.ok()) << ck.status().message();
  std::unique_ptr<Checkpoint> orig;
  if (!orig_dir.empty()) {
    auto o = open_checkpoint(orig_dir);
    EXPECT_TRUE(o.ok());
    orig = std::move(*o);
  }
  std::vector<Err> errs(4);
  auto& tab = (*ck)->experts->table;
  for (size_t L = 0; L < tab.size(); ++L)
    for (size_t e = 0; e < tab[L].size() && static_cast<int>(e) < max_experts; ++e) {
      const ExpertMatrices& x = tab[L][e];
      const ExpertMatrices* o = orig ? &orig->experts->table[L][e] : nullptr;
      for (int c = 0; c < 4; ++c) {
        add_error(x.gate, o ? o->gate : x.gate, kCases[c].bits, kCases[c].m, &errs[c]);
        add_error(x.up, o ? o->up : x.up, kCases[c].bits, kCases[c].m, &errs[c]);
        add_error(x.down, o ? o->down : x.down, kCases[c].bits, kCases[c].m, &errs[c]);
      }
    }
  return errs;
}

void print_weights(const char* what, const std::vector<Err>& e) {
  std::printf("weights %-34s  Q3 topbits %.4f  Q3 refit %.4f  Q2 topbits %.4f  Q2 refit %.4f  (relative RMSE)\n", what,
              e[0].rel(), e[1].rel(), e[2].rel(), e[3].rel());
}

}  // namespace

TEST(LowBit, TopBitsIsTheBucketMidpoint) {
  // A group using every Q4 code once per 16: topbits to 3 bits maps q -> q>>1, decoded at 2q'+0.5.
  std::vector<uint32_t> q(64), c(64);
  for (int i = 0; i < 64; ++i) q[i] = i % 16;
  float s, b;
  store::lowbit_group(q.data(), 64, 4, 0.25f, -1.0f, 3, store::LowBitMethod::TopBits, DType::BF16, c.data(), &s, &b);
  EXPECT_FLOAT_EQ(s, 0.5f);
  EXPECT_FLOAT_EQ(b, -1.0f + 0.125f);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(c[i], q[i] >> 1);
  // Refit is never worse than TopBits on the same group (it keeps the best candidate).
  for (int seed = 0; seed < 200; ++seed) {
    uint64_t h = 0x9E3779B97F4A7C15ull * (seed + 1);
    for (int i = 0; i < 64; ++i) {
      h ^= h >> 29; h *= 0xBF58476D1CE4E5B9ull; h ^= h >> 32;
      q[i] = static_cast<uint32_t>(((h & 7) + ((h >> 3) & 7) + ((h >> 6) & 1)) >> (seed % 3 == 0 ? 1 : 0));
    }
    for (int bits : {3, 2}) {
      double err[2];
      for (int m = 0; m < 2; ++m) {
        store::lowbit_group(q.data(), 64, 4, 0.01f, -0.07f, bits, m ? store::LowBitMethod::Refit : store::LowBitMethod::TopBits,
                            DType::BF16, c.data(), &s, &b);
        err[m] = 0;
        for (int i = 0; i < 64; ++i) {
          double d = (s * c[i] + b) - (0.01f * q[i] - 0.07f);
          err[m] += d * d;
        }
      }
      EXPECT_LE(err[1], err[0] * (1 + 1e-9)) << "seed " << seed << " bits " << bits;
    }
  }
}

// Weight RMSE on three sources of Q4 experts; Refit must beat TopBits on each.
TEST(LowBit, WeightErrors) {
  std::string d = tmpdir();
  store::SynthOptions so;
  so.out = d + "/synth";
  so.layers = 2;
  so.experts = 2;
  so.vocab = 256;
  so.ngram_base = 200;
  so.sync = false;
  ASSERT_TRUE(store::synth_checkpoint(so).ok());
  struct Src { const char* name; std::string dir, orig; int max_experts; };
  const Src srcs[] = {
      {"synth (full geometry, 3x2 experts)", d + "/synth", "", 2},
      {"oracle mlx_q4g64 fixture", kSrc + "/tests/fixtures/oracle/mlx_q4g64_nested_hc4_e32k4", "", 1 << 30},
      {"store_pair mlx vs Q4", kSrc + "/tests/fixtures/store_pair/mlx", "", 1 << 30},
      {"store_pair mlx vs bf16 originals", kSrc + "/tests/fixtures/store_pair/mlx",
       kSrc + "/tests/fixtures/store_pair/hf_bf16", 1 << 30},
  };
  for (const Src& s : srcs) {
    auto e = weight_errors(s.dir, s.orig, s.max_experts);
    print_weights(s.name, e);
    EXPECT_LT(e[1].sq, e[0].sq) << s.name;
    EXPECT_LT(e[3].sq, e[2].sq) << s.name;
    // Loose bounds (a 3-bit code has half the levels: about 2x a Q4 step of error; 2 bits about 4x).
    EXPECT_LT(e[1].rel(), 0.35) << s.name;
    EXPECT_LT(e[3].rel(), 0.7) << s.name;
  }
  rm_rf(d);
}

// Logit error of a full forward with low-bit experts, against the Q4 store, on the MLX oracle fixture.
TEST(LowBit, LogitErrors) {
  for (const std::string& fx : {kSrc + "/tests/fixtures/oracle/mlx_q4g64_nested_hc4_e32k4",
                                kSrc + "/tests/fixtures/store_pair/mlx"}) {
    std::string d = tmpdir();
    std::vector<int32_t> ids;
    auto p = read_npy(fx + "/prompt_ids.npy");
    if (p.ok()) {
      for (int64_t v : p->as_i64()) ids.push_back(static_cast<int32_t>(v));
    } else {
      for (int i = 0; i < 40; ++i) ids.push_back((i * 37 + 11) % 128);
    }
    std::vector<float> q4;
    double err[2][2];
    double agree[2][2];
    for (int m = 0; m < 2; ++m) {
      store::PackOptions o;
      o.src = fx;
      o.out = d + "/s" + std::to_string(m);
      o.low_bits = {3, 2};
      o.method = m ? store::LowBitMethod::Refit : store::LowBitMethod::TopBits;
      o.sync = false;
      ASSERT_TRUE(store::pack_store(o).ok());
      for (int bits : {4, 3, 2}) {
        store::StoreOptions so;
        so.expert_bits = bits;
        auto st = store::open_store(o.out, so);
        ASSERT_TRUE(st.ok()) << st.status().message();
        cpu::Model model((*st)->weights, (*st)->experts);
        auto s = model.new_session();
        cpu::StepResult r;
        ASSERT_TRUE(s->step_rows(ids, false, true, &r).ok());
        if (bits == 4) {
          if (q4.empty()) q4 = r.logits;
          ASSERT_TRUE(q4 == r.logits);
          continue;
        }
        const int64_t V = (*st)->weights.cfg.vocab_size, T = static_cast<int64_t>(ids.size());
        double sq = 0, ref = 0;
        int same = 0;
        for (int64_t t = 0; t < T; ++t) {
          int a = 0, b = 0;
          for (int64_t v = 0; v < V; ++v) {
            double dd = r.logits[t * V + v] - q4[t * V + v];
            sq += dd * dd;
            ref += static_cast<double>(q4[t * V + v]) * q4[t * V + v];
            if (r.logits[t * V + v] > r.logits[t * V + a]) a = static_cast<int>(v);
            if (q4[t * V + v] > q4[t * V + b]) b = static_cast<int>(v);
          }
          same += a == b;
        }
        err[bits == 3 ? 0 : 1][m] = std::sqrt(sq / ref);
        agree[bits == 3 ? 0 : 1][m] = static_cast<double>(same) / T;
      }
    }
    std::printf("logits  %-34s  Q3 topbits %.4f (top-1 %.2f)  Q3 refit %.4f (top-1 %.2f)  Q2 topbits %.4f (top-1 %.2f)  "
                "Q2 refit %.4f (top-1 %.2f)  (relative RMS vs Q4)\n",
                fx.substr(fx.rfind('/') + 1).c_str(), err[0][0], agree[0][0], err[0][1], agree[0][1], err[1][0],
                agree[1][0], err[1][1], agree[1][1]);
    // Bounds: a low-bit model is a perturbation of the Q4 one, not a different model.
    EXPECT_LT(err[0][1], 0.5);
    EXPECT_LT(err[1][1], 1.0);
    rm_rf(d);
  }
}
