// The backend-neutral model and session interfaces the front ends drive (shared/DESIGN.md §1
// "Session"): cpu::Session and cuda::Session implement them through the thin adapters below, so a
// command picks its backend once and runs one loop. Header-only; the CUDA adapter exists only in
// builds with the CUDA engine (CHERENKOV_HAVE_CUDA).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "cpu/qwen4_exp.h"
#include "format/config.h"
#if CHERENKOV_HAVE_CUDA
#include "cuda/qwen4_exp.h"
#endif

namespace ck::engine {

using StepResult = cpu::StepResult;
using RowOutputs = cpu::RowOutputs;

// Prompt rows per prefill step unless a front end asks otherwise (--prefill-chunk): cuda::kChunkRows,
// the CUDA engine's default chunk (it takes up to cuda::kMaxChunkRows, for more GPU memory).
constexpr int kDefaultPrefillChunk = 2048;
// The most a front end may ask for (cuda::kMaxChunkRows).
constexpr int kMaxPrefillChunk = 8192;

// One sequence. Same contract as cpu::Session: step_rows runs rows at pos().., commit(n) accepts the
// first n (rolling the recurrent state back when n < rows, which needs snap).
class Session {
 public:
  virtual ~Session() = default;
  virtual Status step_rows(std::span<const int32_t> tokens, bool snap, bool want_logits, StepResult* out,
                           RowOutputs which) = 0;
  Status step_rows(std::span<const int32_t> tokens, bool snap, bool want_logits, StepResult* out) {
    return step_rows(tokens, snap, want_logits, out, RowOutputs::kEvery);
  }
  virtual void commit(int n) = 0;
  virtual int64_t pos() const = 0;
};

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelConfig& cfg() const = 0;
  virtual const char* backend() const = 0;  // "cpu" or "cuda"
  // max_ctx: the positions the session must hold (the CPU grows its caches and ignores it).
  // prefill_chunk: the most prompt rows one step runs at once; the CUDA engine sizes its per-row GPU
  // buffers by it (clamped to cuda::kMaxChunkRows), the CPU ignores it.
  virtual std::unique_ptr<Session> new_session(int64_t max_ctx, int prefill_chunk) const = 0;
  std::unique_ptr<Session> new_session(int64_t max_ctx) const { return new_session(max_ctx, default_prefill_chunk()); }
  // What a front end uses when its user does not say (--prefill-chunk 0): the CUDA engine's choice by
  // its free GPU memory (cuda::Model::default_chunk_rows), kDefaultPrefillChunk on the CPU.
  virtual int default_prefill_chunk() const { return kDefaultPrefillChunk; }
  // Whether a session of this chunk fits (the CUDA engine's GPU memory; always on the CPU): a front end
  // asks before new_session, so a chunk too large for the GPU is a clear error, not an abort.
  virtual Status prefill_chunk_fits(int64_t /*max_ctx*/, int /*prefill_chunk*/) const { return {}; }
};

template <class S>
class SessionAdapter final : public Session {
 public:
  explicit SessionAdapter(std::unique_ptr<S> s) : s_(std::move(s)) {}
  using Session::step_rows;
  Status step_rows(std::span<const int32_t> tokens, bool snap, bool want_logits, StepResult* out,
                   RowOutputs which) override {
    return s_->step_rows(tokens, snap, want_logits, out, which);
  }
  void commit(int n) override { s_->commit(n); }
  int64_t pos() const override { return s_->pos(); }
  S& impl() { return *s_; }

 private:
  std::unique_ptr<S> s_;
};

// The CPU reference (does not own the model).
class CpuModel final : public Model {
 public:
  explicit CpuModel(const cpu::Model& m) : m_(m) {}
  const ModelConfig& cfg() const override { return m_.cfg(); }
  const char* backend() const override { return "cpu"; }
  using Model::new_session;
  std::unique_ptr<Session> new_session(int64_t, int) const override {
    return std::make_unique<SessionAdapter<cpu::Session>>(m_.new_session());
  }

 private:
  const cpu::Model& m_;
};

#if CHERENKOV_HAVE_CUDA
static_assert(kDefaultPrefillChunk == cuda::kChunkRows, "the default chunk is the CUDA engine's");
static_assert(kMaxPrefillChunk == cuda::kMaxChunkRows, "the largest chunk is the CUDA engine's");

// The CUDA engine (owns the device model).
class CudaModel final : public Model {
 public:
  explicit CudaModel(std::unique_ptr<cuda::Model> m) : m_(std::move(m)) {}
  const ModelConfig& cfg() const override { return m_->cfg(); }
  const char* backend() const override { return "cuda"; }
  using Model::new_session;
  std::unique_ptr<Session> new_session(int64_t max_ctx, int prefill_chunk) const override {
    return std::make_unique<SessionAdapter<cuda::Session>>(m_->new_session(max_ctx, prefill_chunk));
  }
  int default_prefill_chunk() const override { return m_->default_chunk_rows(); }
  Status prefill_chunk_fits(int64_t max_ctx, int prefill_chunk) const override {
    return m_->chunk_fits(max_ctx, prefill_chunk);
  }
  const cuda::Model& impl() const { return *m_; }

 private:
  std::unique_ptr<cuda::Model> m_;
};
#endif

}  // namespace ck::engine
