// lily._core: the Python face of the native core. One init_<area>() per file in this folder,
// as MLX does; nothing outside csrc/python/ includes nanobind.
#include "python/bindings.h"

NB_MODULE(_core, m) {
  m.doc() = "lily native core";
  lily::python::init_errors(m);
  lily::python::init_model(m);
  lily::python::init_sampler(m);
  lily::python::init_msl_cpu(m);
  lily::python::init_kernel_args(m);
  lily::python::init_msl_cuda(m);

}
