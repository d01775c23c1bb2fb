// Persistent-step lab: what would a one-row decode step take as ONE persistent kernel, whose blocks
// stream every weight byte through a shared-memory ring and hand each op's output to the next op by a
// grid-wide counter instead of a kernel boundary; and what as the engine's chain of kernels at its best?
//
// Why (docs/roofline-cuda.md, forty-fifth and forty-seventh sessions): the engine's one-row step is a
// chain of ~178 kernels, 1.61 ms on an H100 against 0.50 ms for its 1.514 GB at the copy rate. Its
// byte-moving kernels already run at ~70-85% of the copy rate; the rest is latency (the mixes, the
// route, kernel boundaries) during which the memory is idle. Issue 6's 70% target needs the memory
// busy through that latency: weights streamed ahead of the op that needs them while earlier ops wait
// on their inputs. Before anyone builds that (weeks: every op of the step rewritten as a tile of a
// persistent kernel), this lab measures its skeleton on the step's real op list and byte counts:
//   - stream: every block streams its share of each op's weights through its ring, no waits for
//     inputs: how fast the ring moves 1.5 GB (the design's own ceiling);
//   - step: the same, and each op also waits until every block has finished the op before it (a
//     grid-wide counter), reads that op's output vector (its activation, from L2) and writes its own;
//     the routed experts' weights are streamed only after the route op has finished (their addresses
//     are its output);
//   - hops: the same chain with no weight bytes: the cost of ~175 dependent hand-overs alone;
//   - chain: the engine's form at its best instead: a kernel per op in one graph under programmatic
//     dependent launch, each kernel copying its weights into shared memory before its wait (two
//     kernels fit an SM), so an op's weights stream while the op before it runs (chain_kernel);
//   - boundaries: the same number of empty kernels, for the cost of a kernel boundary alone.
// Variants: -nofence (the counter's release add without a fence before it), -noact (no input read),
// -relaxed (relaxed polling), -9slots, -l2xN (the producer also asks L2 for the chunks N past its
// ring), ungated (the experts streamed before the route is done, as if their addresses were known).
// The consumers read every weight byte from shared memory (16-byte loads, an XOR) but do no MMAs:
// at one row the engine's tensor-core arithmetic is ~0.5 instructions a code, which a ring-fed warp
// issues far faster than the bytes arrive (the decode experts' stream loops), so the skeleton's time is
// a lower bound for the design, not a prediction. The route, the DeltaNet recurrence and attention are
// modelled as hand-overs with their bytes (the recurrence's state) and no compute: their own latency
// (the route's top-k: ~6.6 us a layer in the engine's step) would come on top.
// What it found (H100 and H200, 2026-12-06; docs/roofline-cuda.md "Forty-seventh session"): the ring
// streams at ~87% of the copy rate, a grid-wide hand-over costs 1.4 us bare and 2.5 us with the input's
// read (a kernel boundary 0.6-0.8 us), the persistent skeleton reaches ~50% of the copy ceiling and the
// kernel chain ~58%, both with no arithmetic at all: below issue 6's 70% for a step of ~179 dependent ops.
// The same bytes as 98 ops (the fused what-if: 6 a layer) read 59% persistent and 71% as a kernel chain.
// Built by scripts/prepare_devcarry.sh (nvcc, sm_90); run on the GPU machine: ./persistent_step_lab [layers]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/bulk_copy.cuh"
#include "lab_check.h"


using ck::cuda::bulk_copy_1d;
using ck::cuda::mbar_arrive;
using ck::cuda::mbar_arrive_expect;
using ck::cuda::mbar_init;
using ck::cuda::mbar_init_fence;
using ck::cuda::mbar_wait;

