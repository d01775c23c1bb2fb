// Jinja-subset interpreter for chat templates (see chat_template.h): the lexer (whitespace control
// as jinja2 with trim_blocks and lstrip_blocks, the settings transformers uses), a recursive-
// descent parser to an AST, and a tree-walking evaluator with the filters, tests and methods.
// Values and their Python semantics are in jinja_value.{h,cpp}.
// Errors inside the interpreter are thrown as TemplateError (every expression can fail, and
// threading a Status through each recursive eval would bury the logic); render() and parse()
// catch them and return a Status naming the template line. Nothing throws past this file.
#include "text/chat_template.h"

#include <unicode/locid.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <ctime>
#include <unordered_map>

#include "text/jinja_value.h"
#include "text/utf8.h"
#include "util/file.h"

namespace ck::text {

namespace {

using namespace jinja;

// ---------------------------------------------------------------------------------------------
// Lexer: template text -> text pieces and tags, with whitespace control applied.

struct Tok {
  enum class T { Name, Str, Int, Float, Op, End } t = T::End;
  std::string s;  // Name, Str, Op
  int64_t i = 0;
  double f = 0;
  int line = 0;
};

struct Piece {
  enum class P { Text, Var, Block } p;
  std::string text;
  std::vector<Tok> toks;  // Var/Block, ending with an End token
  int line;
};

bool is_name_start(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; }
bool is_name_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// Python's \s as used by jinja2's whitespace control ("-") and lstrip_blocks.
size_t ws_len_at(std::string_view s, size_t n) {
  unsigned char c = s[n];
  if (c < 0x80) return py_isspace(c) ? 1 : 0;
  Utf8Char u = utf8_next(s.substr(n));
  if (u.step != Utf8Step::Valid) return 0;
  size_t k = n;
  return py_isspace(utf8_decode_at(s, k)) ? u.n_bytes : 0;
}
std::string rstrip_ws(const std::string& s) {
  std::vector<uint32_t> cps = code_points(s);
  size_t b = cps.size();
  while (b > 0 && py_isspace(cps[b - 1])) --b;
  return from_code_points(cps, 0, b);
}
bool all_ws(std::string_view s) {
  for (size_t n = 0; n < s.size();) {
    size_t w = ws_len_at(s, n);
    if (!w) return false;
    n += w;
  }
  return true;
}

// Decodes a Jinja string literal body (Python unicode-escape rules).
std::string unescape(std::string_view body, int line) {
  std::string out;
  for (size_t n = 0; n < body.size(); ++n) {
    char c = body[n];
    if (c != '\\' || n + 1 >= body.size()) { out += c; continue; }
    char e = body[++n];
    switch (e) {
      case 'n': out += '\n'; break;
      case 't': out += '\t'; break;
      case 'r': out += '\r'; break;
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'v': out += '\v'; break;
      case '0': out += '\0'; break;
      case '\n': break;  // line continuation
      case 'x': case 'u': case 'U': {
        size_t nd = e == 'x' ? 2 : e == 'u' ? 4 : 8;
        uint32_t cp = 0;
        for (size_t k = 1; k <= nd; ++k) {
          if (n + k >= body.size() || !std::isxdigit(static_cast<unsigned char>(body[n + k])))
            fail(line, "bad \\" + std::string(1, e) + " escape in string literal");
          cp = cp * 16 + static_cast<uint32_t>(std::stoi(std::string(1, body[n + k]), nullptr, 16));
        }
        if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) fail(line, "escape is not a Unicode scalar value");
        utf8_append(out, cp);
        n += nd;
        break;
      }
      default: out += '\\'; out += e;  // unknown escapes stay as written (Python does the same)
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string src) : src_(std::move(src)) {}

  std::vector<Piece> run() {
    normalize_newlines();
    std::vector<Piece> out;
    size_t pos = 0;
    bool line_starting = true;
    while (pos < src_.size()) {
      size_t tag = find_tag(pos);
      std::string text = src_.substr(pos, (tag == std::string::npos ? src_.size() : tag) - pos);
      if (tag == std::string::npos) {
        push_text(out, text, line_of(pos));
        break;
      }
      char kind = src_[tag + 1];  // '{', '%' or '#'
      char mod = tag + 2 < src_.size() ? src_[tag + 2] : 0;
      if (mod == '-') {
        text = rstrip_ws(text);
      } else if (mod != '+' && kind != '{') {  // lstrip_blocks: only for blocks and comments
        size_t l_pos = text.rfind('\n');
        l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
        if ((l_pos > 0 || line_starting) && l_pos < text.size() && all_ws(std::string_view(text).substr(l_pos)))
          text.resize(l_pos);
      }
      push_text(out, text, line_of(pos));
      size_t body = tag + 2 + ((mod == '-' || mod == '+') ? 1 : 0);
      int line = line_of(tag);
      size_t end;
      if (kind == '#') {
        size_t close = src_.find("#}", body);
        if (close == std::string::npos) fail(line, "unclosed comment {#");
        end = finish_tag(close, close + 2, true);
      } else {
        Piece p{kind == '{' ? Piece::P::Var : Piece::P::Block, {}, {}, line};
        size_t close = tokenize(body, kind == '{' ? "}}" : "%}", p.toks, line);
        end = finish_tag(close, close + 2, kind == '%');
        out.push_back(std::move(p));
      }
      line_starting = end > 0 && src_[end - 1] == '\n';
      pos = end;
    }
    return out;
  }

 private:
  void normalize_newlines() {
    std::string s;
    s.reserve(src_.size());
    for (size_t n = 0; n < src_.size(); ++n) {
      if (src_[n] == '\r') {
        s += '\n';
        if (n + 1 < src_.size() && src_[n + 1] == '\n') ++n;
      } else {
        s += src_[n];
      }
    }
    if (!s.empty() && s.back() == '\n') s.pop_back();  // jinja2's keep_trailing_newline=False
    src_ = std::move(s);
  }

  size_t find_tag(size_t pos) const {
    for (size_t n = src_.find('{', pos); n != std::string::npos; n = src_.find('{', n + 1)) {
      if (n + 1 < src_.size() && (src_[n + 1] == '{' || src_[n + 1] == '%' || src_[n + 1] == '#')) return n;
    }
    return std::string::npos;
  }

  int line_of(size_t pos) {
    while (line_pos_ < pos && line_pos_ < src_.size()) {
      if (src_[line_pos_] == '\n') ++line_;
      ++line_pos_;
    }
    return line_;
  }

  void push_text(std::vector<Piece>& out, const std::string& text, int line) {
    if (!text.empty()) out.push_back({Piece::P::Text, text, {}, line});
  }

  // `close` is where "}}"/"%}"/"#}" starts, `after` just past it. Applies "-" (strip following
  // whitespace) or trim_blocks (drop one newline) and returns where the next text starts.
  size_t finish_tag(size_t close, size_t after, bool is_block) {
    char before = close > 0 ? src_[close - 1] : 0;
    if (before == '-') {
      while (after < src_.size()) {
        size_t w = ws_len_at(src_, after);
        if (!w) break;
        after += w;
      }
    } else if (before != '+' && is_block && after < src_.size() && src_[after] == '\n') {
      ++after;
    }
    return after;
  }

  // Tokenizes an expression from `pos` up to the closing delimiter; returns where it starts.
  size_t tokenize(size_t pos, const char* closer, std::vector<Tok>& toks, int line0) {
    static const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "(", ")", "[", "]", "{", "}", ",", ".", ":",
                                 "|", "~", "+", "-", "*", "/", "%", "=", "<", ">"};
    int line = line0;
    while (true) {
      while (pos < src_.size() && std::isspace(static_cast<unsigned char>(src_[pos]))) {
        if (src_[pos] == '\n') ++line;
        ++pos;
      }
      if (pos >= src_.size()) fail(line0, std::string("unclosed tag: missing ") + closer);
      if (src_.compare(pos, 2, closer) == 0) break;
      if ((src_[pos] == '-' || src_[pos] == '+') && src_.compare(pos + 1, 2, closer) == 0) { pos += 1; break; }
      char c = src_[pos];
      Tok t;
      t.line = line;
      if (c == '\'' || c == '"') {
        size_t n = pos + 1;
        while (n < src_.size() && src_[n] != c) n += src_[n] == '\\' ? 2 : 1;
        if (n >= src_.size()) fail(line, "unterminated string literal");
        t.t = Tok::T::Str;
        t.s = unescape(std::string_view(src_).substr(pos + 1, n - pos - 1), line);
        for (size_t k = pos; k < n; ++k) line += src_[k] == '\n';
        pos = n + 1;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t n = pos;
        bool is_float = false;
        while (n < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[n])) || src_[n] == '_')) ++n;
        if (n + 1 < src_.size() && src_[n] == '.' && std::isdigit(static_cast<unsigned char>(src_[n + 1]))) {
          is_float = true;
          ++n;
          while (n < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[n])) || src_[n] == '_')) ++n;
        }
        if (n < src_.size() && (src_[n] == 'e' || src_[n] == 'E')) {
          size_t m = n + 1;
          if (m < src_.size() && (src_[m] == '+' || src_[m] == '-')) ++m;
          if (m < src_.size() && std::isdigit(static_cast<unsigned char>(src_[m]))) {
            is_float = true;
            n = m;
            while (n < src_.size() && std::isdigit(static_cast<unsigned char>(src_[n]))) ++n;
          }
        }
        std::string num;
        for (size_t k = pos; k < n; ++k) if (src_[k] != '_') num += src_[k];
        if (is_float) { t.t = Tok::T::Float; t.f = std::stod(num); }
        else {
          t.t = Tok::T::Int;
          try { t.i = std::stoll(num); } catch (const std::exception&) { fail(line, "integer literal out of range"); }
        }
        pos = n;
      } else if (is_name_start(c)) {
        size_t n = pos;
        while (n < src_.size() && is_name_char(src_[n])) ++n;
        t.t = Tok::T::Name;
        t.s = src_.substr(pos, n - pos);
        pos = n;
      } else {
        bool found = false;
        for (const char* op : kOps) {
          size_t len = std::strlen(op);
          if (src_.compare(pos, len, op) == 0) {
            t.t = Tok::T::Op;
            t.s = op;
            pos += len;
            found = true;
            break;
          }
        }
        if (!found) fail(line, fmt::format("unexpected character '{}' in expression", c));
      }
      toks.push_back(std::move(t));
    }
    Tok end;
    end.line = line;
    toks.push_back(end);
    return pos;
  }

  std::string src_;
  size_t line_pos_ = 0;
  int line_ = 1;
};

