// Internal to the layer kernel files (layers*.cu, one per stage of the forward): the per-file set-up of
// kernel attributes (dynamic shared memory limits) that init_kernels (layers.cu) calls once.
#pragma once

namespace ck::cuda {

void init_deltanet_kernels();   // layers_deltanet.cu: the chunked delta rule's prep and scan kernels
void init_attention_kernels();  // layers_attention.cu: the attention kernels (kAttnMaxSmem)

}  // namespace ck::cuda
