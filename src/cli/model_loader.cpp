#include "cli/model_loader.h"

#include "util/file.h"

namespace ck::cli {

Result<std::unique_ptr<LoadedModel>> load_model(const std::string& dir, const std::string& backend) {
  if (!is_directory(dir)) return error("--model {}: not a directory", dir);
  if (backend == "cuda") return error("--backend cuda: this build has no CUDA engine yet (use --backend cpu)");
  auto lm = std::make_unique<LoadedModel>();
  ASSIGN_OR_RETURN(lm->checkpoint, open_checkpoint(dir));
  lm->model = std::make_unique<cpu::Model>(lm->checkpoint->weights, lm->checkpoint->experts);
  return lm;
}

}  // namespace ck::cli
