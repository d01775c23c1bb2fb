// The packed store (src/store/): pack -> load gives the same logits as the checkpoint (bit for bit
// from MLX Q4); a store packed from bf16 equals one packed from the MLX form of the same weights;
// corruption and truncation are caught by verify and by expert reads, naming layer and expert; an
// interrupted pack leaves no loadable store; a valid store is reused.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "../common/temp_dir.h"
#include "cpu/qwen4_exp.h"
#include "format/matrix.h"
#include "format/weights.h"
#include "store/manifest.h"
#include "store/pack.h"
#include "store/store.h"
#include "util/file.h"
#include "util/npy.h"

using namespace ck;

namespace {

const std::string kSrc = CK_SOURCE_DIR;
const std::string kMlxFixture = kSrc + "/tests/fixtures/oracle/mlx_q4g64_nested_hc4_e32k4";
const std::string kPair = kSrc + "/tests/fixtures/store_pair";

std::string tmpdir() { return test::temp_dir("ck_store_"); }

void rm_rf(const std::string& d) { std::system(("rm -rf '" + d + "'").c_str()); }

std::string slurp(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

store::PackReport pack(const std::string& src, const std::string& out, std::vector<int> low = {},
                       store::LowBitMethod m = store::kDefaultLowBit) {
  store::PackOptions o;
  o.src = src;
  o.out = out;
  o.low_bits = low;
  o.method = m;
  o.sync = false;
  o.threads = 2;
  auto r = store::pack_store(o);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? *r : store::PackReport{};
}

std::vector<int32_t> prompt(const std::string& fixture, size_t n) {
  auto a = read_npy(fixture + "/prompt_ids.npy");
  EXPECT_TRUE(a.ok());
  std::vector<int32_t> ids;
  for (int64_t v : a->as_i64())
    if (ids.size() < n) ids.push_back(static_cast<int32_t>(v));
  return ids;
}

std::vector<float> logits(const ModelWeights& w, std::shared_ptr<ExpertSource> ex, const std::vector<int32_t>& ids) {
  cpu::Model m(w, std::move(ex));
  auto s = m.new_session();
  cpu::StepResult r;
  Status st = s->step_rows(ids, false, true, &r);
  EXPECT_TRUE(st.ok()) << st.message();
  return r.logits;
}

void flip_byte(const std::string& path, uint64_t off) {
  FILE* f = std::fopen(path.c_str(), "r+b");
  ASSERT_NE(f, nullptr);
  std::fseek(f, static_cast<long>(off), SEEK_SET);
  int c = std::fgetc(f);
  std::fseek(f, static_cast<long>(off), SEEK_SET);
  std::fputc(c ^ 0x5a, f);
  std::fclose(f);
}

}  // namespace

// The MLX quantizer rule on known values (shared/spec/mlx_affine.md): |min| > |max| gives a positive
// scale and bias = min; the edge is exact.
TEST(StoreQuantizer, KnownGroup) {
  float w[32];
  const float pat[4] = {-2.0f, 0.0f, 0.5f, 1.0f};
  for (int i = 0; i < 32; ++i) w[i] = pat[i % 4];
  uint32_t q[32];
  float s, b;
  quantize_group(w, 32, 4, q, &s, &b);
  // scale = 3/15 = 0.2; q0 = round(-2/0.2) = -10 -> scale = -2/-10 = 0.2, bias = -2.
  EXPECT_FLOAT_EQ(s, 0.2f);
  EXPECT_FLOAT_EQ(b, -2.0f);
  EXPECT_EQ(q[0], 0u);   // -2
  EXPECT_EQ(q[1], 10u);  // 0
  EXPECT_EQ(q[2], 12u);  // 0.5 = -2 + 12.5*0.2 -> round half to even: 12
  EXPECT_EQ(q[3], 15u);  // 1
  for (int i = 0; i < 32; ++i) w[i] = -w[i];
  quantize_group(w, 32, 4, q, &s, &b);
  EXPECT_FLOAT_EQ(s, -0.2f);  // the edge is now the max (2): negative scale, bias = max
  EXPECT_FLOAT_EQ(b, 2.0f);
  EXPECT_EQ(q[0], 0u);
}

// bf16 weights quantized by the packer (C++) == the same weights quantized by tools/mlx_format.py.
TEST(Store, PackedFromBf16EqualsPackedFromMlx) {
  std::string d = tmpdir();
  pack(kPair + "/hf_bf16", d + "/hf");
  pack(kPair + "/mlx", d + "/mlx");
  auto a = store::load_manifest(d + "/hf"), b = store::load_manifest(d + "/mlx");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->experts[0].method, "quantize");
  EXPECT_EQ(b->experts[0].method, "copy");
  EXPECT_EQ(a->ngram[0].method, "quantize");
  EXPECT_EQ(b->ngram[0].method, "copy");
  EXPECT_EQ(a->n_record_layers, 3);  // 2 trunk layers + the MTP head
  EXPECT_EQ(slurp(d + "/hf/experts.bin"), slurp(d + "/mlx/experts.bin"));
  EXPECT_EQ(slurp(d + "/hf/ngram.bin"), slurp(d + "/mlx/ngram.bin"));
  EXPECT_EQ(a->experts[0].checksums, b->experts[0].checksums);
  rm_rf(d);
}