namespace {

constexpr int kMaxSlots = 9, kChunk = 24 * 1024;  // the ring: up to 9 x 24 KB a block (Args::slots)
constexpr int kConsumerWarps = 7, kThreads = 32 * (1 + kConsumerWarps), kConsumers = 32 * kConsumerWarps;

// One op of the step. bytes: its weights (or state), split into kChunk pieces over the blocks;
// in/out: floats of its input and output vectors; gated: its weights' addresses are the output of op
// gate_op (the routed experts after the route), so no block may stream them before that op is done;
// solo: one block does it (the route), the others only wait for it.
struct Op {
  int64_t bytes;
  int in, out;
  int gate_op;  // -1: not gated
  int solo;
  int64_t first_byte;  // offset in the weight buffer
  int first_chunk;     // rotation: chunk c goes to block (c + first_chunk) % blocks
};

struct Args {
  const Op* ops;
  int n_ops;
  const uint8_t* weights;
  float* act;              // two activation buffers of kMaxAct floats, op i reads act[i % 2], writes act[(i + 1) % 2]
  unsigned* done;          // [n_ops] blocks (or 1 for a solo op) that finished op i
  unsigned long long* sink;
  int wait_inputs;         // 0: the stream variant (no counters, no gating)
  int read_act;            // read the op's input vector after the wait (1), or not (0: the hand-over alone)
  int fence;               // a fence.acq_rel.gpu before the counter's release add (1), or the add alone (0)
  int slots;               // the ring's slots (<= kMaxSlots)
  int relaxed_poll;        // poll the counter with relaxed loads, one acquire fence after (1), or acquire loads (0)
  int l2_ahead;            // chunks past the ring's that the producer asks L2 for (0: none)
};
constexpr int kMaxAct = 16 * 1024;

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned ld_relaxed(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void wait_count(const unsigned* p, unsigned want, bool relaxed = false) {
  uint64_t t0, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  if (relaxed) {
    while (ld_relaxed(p) < want) {
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (now - t0 > 4000000000ull) __trap();
    }
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    return;
  }
  while (ld_acquire(p) < want) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - t0 > 4000000000ull) __trap();  // a block that never came (not all resident): fail, do not hang
  }
}
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory"); }

// Chunk c of op o belongs to this block when (c + o.first_chunk) % blocks == blockIdx.x.
__device__ __forceinline__ int first_mine(const Op& o, int blocks) {
  return ((static_cast<int>(blockIdx.x) - o.first_chunk) % blocks + blocks) % blocks;
}
__host__ __device__ __forceinline__ int n_chunks(const Op& o) { return static_cast<int>((o.bytes + kChunk - 1) / kChunk); }

