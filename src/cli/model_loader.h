// Opens a model directory for the CLI commands: a checkpoint (config.json + safetensors) today,
// a packed store once src/store/ serves one. Keeps the mapped files alive beside the model, and
// picks the backend (--backend cpu|cuda|auto; auto = cuda when a GPU is visible, else cpu).
#pragma once
#include <memory>
#include <string>

#include "cpu/qwen4_exp.h"
#include "engine/session.h"
#include "format/weights.h"

namespace ck::cli {

struct LoadedModel {
  std::unique_ptr<Checkpoint> checkpoint;
  std::unique_ptr<cpu::Model> model;      // the CPU reference (views only; always there, backs --check)
  std::unique_ptr<engine::Model> engine;  // the backend that runs the command
};

// True when this build has the CUDA engine and a CUDA device is visible.
bool cuda_available();

Result<std::unique_ptr<LoadedModel>> load_model(const std::string& dir, const std::string& backend);

}  // namespace ck::cli
