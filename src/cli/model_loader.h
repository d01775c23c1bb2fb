// Opens a model directory for the CLI commands: a checkpoint (config.json + safetensors) today,
// a packed store once src/store/ serves one. Keeps the mapped files alive beside the model.
#pragma once
#include <memory>
#include <string>

#include "cpu/qwen4_exp.h"
#include "format/weights.h"

namespace ck::cli {

struct LoadedModel {
  std::unique_ptr<Checkpoint> checkpoint;
  std::unique_ptr<cpu::Model> model;
};

Result<std::unique_ptr<LoadedModel>> load_model(const std::string& dir, const std::string& backend);

}  // namespace ck::cli