__global__ void __launch_bounds__(kThreads, 1) step_kernel(const Args a) {
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ uint64_t full[kMaxSlots], empty[kMaxSlots];
  const int kSlots = a.slots;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, blocks = gridDim.x;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kSlots; ++s) {
      mbar_init(&full[s]);
      mbar_init(&empty[s], kConsumers);
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (warp == 0) {  // the producer: every chunk of this block, op after op, as far ahead as the ring allows
    if (lane == 0) {
      int k = 0;
      // L2 look-ahead (Args::l2_ahead): a second cursor over this block's chunks, a.l2_ahead chunks past
      // the one being copied into the ring, asks L2 for its chunk (cp.async.bulk.prefetch.L2), so the
      // ring refills from L2 while the consumers wait on hand-overs. It does not pass a gated op whose
      // gate is not open yet (it tries again at the next chunk).
      int pi = 0, pc = a.n_ops > 0 ? first_mine(a.ops[0], blocks) : 0, pk = 0;
      auto gate_open = [&](const Op& o) {
        return o.gate_op < 0 || !a.wait_inputs ||
               ld_acquire(a.done + o.gate_op) >= (a.ops[o.gate_op].solo ? 1u : static_cast<unsigned>(blocks));
      };
      auto advance_prefetch = [&](int upto) {
        while (pk < upto && pi < a.n_ops) {
          const Op& o = a.ops[pi];
          if (pc >= n_chunks(o)) {
            if (++pi < a.n_ops) pc = first_mine(a.ops[pi], blocks);
            continue;
          }
          if (!gate_open(o)) return;
          const int64_t off = static_cast<int64_t>(pc) * kChunk;
          const uint32_t bytes = static_cast<uint32_t>(o.bytes - off < kChunk ? o.bytes - off : kChunk);
          asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a.weights + o.first_byte + off), "r"(bytes)
                       : "memory");
          pc += blocks;
          ++pk;
        }
      };
      for (int i = 0; i < a.n_ops; ++i) {
        const Op& o = a.ops[i];
        const int nc = n_chunks(o);
        if (o.gate_op >= 0 && a.wait_inputs && first_mine(o, blocks) < nc)
          wait_count(a.done + o.gate_op, a.ops[o.gate_op].solo ? 1u : static_cast<unsigned>(blocks));
        for (int c = first_mine(o, blocks); c < nc; c += blocks, ++k) {
          if (a.l2_ahead > 0) advance_prefetch(k + kSlots + a.l2_ahead);
          const int s = k % kSlots;
          if (k >= kSlots) mbar_wait(&empty[s], ((k / kSlots) - 1) & 1);
          const int64_t off = static_cast<int64_t>(c) * kChunk;
          const uint32_t bytes = static_cast<uint32_t>(o.bytes - off < kChunk ? o.bytes - off : kChunk);
          mbar_arrive_expect(&full[s], bytes);
          bulk_copy_1d(ring + s * kChunk, a.weights + o.first_byte + off, bytes, &full[s]);
        }
      }
    }
    return;
  }
  // The consumers: per op, wait for the op before (every block, or the solo block), read its output,
  // consume this block's chunks from the ring, write this block's share of the output, count.
  const int ct = threadIdx.x - 32;
  unsigned long long x = 0;
  int k = 0;
  for (int i = 0; i < a.n_ops; ++i) {
    const Op& o = a.ops[i];
    const bool works = !o.solo || blockIdx.x == 0;
    if (a.wait_inputs && i > 0) {
      if (ct == 0 && (works || a.ops[i].solo == 0))
        wait_count(a.done + i - 1, a.ops[i - 1].solo ? 1u : static_cast<unsigned>(blocks), a.relaxed_poll != 0);
      consumers_sync();
      if (works && a.read_act) {  // 16-byte loads, four in flight a thread (40 KB: ~3 round trips)
        const float4* in = reinterpret_cast<const float4*>(a.act + (i % 2) * kMaxAct);
#pragma unroll 4
        for (int e = ct; e < o.in / 4; e += kConsumers) {
          const float4 v = __ldcg(in + e);
          x += __float_as_uint(v.x) ^ __float_as_uint(v.y) ^ __float_as_uint(v.z) ^ __float_as_uint(v.w);
        }
      }
    }
    const int nc = n_chunks(o);
    for (int c = first_mine(o, blocks); c < nc; c += blocks, ++k) {
      const int s = k % kSlots;
      mbar_wait(&full[s], (k / kSlots) & 1);
      const int64_t off = static_cast<int64_t>(c) * kChunk;
      const int bytes = static_cast<int>(o.bytes - off < kChunk ? o.bytes - off : kChunk);
      const uint4* p = reinterpret_cast<const uint4*>(ring + s * kChunk);
      for (int e = ct; e < bytes / 16; e += kConsumers) {
        const uint4 v = p[e];
        x ^= (static_cast<unsigned long long>(v.x ^ v.y) << 32) | (v.z ^ v.w);
      }
      mbar_arrive(&empty[s]);
    }
    if (works) {  // this block's share of the op's output
      float* out = a.act + ((i + 1) % 2) * kMaxAct;
      const int per = (o.out + blocks - 1) / blocks, e0 = o.solo ? 0 : blockIdx.x * per, e1 = o.solo ? o.out : min(o.out, e0 + per);
      for (int e = e0 + ct; e < e1; e += kConsumers) out[e] = static_cast<float>(x & 0xFF);
    }
    if (a.wait_inputs) {
      consumers_sync();
      if (ct == 0 && works) {
        if (a.fence) asm volatile("fence.acq_rel.gpu;" ::: "memory");
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(a.done + i) : "memory");
      }
    }
  }
  if (x == 0x123456789ull) a.sink[blockIdx.x] = x;  // keeps the reads
}