// From MLX Q4 the store's logits equal the checkpoint's exactly; from an HF checkpoint with float
// experts (dims not a multiple of 64) too.
TEST(Store, LogitsEqualCheckpoint) {
  for (const std::string& name : {std::string("mlx_q4g64_nested_hc4_e32k4"), std::string("hf_bf16_nested_hc3_e64k6_sharded")}) {
    SCOPED_TRACE(name);
    std::string fx = kSrc + "/tests/fixtures/oracle/" + name;
    std::string d = tmpdir();
    pack(fx, d + "/s");
    auto ck = open_checkpoint(fx);
    ASSERT_TRUE(ck.ok()) << ck.status().message();
    store::StoreOptions so;
    so.verify = store::VerifyReads::Always;
    auto st = store::open_store(d + "/s", so);
    ASSERT_TRUE(st.ok()) << st.status().message();
    auto ids = prompt(fx, 24);
    auto want = logits((*ck)->weights, (*ck)->experts, ids);
    auto got = logits((*st)->weights, (*st)->experts, ids);
    ASSERT_EQ(want.size(), got.size());
    EXPECT_TRUE(want == got);
    EXPECT_GT((*st)->experts->reads(), 0u);
    EXPECT_EQ((*st)->experts->verified(), (*st)->experts->reads());
    rm_rf(d);
  }
}

// The MTP head's experts are record layer n_layers, after the trunk.
TEST(Store, MtpRecordLayer) {
  std::string d = tmpdir();
  pack(kPair + "/mlx", d + "/s");
  auto ck = open_checkpoint(kPair + "/mlx");
  auto st = store::open_store(d + "/s");
  ASSERT_TRUE(ck.ok() && st.ok());
  ASSERT_TRUE((*st)->weights.mtp.has_value());
  std::vector<uint8_t> scratch;
  ExpertMatrices a, b;
  ASSERT_TRUE((*ck)->experts->get(2, 5, &a, nullptr).ok());
  ASSERT_TRUE((*st)->experts->get(2, 5, &b, &scratch).ok());
  std::vector<float> ra(64), rb(64);
  for (int64_t r = 0; r < a.down.rows; ++r) {
    matrix_row(a.down, r, ra.data());
    matrix_row(b.down, r, rb.data());
    ASSERT_EQ(ra, rb);
  }
  rm_rf(d);
}