// ---------------------------------------------------------------------------------------------
// AST

}  // namespace

// The AST lives in jinja:: because Callable (jinja_value.h) points at macro nodes.
namespace jinja {
struct Node {
  enum class N {
    // expressions
    Literal, Name, Attr, Item, Slice, Call, Filter, Test, Unary, Binary, And, Or, Not, Cond, ListLit, DictLit,
    // statements
    Text, Output, If, For, Set, SetBlock, Macro, Break, Continue,
  } n;
  int line = 0;
  Value value;                      // Literal
  std::string name;                 // Name, Attr, Call-free names: filter/test/op/macro name, Set target
  std::vector<std::unique_ptr<Node>> kids;        // operands, args, list items, dict k/v pairs
  std::vector<std::pair<std::string, std::unique_ptr<Node>>> kwargs;  // Call/Filter/Test
  bool negated = false;             // Test "is not"
  // statements
  std::vector<std::string> targets;  // For loop variables / Set names / Macro params
  std::string attr;                  // Set ns.attr
  std::vector<std::pair<std::unique_ptr<Node>, std::vector<std::unique_ptr<Node>>>> branches;  // If
  std::vector<std::unique_ptr<Node>> body, else_body;
};
}  // namespace jinja

namespace {

using NodePtr = std::unique_ptr<Node>;

NodePtr make(Node::N n, int line) {
  auto p = std::make_unique<Node>();
  p->n = n;
  p->line = line;
  return p;
}

class Parser {
 public:
  explicit Parser(std::vector<Piece> pieces) : pieces_(std::move(pieces)) {}

  std::vector<NodePtr> parse_template() {
    std::vector<NodePtr> body;
    parse_body(body, {}, 0, "");
    return body;
  }

 private:
  // Parses statements until one of `enders` (a block tag name) or the end of the template;
  // returns the ender found ("" at the end). The ender's tokens are left in toks_/tp_.
  std::string parse_body(std::vector<NodePtr>& out, const std::vector<std::string>& enders, int open_line,
                         const char* opener) {
    DepthGuard guard(block_depth_, open_line);
    while (ip_ < pieces_.size()) {
      Piece& p = pieces_[ip_++];
      if (p.p == Piece::P::Text) {
        auto t = make(Node::N::Text, p.line);
        t->value = Value::str(p.text);
        out.push_back(std::move(t));
        continue;
      }
      toks_ = &p.toks;
      tp_ = 0;
      if (p.p == Piece::P::Var) {
        auto o = make(Node::N::Output, p.line);
        o->kids.push_back(parse_expr());
        expect_end();
        out.push_back(std::move(o));
        continue;
      }
      const Tok& t = cur();
      if (t.t != Tok::T::Name) fail(t.line, "expected a tag name after {%");
      std::string tag = t.s;
      if (std::find(enders.begin(), enders.end(), tag) != enders.end()) {
        ++tp_;
        return tag;
      }
      ++tp_;
      if (tag == "if") out.push_back(parse_if(t.line));
      else if (tag == "for") out.push_back(parse_for(t.line));
      else if (tag == "set") out.push_back(parse_set(t.line));
      else if (tag == "macro") out.push_back(parse_macro(t.line));
      else if (tag == "break" || tag == "continue") {
        expect_end();
        out.push_back(make(tag == "break" ? Node::N::Break : Node::N::Continue, t.line));
      } else if (tag == "elif" || tag == "else" || tag.rfind("end", 0) == 0) {
        fail(t.line, "unexpected {% " + tag + " %}");
      } else {
        fail(t.line, "unsupported tag {% " + tag + " %} (this interpreter covers for/if/set/macro/break/continue)");
      }
    }
    if (!enders.empty())
      fail(open_line, fmt::format("{{% {} %}} is never closed (missing {{% {} %}})", opener, enders.back()));
    return "";
  }

  NodePtr parse_if(int line) {
    auto n = make(Node::N::If, line);
    auto cond = parse_expr();
    expect_end();
    while (true) {
      std::vector<NodePtr> body;
      std::string end = parse_body(body, {"elif", "else", "endif"}, line, "if");
      n->branches.emplace_back(std::move(cond), std::move(body));
      if (end == "elif") {
        cond = parse_expr();
        expect_end();
        continue;
      }
      if (end == "else") {
        expect_end();
        parse_body(n->else_body, {"endif"}, line, "if");
      }
      expect_end();
      return n;
    }
  }

  NodePtr parse_for(int line) {
    auto n = make(Node::N::For, line);
    bool paren = accept_op("(");
    do n->targets.push_back(expect_name()); while (accept_op(","));
    if (paren) expect_op(")");
    if (!accept_name("in")) fail(cur().line, "expected 'in' in for loop");
    n->kids.push_back(parse_expr(/*allow_cond=*/false));
    if (accept_name("if")) n->kids.push_back(parse_expr(false));
    if (accept_name("recursive")) fail(line, "recursive for loops are not supported");
    expect_end();
    std::string end = parse_body(n->body, {"else", "endfor"}, line, "for");
    if (end == "else") {
      expect_end();
      parse_body(n->else_body, {"endfor"}, line, "for");
    }
    expect_end();
    return n;
  }

  NodePtr parse_set(int line) {
    std::string first = expect_name();
    if (accept_op(".")) {
      auto n = make(Node::N::Set, line);
      n->targets.push_back(first);
      n->attr = expect_name();
      expect_op("=");
      n->kids.push_back(parse_expr());
      expect_end();
      return n;
    }
    std::vector<std::string> names{first};
    while (accept_op(",")) names.push_back(expect_name());
    if (accept_op("=")) {
      auto n = make(Node::N::Set, line);
      n->targets = names;
      n->kids.push_back(parse_expr());
      expect_end();
      return n;
    }
    if (names.size() != 1) fail(line, "expected '=' in set");
    if (accept_op("|")) fail(line, "filtered set blocks are not supported");
    expect_end();
    auto n = make(Node::N::SetBlock, line);
    n->targets = names;
    parse_body(n->body, {"endset"}, line, "set");
    expect_end();
    return n;
  }

  NodePtr parse_macro(int line) {
    auto n = make(Node::N::Macro, line);
    n->name = expect_name();
    expect_op("(");
    if (!accept_op(")")) {
      do {
        std::string p = expect_name();
        if (accept_op("=")) n->kwargs.emplace_back(p, parse_expr());
        else if (!n->kwargs.empty()) fail(line, "macro parameter without default after one with a default");
        n->targets.push_back(p);
      } while (accept_op(","));
      expect_op(")");
    }
    expect_end();
    parse_body(n->body, {"endmacro"}, line, "macro");
    if (cur().t == Tok::T::Name) ++tp_;  // {% endmacro name %}
    expect_end();
    return n;
  }

  // --- expressions (precedence as jinja2's parser) ---
  // Nesting guard: "((((..." or "not not not ..." thousands deep would otherwise overflow the
  // stack of this recursive-descent parser (and of the evaluator after it).
  struct DepthGuard {
    int& depth;
    DepthGuard(int& d, int line) : depth(d) {
      if (++depth > 200) fail(line, "nested too deeply");
    }
    ~DepthGuard() { --depth; }
  };