// The same op as a kernel of its own (the engine's form at its best): a block per SM at most a.slots x
// 24 KB of ring, so that the next op's kernel, launched early (programmatic dependent launch, triggered
// right after this one's wait), fits beside it and copies its first a.slots chunks into its own ring
// before its wait, while this one computes: each op's weights stream during the op before it. A gated
// op (the experts' gate/up right after the route) copies only after its wait; down, two ops after the
// route, before (the route finished before this kernel could start: the kernel before triggered only
// after its own wait). Then the op's input, its chunks (the ring refilled as they are consumed), its
// output. grid: the SM count, launched in order in one graph.
__global__ void __launch_bounds__(kThreads, 2) chain_kernel(const Args a, int i) {
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ uint64_t full[kMaxSlots];
  const int R = a.slots, blocks = gridDim.x, tid = threadIdx.x;
  const Op o = a.ops[i];
  const int nc = n_chunks(o), c0 = first_mine(o, blocks);
  const int mine = c0 < nc ? (nc - 1 - c0) / blocks + 1 : 0;
  if (tid == 0) {
    for (int s = 0; s < R; ++s) mbar_init(&full[s]);
    mbar_init_fence();
  }
  __syncthreads();
  auto issue = [&](int j) {  // this block's j-th chunk of the op into slot j % R
    const int64_t off = static_cast<int64_t>(c0 + j * blocks) * kChunk;
    const uint32_t bytes = static_cast<uint32_t>(o.bytes - off < kChunk ? o.bytes - off : kChunk);
    mbar_arrive_expect(&full[j % R], bytes);
    bulk_copy_1d(ring + (j % R) * kChunk, a.weights + o.first_byte + off, bytes, &full[j % R]);
  };
  const bool early = o.gate_op < 0 || o.gate_op < i - 1;
  if (tid == 0 && early)
    for (int j = 0; j < mine && j < R; ++j) issue(j);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (tid == 0 && !early)
    for (int j = 0; j < mine && j < R; ++j) issue(j);
  const bool works = !o.solo || blockIdx.x == 0;
  unsigned long long x = 0;
  if (works && a.read_act && i > 0) {
    const float4* in = reinterpret_cast<const float4*>(a.act + (i % 2) * kMaxAct);
#pragma unroll 4
    for (int e = tid; e < o.in / 4; e += kThreads) {
      const float4 v = __ldcg(in + e);
      x += __float_as_uint(v.x) ^ __float_as_uint(v.y) ^ __float_as_uint(v.z) ^ __float_as_uint(v.w);
    }
  }
  for (int j = 0; j < mine; ++j) {
    mbar_wait(&full[j % R], (j / R) & 1);
    const uint4* p = reinterpret_cast<const uint4*>(ring + (j % R) * kChunk);
    const int64_t off = static_cast<int64_t>(c0 + j * blocks) * kChunk;
    const int bytes = static_cast<int>(o.bytes - off < kChunk ? o.bytes - off : kChunk);
    for (int e = tid; e < bytes / 16; e += kThreads) {
      const uint4 v = p[e];
      x ^= (static_cast<unsigned long long>(v.x ^ v.y) << 32) | (v.z ^ v.w);
    }
    __syncthreads();  // the slot is free
    if (tid == 0 && j + R < mine) issue(j + R);
  }
  if (works) {
    float* out = a.act + ((i + 1) % 2) * kMaxAct;
    const int per = (o.out + blocks - 1) / blocks, e0 = o.solo ? 0 : blockIdx.x * per, e1 = o.solo ? o.out : min(o.out, e0 + per);
    for (int e = e0 + tid; e < e1; e += kThreads) out[e] = static_cast<float>(x & 0xFF);
  }
  if (x == 0x123456789ull) a.sink[blockIdx.x] = x;
}

// An empty kernel for the boundary chain: waits for the kernel before, then lets the next one start.
__global__ void empty_kernel(float* p) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (p == nullptr) p[threadIdx.x] = 0.0f;
}

void add(std::vector<Op>& ops, int64_t bytes, int in, int out, int gate_op = -1, int solo = 0) {
  bytes = (bytes + 15) / 16 * 16;
  ops.push_back(Op{bytes, in, out, gate_op, solo, 0, 0});
}
// MLX 4-bit group 64 with bf16 scales and biases: 0.5625 bytes a weight.
int64_t q4(int64_t rows, int64_t cols) { return rows * cols / 2 + rows * (cols / 64) * 4; }
int64_t q8(int64_t rows, int64_t cols) { return rows * cols + rows * (cols / 64) * 4; }

