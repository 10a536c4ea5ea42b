// A small, strict JSON reader for the two documents the core parses itself: safetensors headers
// and (for fuzzing and tools) configuration files. Input is untrusted, so every failure is a
// lily::Error naming the byte offset; nesting depth is bounded so hostile input cannot overflow
// the stack.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace lily::json {

struct Value {
  enum class Kind { Null, Bool, Number, String, Array, Object };
  Kind kind = Kind::Null;
  bool boolean = false;
  double number = 0.0;
  bool is_integer = false;  // the literal had no fraction or exponent
  int64_t integer = 0;      // exact value when is_integer (and it fits)
  std::string string;
  std::vector<Value> array;
  // Key order is kept: safetensors tools report tensors in file order.
  std::vector<std::pair<std::string, Value>> object;

  const Value* find(std::string_view key) const;
  bool is_object() const { return kind == Kind::Object; }
  bool is_array() const { return kind == Kind::Array; }
  bool is_string() const { return kind == Kind::String; }
};

// Parses a whole document; throws lily::Error("[json] ... at byte N") on malformed input,
// duplicate object keys, or nesting deeper than max_depth.
Value parse(std::string_view text, int max_depth = 64);

}  // namespace lily::json
