// Loading the CUDA driver API; see driver.h.
#include "msl_cuda/driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <memory>
#include <mutex>

#include "model/error.h"

namespace lily::msl_cuda {
namespace {

std::unique_ptr<Driver> load() {
  const char* env = std::getenv("LILY_LIBCUDA");
  const std::string name = env && *env ? env : "libcuda.so.1";
  void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  struct Close {  // unless the driver is complete and initialised
    void*& h;
    ~Close() { if (h) dlclose(h); }
  } close_on_error{handle};
  if (!handle) {
    const char* why = dlerror();
    throw Error("[msl_cuda] cannot load the NVIDIA driver library " + name + " (" +
                (why ? why : "not found") + "): backend 'msl-cuda' needs an NVIDIA GPU and its "
                "driver");
  }
  auto d = std::make_unique<Driver>();
  d->library = name;
  auto bind = [&](auto& fn, const char* symbol) {
    void* p = dlsym(handle, symbol);
    if (!p)
      throw Error("[msl_cuda] the driver library " + name + " has no " + symbol +
                  " (not a CUDA driver, or one older than CUDA 11)");
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
  };
  bind(d->cuInit, "cuInit");
  bind(d->cuDriverGetVersion, "cuDriverGetVersion");
  bind(d->cuGetErrorName, "cuGetErrorName");
  bind(d->cuGetErrorString, "cuGetErrorString");
  bind(d->cuDeviceGetCount, "cuDeviceGetCount");
  bind(d->cuDeviceGet, "cuDeviceGet");
  bind(d->cuDeviceGetName, "cuDeviceGetName");
  bind(d->cuDeviceGetAttribute, "cuDeviceGetAttribute");
  bind(d->cuDeviceTotalMem, "cuDeviceTotalMem_v2");
  bind(d->cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  bind(d->cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
  bind(d->cuCtxSetCurrent, "cuCtxSetCurrent");
  bind(d->cuModuleLoadDataEx, "cuModuleLoadDataEx");
  bind(d->cuModuleUnload, "cuModuleUnload");
  bind(d->cuModuleGetFunction, "cuModuleGetFunction");
  bind(d->cuFuncGetAttribute, "cuFuncGetAttribute");
  bind(d->cuMemAlloc, "cuMemAlloc_v2");
  bind(d->cuMemFree, "cuMemFree_v2");
  bind(d->cuMemAllocHost, "cuMemAllocHost_v2");
  bind(d->cuMemFreeHost, "cuMemFreeHost");
  bind(d->cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
  bind(d->cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
  bind(d->cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2");
  bind(d->cuMemsetD8Async, "cuMemsetD8Async");
  bind(d->cuStreamCreate, "cuStreamCreate");
  bind(d->cuStreamDestroy, "cuStreamDestroy_v2");
  bind(d->cuStreamSynchronize, "cuStreamSynchronize");
  bind(d->cuLaunchKernel, "cuLaunchKernel");
  bind(d->cuEventCreate, "cuEventCreate");
  bind(d->cuEventDestroy, "cuEventDestroy_v2");
  bind(d->cuEventRecord, "cuEventRecord");
  bind(d->cuEventSynchronize, "cuEventSynchronize");
  bind(d->cuEventElapsedTime, "cuEventElapsedTime");
  d->check(d->cuInit(0), "cuInit (" + name + ")");
  d->check(d->cuDriverGetVersion(&d->version), "cuDriverGetVersion");
  handle = nullptr;  // the library stays loaded for the process
  return d;
}

}  // namespace

std::string Driver::describe(CUresult r) const {
  const char* n = nullptr;
  const char* s = nullptr;
  cuGetErrorName(r, &n);
  cuGetErrorString(r, &s);
  return std::string(n ? n : "CUDA error " + std::to_string(r)) + (s ? std::string(": ") + s : "");
}

void Driver::check(CUresult r, const std::string& what) const {
  if (r != CUDA_SUCCESS) throw Error("[msl_cuda] " + what + ": " + describe(r));
}

const Driver& driver() {
  // A failure is not cached: the next call tries again (and raises again, naming the library).
  static std::mutex mutex;
  static std::unique_ptr<Driver> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  if (!loaded) loaded = load();
  return *loaded;
}

}  // namespace lily::msl_cuda