// The one-row step of the 16-layer synthetic model of the released geometry (H 2,560, 4 streams,
// low rank 320, DeltaNet 16 key / 48 value heads of 128, QSA 24 heads of 256 and 2 KV heads, 512
// experts of 640 top-10 plus the shared one, vocabulary 248,320), op by op as the engine runs it.
// fused: the same bytes in fewer dependent ops, as if each pair of ops without a grid-wide dependency
// between them were one (a what-if for the op count, not a design): the mix's two phases, in_proj with
// the recurrence (a head's recurrence needs only its head's projections), router with route, gate/up
// with down (an expert's down needs only its own gate/up). 6 ops a layer instead of 11 (10 for QSA).
std::vector<Op> step_ops(int layers, bool fused = false) {
  const int H = 2560, W = 4 * H, LR = 320, I = 640, V = 248320;
  std::vector<Op> ops;
  auto mix = [&](int inject) {
    if (fused) {
      add(ops, q4(LR + inject, W) + q4(W, LR), W, H);
      return;
    }
    add(ops, q4(LR + inject, W), W, LR);  // norm + down (+ inject)
    add(ops, q4(W, LR), LR, H);           // up + gate mean
  };
  for (int l = 0; l < layers; ++l) {
    mix(4);
    if (fused) {
      if (l % 4 != 3) {
        add(ops, q4(2 * 16 * 128 + 48 * 128 + 48 * 128 + 2 * 48, H) + int64_t{48} * 128 * 128 * 4, H, 48 * 128);
        add(ops, q4(H, 48 * 128), 48 * 128, H);
      } else {
        add(ops, q4(2 * 24 * 256 + 2 * 256 + 2 * 256 + 4 * 128, H), H, 2 * 24 * 256 + 1024);
        add(ops, q4(H, 24 * 256), 24 * 256, H);  // attention with o_proj
      }
      mix(4);
      add(ops, q8(512 + 1, H), H, 32);  // router + route
      const int route = static_cast<int>(ops.size()) - 1;
      add(ops, 11 * 2 * q4(I, H) + 11 * q4(H, I), H, H, route);  // the experts, gated by the route
      continue;
    }
    if (l % 4 != 3) {
      add(ops, q4(2 * 16 * 128 + 48 * 128 + 48 * 128 + 2 * 48, H), H, 2 * 16 * 128 + 48 * 128);  // in_proj (+ conv)
      add(ops, int64_t{48} * 128 * 128 * 4, 2 * 16 * 128 + 48 * 128, 48 * 128);                    // recurrence: the state
      add(ops, q4(H, 48 * 128), 48 * 128, H);                                                     // out_proj
    } else {
      add(ops, q4(2 * 24 * 256 + 2 * 256 + 2 * 256 + 4 * 128, H), H, 2 * 24 * 256 + 1024);  // q/k/v/index
      add(ops, 0, 2 * 24 * 256 + 1024, 24 * 256);                                          // attention (short context)
      add(ops, q4(H, 24 * 256), 24 * 256, H);                                              // o_proj
    }
    mix(4);
    add(ops, q8(512 + 1, H), H, 513);  // router + shared gate
    const int route = static_cast<int>(ops.size());
    add(ops, 0, 513, 32, -1, 1);                       // route: one block
    add(ops, 11 * 2 * q4(I, H), H, 11 * I, route);     // gate/up of 10 routed + the shared expert
    add(ops, 11 * q4(H, I), 11 * I, H, route);         // down
  }
  mix(0);                                     // final mixer
  add(ops, q4(V, H), H, 0);                   // LM head (its argmax not modelled)
  return ops;
}

// n launches captured into one graph, each with programmatic dependent launch (it may start once the
// one before triggers): launch(i, cfg) issues launch i with cfg (stream and the attribute set).
template <class Launch>
cudaGraphExec_t pdl_chain_graph(cudaStream_t st, int n, const Launch& launch) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < n; ++i) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    launch(i, cfg);
  }
  CHECK(cudaStreamEndCapture(st, &g));
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  CHECK(cudaGraphDestroy(g));
  return ge;
}

// Times body (enqueued on st) 12 times between two events, each after prep (untimed), and returns the
// last 10 times (ms), sorted: the first two runs are warm-up.
template <class Prep, class Body>
std::vector<float> sorted_times(cudaStream_t st, const Prep& prep, const Body& body) {
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int rep = 0; rep < 12; ++rep) {
    prep();
    CHECK(cudaEventRecord(e0, st));
    body();
    CHECK(cudaEventRecord(e1, st));
    CHECK(cudaEventSynchronize(e1));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, e0, e1));
    if (rep >= 2) ms.push_back(t);
  }
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
  std::sort(ms.begin(), ms.end());
  return ms;
}

struct Variant {
  const char* name;
  bool wait_inputs, zero_bytes, read_act = true, fence = true, gated = true;
  int slots = 8;
  bool relaxed_poll = false;
  int l2_ahead = 0;
};

