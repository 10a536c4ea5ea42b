// A device address inside an argument struct: tables sent with set_bytes that name buffers by
// address rather than by binding. A kernel binds at most 31 buffers, and a dispatch over several
// sequences reaches each one's KV cache and DeltaNet state this way (attention_args.h AttnSeq,
// gdn_args.h GdnSeq), as Metal 3's bindless argument data does:
//   kernels  LILY_DEVICE_PTR(T) is `device T*`;
//   host     a uint64_t holding Buffer::gpu_address() (MTLBuffer.gpuAddress) plus a byte offset,
//            the buffer declared to the encoder with ComputeEncoder::use_resource
//            (useResource:usage:) for the dispatch that reads it.
// Both are 8 bytes: the structs' static_asserts hold on either side.
#pragma once

#if defined(__METAL_VERSION__) || defined(LILY_MSL_INSTANTIATE)
#define LILY_DEVICE_PTR(T) device T*
#else
#define LILY_DEVICE_PTR(T) uint64_t  // (<cstdint> is the host's to include, as for every *_args.h)
#endif