  NodePtr parse_expr(bool allow_cond = true) {
    DepthGuard guard(expr_depth_, cur().line);
    NodePtr e = parse_or();
    while (allow_cond && accept_name("if")) {
      auto c = make(Node::N::Cond, e->line);
      c->kids.push_back(parse_or());  // condition
      c->kids.push_back(std::move(e));
      if (accept_name("else")) c->kids.push_back(parse_expr());
      e = std::move(c);
    }
    return e;
  }
  NodePtr parse_or() {
    NodePtr l = parse_and();
    while (accept_name("or")) l = binary(Node::N::Or, "or", std::move(l), parse_and());
    return l;
  }
  NodePtr parse_and() {
    NodePtr l = parse_not();
    while (accept_name("and")) l = binary(Node::N::And, "and", std::move(l), parse_not());
    return l;
  }
  NodePtr parse_not() {
    DepthGuard guard(expr_depth_, cur().line);
    if (cur().t == Tok::T::Name && cur().s == "not") {
      int line = cur().line;
      ++tp_;
      auto n = make(Node::N::Not, line);
      n->kids.push_back(parse_not());
      return n;
    }
    return parse_compare();
  }
  NodePtr parse_compare() {
    NodePtr l = parse_math1();
    while (true) {
      const Tok& t = cur();
      std::string op;
      if (t.t == Tok::T::Op && (t.s == "==" || t.s == "!=" || t.s == "<" || t.s == "<=" || t.s == ">" || t.s == ">=")) {
        op = t.s;
        ++tp_;
      } else if (t.t == Tok::T::Name && t.s == "in") {
        op = "in";
        ++tp_;
      } else if (t.t == Tok::T::Name && t.s == "not" && peek(1).t == Tok::T::Name && peek(1).s == "in") {
        op = "not in";
        tp_ += 2;
      } else {
        return l;
      }
      l = binary(Node::N::Binary, op, std::move(l), parse_math1());
    }
  }
  NodePtr parse_math1() {
    NodePtr l = parse_concat();
    while (cur().t == Tok::T::Op && (cur().s == "+" || cur().s == "-")) {
      std::string op = cur().s;
      ++tp_;
      l = binary(Node::N::Binary, op, std::move(l), parse_concat());
    }
    return l;
  }
  NodePtr parse_concat() {
    NodePtr l = parse_math2();
    while (accept_op("~")) l = binary(Node::N::Binary, "~", std::move(l), parse_math2());
    return l;
  }
  NodePtr parse_math2() {
    NodePtr l = parse_pow();
    while (cur().t == Tok::T::Op && (cur().s == "*" || cur().s == "/" || cur().s == "//" || cur().s == "%")) {
      std::string op = cur().s;
      ++tp_;
      l = binary(Node::N::Binary, op, std::move(l), parse_pow());
    }
    return l;
  }
  NodePtr parse_pow() {
    NodePtr l = parse_unary(true);
    while (accept_op("**")) l = binary(Node::N::Binary, "**", std::move(l), parse_unary(true));
    return l;
  }
  NodePtr parse_unary(bool with_filter) {
    DepthGuard guard(expr_depth_, cur().line);
    const Tok& t = cur();
    NodePtr n;
    if (t.t == Tok::T::Op && (t.s == "-" || t.s == "+")) {
      ++tp_;
      n = make(Node::N::Unary, t.line);
      n->name = t.s;
      n->kids.push_back(parse_unary(false));
    } else {
      n = parse_primary();
    }
    n = parse_postfix(std::move(n));
    if (with_filter) n = parse_filter_expr(std::move(n));
    return n;
  }
  NodePtr parse_primary() {
    const Tok& t = cur();
    int line = t.line;
    if (t.t == Tok::T::Name) {
      ++tp_;
      if (t.s == "true" || t.s == "True") return literal(Value::boolean(true), line);
      if (t.s == "false" || t.s == "False") return literal(Value::boolean(false), line);
      if (t.s == "none" || t.s == "None") return literal(Value::none(), line);
      auto n = make(Node::N::Name, line);
      n->name = t.s;
      return n;
    }
    if (t.t == Tok::T::Str) {
      std::string s;
      while (cur().t == Tok::T::Str) s += toks_->at(tp_++).s;  // adjacent literals concatenate
      return literal(Value::str(s), line);
    }
    if (t.t == Tok::T::Int) { ++tp_; return literal(Value::integer(t.i), line); }
    if (t.t == Tok::T::Float) { ++tp_; return literal(Value::number(t.f), line); }
    if (accept_op("(")) {
      if (accept_op(")")) return make(Node::N::ListLit, line);  // empty tuple
      NodePtr e = parse_expr();
      if (cur().t == Tok::T::Op && cur().s == ",") {  // a tuple: a list that compares as a tuple
        auto l = make(Node::N::ListLit, line);
        l->negated = true;
        l->kids.push_back(std::move(e));
        while (accept_op(",")) {
          if (cur().t == Tok::T::Op && cur().s == ")") break;
          l->kids.push_back(parse_expr());
        }
        e = std::move(l);
      }
      expect_op(")");
      return e;
    }
    if (accept_op("[")) {
      auto l = make(Node::N::ListLit, line);
      while (!accept_op("]")) {
        if (!l->kids.empty()) expect_op(",");
        if (accept_op("]")) break;
        l->kids.push_back(parse_expr());
      }
      return l;
    }
    if (accept_op("{")) {
      auto d = make(Node::N::DictLit, line);
      while (!accept_op("}")) {
        if (!d->kids.empty()) expect_op(",");
        if (accept_op("}")) break;
        d->kids.push_back(parse_expr());
        expect_op(":");
        d->kids.push_back(parse_expr());
      }
      return d;
    }
    if (t.t == Tok::T::End) fail(line, "unexpected end of expression");
    fail(line, "unexpected '" + t.s + "' in expression");
  }
  NodePtr parse_postfix(NodePtr n) {
    while (true) {
      const Tok& t = cur();
      if (t.t != Tok::T::Op) return n;
      if (t.s == ".") {
        ++tp_;
        auto a = make(Node::N::Attr, t.line);
        if (cur().t == Tok::T::Int) { a->n = Node::N::Item; a->kids.push_back(std::move(n)); a->kids.push_back(literal(Value::integer(cur().i), t.line)); ++tp_; n = std::move(a); continue; }
        a->name = expect_name();
        a->kids.push_back(std::move(n));
        n = std::move(a);
      } else if (t.s == "[") {
        ++tp_;
        n = parse_subscript(std::move(n), t.line);
      } else if (t.s == "(") {
        n = parse_call(std::move(n));
      } else {
        return n;
      }
    }
  }
  NodePtr parse_subscript(NodePtr obj, int line) {
    NodePtr parts[3];
    bool is_slice = false;
    int idx = 0;
    while (true) {
      if (cur().t == Tok::T::Op && cur().s == "]") { ++tp_; break; }
      if (cur().t == Tok::T::Op && cur().s == ":") {
        ++tp_;
        is_slice = true;
        if (++idx > 2) fail(line, "bad slice");
        continue;
      }
      if (parts[idx]) fail(line, "bad subscript");
      parts[idx] = parse_expr();
    }
    if (!is_slice) {
      if (!parts[0]) fail(line, "empty subscript");
      auto n = make(Node::N::Item, line);
      n->kids.push_back(std::move(obj));
      n->kids.push_back(std::move(parts[0]));
      return n;
    }
    auto n = make(Node::N::Slice, line);
    n->kids.push_back(std::move(obj));
    for (auto& p : parts) n->kids.push_back(p ? std::move(p) : literal(Value::none(), line));
    return n;
  }
  // Appends call arguments to n.kids (after what is already there: the callee or the filtered
  // value) and n.kwargs.
  void parse_args(Node& n) {
    expect_op("(");
    size_t n_args = 0;
    while (!accept_op(")")) {
      if (n_args++ > 0) expect_op(",");
      if (accept_op(")")) break;
      if (cur().t == Tok::T::Name && peek(1).t == Tok::T::Op && peek(1).s == "=") {
        std::string k = cur().s;
        tp_ += 2;
        n.kwargs.emplace_back(k, parse_expr());
      } else {
        if (!n.kwargs.empty()) fail(cur().line, "positional argument after keyword argument");
        n.kids.push_back(parse_expr());
      }
    }
  }
  NodePtr parse_call(NodePtr fn) {
    auto c = make(Node::N::Call, fn->line);
    c->kids.push_back(std::move(fn));  // callee first, then positional args
    parse_args(*c);
    return c;
  }
  NodePtr parse_filter_expr(NodePtr n) {
    while (true) {
      if (accept_op("|")) {
        auto f = make(Node::N::Filter, cur().line);
        f->name = expect_name();
        f->kids.push_back(std::move(n));
        if (cur().t == Tok::T::Op && cur().s == "(") parse_args(*f);
        n = std::move(f);
      } else if (cur().t == Tok::T::Name && cur().s == "is") {
        ++tp_;
        auto t = make(Node::N::Test, cur().line);
        t->negated = accept_name("not");
        const Tok& nm = cur();
        if (nm.t != Tok::T::Name) fail(nm.line, "expected a test name after 'is'");
        t->name = nm.s;
        ++tp_;
        t->kids.push_back(std::move(n));
        if (cur().t == Tok::T::Op && cur().s == "(") {
          parse_args(*t);
        } else if ((cur().t == Tok::T::Str || cur().t == Tok::T::Int || cur().t == Tok::T::Float ||
                    (cur().t == Tok::T::Op && (cur().s == "[" || cur().s == "{")) ||
                    (cur().t == Tok::T::Name && cur().s != "else" && cur().s != "or" && cur().s != "and" &&
                     cur().s != "if" && cur().s != "is"))) {
          t->kids.push_back(parse_postfix(parse_primary()));  // `x is divisibleby 3`
        }
        n = std::move(t);
      } else {
        return n;
      }
    }
  }

  NodePtr literal(Value v, int line) {
    auto n = make(Node::N::Literal, line);
    n->value = std::move(v);
    return n;
  }
  NodePtr binary(Node::N kind, const std::string& op, NodePtr l, NodePtr r) {
    auto n = make(kind, l->line);
    n->name = op;
    n->kids.push_back(std::move(l));
    n->kids.push_back(std::move(r));
    return n;
  }

