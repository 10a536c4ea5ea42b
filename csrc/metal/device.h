// The Metal backend's entry point: a gpu::Device over the system's default Metal device.
// Plain C++ (the implementation, device.mm, is the Objective-C++), so the rest of the core never
// sees Objective-C, as in ggml-metal.
#pragma once
#include <memory>

#include "gpu/device.h"

namespace lily::metal {

// Throws lily::Error when there is no Metal device or it lacks Metal 3 (Apple7 / M1 or later).
std::shared_ptr<gpu::Device> make_device();

// Whether the system has a default Metal device at all, usable by lily or not (so backend="auto"
// tells "no Metal here" from "a GPU lily cannot use").
bool system_device_present();

}  // namespace lily::metal
