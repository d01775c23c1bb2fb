// Opens a model directory for the CLI commands: a checkpoint (config.json + safetensors) or a packed
// store (a directory with manifest.json, src/store/store.h). Keeps the mapped files alive beside the
// model, and picks the backend (--backend cpu|cuda|auto; auto = cuda when a GPU is visible, else cpu).
#pragma once
#include <memory>
#include <string>

#include "cpu/qwen4_exp.h"
#include "engine/session.h"
#include "format/weights.h"
#include "store/store.h"

namespace ck::cli {

struct LoadedModel {
  std::unique_ptr<Checkpoint> checkpoint;  // --model is a checkpoint
  std::unique_ptr<store::Store> store;     // --model is a store
  std::unique_ptr<cpu::Model> model;      // the CPU reference (views only; always there, backs --check)
  std::unique_ptr<engine::Model> engine;  // the backend that runs the command
};

// True when this build has the CUDA engine and a CUDA device is visible.
bool cuda_available();

// Store options. Defaults come from the environment so that every command honours them before it
// has flags of its own: CHERENKOV_EXPERTS=4|3|2 (which expert file of a store), CHERENKOV_VERIFY_READS=
// always|sampled|never (checksum checks of expert reads; sampled by default).
struct LoadOptions {
  int expert_bits = 0;       // 0: $CHERENKOV_EXPERTS or 4
  std::string verify_reads;  // "": $CHERENKOV_VERIFY_READS or "sampled"
};

Result<std::unique_ptr<LoadedModel>> load_model(const std::string& dir, const std::string& backend);
Result<std::unique_ptr<LoadedModel>> load_model(const std::string& dir, const std::string& backend,
                                                const LoadOptions& opts);

}  // namespace ck::cli