// chain: the op list as a graph of chain_kernel launches instead of one persistent kernel.
float run(const Variant& v, std::vector<Op> ops, int blocks, const uint8_t* wbuf, int64_t wcap, float* act,
          unsigned* done, unsigned long long* sink, Op* d_ops, double copy_gbs, bool chain = false) {
  const char* name = v.name;
  const bool zero_bytes = v.zero_bytes;
  int64_t off = 0, total = 0;
  int rot = 0;
  for (Op& o : ops) {
    if (zero_bytes) o.bytes = 0;
    if (!v.gated) o.gate_op = -1;
    if (off + o.bytes > wcap) off = 0;  // (the buffer holds the whole step: never wraps at 16 layers)
    o.first_byte = off;
    o.first_chunk = rot;
    rot = (rot + n_chunks(o)) % blocks;  // the next op starts where this one ended: blocks stay balanced
    off += o.bytes;
    total += o.bytes;
  }
  CHECK(cudaMemcpy(d_ops, ops.data(), sizeof(Op) * ops.size(), cudaMemcpyHostToDevice));
  Args a{d_ops, static_cast<int>(ops.size()), wbuf, act, done, sink, v.wait_inputs ? 1 : 0, v.read_act ? 1 : 0,
         v.fence ? 1 : 0, v.slots, v.relaxed_poll ? 1 : 0, v.l2_ahead};
  const size_t smem = static_cast<size_t>(v.slots) * kChunk;
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaGraphExec_t ge = nullptr;
  if (chain)
    ge = pdl_chain_graph(st, static_cast<int>(ops.size()), [&](int i, cudaLaunchConfig_t& cfg) {
      cfg.gridDim = dim3(blocks);
      cfg.blockDim = dim3(kThreads);
      cfg.dynamicSmemBytes = smem;
      CHECK(cudaLaunchKernelEx(&cfg, chain_kernel, a, i));
    });
  auto reset = [&] { CHECK(cudaMemsetAsync(done, 0, sizeof(unsigned) * ops.size(), st)); };
  auto step = [&] {
    void* params[] = {&a};
    if (chain) CHECK(cudaGraphLaunch(ge, st));
    else CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(step_kernel), dim3(blocks), dim3(kThreads), params, smem, st));
  };
  const std::vector<float> ms = sorted_times(st, reset, step);
  if (ge) CHECK(cudaGraphExecDestroy(ge));
  CHECK(cudaStreamDestroy(st));
  const float med = ms[ms.size() / 2];
  const double gbs = total / (med * 1e-3) / 1e9;
  std::printf("%-12s %3zu ops  %8.1f MB  median %8.1f us (min %8.1f)  %7.1f us/op  %6.0f GB/s  %5.1f%% of copy  %6.1f tok/s\n",
              name, ops.size(), total / 1e6, med * 1e3, ms.front() * 1e3, med * 1e3 / ops.size(), gbs,
              copy_gbs > 0 ? 100.0 * gbs / copy_gbs : 0.0, 1e3 / med);
  return med;
}

}  // namespace

