// A captured graph's nodes and edges, read back through the runtime's graph queries (graph_shape.h).
#include "cuda/graph_shape.h"

#include <cxxabi.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <unordered_map>

namespace ck::cuda {
namespace {

// "ck::cuda::(anonymous namespace)::gemv_kernel<4, true>(Args)" -> "gemv_kernel": the function's own
// name, which is what a reader looks for in the sources.
std::string short_name(const char* mangled) {
  if (!mangled) return "?";
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> d(abi::__cxa_demangle(mangled, nullptr, nullptr, &status), std::free);
  std::string n = status == 0 && d ? d.get() : mangled;
  // Drop "(anonymous namespace)::", cut the arguments and template arguments (from the first '(' or
  // '<'), then the return type (a template's demangled name starts with it) and the namespaces.
  for (size_t at; (at = n.find("(anonymous namespace)::")) != std::string::npos;) n.erase(at, 23);
  if (const size_t cut = n.find_first_of("(<"); cut != std::string::npos) n.resize(cut);
  if (const size_t space = n.rfind(' '); space != std::string::npos) n.erase(0, space + 1);
  const size_t colon = n.rfind("::");
  return colon == std::string::npos ? n : n.substr(colon + 2);
}

const char* type_name(cudaGraphNodeType t) {
  switch (t) {
    case cudaGraphNodeTypeKernel: return "kernel";
    case cudaGraphNodeTypeMemcpy: return "copy";
    case cudaGraphNodeTypeMemset: return "memset";
    case cudaGraphNodeTypeMemAlloc: return "alloc";
    case cudaGraphNodeTypeMemFree: return "free";
    case cudaGraphNodeTypeHost: return "host";
    case cudaGraphNodeTypeEmpty: return "empty";
    default: return "other";
  }
}

}  // namespace

GraphShape graph_shape(cudaGraph_t g) {
  GraphShape s;
  size_t n_nodes = 0;
  if (cudaGraphGetNodes(g, nullptr, &n_nodes) != cudaSuccess) return s;
  std::vector<cudaGraphNode_t> nodes(n_nodes);
  if (cudaGraphGetNodes(g, nodes.data(), &n_nodes) != cudaSuccess) return s;
  std::unordered_map<cudaGraphNode_t, std::pair<cudaGraphNodeType, std::string>> info;
  for (cudaGraphNode_t n : nodes) {
    cudaGraphNodeType t = cudaGraphNodeTypeCount;
    cudaGraphNodeGetType(n, &t);
    std::string name = type_name(t);
    switch (t) {
      case cudaGraphNodeTypeKernel: {
        ++s.kernels;
        cudaKernelNodeParams p{};
        const char* fn = nullptr;
        if (cudaGraphKernelNodeGetParams(n, &p) == cudaSuccess && cudaFuncGetName(&fn, p.func) == cudaSuccess)
          name = short_name(fn);
        ++s.kernel_counts[name];
        break;
      }
      case cudaGraphNodeTypeMemcpy: ++s.copies; break;
      case cudaGraphNodeTypeMemset: ++s.memsets; break;
      case cudaGraphNodeTypeMemAlloc:
      case cudaGraphNodeTypeMemFree: ++s.mem_nodes; break;
      default: ++s.other; break;
    }
    info[n] = {t, name};
  }
  cudaGetLastError();  // a refused name query must not surface as a later launch's error
  size_t n_edges = 0;
  if (cudaGraphGetEdges(g, nullptr, nullptr, nullptr, &n_edges) != cudaSuccess) return s;
  std::vector<cudaGraphNode_t> from(n_edges), to(n_edges);
  std::vector<cudaGraphEdgeData> data(n_edges);
  if (cudaGraphGetEdges(g, from.data(), to.data(), data.data(), &n_edges) != cudaSuccess) return s;
  for (size_t e = 0; e < n_edges; ++e) {
    const auto& a = info[from[e]];
    const auto& b = info[to[e]];
    if (a.first != cudaGraphNodeTypeKernel || b.first != cudaGraphNodeTypeKernel) {
      ++s.edges_via_nodes;
      if (b.first == cudaGraphNodeTypeKernel && a.first != cudaGraphNodeTypeKernel)
        s.late_kernels.push_back(a.second + " -> " + b.second);
      continue;
    }
    const bool early = data[e].type == cudaGraphDependencyTypeProgrammatic || data[e].from_port != 0;
    if (early) {
      ++s.early_edges;
    } else {
      ++s.full_kernel_edges;
      s.late_kernels.push_back(a.second + " -> " + b.second);
    }
  }
  return s;
}

std::string summary(const GraphShape& s) {
  return fmt::format(
      "{} kernels, {} copies, {} memsets, {} memory nodes, {} other; kernel edges: {} early, {} full; "
      "{} edges through other nodes",
      s.kernels, s.copies, s.memsets, s.mem_nodes, s.other, s.early_edges, s.full_kernel_edges, s.edges_via_nodes);
}

std::string describe(const GraphShape& s) {
  std::string out = summary(s);
  for (const std::string& l : s.late_kernels) out += fmt::format("\n  starts late: {}", l);
  std::vector<std::pair<std::string, int>> counts(s.kernel_counts.begin(), s.kernel_counts.end());
  std::stable_sort(counts.begin(), counts.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
  for (const auto& [name, n] : counts) out += fmt::format("\n  {:4d} x {}", n, name);
  return out;
}

}  // namespace ck::cuda