TEST(Store, CorruptRecordNamedByVerifyAndRead) {
  std::string d = tmpdir();
  pack(kMlxFixture, d + "/s");
  auto m = store::load_manifest(d + "/s");
  ASSERT_TRUE(m.ok());
  auto v0 = store::verify_store(d + "/s", 2);
  ASSERT_TRUE(v0.ok());
  EXPECT_TRUE(v0->failures.empty());
  EXPECT_EQ(v0->records, static_cast<uint64_t>(m->n_record_layers) * m->n_experts);
  // Flip one byte inside the down scales of layer 2, expert 17.
  const store::ExpertFile& f = m->experts[0];
  uint64_t k = 2ull * m->n_experts + 17;
  flip_byte(d + "/s/experts.bin", k * f.stride + f.down.scales + 3);
  auto v = store::verify_store(d + "/s", 2);
  ASSERT_TRUE(v.ok());
  ASSERT_EQ(v->failures.size(), 1u);
  EXPECT_NE(v->failures[0].find("layer 2, expert 17"), std::string::npos) << v->failures[0];
  EXPECT_NE(v->failures[0].find("checksum mismatch"), std::string::npos) << v->failures[0];
  for (auto mode : {store::VerifyReads::Always, store::VerifyReads::Sampled}) {
    store::StoreOptions so;
    so.verify = mode;
    auto st = store::open_store(d + "/s", so);
    ASSERT_TRUE(st.ok()) << st.status().message();
    std::vector<uint8_t> scratch;
    ExpertMatrices ex;
    EXPECT_TRUE((*st)->experts->get(2, 16, &ex, &scratch).ok());
    Status s = (*st)->experts->get(2, 17, &ex, &scratch);
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("layer 2, expert 17"), std::string::npos) << s.message();
  }
  // With checks off the read goes through (the caller chose speed).
  store::StoreOptions off;
  off.verify = store::VerifyReads::Never;
  auto st = store::open_store(d + "/s", off);
  ASSERT_TRUE(st.ok());
  std::vector<uint8_t> scratch;
  ExpertMatrices ex;
  EXPECT_TRUE((*st)->experts->get(2, 17, &ex, &scratch).ok());
  // A corrupt dense tensor: named by verify and refused at load.
  const store::DenseTensor& t = m->dense[m->dense.size() / 2];
  flip_byte(d + "/s/dense.bin", t.offset);
  auto v2 = store::verify_store(d + "/s", 2);
  ASSERT_TRUE(v2.ok());
  EXPECT_EQ(v2->failures.size(), 2u);
  auto bad = store::open_store(d + "/s");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find(t.name), std::string::npos) << bad.status().message();
  rm_rf(d);
}

TEST(Store, TruncationNamedByVerifyOpenAndRead) {
  std::string d = tmpdir();
  pack(kMlxFixture, d + "/s");
  auto m = store::load_manifest(d + "/s");
  ASSERT_TRUE(m.ok());
  const store::ExpertFile& f = m->experts[0];
  const int E = m->n_experts;
  // Open first, then cut the file inside record (3, 4): the read names it.
  auto st = store::open_store(d + "/s");
  ASSERT_TRUE(st.ok());
  uint64_t cut = (3ull * E + 4) * f.stride + 100;
  ASSERT_EQ(::truncate((d + "/s/experts.bin").c_str(), static_cast<off_t>(cut)), 0);
  std::vector<uint8_t> scratch;
  ExpertMatrices ex;
  EXPECT_TRUE((*st)->experts->get(3, 3, &ex, &scratch).ok());
  Status s = (*st)->experts->get(3, 4, &ex, &scratch);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("layer 3, expert 4"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("short read"), std::string::npos) << s.message();
  // A fresh open refuses the store and names the first missing record.
  auto again = store::open_store(d + "/s");
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("layer 3, expert 4"), std::string::npos) << again.status().message();
  auto v = store::verify_store(d + "/s", 2);
  ASSERT_TRUE(v.ok());
  ASSERT_FALSE(v->failures.empty());
  EXPECT_NE(v->failures[0].find("truncated"), std::string::npos) << v->failures[0];
  bool named = false;
  for (auto& l : v->failures) named |= l.find("layer 3, expert 4") != std::string::npos;
  EXPECT_TRUE(named);
  rm_rf(d);
}

