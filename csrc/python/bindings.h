// Shared declarations for the binding files in csrc/python/ (the only nanobind users).
#pragma once
#include <nanobind/nanobind.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "gpu/device.h"

namespace nb = nanobind;

namespace lily::python {
// Function-constant values as Python passes them: {index: ("bool" | "uint" | ..., value)}.
using ConstantValues = std::map<uint32_t, std::pair<std::string, double>>;
gpu::FunctionConstants function_constants(const ConstantValues& constants);  // msl_cpu.cpp

void init_errors(nb::module_& m);
void init_model(nb::module_& m);
void init_sampler(nb::module_& m);
void init_msl_cpu(nb::module_& m);
void init_kernel_args(nb::module_& m);
void init_msl_cuda(nb::module_& m);

}  // namespace lily::python
