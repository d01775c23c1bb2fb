// Transitional: nlohmann::json for the files not yet moved onto util/json.h. Removed once none is left.
#pragma once
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "util/status.h"

namespace ck {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

Result<json> parse_nljson(std::string_view text);
Result<ojson> parse_ojson(std::string_view text);
std::string dump_json(const json& j, int indent = -1);
std::string dump_json(const ojson& j, int indent = -1);

}  // namespace ck
