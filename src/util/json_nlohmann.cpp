#include "util/json_nlohmann.h"

namespace ck {

namespace {

template <typename J>
Result<J> nl_parse_as(std::string_view text) {
  try {
    return J::parse(text.begin(), text.end());
  } catch (const typename J::exception& e) {
    return Status::error(e.what());
  }
}

template <typename J>
std::string nl_dump_as(const J& j, int indent) {
  return j.dump(indent, ' ', false, J::error_handler_t::replace);
}

}  // namespace

Result<json> parse_nljson(std::string_view text) { return nl_parse_as<json>(text); }
Result<ojson> parse_ojson(std::string_view text) { return nl_parse_as<ojson>(text); }
std::string dump_json(const json& j, int indent) { return nl_dump_as(j, indent); }
std::string dump_json(const ojson& j, int indent) { return nl_dump_as(j, indent); }

}  // namespace ck
