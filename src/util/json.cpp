#include "util/json.h"

namespace ck {

namespace {

template <typename J>
Result<J> parse_as(std::string_view text) {
  try {
    return J::parse(text.begin(), text.end());
  } catch (const typename J::exception& e) {
    return Status::error(e.what());
  }
}

template <typename J>
std::string dump_as(const J& j, int indent) {
  return j.dump(indent, ' ', false, J::error_handler_t::replace);
}

}  // namespace

Result<json> parse_json(std::string_view text) { return parse_as<json>(text); }
Result<ojson> parse_ojson(std::string_view text) { return parse_as<ojson>(text); }
std::string dump_json(const json& j, int indent) { return dump_as(j, indent); }
std::string dump_json(const ojson& j, int indent) { return dump_as(j, indent); }

}  // namespace ck