  const Tok& cur() const { return (*toks_)[tp_]; }
  const Tok& peek(size_t k) const { return (*toks_)[std::min(tp_ + k, toks_->size() - 1)]; }
  bool accept_op(const char* op) {
    if (cur().t == Tok::T::Op && cur().s == op) { ++tp_; return true; }
    return false;
  }
  bool accept_name(const char* name) {
    if (cur().t == Tok::T::Name && cur().s == name) { ++tp_; return true; }
    return false;
  }
  void expect_op(const char* op) {
    if (!accept_op(op)) fail(cur().line, fmt::format("expected '{}'{}", op, describe_cur()));
  }
  std::string expect_name() {
    if (cur().t != Tok::T::Name) fail(cur().line, "expected a name" + describe_cur());
    return (*toks_)[tp_++].s;
  }
  void expect_end() {
    if (cur().t != Tok::T::End) fail(cur().line, "unexpected '" + cur().s + "' before the end of the tag");
  }
  std::string describe_cur() const {
    if (cur().t == Tok::T::End) return " before the end of the tag";
    if (cur().t == Tok::T::Int) return ", got " + std::to_string(cur().i);
    return ", got '" + cur().s + "'";
  }

  std::vector<Piece> pieces_;
  size_t ip_ = 0;
  std::vector<Tok>* toks_ = nullptr;
  size_t tp_ = 0;
  int expr_depth_ = 0;
  int block_depth_ = 0;
};

}  // namespace

struct TemplateProgram {
  std::vector<NodePtr> body;
};

namespace {

// ---------------------------------------------------------------------------------------------
// Evaluator

struct Scope {
  std::unordered_map<std::string, Value> vars;
  Scope* parent = nullptr;
  Value lookup(const std::string& name) const {
    for (const Scope* s = this; s; s = s->parent) {
      auto it = s->vars.find(name);
      if (it != s->vars.end()) return it->second;
    }
    return Value::undefined(name);
  }
};

enum class Flow { Normal, Break, Continue };

class Evaluator {
 public:
  explicit Evaluator(Scope* root) : root_(root) {}

  Flow exec_all(const std::vector<NodePtr>& body, Scope& sc, std::string& out) {
    for (auto& n : body) {
      Flow f = exec(*n, sc, out);
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

 private:
  Flow exec(const Node& n, Scope& sc, std::string& out) {
    switch (n.n) {
      case Node::N::Text: out += n.value.s; return Flow::Normal;
      case Node::N::Output: out += to_str(eval(*n.kids[0], sc)); return Flow::Normal;
      case Node::N::If:
        for (auto& [cond, body] : n.branches) {
          if (truthy(eval(*cond, sc))) return exec_all(body, sc, out);
        }
        return exec_all(n.else_body, sc, out);
      case Node::N::For: return exec_for(n, sc, out);
      case Node::N::Set: {
        Value v = eval(*n.kids[0], sc);
        if (!n.attr.empty()) {
          Value ns = sc.lookup(n.targets[0]);
          if (ns.k != Value::K::Ns) fail(n.line, "cannot assign attribute on non-namespace object '" + n.targets[0] + "'");
          ns.d->set(n.attr, std::move(v));
        } else {
          assign(n.targets, std::move(v), sc, n.line);
        }
        return Flow::Normal;
      }
      case Node::N::SetBlock: {
        std::string captured;
        exec_all(n.body, sc, captured);
        sc.vars[n.targets[0]] = Value::str(std::move(captured));
        return Flow::Normal;
      }
      case Node::N::Macro: {
        Value v;
        v.k = Value::K::Fn;
        v.fn = std::make_shared<Callable>(Callable{Callable::Kind::Macro, &n, n.name, {}});
        sc.vars[n.name] = v;
        return Flow::Normal;
      }
      case Node::N::Break: return Flow::Break;
      case Node::N::Continue: return Flow::Continue;
      default: fail(n.line, "internal: expression used as a statement");
    }
  }

  void assign(const std::vector<std::string>& targets, Value v, Scope& sc, int line) {
    if (targets.size() == 1) {
      sc.vars[targets[0]] = std::move(v);
      return;
    }
    List items = iterate(v, line);
    if (items.size() != targets.size())
      fail(line, fmt::format("cannot unpack {} values into {} names", items.size(), targets.size()));
    for (size_t k = 0; k < targets.size(); ++k) sc.vars[targets[k]] = items[k];
  }

  List iterate(const Value& v, int line) {
    switch (v.k) {
      case Value::K::Undefined: return {};
      case Value::K::List: return *v.l;
      case Value::K::Dict: {
        List keys;
        for (auto& kv : v.d->items) keys.push_back(Value::str(kv.first));
        return keys;
      }
      case Value::K::Str: {
        List chars;
        for (uint32_t c : code_points(v.s)) { std::string s; utf8_append(s, c); chars.push_back(Value::str(s)); }
        return chars;
      }
      default: fail(line, fmt::format("'{}' object is not iterable", type_name(v)));
    }
  }

  Flow exec_for(const Node& n, Scope& sc, std::string& out) {
    List items = iterate(eval(*n.kids[0], sc), n.line);
    if (n.kids.size() > 1) {  // {% for x in xs if cond %}: filter first, loop.* counts what is left
      List kept;
      for (auto& it : items) {
        Scope probe{{}, &sc};
        assign(n.targets, it, probe, n.line);
        if (truthy(eval(*n.kids[1], probe))) kept.push_back(it);
      }
      items = std::move(kept);
    }
    if (items.empty()) return exec_all(n.else_body, sc, out);
    const int64_t len = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < len; ++k) {
      Scope inner{{}, &sc};
      assign(n.targets, items[k], inner, n.line);
      Dict loop;
      loop.items = {{"index", Value::integer(k + 1)},          {"index0", Value::integer(k)},
                    {"revindex", Value::integer(len - k)},     {"revindex0", Value::integer(len - k - 1)},
                    {"first", Value::boolean(k == 0)},         {"last", Value::boolean(k == len - 1)},
                    {"length", Value::integer(len)},           {"depth", Value::integer(1)},
                    {"depth0", Value::integer(0)},
                    {"previtem", k > 0 ? items[k - 1] : Value::undefined("loop.previtem")},
                    {"nextitem", k + 1 < len ? items[k + 1] : Value::undefined("loop.nextitem")}};
      inner.vars["loop"] = Value::dict(std::move(loop));
      Flow f = exec_all(n.body, inner, out);
      if (f == Flow::Break) break;
    }
    return Flow::Normal;
  }

  // --- expressions ---
  Value eval(const Node& n, Scope& sc) {
    switch (n.n) {
      case Node::N::Literal: return n.value;
      case Node::N::Name: {
        Value v = sc.lookup(n.name);
        if (v.is_undefined()) {
          static const char* kBuiltins[] = {"namespace", "raise_exception", "range", "dict", "strftime_now"};
          for (const char* b : kBuiltins) {
            if (n.name == b) {
              Value f;
              f.k = Value::K::Fn;
              f.fn = std::make_shared<Callable>(Callable{Callable::Kind::Builtin, nullptr, b, {}});
              return f;
            }
          }
        }
        return v;
      }
      case Node::N::Attr: return get_attr(eval(*n.kids[0], sc), n.name, n.line);
      case Node::N::Item: return get_item(eval(*n.kids[0], sc), eval(*n.kids[1], sc), n.line);
      case Node::N::Slice:
        return slice(eval(*n.kids[0], sc), eval(*n.kids[1], sc), eval(*n.kids[2], sc), eval(*n.kids[3], sc), n.line);
      case Node::N::Call: return call(n, sc);
      case Node::N::Filter: return filter(n, sc);
      case Node::N::Test: {
        bool r = test(n, sc);
        return Value::boolean(n.negated ? !r : r);
      }
      case Node::N::Unary: {
        Value v = eval(*n.kids[0], sc);
        if (!v.is_num()) fail(n.line, fmt::format("bad operand type for unary {}: {}", n.name, type_name(v)));
        if (n.name == "+") return v.k == Value::K::Float ? v : Value::integer(v.as_int());
        return v.k == Value::K::Float ? Value::number(-v.f) : Value::integer(-v.as_int());
      }
      case Node::N::And: {
        Value l = eval(*n.kids[0], sc);
        return truthy(l) ? eval(*n.kids[1], sc) : l;
      }
      case Node::N::Or: {
        Value l = eval(*n.kids[0], sc);
        return truthy(l) ? l : eval(*n.kids[1], sc);
      }
      case Node::N::Not: return Value::boolean(!truthy(eval(*n.kids[0], sc)));
      case Node::N::Cond:
        if (truthy(eval(*n.kids[0], sc))) return eval(*n.kids[1], sc);
        return n.kids.size() > 2 ? eval(*n.kids[2], sc) : Value::undefined();
      case Node::N::ListLit: {
        List l;
        for (auto& k : n.kids) l.push_back(eval(*k, sc));
        Value v = Value::list(std::move(l));
        v.tuple = n.negated;
        return v;
      }
      case Node::N::DictLit: {
        Dict d;
        for (size_t k = 0; k + 1 < n.kids.size(); k += 2) {
          Value key = eval(*n.kids[k], sc);
          if (key.k != Value::K::Str) fail(n.line, "dict keys must be strings here");
          d.set(key.s, eval(*n.kids[k + 1], sc));
        }
        return Value::dict(std::move(d));
      }
      case Node::N::Binary: return binary(n, sc);
      default: fail(n.line, "internal: statement used as an expression");
    }
  }

  static bool is_dict_method(const std::string& name) {
    return name == "items" || name == "keys" || name == "values" || name == "get";
  }
  static bool is_str_method(const std::string& name) {
    static const char* kMethods[] = {"startswith", "endswith", "split", "rsplit", "strip", "lstrip", "rstrip",
                                     "replace", "upper", "lower", "title", "capitalize", "find", "rfind",
                                     "count", "join", "isdigit", "isspace", "isalpha", "isalnum", "splitlines"};
    for (const char* m : kMethods) if (name == m) return true;
    return false;
  }
  static Value method(const Value& self, const std::string& name) {
    Value f;
    f.k = Value::K::Fn;
    f.fn = std::make_shared<Callable>(Callable{Callable::Kind::Method, nullptr, name, self});
    return f;
  }

  Value get_attr(const Value& obj, const std::string& name, int line) {
    switch (obj.k) {
      case Value::K::Undefined:
        fail(line, obj.s.empty() ? "attribute '" + name + "' of an undefined value"
                                 : "'" + obj.s + "' is undefined (reading ." + name + ")");
      case Value::K::Dict:
        if (is_dict_method(name)) return method(obj, name);
        [[fallthrough]];
      case Value::K::Ns: {
        const Value* v = obj.d->find(name);
        return v ? *v : Value::undefined(name);
      }
      case Value::K::Str:
        if (is_str_method(name)) return method(obj, name);
        return Value::undefined(name);
      default: return Value::undefined(name);
    }
  }

  static int64_t norm_index(int64_t i, int64_t len) { return i < 0 ? i + len : i; }

  Value get_item(const Value& obj, const Value& key, int line) {
    switch (obj.k) {
      case Value::K::Undefined: fail(line, "'" + obj.s + "' is undefined (subscripted)");
      case Value::K::Dict: case Value::K::Ns:
        if (key.k == Value::K::Str) {
          const Value* v = obj.d->find(key.s);
          if (v) return *v;
          if (obj.k == Value::K::Dict && is_dict_method(key.s)) return method(obj, key.s);
        }
        return Value::undefined(key.k == Value::K::Str ? key.s : "");
      case Value::K::List: {
        if (!key.is_num() || key.k == Value::K::Float) {
          if (key.k == Value::K::Str) return Value::undefined(key.s);
          fail(line, "list indices must be integers");
        }
        int64_t i = norm_index(key.as_int(), static_cast<int64_t>(obj.l->size()));
        if (i < 0 || i >= static_cast<int64_t>(obj.l->size())) return Value::undefined("list index");
        return (*obj.l)[i];
      }
      case Value::K::Str: {
        if (key.k == Value::K::Str) return get_attr(obj, key.s, line);
        if (!key.is_num() || key.k == Value::K::Float) fail(line, "string indices must be integers");
        std::vector<uint32_t> cps = code_points(obj.s);
        int64_t i = norm_index(key.as_int(), static_cast<int64_t>(cps.size()));
        if (i < 0 || i >= static_cast<int64_t>(cps.size())) return Value::undefined("string index");
        return Value::str(from_code_points(cps, i, i + 1));
      }
      default: return Value::undefined();
    }
  }

  // Python slice semantics (start/stop/step may be None).
  Value slice(const Value& obj, const Value& a, const Value& b, const Value& c, int line) {
    auto as_opt = [&](const Value& v) -> std::optional<int64_t> {
      if (v.k == Value::K::None || v.is_undefined()) return std::nullopt;
      if (!v.is_num() || v.k == Value::K::Float) fail(line, "slice indices must be integers");
      return v.as_int();
    };
    int64_t step = as_opt(c).value_or(1);
    if (step == 0) fail(line, "slice step cannot be zero");
    auto pick = [&](int64_t len, auto&& take) {
      auto clamp = [&](std::optional<int64_t> x, int64_t dflt) {
        if (!x) return dflt;
        int64_t v = *x < 0 ? *x + len : *x;
        if (step > 0) return std::clamp<int64_t>(v, 0, len);
        return std::clamp<int64_t>(v, -1, len - 1);
      };
      int64_t start = clamp(as_opt(a), step > 0 ? 0 : len - 1);
      int64_t stop = clamp(as_opt(b), step > 0 ? len : -1);
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) take(i);
    };
    if (obj.k == Value::K::List) {
      List out;
      pick(static_cast<int64_t>(obj.l->size()), [&](int64_t i) { out.push_back((*obj.l)[i]); });
      return Value::list(std::move(out));
    }
    if (obj.k == Value::K::Str) {
      std::vector<uint32_t> cps = code_points(obj.s);
      std::string out;
      pick(static_cast<int64_t>(cps.size()), [&](int64_t i) { utf8_append(out, cps[i]); });
      return Value::str(out);
    }
    fail(line, fmt::format("'{}' object cannot be sliced", type_name(obj)));
  }

