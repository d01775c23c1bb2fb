#include "cli/model_loader.h"

#include <cstdlib>

#include "util/file.h"
#include "util/log.h"

namespace ck::cli {

bool cuda_available() {
#if CHERENKOV_HAVE_CUDA
  return cuda::device_count() > 0;
#else
  return false;
#endif
}

Result<std::unique_ptr<LoadedModel>> load_model(const std::string& dir, const std::string& backend) {
  return load_model(dir, backend, LoadOptions{});
}

Result<std::unique_ptr<LoadedModel>> load_model(const std::string& dir, const std::string& backend,
                                                const LoadOptions& opts) {
  if (!is_directory(dir)) return error("--model {}: not a directory", dir);
  const std::string chosen = backend == "auto" ? (cuda_available() ? "cuda" : "cpu") : backend;
#if !CHERENKOV_HAVE_CUDA
  if (chosen == "cuda") return error("--backend cuda: this build has no CUDA engine (use --backend cpu)");
#endif
  auto lm = std::make_unique<LoadedModel>();
  const ModelWeights* weights = nullptr;
  std::shared_ptr<ExpertSource> experts;
  if (store::is_store_dir(dir)) {
    store::StoreOptions so;
    so.expert_bits = opts.expert_bits;
    if (so.expert_bits == 0) {
      const char* env = std::getenv("CHERENKOV_EXPERTS");
      so.expert_bits = env && *env ? std::atoi(env) : 4;
    }
    if (so.expert_bits != 4 && so.expert_bits != 3 && so.expert_bits != 2)
      return error("--experts {}: expected 4, 3 or 2", so.expert_bits);
    std::string verify = opts.verify_reads;
    if (verify.empty()) {
      const char* env = std::getenv("CHERENKOV_VERIFY_READS");
      verify = env && *env ? env : "sampled";
    }
    if (!store::parse_verify_reads(verify, &so.verify))
      return error("--verify-reads {}: expected always, sampled or never", verify);
    ASSIGN_OR_RETURN(lm->store, store::open_store(dir, so));
    weights = &lm->store->weights;
    experts = lm->store->experts;
  } else {
    ASSIGN_OR_RETURN(lm->checkpoint, open_checkpoint(dir));
    weights = &lm->checkpoint->weights;
    experts = lm->checkpoint->experts;
  }
  lm->model = std::make_unique<cpu::Model>(*weights, experts);
#if CHERENKOV_HAVE_CUDA
  if (chosen == "cuda") {
    auto cm = cuda::Model::create(*weights, experts);
    if (cm.ok()) {
      lm->engine = std::make_unique<engine::CudaModel>(std::move(*cm));
      return lm;
    }
    // --backend cuda asked for this engine: its error is the answer. With auto, the CPU engine runs
    // what the CUDA engine cannot (today: a model whose experts do not fit the GPU), with a warning.
    if (backend != "auto") return cm.status();
    LOG_WRN("cli", "--backend auto: the CUDA engine cannot run this model ({}); using the CPU engine",
            cm.status().message());
  }
#endif
  lm->engine = std::make_unique<engine::CpuModel>(*lm->model);
  return lm;
}

}  // namespace ck::cli
