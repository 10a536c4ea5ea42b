// Arguments of the sampling family (metal/sampling.metal), shared by host and kernels: plain
// 32-bit fields only, so the layout is the same in C++ and MSL.
#pragma once

// One token from logits[0, vocab): argmax (temperature off), or a seeded draw after
// temperature / top-k / top-p / min-p, the CPU sampler's algorithm (engine/sampler.h).
struct SampleArgs {
  uint32_t vocab;      // tokens that may be chosen: logits [0, vocab) of a row that may be longer
                       // (the sampler's token limit: an embedding's rows past the tokenizer's)
  uint32_t sample;     // 0: argmax (lowest id on ties); 1: draw
  uint32_t top_k;      // 0: off (also when >= vocab)
  uint32_t use_top_p;  // top_p < 1
  uint32_t top_p_lo;   // top_p * 2^64 (exact: top_p is a float <= 1), low and high words
  uint32_t top_p_hi;
  uint32_t use_min_p;
  float inv_t;         // 1 / temperature, as the CPU computes it (1.0f / T)
  float min_p_offset;  // float(T * log(min_p)): tokens below max + offset are cut
  uint32_t stride;     // floats from one row's logits (and scratch) to the next row's
};

static_assert(sizeof(SampleArgs) == 40, "SampleArgs: 10 fields of 4 bytes, as the kernel reads them");

// status[3] a sample dispatch writes next to its token: code, token index, logit bits.
#define LILY_SAMPLE_OK 0u
#define LILY_SAMPLE_BAD_LOGIT 1u  // a NaN or +inf logit (index and bits of the first)
#define LILY_SAMPLE_ALL_NEG_INF 2u

#define LILY_SAMPLE_THREADS 1024