  struct Args {
    List pos;
    std::vector<std::pair<std::string, Value>> kw;
    const Value* get(size_t i, const char* name) const {
      if (i < pos.size()) return &pos[i];
      for (auto& [k, v] : kw) if (k == name) return &v;
      return nullptr;
    }
  };
  Args eval_args(const Node& n, Scope& sc, size_t first) {
    Args a;
    for (size_t k = first; k < n.kids.size(); ++k) a.pos.push_back(eval(*n.kids[k], sc));
    for (auto& [k, e] : n.kwargs) a.kw.emplace_back(k, eval(*e, sc));
    return a;
  }

  Value call(const Node& n, Scope& sc) {
    Value fn = eval(*n.kids[0], sc);
    Args args = eval_args(n, sc, 1);
    if (fn.k != Value::K::Fn) {
      std::string what = n.kids[0]->n == Node::N::Name ? "'" + n.kids[0]->name + "'"
                         : n.kids[0]->n == Node::N::Attr ? "'." + n.kids[0]->name + "'" : "expression";
      fail(n.line, fmt::format("{} is not callable ({})", what, fn.is_undefined() ? "undefined" : type_name(fn)));
    }
    const Callable& c = *fn.fn;
    if (c.kind == Callable::Kind::Macro) return call_macro(*c.macro, args, n.line);
    if (c.kind == Callable::Kind::Method) return call_method(c.self, c.name, args, n.line);
    return call_builtin(c.name, args, n.line);
  }

  Value call_macro(const Node& m, const Args& args, int line) {
    if (args.pos.size() > m.targets.size())
      fail(line, fmt::format("macro '{}' takes {} arguments, {} given", m.name, m.targets.size(), args.pos.size()));
    Scope local{{}, root_};
    size_t n_required = m.targets.size() - m.kwargs.size();
    for (size_t k = 0; k < m.targets.size(); ++k) {
      const std::string& p = m.targets[k];
      if (k < args.pos.size()) { local.vars[p] = args.pos[k]; continue; }
      bool found = false;
      for (auto& [kn, kv] : args.kw) if (kn == p) { local.vars[p] = kv; found = true; }
      if (found) continue;
      if (k >= n_required) local.vars[p] = eval(*m.kwargs[k - n_required].second, local);
      else local.vars[p] = Value::undefined(p);  // jinja2 passes missing macro args as undefined
    }
    for (auto& [kn, kv] : args.kw) {
      if (std::find(m.targets.begin(), m.targets.end(), kn) == m.targets.end())
        fail(line, fmt::format("macro '{}' has no parameter '{}'", m.name, kn));
    }
    std::string out;
    if (++depth_ > 200) fail(line, "macro recursion too deep");
    exec_all(m.body, local, out);
    --depth_;
    return Value::str(std::move(out));
  }

  static std::string str_arg(const Value* v, const char* what, int line) {
    if (!v || v->k != Value::K::Str) fail(line, fmt::format("{} must be a string", what));
    return v->s;
  }

