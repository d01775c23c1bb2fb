#include "cli/model_loader.h"

#include "util/file.h"

namespace ck::cli {

bool cuda_available() {
#if CHERENKOV_HAVE_CUDA
  return cuda::device_count() > 0;
#else
  return false;
#endif
}

Result<std::unique_ptr<LoadedModel>> load_model(const std::string& dir, const std::string& backend) {
  if (!is_directory(dir)) return error("--model {}: not a directory", dir);
  const std::string chosen = backend == "auto" ? (cuda_available() ? "cuda" : "cpu") : backend;
#if !CHERENKOV_HAVE_CUDA
  if (chosen == "cuda") return error("--backend cuda: this build has no CUDA engine (use --backend cpu)");
#endif
  auto lm = std::make_unique<LoadedModel>();
  ASSIGN_OR_RETURN(lm->checkpoint, open_checkpoint(dir));
  lm->model = std::make_unique<cpu::Model>(lm->checkpoint->weights, lm->checkpoint->experts);
#if CHERENKOV_HAVE_CUDA
  if (chosen == "cuda") {
    ASSIGN_OR_RETURN(auto cm, cuda::Model::create(lm->checkpoint->weights, lm->checkpoint->experts));
    lm->engine = std::make_unique<engine::CudaModel>(std::move(cm));
    return lm;
  }
#endif
  lm->engine = std::make_unique<engine::CpuModel>(*lm->model);
  return lm;
}

}  // namespace ck::cli
