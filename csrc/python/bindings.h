// Shared declarations for the binding files in csrc/python/ (the only nanobind users).
#pragma once
#include <nanobind/nanobind.h>

namespace nb = nanobind;

namespace lily::python {
void init_errors(nb::module_& m);
void init_model(nb::module_& m);
void init_sampler(nb::module_& m);
void init_msl_cpu(nb::module_& m);
void init_kernel_args(nb::module_& m);

}  // namespace lily::python