TEST(Store, InterruptedPackLeavesNoStore) {
  std::string d = tmpdir();
  pack(kMlxFixture, d + "/s");  // a valid store first: an interrupted repack must not leave it half-replaced
  store::PackOptions o;
  o.src = kMlxFixture;
  o.out = d + "/s";
  o.sync = false;
  o.force = true;
  o.fail_after_bytes = 200000;
  auto r = store::pack_store(o);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("simulated failure"), std::string::npos);
  EXPECT_FALSE(store::is_store_dir(d + "/s"));
  EXPECT_FALSE(store::open_store(d + "/s").ok());
  for (const char* f : {"experts.bin.tmp", "dense.bin.tmp", "ngram.bin.tmp", "experts.bin"})
    EXPECT_FALSE(file_exists(d + "/s/" + f)) << f;
  // The next pack starts over and succeeds.
  auto ok = pack(kMlxFixture, d + "/s");
  EXPECT_FALSE(ok.reused);
  EXPECT_TRUE(store::open_store(d + "/s").ok());
  rm_rf(d);
}

TEST(Store, ValidStoreIsReused) {
  std::string d = tmpdir();
  // A private copy of the source so that its mtime can change.
  std::system(("cp -r '" + kPair + "/mlx' '" + d + "/src'").c_str());
  auto a = pack(d + "/src", d + "/s");
  EXPECT_FALSE(a.reused);
  auto b = pack(d + "/src", d + "/s");
  EXPECT_TRUE(b.reused);
  EXPECT_EQ(b.bytes, 0u);
  // Asking for a precision the store lacks repacks.
  auto c = pack(d + "/src", d + "/s", {3});
  EXPECT_FALSE(c.reused);
  EXPECT_TRUE(pack(d + "/src", d + "/s", {3}).reused);
  // A touched source file is a different source.
  std::system(("touch -d '2001-01-01' '" + d + "/src/model.safetensors'").c_str());
  EXPECT_FALSE(pack(d + "/src", d + "/s").reused);
  rm_rf(d);
}

TEST(Store, RefusesStoreWhoseConfigDiffers) {
  std::string d = tmpdir();
  pack(kMlxFixture, d + "/s");
  std::string cfg = slurp(d + "/s/config.json");
  ASSERT_TRUE(write_file_atomic(d + "/s/config.json", cfg + "\n").ok());  // same values, other bytes
  auto st = store::open_store(d + "/s");
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find("does not match the store's manifest"), std::string::npos)
      << st.status().message();
  auto v = store::verify_store(d + "/s", 1);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->failures.size(), 1u);
  rm_rf(d);
}

TEST(Store, ManifestRoundTrip) {
  std::string d = tmpdir();
  pack(kPair + "/mlx", d + "/s", {3, 2});
  auto m = store::load_manifest(d + "/s");
  ASSERT_TRUE(m.ok()) << m.status().message();
  auto again = store::parse_manifest(store::manifest_to_json(*m), "x");
  ASSERT_TRUE(again.ok()) << again.status().message();
  EXPECT_EQ(store::manifest_to_json(*again), store::manifest_to_json(*m));
  ASSERT_EQ(m->experts.size(), 3u);
  EXPECT_EQ(m->expert_file(3)->file, "experts3.bin");
  EXPECT_EQ(m->expert_file(2)->file, "experts2.bin");
  for (const auto& f : m->experts) EXPECT_EQ(f.stride % 4096, 0u);
  auto bad = store::parse_manifest("{\"format\": \"cherenkov-store\", \"version\": 99}", "m.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("version 99"), std::string::npos);
  rm_rf(d);
}
