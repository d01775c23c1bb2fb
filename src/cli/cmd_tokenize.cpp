// `cherenkov tokenize`: text on stdin -> token ids on stdout, or the reverse with --decode.
// Plain mode reads all of stdin as one text and prints one comma-separated line; --jsonl treats
// each input line as one JSON string (or, with --decode, one JSON array of ids) and prints one
// JSON value per line. Errors are one line on stderr and a non-zero exit.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>
#include <iterator>
#include <string>

#include "cli/command.h"
#include "text/tokenizer.h"
#include "util/json.h"

namespace {


std::string join_ids(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(ids[i]);
  }
  return s;
}

// Parses "1, 2,3\n" into ids; false (with a message) on anything else.
bool parse_id_list(const std::string& text, std::vector<int32_t>& ids, std::string& err) {
  size_t i = 0;
  auto skip_ws = [&] { while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i; };
  skip_ws();
  while (i < text.size()) {
    size_t start = i;
    if (text[i] == '-') ++i;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
    if (i == start || (i == start + 1 && text[start] == '-')) {
      err = "expected a token id at byte " + std::to_string(start);
      return false;
    }
    try {
      ids.push_back(static_cast<int32_t>(std::stol(text.substr(start, i - start))));
    } catch (const std::exception&) {
      err = "token id out of range at byte " + std::to_string(start);
      return false;
    }
    skip_ws();
    if (i < text.size()) {
      if (text[i] != ',') {
        err = "expected ',' at byte " + std::to_string(i);
        return false;
      }
      ++i;
      skip_ws();
    }
  }
  return true;
}

int run_tokenize(int argc, char** argv) {
  CLI::App app{"Encode UTF-8 text from stdin to token ids (or decode ids with --decode)"};
  std::string tokenizer_path;
  bool jsonl = false, decode = false, no_special = false, skip_special = false;
  app.add_option("--tokenizer", tokenizer_path, "tokenizer.json")->required();
  app.add_flag("--jsonl", jsonl, "one JSON string (or id array with --decode) per input line");
  app.add_flag("--decode", decode, "ids -> text");
  app.add_flag("--no-special", no_special, "encode special tokens like <|im_start|> as plain text");
  app.add_flag("--skip-special", skip_special, "with --decode: drop special tokens");
  CLI11_PARSE(app, argc, argv);

  auto tok = ck::text::Tokenizer::load(tokenizer_path);
  if (!tok.ok()) {
    std::fprintf(stderr, "error: %s\n", tok.status().message().c_str());
    return 1;
  }

  if (!jsonl) {
    std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    if (decode) {
      std::vector<int32_t> ids;
      std::string err;
      if (!parse_id_list(input, ids, err)) {
        std::fprintf(stderr, "error: stdin: %s\n", err.c_str());
        return 1;
      }
      std::string text = tok->decode(ids, skip_special);
      std::fwrite(text.data(), 1, text.size(), stdout);
    } else {
      std::string line = join_ids(tok->encode(input, !no_special)) + "\n";
      std::fwrite(line.data(), 1, line.size(), stdout);
    }
    return 0;
  }

  std::string line;
  size_t line_no = 0;
  while (std::getline(std::cin, line)) {
    ++line_no;
    auto parsed = ck::parse_json(line);
    if (!parsed.ok()) {
      std::fprintf(stderr, "error: stdin line %zu: malformed JSON: %s\n", line_no, parsed.status().message().c_str());
      return 1;
    }
    const ck::JsonDoc& v = *parsed;
    std::string out;
    if (decode) {
      if (!v.is_array()) {
        std::fprintf(stderr, "error: stdin line %zu: expected a JSON array of ids\n", line_no);
        return 1;
      }
      std::vector<int32_t> ids;
      for (ck::JsonRef x : v.elements()) {
        if (!x.is_integer()) {
          std::fprintf(stderr, "error: stdin line %zu: ids must be integers\n", line_no);
          return 1;
        }
        ids.push_back(static_cast<int32_t>(x.as_int()));
      }
      out = ck::json_quote(tok->decode(ids, skip_special)) + "\n";
    } else {
      if (!v.is_string()) {
        std::fprintf(stderr, "error: stdin line %zu: expected a JSON string\n", line_no);
        return 1;
      }
      ck::JsonBuilder ids;
      ids.begin_array();
      for (int32_t id : tok->encode(v.as_string(), !no_special)) ids.value(id);
      out = ids.end_array().finish().dump() + "\n";
    }
    std::fwrite(out.data(), 1, out.size(), stdout);
  }
  return 0;
}

ck::cli::Registrar register_tokenize("tokenize", "text on stdin -> token ids (or ids -> text with --decode)", run_tokenize);

}  // namespace
