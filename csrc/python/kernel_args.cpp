// lily._core.kernel_args: the host/kernel argument structs of metal/*_args.h, so tests fill them
// by field name and hand them to ComputeEncoder.set_bytes as the host does (no struct.pack
// format strings to keep in step with the headers):
//
//   a = kernel_args.AttnArgs(D=256, Hq=16, Hkv=2, scale=0.0625)   # unset fields are 0
//   a.n_splits = 4;  bytes(a)  -> the struct's bytes;  kernel_args.AttnArgs.nbytes -> sizeof
//   kernel_args.GemvArgs(w=kernel_args.QuantMatrix(in_=64, out=32, bits=4, group=64), ldx=64)
//
// A field named like a Python keyword takes a trailing underscore (QuantMatrix.in_). An unknown
// field is an AttributeError. The kernels' compile-time constants the host sizes grids by are
// module attributes (GEMV_ROWS, ATTN_HEAD_DIMS, ...).
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gpu/encode.h"
#include "metal/attention_args.h"
#include "metal/attention_prefill_args.h"
#include "metal/gdn_args.h"
#include "metal/gdn_prefill_args.h"
#include "metal/moe_args.h"
#include "metal/norm_args.h"
#include "metal/quant_args.h"
#include "metal/sampling_args.h"
#include "python/bindings.h"

