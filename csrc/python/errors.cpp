// Native exceptions -> Python exceptions. The Python classes are created here (so the
// extension is self-contained) and re-exported by lily/__init__.py.
#include "model/error.h"
#include "python/bindings.h"

namespace lily::python {

void init_errors(nb::module_& m) {
  static nb::exception<lily::Error> lily_error(m, "LilyError", PyExc_ValueError);
  static nb::exception<lily::CheckpointError> checkpoint_error(m, "CheckpointError", lily_error);
  static nb::exception<lily::ConfigError> config_error(m, "ConfigError", lily_error);
  static nb::exception<lily::RequestError> request_error(m, "RequestError", lily_error);
}

}  // namespace lily::python
