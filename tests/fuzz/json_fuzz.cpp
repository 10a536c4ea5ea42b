// libFuzzer target: the native JSON reader (csrc/model/json.cpp) on arbitrary bytes, at the
// default depth bound and a shallow one. Clean rejections are lily::Error; invariants checked
// on accepted documents: an integer literal's exact value agrees with its double, and object
// keys are unique (the reader promises to refuse duplicates).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <set>
#include <string_view>

#include "model/error.h"
#include "model/json.h"

using lily::json::Value;

namespace {

void check(const Value& v, int depth, int max_depth) {
  if (depth > max_depth + 1) __builtin_trap();
  switch (v.kind) {
    case Value::Kind::Number:
      if (v.is_integer && std::fabs(double(v.integer) - v.number) > std::fabs(v.number) * 1e-12 + 1) __builtin_trap();
      break;
    case Value::Kind::Array:
      for (const Value& x : v.array) check(x, depth + 1, max_depth);
      break;
    case Value::Kind::Object: {
      std::set<std::string_view> keys;
      for (const auto& [k, x] : v.object) {
        if (!keys.insert(k).second) __builtin_trap();
        if (v.find(k) != &x) __builtin_trap();
        check(x, depth + 1, max_depth);
      }
      break;
    }
    default:
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  for (int depth : {64, 3}) {
    try {
      Value v = lily::json::parse(text, depth);
      check(v, 0, depth);
    } catch (const lily::Error&) {
    }
  }
  return 0;
}