namespace lily::python {
namespace {

template <class T>
nb::class_<T> args_struct(nb::module_& m, const char* name, const char* doc) {
  nb::class_<T> c(m, name, doc);
  c.def("__init__", [](nb::pointer_and_handle<T> v, nb::kwargs fields) {
    new (v.p) T{};
    nb::inst_mark_ready(v.h);  // the fields' setters need a constructed instance
    for (auto [key, value] : fields) nb::setattr(v.h, key, value);
  });
  c.def("__bytes__", [](const T& a) { return nb::bytes(reinterpret_cast<const char*>(&a), sizeof a); });
  c.def_prop_ro_static("nbytes", [](nb::handle) { return sizeof(T); }, "sizeof the struct (what set_bytes sends)");
  return c;
}

#define LILY_FIELD(T, f) def_rw(#f, &T::f)

std::vector<int> dims(std::initializer_list<int> l) { return l; }

// AttnSeq's k / v: LILY_ATTN_MAX_ARENAS device addresses (unset ones 0).
std::vector<uint64_t> arenas(const uint64_t (&a)[LILY_ATTN_MAX_ARENAS]) { return {a, a + LILY_ATTN_MAX_ARENAS}; }
void set_arenas(uint64_t (&a)[LILY_ATTN_MAX_ARENAS], const std::vector<uint64_t>& v, const char* name) {
  if (v.size() > LILY_ATTN_MAX_ARENAS)
    throw nb::value_error((std::string("AttnSeq.") + name + ": at most " + std::to_string(LILY_ATTN_MAX_ARENAS) +
                           " addresses").c_str());
  for (size_t i = 0; i < LILY_ATTN_MAX_ARENAS; ++i) a[i] = i < v.size() ? v[i] : 0;
}

}  // namespace

void init_kernel_args(nb::module_& parent) {
  nb::module_ m = parent.def_submodule("kernel_args", "metal/*_args.h: the kernels' argument structs");

  args_struct<QuantMatrix>(m, "QuantMatrix", "W [out, in]: bits 0 = dense, else MLX affine")
      .def_rw("in_", &QuantMatrix::in)
      .LILY_FIELD(QuantMatrix, out)
      .LILY_FIELD(QuantMatrix, bits)
      .LILY_FIELD(QuantMatrix, group)
      .LILY_FIELD(QuantMatrix, vec);
  args_struct<GemvArgs>(m, "GemvArgs", "gemv_<S>").LILY_FIELD(GemvArgs, w).LILY_FIELD(GemvArgs, ldx).LILY_FIELD(GemvArgs, ldy);
  args_struct<EmbedArgs>(m, "EmbedArgs", "embed_<S>").LILY_FIELD(EmbedArgs, w).LILY_FIELD(EmbedArgs, vocab);
  args_struct<GemmArgs>(m, "GemmArgs", "gemm_<S>_bm<BM>")
      .LILY_FIELD(GemmArgs, w)
      .LILY_FIELD(GemmArgs, rows)
      .LILY_FIELD(GemmArgs, ldx)
      .LILY_FIELD(GemmArgs, ldy);
  args_struct<NormArgs>(m, "NormArgs", "add_rms_norm").LILY_FIELD(NormArgs, n).LILY_FIELD(NormArgs, add).LILY_FIELD(NormArgs, eps);
  args_struct<AttnSeq>(m, "AttnSeq", "one sequence of an attention dispatch (a table entry; k, v: 6 addresses each)")
      .def_prop_rw("k", [](const AttnSeq& s) { return arenas(s.k); },
                   [](AttnSeq& s, const std::vector<uint64_t>& a) { set_arenas(s.k, a, "k"); })
      .def_prop_rw("v", [](const AttnSeq& s) { return arenas(s.v); },
                   [](AttnSeq& s, const std::vector<uint64_t>& a) { set_arenas(s.v, a, "v"); })
      .LILY_FIELD(AttnSeq, table)
      .LILY_FIELD(AttnSeq, first)
      .LILY_FIELD(AttnSeq, n)
      .LILY_FIELD(AttnSeq, pos0)
      .LILY_FIELD(AttnSeq, cap)
      .LILY_FIELD(AttnSeq, n_splits)
      .LILY_FIELD(AttnSeq, split_len)
      .LILY_FIELD(AttnSeq, part);
  args_struct<AttnPrepareArgs>(m, "AttnPrepareArgs", "attn_prepare_[blocks_]<KV>")
      .LILY_FIELD(AttnPrepareArgs, D)
      .LILY_FIELD(AttnPrepareArgs, rot)
      .LILY_FIELD(AttnPrepareArgs, Hq)
      .LILY_FIELD(AttnPrepareArgs, Hkv)
      .LILY_FIELD(AttnPrepareArgs, n_seqs)
      .LILY_FIELD(AttnPrepareArgs, eps);
  args_struct<AttnArgs>(m, "AttnArgs", "attn_decode_[blocks_]<KV>_d<D>, attn_combine")
      .LILY_FIELD(AttnArgs, D)
      .LILY_FIELD(AttnArgs, Hq)
      .LILY_FIELD(AttnArgs, Hkv)
      .LILY_FIELD(AttnArgs, n_seqs)
      .LILY_FIELD(AttnArgs, max_splits)
      .LILY_FIELD(AttnArgs, scale);
  args_struct<AttnPrefillArgs>(m, "AttnPrefillArgs", "attn_prefill_[blocks_]<KV>_d<D>")
      .LILY_FIELD(AttnPrefillArgs, D)
      .LILY_FIELD(AttnPrefillArgs, Hq)
      .LILY_FIELD(AttnPrefillArgs, Hkv)
      .LILY_FIELD(AttnPrefillArgs, tile_tokens)
      .LILY_FIELD(AttnPrefillArgs, scale);
  args_struct<GdnSeq>(m, "GdnSeq", "one sequence of a gdn_conv / gdn_recurrence dispatch (a table entry)")
      .LILY_FIELD(GdnSeq, window)
      .LILY_FIELD(GdnSeq, window_out)
      .LILY_FIELD(GdnSeq, S)
      .LILY_FIELD(GdnSeq, S_out)
      .LILY_FIELD(GdnSeq, first)
      .LILY_FIELD(GdnSeq, n);
  args_struct<GdnArgs>(m, "GdnArgs", "the DeltaNet kernels (gdn.metal, gdn_prefill.metal)")
      .LILY_FIELD(GdnArgs, T)
      .LILY_FIELD(GdnArgs, Hk)
      .LILY_FIELD(GdnArgs, Hv)
      .LILY_FIELD(GdnArgs, Dk)
      .LILY_FIELD(GdnArgs, Dv)
      .LILY_FIELD(GdnArgs, K)
      .LILY_FIELD(GdnArgs, C)
      .LILY_FIELD(GdnArgs, eps)
      .LILY_FIELD(GdnArgs, q_scale);
  args_struct<MoeRouteArgs>(m, "MoeRouteArgs", "moe_route")
      .LILY_FIELD(MoeRouteArgs, E)
      .LILY_FIELD(MoeRouteArgs, k)
      .LILY_FIELD(MoeRouteArgs, renormalize);
  args_struct<MoeGateUpArgs>(m, "MoeGateUpArgs", "moe_gate_up_<S>")
      .LILY_FIELD(MoeGateUpArgs, gate)
      .LILY_FIELD(MoeGateUpArgs, up)
      .LILY_FIELD(MoeGateUpArgs, k);
  args_struct<MoeDownArgs>(m, "MoeDownArgs", "moe_down_<S>")
      .LILY_FIELD(MoeDownArgs, down)
      .LILY_FIELD(MoeDownArgs, shared_down)
      .LILY_FIELD(MoeDownArgs, k)
      .LILY_FIELD(MoeDownArgs, weighted)
      .LILY_FIELD(MoeDownArgs, has_shared)
      .LILY_FIELD(MoeDownArgs, lanes);
  args_struct<MoePlanArgs>(m, "MoePlanArgs", "moe_plan")
      .LILY_FIELD(MoePlanArgs, n)
      .LILY_FIELD(MoePlanArgs, E)
      .LILY_FIELD(MoePlanArgs, block_rows);
  args_struct<MoeGemmArgs>(m, "MoeGemmArgs", "moe_gemm_{gate_up,down}_<S>_bm<BM>")
      .LILY_FIELD(MoeGemmArgs, a)
      .LILY_FIELD(MoeGemmArgs, b)
      .LILY_FIELD(MoeGemmArgs, k)
      .LILY_FIELD(MoeGemmArgs, routed)
      .LILY_FIELD(MoeGemmArgs, n);
  args_struct<MoeCombineArgs>(m, "MoeCombineArgs", "moe_combine")
      .LILY_FIELD(MoeCombineArgs, H)
      .LILY_FIELD(MoeCombineArgs, k)
      .LILY_FIELD(MoeCombineArgs, has_shared);
  args_struct<SampleArgs>(m, "SampleArgs", "sample")
      .LILY_FIELD(SampleArgs, vocab)
      .LILY_FIELD(SampleArgs, sample)
      .LILY_FIELD(SampleArgs, top_k)
      .LILY_FIELD(SampleArgs, use_top_p)
      .LILY_FIELD(SampleArgs, top_p_lo)
      .LILY_FIELD(SampleArgs, top_p_hi)
      .LILY_FIELD(SampleArgs, use_min_p)
      .LILY_FIELD(SampleArgs, inv_t)
      .LILY_FIELD(SampleArgs, min_p_offset)
      .LILY_FIELD(SampleArgs, stride);

  // The host's choices the tests make as it does (csrc/gpu/encode.h).
  m.def("vector_rows", &gpu::vector_rows, nb::arg("m"), nb::arg("starts"),
        "whether QuantMatrix.vec may be set: rows of whole 16-byte runs, every start 16-byte aligned");
  m.def(
      "moe_down_lanes",
      [](const QuantMatrix& down, const QuantMatrix* shared, int k) { return gpu::moe_down_lanes(down, shared, k); },
      nb::arg("down"), nb::arg("shared").none(), nb::arg("k"), "MoeDownArgs.lanes as encode_moe_down picks it");

  // The compile-time constants grids are sized by.
  m.attr("GEMV_ROWS") = LILY_GEMV_SIMDGROUPS * LILY_GEMV_ROWS_PER_SIMDGROUP;  // rows per gemv threadgroup
  m.attr("GEMV_THREADS") = 32 * LILY_GEMV_SIMDGROUPS;
  m.attr("GEMM_BN") = LILY_GEMM_BN;
  m.attr("GEMM_THREADS") = LILY_GEMM_THREADS;
  m.attr("ATTN_THREADS") = 32 * LILY_ATTN_SIMDGROUPS;
  m.attr("ATTN_COMBINE_COLUMNS") = LILY_ATTN_COMBINE_COLUMNS;
  m.attr("GDN_COLUMNS") = LILY_GDN_COLUMNS;
  m.attr("ATTN_MAX_SEQS") = LILY_ATTN_MAX_SEQS;
  m.attr("GDN_MAX_SEQS") = LILY_GDN_MAX_SEQS;
  m.attr("ATTN_PF_ROWS") = LILY_ATTN_PF_ROWS;
  m.attr("ATTN_PF_THREADS") = LILY_ATTN_PF_THREADS;
  m.attr("GDN_PREP_THREADS") = LILY_GDN_PREP_THREADS;
  m.attr("GDN_SCAN_SPLIT") = LILY_GDN_SCAN_SPLIT;
  m.attr("MOE_PLAN_THREADS") = LILY_MOE_PLAN_THREADS;
  m.attr("SAMPLE_THREADS") = LILY_SAMPLE_THREADS;
#define LILY_LIST(D) D,
  m.attr("ATTN_HEAD_DIMS") = dims({LILY_ATTN_HEAD_DIMS(LILY_LIST)});
  m.attr("GDN_KEY_DIMS") = dims({LILY_GDN_KEY_DIMS(LILY_LIST)});
#undef LILY_LIST
}

}  // namespace lily::python