int main(int argc, char** argv) {
  const int layers = argc > 1 ? std::atoi(argv[1]) : 16;
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const size_t smem = static_cast<size_t>(kMaxSlots) * kChunk;
  CHECK(cudaFuncSetAttribute(step_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, step_kernel, kThreads, smem));
  const int blocks = prop.multiProcessorCount;
  if (per_sm < 1) {
    std::fprintf(stderr, "step_kernel does not fit an SM\n");
    return 1;
  }
  std::vector<Op> ops = step_ops(layers);
  int64_t need = 0;
  for (const Op& o : ops) need += (o.bytes + 15) / 16 * 16;
  uint8_t* wbuf = nullptr;
  CHECK(cudaMalloc(&wbuf, need));
  CHECK(cudaMemset(wbuf, 0x5A, need));
  float* act = nullptr;
  unsigned* done = nullptr;
  unsigned long long* sink = nullptr;
  Op* d_ops = nullptr;
  CHECK(cudaMalloc(&act, sizeof(float) * 2 * kMaxAct));
  CHECK(cudaMemset(act, 0, sizeof(float) * 2 * kMaxAct));
  CHECK(cudaMalloc(&done, sizeof(unsigned) * ops.size()));
  CHECK(cudaMalloc(&sink, sizeof(unsigned long long) * blocks));
  CHECK(cudaMalloc(&d_ops, sizeof(Op) * ops.size()));

  // The copy ceiling as bench_cuda measures it: a device-to-device copy, read + write bytes over time.
  const size_t cb = size_t{1} << 30;
  uint8_t *c0 = nullptr, *c1 = nullptr;
  CHECK(cudaMalloc(&c0, cb));
  CHECK(cudaMalloc(&c1, cb));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  float best = 1e9f;
  for (int rep = 0; rep < 6; ++rep) {
    CHECK(cudaEventRecord(e0));
    CHECK(cudaMemcpyAsync(c1, c0, cb, cudaMemcpyDeviceToDevice));
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, e0, e1));
    if (rep > 0) best = std::min(best, t);
  }
  const double copy_gbs = 2.0 * cb / (best * 1e-3) / 1e9;
  CHECK(cudaFree(c0));
  CHECK(cudaFree(c1));
  std::printf("%s, %d SMs; %d layers; ring of %d KB slots a block (8 unless named), %d consumer warps; copy %.1f GB/s (read + write)\n",
              prop.name, blocks, layers, kChunk / 1024, kConsumerWarps, copy_gbs);
  std::printf("step at the copy rate: %.1f us (%.1f tok/s)\n", need / copy_gbs / 1e3, copy_gbs * 1e9 / need);
  // ungated: the experts' weights streamed as if their addresses were known ahead (what the route's
  // gate costs); -noact: the hand-over without reading the input vector; -nofence: the counter's
  // release add without a fence before it.
  const Variant variants[] = {
      {"stream", false, false},
      {"step", true, false},
      {"step-nofence", true, false, true, false},
      {"ungated", true, false, true, true, false},
      {"hops", true, true},
      {"hops-noact", true, true, false},
      {"hops-nofence", true, true, true, false},
      {"hops-bare", true, true, false, false},
      {"step-9slots", true, false, true, false, true, 9},
      {"step-relaxed", true, false, true, false, true, 8, true},
      {"step-noact", true, false, false, false, true, 8, true},
      {"hops-relaxed", true, true, true, false, true, 8, true},
      {"step-l2x8", true, false, true, false, true, 8, false, 8},
      {"step-l2x16", true, false, true, false, true, 8, false, 16},
      {"step-l2x32", true, false, true, false, true, 8, false, 32},
      {"noact-l2x16", true, false, false, false, true, 8, false, 16},
  };
  for (const Variant& v : variants) run(v, ops, blocks, wbuf, need, act, done, sink, d_ops, copy_gbs);
  // The kernel-per-op chain: rings of 4 (2 kernels an SM) or 3 slots, with and without the input reads.
  CHECK(cudaFuncSetAttribute(chain_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * kChunk));
  const Variant chains[] = {
      {"chain-4", true, false, true, false, true, 4},
      {"chain-3", true, false, true, false, true, 3},
      {"chain-4-noact", true, false, false, false, true, 4},
      {"chain-hops", true, true, true, false, true, 4},
  };
  for (const Variant& v : chains) run(v, ops, blocks, wbuf, need, act, done, sink, d_ops, copy_gbs, true);
  // The same bytes in fewer dependent ops (step_ops' fused what-if).
  const std::vector<Op> fused = step_ops(layers, true);
  const Variant fused_variants[] = {
      {"fused-step", true, false, true, false},
      {"fused-chain", true, false, true, false, true, 4},
  };
  run(fused_variants[0], fused, blocks, wbuf, need, act, done, sink, d_ops, copy_gbs);
  run(fused_variants[1], fused, blocks, wbuf, need, act, done, sink, d_ops, copy_gbs, true);
  // The engine's alternative for the hand-overs: a chain of kernel boundaries. The same number of empty
  // kernels, each waiting on the one before under programmatic dependent launch, in one graph.
  {
    cudaStream_t st;
    CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const cudaGraphExec_t ge = pdl_chain_graph(st, static_cast<int>(ops.size()), [&](int, cudaLaunchConfig_t& cfg) {
      cfg.gridDim = dim3(blocks);
      cfg.blockDim = dim3(kThreads);
      CHECK(cudaLaunchKernelEx(&cfg, empty_kernel, act));
    });
    const std::vector<float> ms = sorted_times(st, [] {}, [&] { CHECK(cudaGraphLaunch(ge, st)); });
    std::printf("%-12s %3zu empty kernels in a graph (programmatic launch): median %8.1f us, %5.2f us a boundary\n",
                "boundaries", ops.size(), ms[ms.size() / 2] * 1e3, ms[ms.size() / 2] * 1e3 / ops.size());
    CHECK(cudaGraphExecDestroy(ge));
    CHECK(cudaStreamDestroy(st));
  }
  CHECK(cudaDeviceSynchronize());
  return 0;
}