  Value call_method(const Value& self, const std::string& name, const Args& a, int line) {
    if (self.k == Value::K::Dict) {
      if (name == "items") {
        List out;
        for (auto& [k, v] : self.d->items) out.push_back(Value::list({Value::str(k), v}));
        return Value::list(std::move(out));
      }
      if (name == "keys" || name == "values") {
        List out;
        for (auto& [k, v] : self.d->items) out.push_back(name == "keys" ? Value::str(k) : v);
        return Value::list(std::move(out));
      }
      if (name == "get") {
        std::string key = str_arg(a.get(0, "key"), "dict.get key", line);
        const Value* v = self.d->find(key);
        if (v) return *v;
        const Value* dflt = a.get(1, "default");
        return dflt ? *dflt : Value::none();
      }
    }
    const std::string& s = self.s;
    auto opt_str = [&](size_t i, const char* nm) -> std::optional<std::string> {
      const Value* v = a.get(i, nm);
      if (!v || v->k == Value::K::None) return std::nullopt;
      return str_arg(v, nm, line);
    };
    if (name == "startswith" || name == "endswith") {
      const Value* p = a.get(0, "prefix");
      if (!p) fail(line, name + "() takes a prefix");
      List cands = p->k == Value::K::List ? *p->l : List{*p};
      for (auto& c : cands) {
        std::string x = str_arg(&c, "prefix", line);
        bool hit = name == "startswith" ? s.compare(0, x.size(), x) == 0
                                         : s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
        if (hit) return Value::boolean(true);
      }
      return Value::boolean(false);
    }
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      auto chars = opt_str(0, "chars");
      return Value::str(py_strip(s, chars ? &*chars : nullptr, name != "rstrip", name != "lstrip"));
    }
    if (name == "split" || name == "rsplit") {
      auto sep = opt_str(0, "sep");
      const Value* mx = a.get(1, "maxsplit");
      int64_t maxsplit = mx && mx->is_num() ? mx->as_int() : -1;
      return Value::list(py_split(s, sep, maxsplit, name == "rsplit", line));
    }
    if (name == "replace") {
      std::string from = str_arg(a.get(0, "old"), "replace old", line), to = str_arg(a.get(1, "new"), "replace new", line);
      const Value* cnt = a.get(2, "count");
      return Value::str(py_replace(s, from, to, cnt && cnt->is_num() ? cnt->as_int() : -1));
    }
    if (name == "upper" || name == "lower") return Value::str(change_case(s, name == "upper"));
    if (name == "title" || name == "capitalize") return Value::str(title_case(s, name == "title"));
    if (name == "find" || name == "rfind" || name == "count") {
      std::string sub = str_arg(a.get(0, "sub"), name.c_str(), line);
      if (name == "count") {
        if (sub.empty()) return Value::integer(static_cast<int64_t>(utf8_length(s)) + 1);
        int64_t c = 0;
        for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++c;
        return Value::integer(c);
      }
      size_t p = name == "find" ? s.find(sub) : s.rfind(sub);
      return Value::integer(p == std::string::npos ? -1 : static_cast<int64_t>(utf8_length(s.substr(0, p))));
    }
    if (name == "join") {
      const Value* it = a.get(0, "iterable");
      if (!it) fail(line, "join() takes an iterable");
      std::string out;
      List items = iterate(*it, line);
      for (size_t k = 0; k < items.size(); ++k) {
        if (items[k].k != Value::K::Str) fail(line, "join() items must be strings");
        out += (k ? s : "") + items[k].s;
      }
      return Value::str(out);
    }
    if (name == "splitlines") {
      List out;
      size_t start = 0;
      for (size_t p = 0; p < s.size(); ++p) {
        if (s[p] == '\n') { out.push_back(Value::str(s.substr(start, p - start))); start = p + 1; }
      }
      if (start < s.size()) out.push_back(Value::str(s.substr(start)));
      return Value::list(std::move(out));
    }
    if (name == "isdigit" || name == "isspace" || name == "isalpha" || name == "isalnum") {
      if (s.empty()) return Value::boolean(false);
      for (uint32_t c : code_points(s)) {
        bool ok = name == "isspace" ? py_isspace(c)
                  : name == "isdigit" ? (c >= '0' && c <= '9')
                  : name == "isalpha" ? (c < 0x80 && std::isalpha(static_cast<int>(c)))
                                      : (c < 0x80 && std::isalnum(static_cast<int>(c)));
        if (!ok) return Value::boolean(false);
      }
      return Value::boolean(true);
    }
    fail(line, fmt::format("method '{}' of {} is not supported", name, type_name(self)));
  }

