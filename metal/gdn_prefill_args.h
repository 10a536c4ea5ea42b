// Constants of the Gated DeltaNet prefill family (metal/gdn_prefill.metal), shared by host and
// kernels. Its arguments are the decode family's GdnArgs (metal/gdn_args.h): the same shapes.
//
// Layouts: qkv [T, C] raw projections, C = 2*Hk*Dk + Hv*Dv ([q | k | v], heads contiguous);
// x [T, C] after conv + SiLU, with q and k L2-normalised per head (q also times 1/sqrt(Dk));
// gates [T, Hv, 2] = (beta, decay); z [T, Hv*Dv]; conv window [K-1, C] (oldest first);
// state S [Hv, Dk, Dv] f32.
#pragma once

#include "gdn_args.h"

#define LILY_GDN_PREP_THREADS 128  // threads of a gdn_prepare threadgroup (one head, one token)
#define LILY_GDN_SCAN_SPLIT 4      // threads per state column in gdn_scan (one quad)
#define LILY_GDN_SCAN_MAX_DK 256   // key head dim: Dk / SPLIT floats of a column per thread
// Most threads of a gdn_scan threadgroup (SPLIT * Dv): 512 = the family's Dv of 128. Declared,
// so the compiler must fit that many threads; each holds Dk / SPLIT state floats in registers,
// which a 1024-thread promise would spill (ptxas: 64 registers a thread). Wider Dv runs the
// per-token recurrence instead (gdn_prefill_fits).
#define LILY_GDN_SCAN_MAX_THREADS 512
