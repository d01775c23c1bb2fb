// JSON values (nlohmann::json) with the parser and the serializer compiled once, in util/json.cpp.
// Why: nlohmann's parse() and dump() are templates that cost ~3 s and ~1.5 s of compile time in every
// translation unit that calls them; the README's first command must build in about a minute on two
// cores. Reading fields (at, get, contains, iteration) stays inline: it is cheap.
#pragma once
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "util/status.h"

namespace ck {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;  // keeps object keys in input order (Jinja's tojson needs it)

// Parses a whole JSON text. The error message is the parser's (position and what it expected);
// callers prefix the file or field it came from.
Result<json> parse_json(std::string_view text);
Result<ojson> parse_ojson(std::string_view text);

// Serializes; indent < 0 gives the compact one-line form. Invalid UTF-8 in strings is replaced by
// U+FFFD instead of throwing.
std::string dump_json(const json& j, int indent = -1);
std::string dump_json(const ojson& j, int indent = -1);

}  // namespace ck
