// Recursive-descent JSON reader (RFC 8259), strict: no comments, no trailing commas, no NaN.
#include "model/json.h"

#include <cmath>
#include <cerrno>
#include <cstdlib>
#include <unordered_set>

#include "model/error.h"

namespace lily::json {

const Value* Value::find(std::string_view key) const {
  for (const auto& [k, v] : object)
    if (k == key) return &v;
  return nullptr;
}

namespace {

class Parser {
 public:
  Parser(std::string_view text, int max_depth) : s_(text), max_depth_(max_depth) {}

  Value document() {
    Value v = value(0);
    skip_space();
    if (i_ != s_.size()) fail("trailing characters after the document");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw Error("[json] " + what + " at byte " + std::to_string(i_));
  }

  void skip_space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r'))
      ++i_;
  }

  char peek() {
    skip_space();
    if (i_ >= s_.size()) fail("unexpected end of input");
    return s_[i_];
  }

  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++i_;
  }

  void literal(std::string_view word) {
    if (s_.substr(i_, word.size()) != word) fail("invalid literal");
    i_ += word.size();
  }

  Value value(int depth) {
    if (depth > max_depth_) fail("nesting deeper than " + std::to_string(max_depth_));
    Value v;
    switch (peek()) {
      case '{': object(v, depth); break;
      case '[': array(v, depth); break;
      case '"': v.kind = Value::Kind::String; v.string = string(); break;
      case 't': literal("true"); v.kind = Value::Kind::Bool; v.boolean = true; break;
      case 'f': literal("false"); v.kind = Value::Kind::Bool; break;
      case 'n': literal("null"); break;
      default: number(v); break;
    }
    return v;
  }

  void object(Value& v, int depth) {
    v.kind = Value::Kind::Object;
    expect('{');
    if (peek() == '}') { ++i_; return; }
    // Duplicate keys are looked up in a hash set: a linear find per key made a header of n
    // tensors cost O(n^2) (80,000 keys took 47 s; the 100 MiB header bound allows millions).
    std::unordered_set<std::string> seen;
    for (;;) {
      if (peek() != '"') fail("expected a string key");
      std::string key = string();
      if (!seen.insert(key).second) fail("duplicate key \"" + key + "\"");
      expect(':');
      v.object.emplace_back(std::move(key), value(depth + 1));
      char c = peek();
      ++i_;
      if (c == '}') return;
      if (c != ',') fail("expected ',' or '}'");
    }
  }

  void array(Value& v, int depth) {
    v.kind = Value::Kind::Array;
    expect('[');
    if (peek() == ']') { ++i_; return; }
    for (;;) {
      v.array.push_back(value(depth + 1));
      char c = peek();
      ++i_;
      if (c == ']') return;
      if (c != ',') fail("expected ',' or ']'");
    }
  }

  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xC0 | (cp >> 6));
      out += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += char(0xE0 | (cp >> 12));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    } else {
      out += char(0xF0 | (cp >> 18));
      out += char(0x80 | ((cp >> 12) & 0x3F));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    }
  }

  uint32_t hex4() {
    if (i_ + 4 > s_.size()) fail("truncated \\u escape");
    uint32_t cp = 0;
    for (int k = 0; k < 4; ++k) {
      char c = s_[i_++];
      cp <<= 4;
      if (c >= '0' && c <= '9') cp |= uint32_t(c - '0');
      else if (c >= 'a' && c <= 'f') cp |= uint32_t(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') cp |= uint32_t(c - 'A' + 10);
      else fail("bad hex digit in \\u escape");
    }
    return cp;
  }

  std::string string() {
    ++i_;  // opening quote (checked by the caller)
    std::string out;
    for (;;) {
      if (i_ >= s_.size()) fail("unterminated string");
      char c = s_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') { out += c; continue; }
      if (i_ >= s_.size()) fail("unterminated escape");
      char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00) {  // surrogate pair
            if (s_.substr(i_, 2) != "\\u") fail("unpaired surrogate");
            i_ += 2;
            uint32_t lo = hex4();
            if (lo < 0xDC00 || lo >= 0xE000) fail("bad low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            fail("unpaired surrogate");
          }
          append_utf8(out, cp);
          break;
        }
        default: fail("bad escape");
      }
    }
  }

  void number(Value& v) {
    size_t start = i_;
    bool integral = true;
    if (i_ < s_.size() && s_[i_] == '-') ++i_;
    auto digits = [&] {
      size_t d0 = i_;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
      if (i_ == d0) fail("invalid number");
    };
    if (i_ < s_.size() && s_[i_] == '0') ++i_;
    else digits();
    if (i_ < s_.size() && s_[i_] == '.') { ++i_; digits(); integral = false; }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      ++i_;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      digits();
      integral = false;
    }
    std::string lit(s_.substr(start, i_ - start));
    v.kind = Value::Kind::Number;
    v.number = std::strtod(lit.c_str(), nullptr);
    if (!std::isfinite(v.number)) fail("number out of range");
    if (integral) {
      errno = 0;
      char* end = nullptr;
      long long n = std::strtoll(lit.c_str(), &end, 10);
      if (errno == 0 && end == lit.c_str() + lit.size()) {
        v.is_integer = true;
        v.integer = n;
      }
    }
  }

  std::string_view s_;
  size_t i_ = 0;
  int max_depth_;
};

}  // namespace

Value parse(std::string_view text, int max_depth) { return Parser(text, max_depth).document(); }

}  // namespace lily::json