  static List py_split(const std::string& s, const std::optional<std::string>& sep, int64_t maxsplit, bool from_right, int line) {
    List out;
    if (!sep) {  // runs of whitespace, no empty strings
      std::vector<uint32_t> cps = code_points(s);
      std::vector<std::pair<size_t, size_t>> words;
      size_t k = 0;
      while (k < cps.size()) {
        while (k < cps.size() && py_isspace(cps[k])) ++k;
        if (k >= cps.size()) break;
        size_t b = k;
        while (k < cps.size() && !py_isspace(cps[k])) ++k;
        words.emplace_back(b, k);
      }
      if (maxsplit >= 0 && static_cast<int64_t>(words.size()) > maxsplit + 1) {
        if (!from_right) {
          size_t b = words[maxsplit].first;
          words.resize(maxsplit + 1);
          size_t e = cps.size();
          while (e > b && py_isspace(cps[e - 1])) --e;
          words.back() = {b, e};
        } else {
          size_t cut = words.size() - maxsplit - 1;
          size_t e = words[cut].second, b = 0;
          while (b < e && py_isspace(cps[b])) ++b;
          words.erase(words.begin(), words.begin() + cut);
          words.front() = {b, e};
        }
      }
      for (auto& [b, e] : words) out.push_back(Value::str(from_code_points(cps, b, e)));
      return out;
    }
    if (sep->empty()) fail(line, "empty separator");
    std::vector<std::string> parts;
    size_t start = 0;
    for (size_t p = s.find(*sep); p != std::string::npos; p = s.find(*sep, start)) {
      parts.push_back(s.substr(start, p - start));
      start = p + sep->size();
    }
    parts.push_back(s.substr(start));
    if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) > maxsplit + 1) {
      std::vector<std::string> merged;
      if (!from_right) {
        merged.assign(parts.begin(), parts.begin() + maxsplit);
        std::string rest;
        for (size_t k = maxsplit; k < parts.size(); ++k) rest += (k > static_cast<size_t>(maxsplit) ? *sep : "") + parts[k];
        merged.push_back(rest);
      } else {
        size_t cut = parts.size() - maxsplit;
        std::string rest;
        for (size_t k = 0; k < cut; ++k) rest += (k ? *sep : "") + parts[k];
        merged.push_back(rest);
        merged.insert(merged.end(), parts.begin() + cut, parts.end());
      }
      parts = std::move(merged);
    }
    for (auto& p : parts) out.push_back(Value::str(p));
    return out;
  }

  static std::string py_replace(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
    if (from.empty()) {
      // Python inserts `to` between characters (and at both ends).
      std::string out;
      int64_t n = 0;
      std::vector<uint32_t> cps = code_points(s);
      for (size_t k = 0; k <= cps.size(); ++k) {
        if (count < 0 || n < count) { out += to; ++n; }
        if (k < cps.size()) utf8_append(out, cps[k]);
      }
      return out;
    }
    std::string out;
    size_t start = 0;
    int64_t n = 0;
    for (size_t p = s.find(from); p != std::string::npos && (count < 0 || n < count); p = s.find(from, start)) {
      out += s.substr(start, p - start) + to;
      start = p + from.size();
      ++n;
    }
    return out + s.substr(start);
  }

  // Full Unicode case mapping (ß -> SS), like Python's str.upper/lower.
  static std::string change_case(const std::string& s, bool upper) {
    icu::UnicodeString u = icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())));
    if (upper) u.toUpper(icu::Locale::getRoot()); else u.toLower(icu::Locale::getRoot());
    std::string out;
    u.toUTF8String(out);
    return out;
  }
  // str.title()/capitalize(), ASCII letters only (enough for role names and identifiers).
  static std::string title_case(const std::string& s, bool every_word) {
    std::string out = s;
    bool start = true;
    for (char& c : out) {
      unsigned char u = static_cast<unsigned char>(c);
      bool alpha = std::isalpha(u);
      if (alpha) c = static_cast<char>(start ? std::toupper(u) : std::tolower(u));
      start = every_word ? !alpha : false;
    }
    return out;
  }

  Value call_builtin(const std::string& name, const Args& a, int line) {
    if (name == "namespace" || name == "dict") {
      Value v = Value::dict();
      if (name == "namespace") v.k = Value::K::Ns;
      if (!a.pos.empty()) {
        if (a.pos.size() > 1 || a.pos[0].k != Value::K::Dict) fail(line, name + "() takes one dict or keyword arguments");
        v.d->items = a.pos[0].d->items;
      }
      for (auto& [k, x] : a.kw) v.d->set(k, x);
      return v;
    }
    if (name == "raise_exception") {
      fail(line, "raise_exception: " + (a.pos.empty() ? std::string() : to_str(a.pos[0])));
    }
    if (name == "range") {
      std::vector<int64_t> p;
      for (auto& v : a.pos) {
        if (!v.is_num() || v.k == Value::K::Float) fail(line, "range() takes integers");
        p.push_back(v.as_int());
      }
      if (p.empty() || p.size() > 3) fail(line, "range() takes 1 to 3 arguments");
      int64_t start = p.size() > 1 ? p[0] : 0, stop = p.size() > 1 ? p[1] : p[0], step = p.size() > 2 ? p[2] : 1;
      if (step == 0) fail(line, "range() step must not be zero");
      List out;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        out.push_back(Value::integer(i));
        if (out.size() > 1000000) fail(line, "range() too long");
      }
      return Value::list(std::move(out));
    }
    if (name == "strftime_now") {
      std::string f = str_arg(a.get(0, "format"), "strftime_now format", line);
      std::time_t t = std::time(nullptr);
      std::tm tm{};
      localtime_r(&t, &tm);
      char buf[256];
      size_t len = std::strftime(buf, sizeof buf, f.c_str(), &tm);
      return Value::str(std::string(buf, len));
    }
    fail(line, "unknown function '" + name + "'");
  }

  Value binary(const Node& n, Scope& sc) {
    const std::string& op = n.name;
    Value a = eval(*n.kids[0], sc), b = eval(*n.kids[1], sc);
    int line = n.line;
    if (op == "==") return Value::boolean(equal(a, b));
    if (op == "!=") return Value::boolean(!equal(a, b));
    if (op == "<") return Value::boolean(compare(a, b, line) < 0);
    if (op == "<=") return Value::boolean(compare(a, b, line) <= 0);
    if (op == ">") return Value::boolean(compare(a, b, line) > 0);
    if (op == ">=") return Value::boolean(compare(a, b, line) >= 0);
    if (op == "in" || op == "not in") {
      bool r = contains(b, a, line);
      return Value::boolean(op == "in" ? r : !r);
    }
    if (op == "~") return Value::str(to_str(a) + to_str(b));
    if (op == "+") {
      if (a.k == Value::K::Str && b.k == Value::K::Str) return Value::str(a.s + b.s);
      if (a.k == Value::K::List && b.k == Value::K::List) {
        List l = *a.l;
        l.insert(l.end(), b.l->begin(), b.l->end());
        return Value::list(std::move(l));
      }
    }
    if (op == "*" && (b.k == Value::K::Str || b.k == Value::K::List) && a.is_num() && a.k != Value::K::Float)
      std::swap(a, b);  // 3 * 'ab' == 'ab' * 3
    if (op == "*" && ((a.k == Value::K::Str || a.k == Value::K::List) && b.is_num() && b.k != Value::K::Float)) {
      int64_t times = std::max<int64_t>(0, b.as_int());
      if (a.k == Value::K::Str) {
        std::string out;
        for (int64_t k = 0; k < times; ++k) out += a.s;
        return Value::str(out);
      }
      List l;
      for (int64_t k = 0; k < times; ++k) l.insert(l.end(), a.l->begin(), a.l->end());
      return Value::list(std::move(l));
    }
    if (!a.is_num() || !b.is_num())
      fail(line, fmt::format("unsupported operand types for {}: {} and {}", op, type_name(a), type_name(b)));
    bool ints = a.k != Value::K::Float && b.k != Value::K::Float;
    if (op == "/") {
      if (b.as_double() == 0) fail(line, "division by zero");
      return Value::number(a.as_double() / b.as_double());
    }
    if (op == "**") {
      if (ints && b.as_int() >= 0) {
        int64_t r = 1;
        for (int64_t k = 0; k < b.as_int(); ++k) r *= a.as_int();
        return Value::integer(r);
      }
      return Value::number(std::pow(a.as_double(), b.as_double()));
    }
    if (ints) {
      int64_t x = a.as_int(), y = b.as_int();
      if (op == "+") return Value::integer(x + y);
      if (op == "-") return Value::integer(x - y);
      if (op == "*") return Value::integer(x * y);
      if (y == 0) fail(line, "integer division or modulo by zero");
      int64_t q = x / y, r = x % y;
      if (r != 0 && ((r < 0) != (y < 0))) { q -= 1; r += y; }  // Python floors
      if (op == "//") return Value::integer(q);
      if (op == "%") return Value::integer(r);
    } else {
      double x = a.as_double(), y = b.as_double();
      if (op == "+") return Value::number(x + y);
      if (op == "-") return Value::number(x - y);
      if (op == "*") return Value::number(x * y);
      if (y == 0) fail(line, "float division or modulo by zero");
      if (op == "//") return Value::number(std::floor(x / y));
      if (op == "%") { double r = std::fmod(x, y); if (r != 0 && ((r < 0) != (y < 0))) r += y; return Value::number(r); }
    }
    fail(line, "unsupported operator " + op);
  }

  bool contains(const Value& container, const Value& item, int line) {
    switch (container.k) {
      case Value::K::Str:
        if (item.k != Value::K::Str) fail(line, "'in <string>' requires a string on the left");
        return container.s.find(item.s) != std::string::npos;
      case Value::K::List:
        for (auto& x : *container.l) if (equal(x, item)) return true;
        return false;
      case Value::K::Dict: case Value::K::Ns:
        return item.k == Value::K::Str && container.d->find(item.s) != nullptr;
      case Value::K::Undefined: return false;
      default: fail(line, fmt::format("argument of type '{}' is not iterable", type_name(container)));
    }
  }

  // --- tests ---
  bool test(const Node& n, Scope& sc) {
    Value v = eval(*n.kids[0], sc);
    Args a = eval_args(n, sc, 1);
    return apply_test(n.name, v, a, n.line);
  }

  bool apply_test(const std::string& name, const Value& v, const Args& a, int line) {
    using K = Value::K;
    auto arg0 = [&]() -> const Value& {
      const Value* x = a.get(0, "other");
      if (!x) fail(line, "test '" + name + "' needs an argument");
      return *x;
    };
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.k == K::None;
    if (name == "boolean") return v.k == K::Bool;
    if (name == "true") return v.k == K::Bool && v.b;
    if (name == "false") return v.k == K::Bool && !v.b;
    if (name == "integer") return v.k == K::Int;
    if (name == "float") return v.k == K::Float;
    if (name == "number") return v.is_num();
    if (name == "string") return v.k == K::Str;
    if (name == "mapping") return v.k == K::Dict;
    if (name == "iterable") return v.k == K::Str || v.k == K::List || v.k == K::Dict || v.k == K::Undefined;
    if (name == "sequence") return v.k == K::Str || v.k == K::List || v.k == K::Dict;
    if (name == "callable") return v.k == K::Fn;
    if (name == "eq" || name == "equalto" || name == "==") return equal(v, arg0());
    if (name == "ne" || name == "!=") return !equal(v, arg0());
    if (name == "lt" || name == "lessthan" || name == "<") return compare(v, arg0(), line) < 0;
    if (name == "le" || name == "<=") return compare(v, arg0(), line) <= 0;
    if (name == "gt" || name == "greaterthan" || name == ">") return compare(v, arg0(), line) > 0;
    if (name == "ge" || name == ">=") return compare(v, arg0(), line) >= 0;
    if (name == "in") return contains(arg0(), v, line);
    if (name == "sameas") {
      const Value& o = arg0();
      return v.k == o.k && (v.k == K::None || v.k == K::Undefined || (v.k == K::Bool && v.b == o.b));
    }
    if (name == "odd" || name == "even" || name == "divisibleby") {
      if (!v.is_num() || v.k == K::Float) fail(line, "test '" + name + "' needs an integer");
      if (name == "divisibleby") {
        int64_t d = arg0().as_int();
        if (d == 0) fail(line, "divisibleby 0");
        return v.as_int() % d == 0;
      }
      return (v.as_int() % 2 != 0) == (name == "odd");
    }
    if (name == "lower" || name == "upper") {
      std::string s = to_str(v);
      return change_case(s, name == "upper") == s;
    }
    fail(line, "unknown test '" + name + "'");
  }

  // --- filters ---
  Value filter(const Node& n, Scope& sc) {
    Value v = eval(*n.kids[0], sc);
    Args a = eval_args(n, sc, 1);
    return apply_filter(n.name, v, a, n.line);
  }

  Value apply_filter(const std::string& name, const Value& v, const Args& a, int line) {
    using K = Value::K;
    if (name == "tojson") {
      JsonStyle st;
      // transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
      // note ensure_ascii comes first, unlike jinja2's own tojson(indent).
      if (const Value* x = a.get(0, "ensure_ascii")) st.ensure_ascii = truthy(*x);
      if (const Value* x = a.get(1, "indent"); x && x->k != K::None) {
        if (x->k == K::Str) fail(line, "tojson: string indents are not supported");
        st.indent = static_cast<int>(x->as_int());
        st.item_sep = ",";
      }
      if (const Value* x = a.get(2, "separators"); x && x->k == K::List && x->l->size() == 2) {
        st.item_sep = to_str((*x->l)[0]);
        st.key_sep = to_str((*x->l)[1]);
      }
      if (const Value* x = a.get(3, "sort_keys")) st.sort_keys = truthy(*x);
      std::string out;
      to_json(v, st, 0, out, line);
      return Value::str(out);
    }
    if (name == "safe") return v;
    if (name == "string") return Value::str(to_str(v));
    if (name == "trim") {
      const Value* chars = a.get(0, "chars");
      std::string cs = chars && chars->k == K::Str ? chars->s : std::string();
      return Value::str(py_strip(to_str(v), chars && chars->k == K::Str ? &cs : nullptr, true, true));
    }
    if (name == "length" || name == "count") {
      switch (v.k) {
        case K::Str: return Value::integer(static_cast<int64_t>(utf8_length(v.s)));
        case K::List: return Value::integer(static_cast<int64_t>(v.l->size()));
        case K::Dict: case K::Ns: return Value::integer(static_cast<int64_t>(v.d->items.size()));
        case K::Undefined: return Value::integer(0);
        default: fail(line, fmt::format("object of type '{}' has no length", type_name(v)));
      }
    }
    if (name == "lower" || name == "upper") return Value::str(change_case(to_str(v), name == "upper"));
    if (name == "title" || name == "capitalize") return Value::str(title_case(to_str(v), name == "title"));
    if (name == "replace") {
      return Value::str(py_replace(to_str(v), str_arg(a.get(0, "old"), "replace old", line),
                                   str_arg(a.get(1, "new"), "replace new", line),
                                   a.get(2, "count") ? a.get(2, "count")->as_int() : -1));
    }
    if (name == "default" || name == "d") {
      const Value* dflt = a.get(0, "default_value");
      const Value* boolean = a.get(1, "boolean");
      bool use = v.is_undefined() || (boolean && truthy(*boolean) && !truthy(v));
      return use ? (dflt ? *dflt : Value::str("")) : v;
    }
    if (name == "first" || name == "last") {
      List items = iterate(v, line);
      if (items.empty()) return Value::undefined(name);
      return name == "first" ? items.front() : items.back();
    }
    if (name == "list") return Value::list(iterate(v, line));
    if (name == "reverse") {
      if (v.k == K::Str) {
        std::vector<uint32_t> cps = code_points(v.s);
        std::reverse(cps.begin(), cps.end());
        return Value::str(from_code_points(cps, 0, cps.size()));
      }
      List items = iterate(v, line);
      std::reverse(items.begin(), items.end());
      return Value::list(std::move(items));
    }
    if (name == "items") {
      if (v.is_undefined()) return Value::list();
      if (v.k != K::Dict && v.k != K::Ns) fail(line, fmt::format("items: expected a mapping, got {}", type_name(v)));
      return call_method(v.k == K::Dict ? v : Value::dict(*v.d), "items", {}, line);
    }
    if (name == "join") {
      const Value* sep = a.get(0, "d");
      const Value* attr = a.get(1, "attribute");
      std::string out, s = sep ? to_str(*sep) : "";
      List items = iterate(v, line);
      for (size_t k = 0; k < items.size(); ++k) {
        Value x = attr ? get_attr_path(items[k], to_str(*attr), line) : items[k];
        out += (k ? s : "") + to_str(x);
      }
      return Value::str(out);
    }
    if (name == "map") {
      List items = iterate(v, line), out;
      if (const Value* attr = a.get(1000, "attribute")) {
        const Value* dflt = a.get(1000, "default");
        for (auto& x : items) {
          Value y = get_attr_path(x, to_str(*attr), line);
          out.push_back(y.is_undefined() && dflt ? *dflt : y);
        }
      } else {
        if (a.pos.empty()) fail(line, "map() needs a filter name or attribute=");
        std::string f = str_arg(&a.pos[0], "map filter name", line);
        Args rest;
        rest.pos.assign(a.pos.begin() + 1, a.pos.end());
        rest.kw = a.kw;
        for (auto& x : items) out.push_back(apply_filter(f, x, rest, line));
      }
      return Value::list(std::move(out));
    }
    if (name == "selectattr" || name == "rejectattr" || name == "select" || name == "reject") {
      bool by_attr = name == "selectattr" || name == "rejectattr";
      bool keep_if = name == "selectattr" || name == "select";
      size_t t0 = by_attr ? 1 : 0;
      std::string attr = by_attr ? str_arg(a.get(0, "attribute"), "selectattr attribute", line) : "";
      List items = iterate(v, line), out;
      for (auto& x : items) {
        Value y = by_attr ? get_attr_path(x, attr, line) : x;
        bool r;
        if (a.pos.size() > t0) {
          Args targs;
          targs.pos.assign(a.pos.begin() + t0 + 1, a.pos.end());
          r = apply_test(str_arg(&a.pos[t0], "test name", line), y, targs, line);
        } else {
          r = truthy(y);
        }
        if (r == keep_if) out.push_back(x);
      }
      return Value::list(std::move(out));
    }
    if (name == "unique") {
      List items = iterate(v, line), out;
      for (auto& x : items) {
        bool seen = false;
        for (auto& y : out) if (equal(x, y)) seen = true;
        if (!seen) out.push_back(x);
      }
      return Value::list(std::move(out));
    }
    if (name == "sort") {
      List items = iterate(v, line);
      bool rev = a.get(0, "reverse") && truthy(*a.get(0, "reverse"));
      const Value* attr = a.get(2, "attribute");
      std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
        Value p = attr ? get_attr_path(x, to_str(*attr), line) : x, q = attr ? get_attr_path(y, to_str(*attr), line) : y;
        return rev ? compare(q, p, line) < 0 : compare(p, q, line) < 0;
      });
      return Value::list(std::move(items));
    }
    if (name == "int") {
      if (v.is_num()) return Value::integer(v.as_int());
      if (v.k == K::Str) {
        try { return Value::integer(static_cast<int64_t>(std::stod(v.s))); } catch (const std::exception&) {}
      }
      const Value* d = a.get(0, "default");
      return d ? *d : Value::integer(0);
    }
    if (name == "float") {
      if (v.is_num()) return Value::number(v.as_double());
      if (v.k == K::Str) {
        try { return Value::number(std::stod(v.s)); } catch (const std::exception&) {}
      }
      const Value* d = a.get(0, "default");
      return d ? *d : Value::number(0);
    }
    if (name == "abs") {
      if (!v.is_num()) fail(line, "abs of a non-number");
      return v.k == K::Float ? Value::number(std::fabs(v.f)) : Value::integer(std::llabs(v.as_int()));
    }
    fail(line, "unknown or unsupported filter '" + name + "'");
  }

  // selectattr/map attribute paths: "a.b" or "a.0".
  Value get_attr_path(const Value& v, const std::string& path, int line) {
    Value cur = v;
    size_t start = 0;
    while (true) {
      size_t dot = path.find('.', start);
      std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      if (cur.is_undefined()) return cur;
      bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
      cur = digits && cur.k == Value::K::List ? get_item(cur, Value::integer(std::stoll(part)), line)
                                              : get_item(cur, Value::str(part), line);
      if (dot == std::string::npos) return cur;
      start = dot + 1;
    }
  }

  Scope* root_;
  int depth_ = 0;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Public API

