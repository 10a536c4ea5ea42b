// Arguments of the Gated DeltaNet family (metal/gdn.metal), shared by host and kernels.
//
// Layouts: qkv [T, C] with C = 2*Hk*Dk + Hv*Dv ([q | k | v], heads contiguous);
// z [T, Hv*Dv]; b, a [T, Hv]; conv state [K-1, C] (oldest first); taps [C, K];
// recurrent state S [Hv, Dk, Dv] f32; Qwen3-Next grouped inputs qkvz [T, C + Hv*Dv], ba [T, 2*Hv].
#pragma once
#include "device_ptr.h"

#define LILY_GDN_MAX_DK 256  // key head dim held per thread (the state column lives in registers)
#define LILY_GDN_COLUMNS 32   // value columns (threads) per gdn_recurrence threadgroup

// The key head dims the recurrence kernels are instantiated for (a compile-time Dk keeps the
// state column in registers): the Qwen3.5 / 3.6 / Next family's 128, and smaller ones for tests
// and tiny checkpoints. X(Dk) per dim; the host checks a model's against it.
#define LILY_GDN_KEY_DIMS(X) X(32) X(48) X(64) X(128)

struct GdnArgs {
  uint32_t T;  // rows of the pass (gdn_conv, gdn_recurrence: sequences in the table instead)
  uint32_t Hk, Hv, Dk, Dv;
  uint32_t K;  // conv kernel width
  uint32_t C;  // conv channels
  float eps;      // gated RMSNorm epsilon
  float q_scale;  // 1 / sqrt(Dk)
};

// One sequence of a decode-route dispatch (gdn_conv, gdn_recurrence): its rows of the pass and
// its state, by address (device_ptr.h), so one dispatch serves every sequence of a pass. Each
// state is read from one copy and written to the other (they may be the same buffer).
struct GdnSeq {
  LILY_DEVICE_PTR(float) window;      // [K-1, C] carried conv inputs, read
  LILY_DEVICE_PTR(float) window_out;  // [K-1, C] written
  LILY_DEVICE_PTR(float) S;           // [Hv, Dk, Dv] read
  LILY_DEVICE_PTR(float) S_out;       // [Hv, Dk, Dv] written
  uint32_t first;  // its first row in qkv, b, a, conv_out, o
  uint32_t n;      // its rows (tokens), walked in order
};
#define LILY_GDN_MAX_SEQS 8  // sequences per dispatch

static_assert(sizeof(GdnSeq) == 40, "GdnSeq: 4 addresses of 8 bytes and 2 fields of 4, as the kernels read them");
static_assert(sizeof(GdnArgs) == 36, "GdnArgs: 9 fields of 4 bytes, as the kernels read them");
