// Safetensors and checkpoint bad-input handling: every corruption gives one error naming the file
// and tensor (never a crash). Checkpoint-level cases rewrite a copy of an oracle fixture.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "../common/fixtures.h"
#include "../common/temp_dir.h"
#include "format/safetensors.h"
#include "format/weights.h"
#include "util/file.h"

using namespace ck;
using nlohmann::json;

namespace {

std::string tmpdir() { return test::temp_dir("ck_st_"); }

std::string make_file(const json& header, size_t data_bytes) {
  std::string h = header.dump();
  uint64_t n = h.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  out += h;
  out.append(data_bytes, '\x01');
  return out;
}

Status parse_bytes(const std::string& bytes) {
  std::map<std::string, TensorInfo> t;
  return parse_safetensors_header(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "x.safetensors", &t);
}

void expect_bad(const std::string& bytes, const std::string& needle) {
  Status s = parse_bytes(bytes);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("x.safetensors"), std::string::npos) << s.message();
}

json good_header() {
  return json{{"a", {{"dtype", "F32"}, {"shape", {2, 3}}, {"data_offsets", {0, 24}}}},
              {"b", {{"dtype", "BF16"}, {"shape", {4}}, {"data_offsets", {24, 32}}}},
              {"__metadata__", {{"format", "pt"}}}};
}

TEST(Safetensors, ParsesGoodFile) {
  std::map<std::string, TensorInfo> t;
  std::string f = make_file(good_header(), 32);
  ASSERT_TRUE(parse_safetensors_header(reinterpret_cast<const uint8_t*>(f.data()), f.size(), "x", &t).ok());
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t["a"].shape_str(), "[2, 3]");
  EXPECT_EQ(t["b"].nbytes, 8u);
}

TEST(Safetensors, RejectsCorruptHeaders) {
  expect_bad("abc", "truncated");
  std::string f = make_file(good_header(), 32);
  expect_bad(f.substr(0, f.size() - 4), "past the end of the data");           // truncated data
  std::string big = f;
  uint64_t huge = 1ull << 40;
  std::memcpy(big.data(), &huge, 8);
  expect_bad(big, "points past the end of the file");
  std::string garbage = f;
  garbage[8] = '#';
  expect_bad(garbage, "invalid JSON");
  json h = good_header();
  h["a"]["dtype"] = "F33";
  expect_bad(make_file(h, 32), "unknown dtype");
  h = good_header();
  h["a"]["shape"] = {2, 4};
  expect_bad(make_file(h, 32), "needs 32 bytes but data_offsets span 24");
  h = good_header();
  h["a"]["data_offsets"] = {24, 0};
  expect_bad(make_file(h, 32), "reversed");
  h = good_header();
  h["b"]["data_offsets"] = {16, 24};
  expect_bad(make_file(h, 32), "overlap");
  h = good_header();
  h["a"]["shape"] = {-1, 3};
  expect_bad(make_file(h, 32), "negative");
  h = good_header();
  h["a"].erase("dtype");
  expect_bad(make_file(h, 32), "needs dtype");
  expect_bad(make_file(json::array(), 0), "not a JSON object");
}

// ---- checkpoint level: a copy of a fixture with one thing broken ----

struct Copy {
  std::string dir;
  json header;
  std::string data;  // bytes after the header
};

Copy copy_fixture(const std::string& src) {
  Copy c;
  c.dir = tmpdir();
  auto cfg = read_file(src + "/config.json");
  EXPECT_TRUE(cfg.ok());
  EXPECT_TRUE(write_file_atomic(c.dir + "/config.json", *cfg).ok());
  auto raw = read_file(src + "/model.safetensors");
  EXPECT_TRUE(raw.ok());
  uint64_t n;
  std::memcpy(&n, raw->data(), 8);
  c.header = json::parse(raw->substr(8, n));
  c.data = raw->substr(8 + n);
  return c;
}

void write_copy(const Copy& c) {
  std::string h = c.header.dump();
  uint64_t n = h.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  ASSERT_TRUE(write_file_atomic(c.dir + "/model.safetensors", out + h + c.data).ok());
}

std::string single_file_fixture() {
  for (auto& d : test::fixture_dirs("oracle"))
    if (file_exists(d + "/model.safetensors") && !file_exists(d + "/model.safetensors.index.json")) {
      auto ck = open_checkpoint(d);
      if (ck.ok() && (*ck)->layout == Layout::HfPerExpert) return d;
    }
  return "";
}

std::string first_tensor_with(const json& h, const std::string& part) {
  for (auto it = h.begin(); it != h.end(); ++it)
    if (it.key().find(part) != std::string::npos) return it.key();
  return "";
}

TEST(Checkpoint, BadTensorsAreNamed) {
  std::string src = single_file_fixture();
  if (src.empty()) GTEST_SKIP() << "no single-file Hugging Face fixture";
  {
    Copy c = copy_fixture(src);
    write_copy(c);
    auto ok = open_checkpoint(c.dir);
    ASSERT_TRUE(ok.ok()) << ok.status().message();
  }
  {  // a missing tensor
    Copy c = copy_fixture(src);
    std::string name = first_tensor_with(c.header, "in_proj_z.weight");
    ASSERT_FALSE(name.empty());
    json v = c.header[name];
    c.header.erase(name);
    c.header[name + "_renamed"] = v;
    write_copy(c);
    auto r = open_checkpoint(c.dir);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("missing tensor '" + name + "'"), std::string::npos) << r.status().message();
  }
  {  // wrong shape, same byte count
    Copy c = copy_fixture(src);
    std::string name = first_tensor_with(c.header, "o_proj.weight");
    ASSERT_FALSE(name.empty());
    auto shape = c.header[name]["shape"];
    c.header[name]["shape"] = {shape[1], shape[0]};
    write_copy(c);
    auto r = open_checkpoint(c.dir);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find(name), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("expected"), std::string::npos) << r.status().message();
  }
  {  // wrong dtype
    Copy c = copy_fixture(src);
    std::string name = first_tensor_with(c.header, "q_proj.weight");
    std::string dt = c.header[name]["dtype"];
    c.header[name]["dtype"] = dt == "F32" ? "I32" : "I16";
    write_copy(c);
    auto r = open_checkpoint(c.dir);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find(name), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("dtype"), std::string::npos) << r.status().message();
  }
  {  // truncated file
    Copy c = copy_fixture(src);
    c.data.resize(c.data.size() / 2);
    write_copy(c);
    auto r = open_checkpoint(c.dir);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("model.safetensors"), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("past the end"), std::string::npos) << r.status().message();
  }
  {  // unknown architecture in config.json
    Copy c = copy_fixture(src);
    write_copy(c);
    auto cfg = json::parse(*read_file(c.dir + "/config.json"));
    cfg["model_type"] = "mixtral";
    ASSERT_TRUE(write_file_atomic(c.dir + "/config.json", cfg.dump()).ok());
    auto r = open_checkpoint(c.dir);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("unknown architecture 'mixtral'"), std::string::npos) << r.status().message();
  }
}

TEST(Checkpoint, MissingDirectoryAndFiles) {
  auto r = open_checkpoint("/nonexistent/model");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("/nonexistent/model"), std::string::npos);
  std::string d = tmpdir();
  ASSERT_TRUE(write_file_atomic(d + "/config.json", "{}").ok());
  r = open_checkpoint(d);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("model_type"), std::string::npos) << r.status().message();
}

}  // namespace