ChatTemplate::ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;
ChatTemplate::~ChatTemplate() = default;

// The origin is kept with the program so render errors name the template too.
struct NamedProgram : TemplateProgram {
  std::string origin;
};

Result<ChatTemplate> ChatTemplate::parse(std::string_view source, const std::string& origin) {
  if (!utf8_is_valid(source)) return error("{}: template is not valid UTF-8", origin);
  auto prog = std::make_shared<NamedProgram>();
  prog->origin = origin;
  try {
    Lexer lexer{std::string(source)};
    Parser parser(lexer.run());
    prog->body = parser.parse_template();
  } catch (const TemplateError& e) {
    if (e.line <= 0) return error("{}: {}", origin, e.msg);
    return error("{}: line {}: {}", origin, e.line, e.msg);
  } catch (const std::exception& e) {
    return error("{}: {}", origin, e.what());
  }
  ChatTemplate t;
  t.program_ = std::move(prog);
  return t;
}

Result<std::string> ChatTemplate::render(const ChatTemplateInput& in) const {
  if (!program_) return error("render: empty chat template");
  const auto& origin = static_cast<const NamedProgram&>(*program_).origin;
  if (!in.messages.is_array()) return error("{}: messages must be a JSON array", origin);
  if (!in.tools.is_null() && !in.tools.is_array()) return error("{}: tools must be a JSON array", origin);
  Scope root;
  std::string out;
  try {
    if (in.extra.is_object()) {
      for (const auto& [key, value] : in.extra.members()) root.vars[key] = from_json(value);
    }
    root.vars["messages"] = from_json(in.messages);
    root.vars["tools"] = from_json(in.tools);
    root.vars["documents"] = Value::none();
    root.vars["add_generation_prompt"] = Value::boolean(in.add_generation_prompt);
    if (in.enable_thinking) root.vars["enable_thinking"] = Value::boolean(*in.enable_thinking);
    Evaluator ev(&root);
    ev.exec_all(program_->body, root, out);
  } catch (const TemplateError& e) {
    if (e.line <= 0) return error("{}: {}", origin, e.msg);
    return error("{}: line {}: {}", origin, e.line, e.msg);
  } catch (const std::exception& e) {
    return error("{}: {}", origin, e.what());
  }
  return out;
}

Result<ChatTemplate> load_chat_template(const std::string& model_dir, JsonDoc* extra) {
  std::string config_path = join_path(model_dir, "tokenizer_config.json");
  JsonDoc config(true);
  if (file_exists(config_path)) {
    ASSIGN_OR_RETURN(std::string text, read_file(config_path));
    Result<JsonDoc> parsed = parse_json_ordered(text);
    if (!parsed.ok()) return error("{}: malformed JSON: {}", config_path, parsed.status().message());
    config = std::move(*parsed);
    if (!config.is_object()) return error("{}: top level is not a JSON object", config_path);
  }
  if (extra) {
    for (const char* k : {"bos_token", "eos_token", "pad_token", "unk_token"}) {
      JsonRef t = config[k];
      if (t.is_string()) extra->set(k, t);
      else if (t["content"].is_string()) extra->set(k, t["content"]);
    }
  }
  std::string jinja_path = join_path(model_dir, "chat_template.jinja");
  if (file_exists(jinja_path)) {
    ASSIGN_OR_RETURN(std::string text, read_file(jinja_path));
    return ChatTemplate::parse(text, jinja_path);
  }
  if (!file_exists(config_path))
    return error("{}: no chat_template.jinja and no tokenizer_config.json", model_dir);
  if (!config.contains("chat_template")) return error("{}: no \"chat_template\" field", config_path);
  JsonRef ct = config["chat_template"];
  std::string origin = config_path + ": chat_template";
  if (ct.is_string()) return ChatTemplate::parse(ct.as_string(), origin);
  if (ct.is_array()) {
    for (JsonRef entry : ct.elements()) {
      if (entry["name"] == "default" && entry["template"].is_string())
        return ChatTemplate::parse(entry["template"].as_string(), origin + "[default]");
    }
    return error("{}: a list without a {{\"name\": \"default\"}} entry", origin);
  }
  return error("{}: expected a string or a list of {{name, template}}", origin);
}

}  // namespace ck::text
