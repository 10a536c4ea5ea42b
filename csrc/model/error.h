// Errors raised by the native core. Messages read "[where] what is wrong", naming the tensor,
// file or field at fault; csrc/python/errors.cpp maps each class to a Python exception
// (lily.LilyError, lily.CheckpointError, lily.ConfigError — all ValueError subclasses).
#pragma once
#include <stdexcept>
#include <string>

namespace lily {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A checkpoint file or tensor is unreadable, truncated, inconsistent, missing or mis-shaped.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

// A configuration value is missing, out of range or names an unsupported model.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A request cannot be served as asked (over-long prompt, bad sampling parameter, ...).
class RequestError : public Error {
 public:
  using Error::Error;
};

}  // namespace lily
