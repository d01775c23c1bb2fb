// What a captured decode step's CUDA graph is made of: its nodes by type, and how its kernels depend
// on each other. A kernel whose edge from the kernel before is programmatic starts early (its blocks
// resident while that kernel still runs, doing what depends on nothing before their wait); a full
// edge, or a copy or memory node between two kernels, makes it start only after the kernel before has
// ended (docs/roofline-cuda.md, "Twenty-eighth session"). Session keeps one per captured step graph;
// CK_GRAPH_STATS=1 logs it at capture, and the model tests check that no decode step loses an early
// launch by accident.
#pragma once
#include <cuda_runtime.h>

#include <map>
#include <string>
#include <vector>

namespace ck::cuda {

struct GraphShape {
  int kernels = 0;
  int copies = 0;     // memcpy nodes (the step's params in, its outputs out)
  int memsets = 0;
  int mem_nodes = 0;  // memory allocation and free nodes (cudaMallocAsync / cudaFreeAsync in the capture)
  int other = 0;      // any other node type
  int early_edges = 0;        // kernel -> kernel, programmatic (the second starts early)
  int full_kernel_edges = 0;  // kernel -> kernel, full completion
  int edges_via_nodes = 0;    // edges from or to a node that is not a kernel
  // Kernels that wait for every node before them, one line each: "after -> kernel" (a name is the
  // kernel's function name without its template arguments; "copy", "memset", ... for other nodes).
  std::vector<std::string> late_kernels;
  std::map<std::string, int> kernel_counts;  // launches per kernel function
};

// Reads `g` (not modified). Never fails: a query the runtime refuses leaves its counts at zero.
GraphShape graph_shape(cudaGraph_t g);

// One line: the node counts and the kernel edges.
std::string summary(const GraphShape& s);
// Lines for a log: summary(), then the late kernels, then the launches per function (largest first).
std::string describe(const GraphShape& s);

}  // namespace ck::cuda
