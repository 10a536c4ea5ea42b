// Bindings for checkpoints, weights and the engine: what lily/model.py drives.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <functional>

#include "cpu/backend.h"
#include "cpu/linear.h"
#include "cpu/linear_int8.h"
#include "engine/engine.h"
#include "gpu/backend.h"
#include "gpu/plan.h"
#include "model/error.h"
#include "msl_cpu/device.h"
#include "msl_cuda/device.h"
#if defined(LILY_HAVE_METAL)
#include "metal/device.h"
#endif
#include "python/bindings.h"

namespace lily::python {

namespace {

using F32Array = nb::ndarray<nb::numpy, float>;

// A fresh C-contiguous float32 NumPy array the caller fills.
F32Array new_f32(std::initializer_list<size_t> shape, float** data) {
  size_t n = 1;
  for (size_t d : shape) n *= d;
  float* p = new float[n];
  nb::capsule owner(p, [](void* q) noexcept { delete[] static_cast<float*>(q); });
  *data = p;
  return F32Array(p, shape.size(), shape.begin(), owner);
}

std::vector<Mixer> parse_mixers(const std::vector<std::string>& names) {
  std::vector<Mixer> out;
  for (const auto& n : names) {
    if (n == "full_attention") out.push_back(Mixer::Attention);
    else if (n == "linear_attention") out.push_back(Mixer::GatedDeltaNet);
    else throw ConfigError("[config] unknown layer type '" + n + "'");
  }
  return out;
}

std::vector<Ffn> parse_ffns(const std::vector<std::string>& names) {
  std::vector<Ffn> out;
  for (const auto& n : names) {
    if (n == "dense") out.push_back(Ffn::Dense);
    else if (n == "moe") out.push_back(Ffn::Moe);
    else throw ConfigError("[config] unknown feed-forward type '" + n + "'");
  }
  return out;
}

// Engine(backend=...) options. The GPU ones are for tests (route thresholds, the MSL-on-CPU
// runtime's checking modes, and what its device reports or fails at).
struct BackendArgs {
  int threads = 0;
  int split_threshold = -1, split_len = -1, gemm_min_rows = -1, block_threshold = -1, block_len = -1;
  bool check_dependencies = false, asan = false, metal4 = false, opaque_buffers = false;
  int interleavings = 0;
  std::string kv_dtype = "auto", gemm = "auto", cpu_matmul = "auto";
  int apple_gpu_family = 0;    // msl-cpu: the family the device reports (0: its default)
  uint64_t working_set = 0;    // msl-cpu: recommendedMaxWorkingSetSize reported (0: none)
  std::string fail_dispatch, fail_library;  // msl-cpu: fault injection (tests of error paths)
  // msl-cuda: the device's checking and measuring modes (msl_cuda::DeviceOptions).
  bool permute_threadgroups = false, timing = false, synchronous = false;
  uint64_t seed = 0;
  bool gemv_words = false;  // GpuOptions::gemv_vector_loads off (A/B timing of the decode GEMVs)
  bool per_sequence_mixers = false;  // GpuOptions::mixer_tables off (A/B timing of the sequence tables)
  // The weights serve this engine alone (Model.load's own): an int8 CPU backend may rearrange
  // them for its kernels (cpu::arrange_for_int8).
  bool exclusive_weights = false;
};

// "cpu", "msl-cpu" (the Metal backend's dispatches run by the MSL-on-CPU runtime), "msl-cuda"
// (run on an NVIDIA GPU) or "metal".
std::unique_ptr<Backend> make_backend(const std::shared_ptr<ModelWeights>& weights, const std::string& name,
                                      const BackendArgs& a) {
  // "auto": int8 where this build has the integer kernels (x86 AVX2 / AVX-VNNI / AVX-512 VNNI,
  // arm64), f32 elsewhere. Both modes give each token the same result however it is chunked,
  // cached or batched (csrc/cpu/linear.h), so the faster one can be the default.
  cpu::Matmul matmul;
  if (a.cpu_matmul == "f32") matmul = cpu::Matmul::F32;
  else if (a.cpu_matmul == "int8") matmul = cpu::Matmul::Int8;
  else if (a.cpu_matmul == "auto") matmul = cpu::int8_kernels_available() ? cpu::Matmul::Int8 : cpu::Matmul::F32;
  else throw ConfigError("[engine] cpu_matmul must be 'auto', 'int8' or 'f32', not '" + a.cpu_matmul + "'");
  const bool cpu_int8 = name == "cpu" && matmul == cpu::Matmul::Int8;
  if (weights->arranged_for_cpu_int8() && !cpu_int8)
    throw ConfigError("[engine] these weights were rearranged for an int8 CPU engine (exclusive_weights=True); "
                      "load them again for backend '" + name + "' with cpu_matmul '" + a.cpu_matmul + "'");
  if (cpu_int8 && a.exclusive_weights) cpu::arrange_for_int8(*weights);
  if (name == "cpu") return std::make_unique<cpu::CpuBackend>(weights, a.threads, matmul);
  gpu::GpuOptions opt;
  if (a.split_threshold >= 0) opt.split_threshold = a.split_threshold;
  if (a.split_len > 0) opt.split_len = a.split_len;
  if (a.gemm_min_rows > 0) opt.gemm_min_rows = a.gemm_min_rows;
  opt.gemm = a.gemm;
  opt.gemv_vector_loads = !a.gemv_words;
  opt.mixer_tables = !a.per_sequence_mixers;
  const bool device_options = a.metal4 || a.apple_gpu_family || a.working_set || !a.fail_dispatch.empty() ||
                              !a.fail_library.empty() || a.opaque_buffers;
  if (device_options && name != "msl-cpu")
    throw ConfigError("[engine] metal4, apple_gpu_family, working_set, fail_dispatch, fail_library and "
                      "opaque_buffers are options of the msl-cpu backend (a real device reports its own)");
  if (a.block_threshold >= 0) opt.block_threshold = a.block_threshold;
  if (a.block_len > 0) opt.block_len = a.block_len;
  // "auto": float16 (GpuOptions::kv_half's default: half the bytes a long-context decode step
  // reads, f32 accumulation); "float32" is the reference option the tight tests select.
  if (a.kv_dtype != "auto" && a.kv_dtype != "float32" && a.kv_dtype != "float16")
    throw ConfigError("[engine] kv_dtype must be 'auto', 'float32' or 'float16', not '" + a.kv_dtype + "'");
  if (a.kv_dtype != "auto") opt.kv_half = a.kv_dtype == "float16";
  if (name == "msl-cuda") {
    // The msl_cpu checking modes have no CUDA counterpart here: refused by name.
    for (const auto& [set, option] : {std::pair{a.check_dependencies, "check_dependencies"},
                                      std::pair{a.interleavings != 0, "interleavings"},
                                      std::pair{a.asan, "asan"}})
      if (set) throw ConfigError(std::string("[engine] ") + option + " is an option of the msl-cpu backend, not msl-cuda");
    msl_cuda::DeviceOptions dev;
    dev.permute_threadgroups = a.permute_threadgroups;
    dev.seed = a.seed;
    dev.timing = a.timing;
    dev.synchronous = a.synchronous;
    // Raises without an NVIDIA driver, naming libcuda; the weights are uploaded once, now.
    return std::make_unique<gpu::GpuBackend>(weights, msl_cuda::make_device(dev), "msl-cuda", opt);
  }
  if (a.permute_threadgroups || a.timing || a.synchronous)
    throw ConfigError("[engine] permute_threadgroups, timing and synchronous are options of the msl-cuda backend");
  if (name == "msl-cpu") {
    msl_cpu::DeviceOptions dev;
    dev.check_dependencies = a.check_dependencies;
    dev.interleavings = a.interleavings;
    dev.asan = a.asan;
    dev.metal4 = a.metal4;
    if (a.apple_gpu_family) dev.apple_gpu_family = a.apple_gpu_family;
    dev.working_set = a.working_set;
    dev.fail_dispatch = a.fail_dispatch;
    dev.fail_library = a.fail_library;
    dev.opaque_buffers = a.opaque_buffers;
    dev.seed = a.seed;
    return std::make_unique<gpu::GpuBackend>(weights, msl_cpu::make_device(dev), "msl-cpu", opt);
  }
#if defined(LILY_HAVE_METAL)
  if (name == "metal") return std::make_unique<gpu::GpuBackend>(weights, metal::make_device(), "metal", opt);
#else
  if (name == "metal")
    throw ConfigError("[engine] backend 'metal' needs a build on macOS with Metal (this one has none); "
                      "'msl-cpu' runs the same kernels on the CPU");
#endif
  throw ConfigError("[engine] unknown backend '" + name + "'");
}

TensorSlice slice(int file, const std::string& name, int index, int row_begin, int row_end) {
  return TensorSlice{file, name, index, row_begin, row_end};
}

// (kernel, stage, weight bytes, state bytes, other bytes, threadgroups, threads per threadgroup)
// per dispatch: what gpu_records, gpu_plan and gpu_plan_prefill return.
using DispatchRow = std::tuple<std::string, int, uint64_t, uint64_t, uint64_t, uint64_t, uint32_t>;
std::vector<DispatchRow> dispatch_rows(const std::vector<gpu::DispatchRecord>& records) {
  std::vector<DispatchRow> rows;
  for (const auto& d : records)
    rows.emplace_back(d.kernel, d.stage, d.weight_bytes, d.state_bytes, d.other_bytes, d.threadgroups,
                      d.threads_per_threadgroup);
  return rows;
}

using PackedArray = nb::ndarray<const uint32_t, nb::ndim<2>, nb::c_contig>;
using F32In = nb::ndarray<const float, nb::ndim<2>, nb::c_contig>;

// An MLX affine matrix over caller-owned arrays (test bindings): packed [rows, cols*bits/32],
// scales and biases [rows, cols/group], f32. Checks the shapes agree; names `op` in errors.
Linear affine_from_arrays(const char* op, const PackedArray& packed, const F32In& scales, const F32In& biases,
                          int bits, int group_size) {
  const std::string tag = std::string("[") + op + "] ";
  const size_t rows = packed.shape(0), words = packed.shape(1);
  if (bits < 2 || bits > 8 || bits == 7) throw Error(tag + "unsupported bits " + std::to_string(bits));
  if (group_size <= 0) throw Error(tag + "group_size must be positive");
  const size_t cols = words * 32 / bits;
  if (words * 32 % bits || cols % group_size || scales.shape(0) != rows || biases.shape(0) != rows ||
      scales.shape(1) != cols / group_size || biases.shape(1) != cols / group_size)
    throw Error(tag + "packed, scales and biases shapes disagree");
  Linear W;
  W.format = Linear::Format::Affine;
  W.out = int(rows);
  W.in = int(cols);
  W.dtype = DType::F32;
  W.bits = bits;
  W.group = group_size;
  W.w = reinterpret_cast<const uint8_t*>(packed.data());
  W.scales = reinterpret_cast<const uint8_t*>(scales.data());
  W.biases = reinterpret_cast<const uint8_t*>(biases.data());
  return W;
}

// State.export_tensors: {name: float32 array}, each array owning the vector it was made in.
nb::dict export_state(const State& st, const Snapshot* at, bool with_kv) {
  std::vector<StateTensor> tensors;
  {
    nb::gil_scoped_release release;
    tensors = st.export_tensors(at, with_kv);
  }
  nb::dict out;
  for (auto& t : tensors) {
    auto* data = new std::vector<float>(std::move(t.data));
    nb::capsule owner(data, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
    std::vector<size_t> shape(t.shape.begin(), t.shape.end());
    out[nb::str(t.name.c_str())] = F32Array(data->data(), shape.size(), shape.data(), owner);
  }
  return out;
}

// {name: array} from Python -> StateTensors (float32, C-contiguous, copied).
std::vector<StateTensor> state_tensors(const nb::dict& tensors) {
  using F32Any = nb::ndarray<const float, nb::c_contig, nb::device::cpu>;
  std::vector<StateTensor> out;
  for (auto [key, value] : tensors) {
    StateTensor t;
    t.name = nb::cast<std::string>(key);
    F32Any a;
    if (!nb::try_cast(value, a))
      throw RequestError("[state] tensor '" + t.name + "' must be a C-contiguous float32 array");
    for (size_t d = 0; d < a.ndim(); ++d) t.shape.push_back(int64_t(a.shape(d)));
    t.data.assign(a.data(), a.data() + a.size());
    out.push_back(std::move(t));
  }
  return out;
}

// A fresh [rows, vocab] logits array, filled by run(data) with the GIL released.
template <class Run>
F32Array logit_rows(const Engine& e, size_t rows, Run run) {
  float* p;
  F32Array out = new_f32({rows, size_t(e.config().vocab)}, &p);
  {
    nb::gil_scoped_release release;
    run(p);
  }
  return out;
}

// generate_greedy's keep_going: false once a stop token was generated.
std::function<bool(int32_t)> until_stop(const std::vector<int32_t>& stop) {
  return [&stop](int32_t t) { return std::find(stop.begin(), stop.end(), t) == stop.end(); };
}

}  // namespace

void init_model(nb::module_& m) {
  nb::class_<ModelConfig>(m, "ModelConfig")
      .def(nb::init<>())
      .def_rw("model_type", &ModelConfig::model_type)
      .def_rw("hidden", &ModelConfig::hidden)
      .def_rw("vocab", &ModelConfig::vocab)
      .def_rw("max_position", &ModelConfig::max_position)
      .def_rw("rms_eps", &ModelConfig::rms_eps)
      .def_prop_rw(
          "layer_types",
          [](const ModelConfig& c) {
            std::vector<std::string> v;
            for (Mixer x : c.mixers) v.push_back(x == Mixer::Attention ? "full_attention" : "linear_attention");
            return v;
          },
          [](ModelConfig& c, const std::vector<std::string>& v) { c.mixers = parse_mixers(v); })
      .def_prop_rw(
          "ffn_types",
          [](const ModelConfig& c) {
            std::vector<std::string> v;
            for (Ffn x : c.ffns) v.push_back(x == Ffn::Moe ? "moe" : "dense");
            return v;
          },
          [](ModelConfig& c, const std::vector<std::string>& v) { c.ffns = parse_ffns(v); })
      .def_rw("n_heads", &ModelConfig::n_heads)
      .def_rw("n_kv_heads", &ModelConfig::n_kv_heads)
      .def_rw("head_dim", &ModelConfig::head_dim)
      .def_rw("rotary_dim", &ModelConfig::rotary_dim)
      .def_rw("rope_theta", &ModelConfig::rope_theta)
      .def_rw("yarn_factor", &ModelConfig::yarn_factor)
      .def_rw("yarn_low", &ModelConfig::yarn_low)
      .def_rw("yarn_high", &ModelConfig::yarn_high)
      .def_rw("rope_attention_factor", &ModelConfig::rope_attention_factor)
      .def("rope_inv_freq", &ModelConfig::rope_inv_freq)
      .def_rw("gdn_k_heads", &ModelConfig::gdn_k_heads)
      .def_rw("gdn_v_heads", &ModelConfig::gdn_v_heads)
      .def_rw("gdn_k_dim", &ModelConfig::gdn_k_dim)
      .def_rw("gdn_v_dim", &ModelConfig::gdn_v_dim)
      .def_rw("conv_kernel", &ModelConfig::conv_kernel)
      .def_rw("gdn_fused_qkvz", &ModelConfig::gdn_fused_qkvz)
      .def_rw("intermediate", &ModelConfig::intermediate)
      .def_rw("n_experts", &ModelConfig::n_experts)
      .def_rw("top_k", &ModelConfig::top_k)
      .def_rw("moe_intermediate", &ModelConfig::moe_intermediate)
      .def_rw("shared_intermediate", &ModelConfig::shared_intermediate)
      .def_rw("norm_topk_prob", &ModelConfig::norm_topk_prob)
      .def("validate", &ModelConfig::validate);

  nb::class_<ModelWeights>(m, "Weights")
      .def_prop_ro("files", [](const ModelWeights& w) {
        std::vector<std::string> v;
        for (const auto& f : w.files) v.push_back(f->path());
        return v;
      })
      .def("check_files_unchanged", &ModelWeights::check_files_unchanged)
      .def_prop_ro("stat_checks", &ModelWeights::stat_checks)
      .def_prop_ro("arranged_for_cpu_int8", [](const ModelWeights& w) { return w.arranged_for_cpu_int8(); },
                   "Whether an int8 CPU engine rearranged these weights for its kernels (exclusive_weights).")
      .def_prop_ro("watching_files", [](const ModelWeights& w) { return w.watch && w.watch->active(); })
      .def_prop_ro("resident",
                   [](const ModelWeights& w) {
                     return !w.files.empty() && std::all_of(w.files.begin(), w.files.end(), [](const auto& f) {
                       return f->residency() == Residency::Resident;
                     });
                   })
      .def_prop_ro("nbytes", [](const ModelWeights& w) {
        size_t n = 0;
        for (const auto& f : w.files) n += f->file_size();
        return n;
      });

  nb::class_<WeightsBuilder>(m, "WeightsBuilder")
      .def(nb::init<ModelConfig>())
      .def(
          "add_file",
          [](WeightsBuilder& b, const std::string& path, bool resident) {
            return b.add_file(path, resident ? Residency::Resident : Residency::Mapped);
          },
          nb::arg("path"), nb::arg("resident") = false, nb::call_guard<nb::gil_scoped_release>())
      .def("tensors",
           [](const WeightsBuilder& b, int file) {
             std::vector<std::tuple<std::string, std::string, std::vector<int64_t>>> out;
             for (const TensorInfo& t : b.file(file).tensors()) out.emplace_back(t.name, dtype_name(t.dtype), t.shape);
             return out;
           })
      .def("read_f32",
           [](const WeightsBuilder& b, int file, const std::string& name) {
             const SafetensorsFile& f = b.file(file);
             const TensorInfo* t = f.find(name);
             if (!t) throw CheckpointError("[weights] no tensor '" + name + "' in " + f.path());
             if (!is_float_dtype(t->dtype))
               throw CheckpointError("[weights] tensor '" + name + "' in " + f.path() + " has dtype " +
                                     dtype_name(t->dtype) + ", expected a float type");
             const size_t n = size_t(t->numel());
             float* p;
             F32Array a = new_f32({n}, &p);
             for (size_t i = 0; i < n; ++i) p[i] = load_as_f32(f.data(*t), t->dtype, i);
             return a;
           })
      .def(
          "set_dense",
          [](WeightsBuilder& b, const std::string& slot, int file, const std::string& name, int index, int row_begin,
             int row_end) { b.set_dense(slot, slice(file, name, index, row_begin, row_end)); },
          nb::arg("slot"), nb::arg("file"), nb::arg("name"), nb::arg("index") = -1, nb::arg("row_begin") = 0,
          nb::arg("row_end") = -1)
      .def(
          "set_affine",
          [](WeightsBuilder& b, const std::string& slot, int file, const std::string& name, int sfile,
             const std::string& sname, int bfile, const std::string& bname, int bits, int group, int index,
             int row_begin, int row_end) {
            b.set_affine(slot, slice(file, name, index, row_begin, row_end),
                         slice(sfile, sname, index, row_begin, row_end), slice(bfile, bname, index, row_begin, row_end),
                         bits, group);
          },
          nb::arg("slot"), nb::arg("file"), nb::arg("name"), nb::arg("scales_file"), nb::arg("scales_name"),
          nb::arg("biases_file"), nb::arg("biases_name"), nb::arg("bits"), nb::arg("group_size"),
          nb::arg("index") = -1, nb::arg("row_begin") = 0, nb::arg("row_end") = -1)
      .def(
          "set_microscaled",
          [](WeightsBuilder& b, const std::string& slot, int file, const std::string& name, int sfile,
             const std::string& sname, const std::string& mode, int index, int row_begin, int row_end,
             std::optional<float> global_scale) {
            b.set_microscaled(slot, slice(file, name, index, row_begin, row_end),
                              slice(sfile, sname, index, row_begin, row_end), mode, global_scale);
          },
          nb::arg("slot"), nb::arg("file"), nb::arg("name"), nb::arg("scales_file"), nb::arg("scales_name"),
          nb::arg("mode"), nb::arg("index") = -1, nb::arg("row_begin") = 0, nb::arg("row_end") = -1,
          nb::arg("global_scale") = nb::none())
      .def("set_vector",
           [](WeightsBuilder& b, const std::string& slot, nb::ndarray<const float, nb::ndim<1>, nb::c_contig> v) {
             b.set_vector(slot, std::vector<float>(v.data(), v.data() + v.shape(0)));
           })
      .def("finish", &WeightsBuilder::finish);

  nb::class_<Snapshot>(m, "Snapshot")
      .def_prop_ro("position", &Snapshot::position)
      .def_prop_ro("nbytes", &Snapshot::nbytes);

  nb::class_<State>(m, "State")
      .def("snapshot", &State::snapshot)
      .def("restore", &State::restore, nb::arg("snapshot"))
      .def_prop_ro("position", &State::position)
      .def_prop_ro("max_context", &State::max_context)
      .def_prop_ro("nbytes", &State::nbytes)
      .def("clone", &State::clone)
      .def("export_tensors", &export_state, nb::arg("snapshot").none() = nb::none(), nb::arg("with_kv") = true,
           "{name: float32 array} of the state (see State::export_tensors in csrc/model/backend.h), at "
           "`snapshot` (a snapshot of this state) if given; with_kv=False: the recurrent tensors alone.")
      .def(
          "import_tensors",
          [](State& st, int position, const nb::dict& tensors) {
            auto ts = state_tensors(tensors);
            nb::gil_scoped_release release;
            st.import_tensors(position, ts);
          },
          nb::arg("position"), nb::arg("tensors"),
          "Moves the sequence to `position` from export_tensors' tensors (KV and recurrent).")
      .def(
          "snapshot_from_tensors",
          [](const State& st, int position, const nb::dict& tensors) {
            return st.snapshot_from_tensors(position, state_tensors(tensors));
          },
          nb::arg("position"), nb::arg("tensors"),
          "A snapshot of this sequence at `position` from recurrent tensors (export_tensors(with_kv=False)).");

  nb::class_<Engine>(m, "Engine")
      .def(
          "__init__",
          [](Engine* self, std::shared_ptr<ModelWeights> weights, const std::string& backend, int threads,
             int prefill_chunk, int split_threshold, int split_len, bool check_dependencies, int interleavings,
             const std::string& kv_dtype, bool asan, int gemm_min_rows, bool metal4, const std::string& gemm,
             int block_threshold, int block_len, const std::string& cpu_matmul, int apple_gpu_family,
             uint64_t working_set, const std::string& fail_dispatch, const std::string& fail_library,
             bool opaque_buffers, bool permute_threadgroups, uint64_t seed, bool timing, bool synchronous,
             bool gemv_words, bool per_sequence_mixers, bool exclusive_weights) {
            BackendArgs a;
            a.exclusive_weights = exclusive_weights;
            a.gemv_words = gemv_words;
            a.per_sequence_mixers = per_sequence_mixers;
            a.opaque_buffers = opaque_buffers;
            a.permute_threadgroups = permute_threadgroups;
            a.seed = seed;
            a.timing = timing;
            a.synchronous = synchronous;
            a.threads = threads;
            a.split_threshold = split_threshold;
            a.split_len = split_len;
            a.check_dependencies = check_dependencies;
            a.interleavings = interleavings;
            a.kv_dtype = kv_dtype;
            a.asan = asan;
            a.gemm_min_rows = gemm_min_rows;
            a.metal4 = metal4;
            a.gemm = gemm;
            a.block_threshold = block_threshold;
            a.block_len = block_len;
            a.cpu_matmul = cpu_matmul;
            a.apple_gpu_family = apple_gpu_family;
            a.working_set = working_set;
            a.fail_dispatch = fail_dispatch;
            a.fail_library = fail_library;
            new (self) Engine(weights, make_backend(weights, backend, a), prefill_chunk);
          },
          nb::arg("weights"), nb::arg("backend") = "cpu", nb::arg("threads") = 0, nb::arg("prefill_chunk") = 512,
          nb::arg("split_threshold") = -1, nb::arg("split_len") = -1, nb::arg("check_dependencies") = false,
          nb::arg("interleavings") = 0, nb::arg("kv_dtype") = "auto", nb::arg("asan") = false,
          nb::arg("gemm_min_rows") = -1, nb::arg("metal4") = false, nb::arg("gemm") = "auto",
          nb::arg("block_threshold") = -1, nb::arg("block_len") = -1, nb::arg("cpu_matmul") = "auto",
          nb::arg("apple_gpu_family") = 0, nb::arg("working_set") = 0, nb::arg("fail_dispatch") = "",
          nb::arg("fail_library") = "", nb::arg("opaque_buffers") = false, nb::arg("permute_threadgroups") = false,
          nb::arg("seed") = 0, nb::arg("timing") = false, nb::arg("synchronous") = false,
          nb::arg("gemv_words") = false, nb::arg("per_sequence_mixers") = false,
          nb::arg("exclusive_weights") = false)
      .def_prop_ro("max_fitting_context", [](Engine& e) { return e.backend().max_fitting_context(); },
                   "The longest context whose state fits beside the weights in the memory the backend may use "
                   "(GPU: the device's recommended working set); a very large number where nothing limits it.")
      .def("check_context", [](Engine& e, int max_context) { e.backend().check_context(max_context); },
           nb::arg("max_context"),
           "Raises ConfigError (naming the sizes) if a sequence of max_context positions does not fit beside "
           "the weights; allocates nothing.")
      .def_prop_ro("gpu_device", [](Engine& e) -> gpu::Device& {
        auto* g = dynamic_cast<gpu::GpuBackend*>(&e.backend());
        if (!g) throw Error("[engine] gpu_device: the backend is not a GPU backend");
        return g->device();
      }, nb::rv_policy::reference_internal,
      // The stub types submodules as plain modules (cmake/rename_stub_module.py), so not msl_cpu.Device.
      nb::for_getter(nb::sig("def gpu_device(self) -> typing.Any")),
      "The GPU backend's device (lily._core.msl_cpu.Device: name, apple_gpu_family, supports_tensor_ops, "
      "library(...)); it keeps the engine alive.")
      .def_prop_ro("gpu_gemm_path", [](Engine& e) {
        auto* g = dynamic_cast<gpu::GpuBackend*>(&e.backend());
        if (!g) throw Error("[engine] gpu_gemm_path: the backend is not a GPU backend");
        return g->gemm_path();
      }, "Which prefill GEMMs the GPU backend chose at load (tensor / simdgroup) and why.")
      .def_prop_ro("gpu_stats", [](Engine& e) {
        auto* g = dynamic_cast<gpu::GpuBackend*>(&e.backend());
        if (!g) throw Error("[engine] gpu_stats: the backend is not a GPU backend");
        const gpu::GpuStats& s = g->stats();
        return std::make_tuple(s.dispatches, s.barriers, s.command_buffers, s.waits, s.max_in_flight);
      }, "(dispatches, barriers, command buffers, CPU waits, most greedy steps in flight) so far")
      .def_prop_ro("gpu_weight_bytes", [](Engine& e) {
        auto* g = dynamic_cast<gpu::GpuBackend*>(&e.backend());
        if (!g) throw Error("[engine] gpu_weight_bytes: the backend is not a GPU backend");
        return std::make_tuple(g->weight_bytes(), g->weight_copied_bytes());
      }, "(bytes of the checkpoint the GPU holds, bytes of them copied at load): files whose tensors are "
         "misaligned (an unpadded safetensors header, as mlx writes) are copied, aligned ones wrapped zero-copy.")
      .def("gpu_records", [](Engine& e, bool recording) {
        auto* g = dynamic_cast<gpu::GpuBackend*>(&e.backend());
        if (!g) throw Error("[engine] gpu_records: the backend is not a GPU backend");
        auto rows = dispatch_rows(g->records());
        g->records().clear();
        g->set_recording(recording);
        return rows;
      }, nb::arg("recording"),
      "[(kernel, stage, weight bytes, state bytes, other bytes, threadgroups, threads per threadgroup)] of the dispatches encoded since the last "
      "call (while recording), then clears them and turns recording on or off.")
      .def("gpu_timings", [](Engine& e) {
        auto* g = dynamic_cast<gpu::GpuBackend*>(&e.backend());
        if (!g) throw Error("[engine] gpu_timings: the backend is not a GPU backend");
        std::vector<std::tuple<std::string, double>> rows;
        for (const auto& t : msl_cuda::take_timings(g->device())) rows.emplace_back(t.kernel, t.ms);
        return rows;
      },
      "[(kernel, ms)] of every dispatch the msl-cuda backend completed since the last call, in order "
      "(backend_options timing=True: CUDA events around each dispatch).")
      .def_prop_ro("backend", [](Engine& e) { return std::string(e.backend().name()); })
      .def_prop_ro("threads", [](Engine& e) {
        auto* cpu = dynamic_cast<cpu::CpuBackend*>(&e.backend());
        return cpu ? cpu->threads() : 0;
      })
      .def_prop_ro("cpu_matmul", [](Engine& e) {
        auto* cpu = dynamic_cast<cpu::CpuBackend*>(&e.backend());
        if (!cpu) return std::string();
        return std::string(cpu->matmul() == cpu::Matmul::Int8 ? "int8" : "f32");
      }, "The CPU backend's matmul mode that runs: 'int8' or 'f32' ('auto' resolved; '' on other backends).")
      .def_prop_ro("kv_dtype", [](Engine& e) {
        auto* g = dynamic_cast<gpu::GpuBackend*>(&e.backend());
        return std::string(g && g->options().kv_half ? "float16" : "float32");
      }, "The KV cache's element type: 'float32' or 'float16' (a GPU backend's kv_dtype option).")
      .def_prop_ro("prefill_chunk", &Engine::prefill_chunk)
      .def_prop_ro(
          "batches", [](Engine& e) { return e.backend().batches(); },
          "Whether one pass may hold rows of several sequences (Engine.step; every backend today).")
      .def_prop_ro(
          "batch_rows", [](Engine& e) { return e.backend().batch_rows(); },
          "The most rows one pass of several sequences holds (Engine.step splits a larger step into passes).")
      .def("new_state", &Engine::new_state, nb::arg("max_context"))
      .def("kv_bytes", &Engine::kv_bytes, nb::arg("positions"),
           "Bytes of KV cache (all attention layers) for `positions` tokens.")
      .def(
          "prefill",
          [](Engine& e, State& st, nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig> tokens, bool all_logits) {
            const int n = int(tokens.shape(0));
            if (n == 0) throw RequestError("[engine] prefill needs at least one token");
            float* p;
            F32Array out = all_logits ? new_f32({size_t(n), size_t(e.config().vocab)}, &p)
                                      : new_f32({size_t(e.config().vocab)}, &p);
            {
              nb::gil_scoped_release release;
              e.prefill(st, tokens.data(), n, p, all_logits);
            }
            return out;
          },
          nb::arg("state"), nb::arg("tokens"), nb::arg("all_logits") = false)
      .def(
          "decode",
          [](Engine& e, State& st, int32_t token) {
            float* p;
            F32Array out = new_f32({size_t(e.config().vocab)}, &p);
            {
              nb::gil_scoped_release release;
              e.decode(st, token, p);
            }
            return out;
          },
          nb::arg("state"), nb::arg("token"))
      .def(
          "decode_batch",
          [](Engine& e, const std::vector<State*>& states, nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig> tokens) {
            const size_t B = states.size();
            if (tokens.shape(0) != B)
              throw RequestError("[engine] decode_batch: " + std::to_string(B) + " states but " +
                                 std::to_string(tokens.shape(0)) + " tokens");
            return logit_rows(e, B, [&](float* logits) { e.decode_batch(states, tokens.data(), logits); });
          },
          nb::arg("states"), nb::arg("tokens"),
          "One decode step of several sequences: tokens[i] appended to states[i]; returns logits [B, vocab]. "
          "One pass for all (each row bit-identical to decode() alone); GPU backends "
          "too, in passes of at most batch_rows rows. Checks everything first: a refused batch changes no state.")
      .def(
          "step",
          [](Engine& e, const std::vector<State*>& states,
             const std::vector<nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig>>& tokens) {
            const size_t S = states.size();
            if (tokens.size() != S)
              throw RequestError("[engine] step: " + std::to_string(S) + " states but " +
                                 std::to_string(tokens.size()) + " token arrays");
            std::vector<Engine::StepRows> seqs(S);
            for (size_t i = 0; i < S; ++i) seqs[i] = {states[i], tokens[i].data(), int(tokens[i].shape(0))};
            return logit_rows(e, S, [&](float* logits) { e.step(seqs, logits); });
          },
          nb::arg("states"), nb::arg("tokens"),
          "One step of several sequences, each appending its tokens (one: a decode row; more: a prefill chunk, "
          "prefilled in the same pass as the others' decode rows on the CPU backend); returns the logits of "
          "each sequence's last token [len(states), vocab]. Checks as decode_batch.")
      .def(
          "generate_greedy",
          [](Engine& e, State& st, int32_t token, int max_tokens, const std::vector<int32_t>& stop_tokens) {
            nb::gil_scoped_release release;
            return e.generate_greedy(st, token, max_tokens, until_stop(stop_tokens));
          },
          nb::arg("state"), nb::arg("token"), nb::arg("max_tokens"), nb::arg("stop_tokens") = std::vector<int32_t>{},
          "Greedy tokens after `token` (argmax, ties to the lowest id), stopping after a stop token; on a GPU "
          "backend the token is fed back on the device with depth-2 pipelining.")
      .def(
          "generate_greedy",
          [](Engine& e, State& st, const std::vector<int32_t>& prompt, int max_tokens,
             const std::vector<int32_t>& stop_tokens) {
            nb::gil_scoped_release release;
            return e.generate_greedy(st, prompt.data(), int(prompt.size()), max_tokens, until_stop(stop_tokens));
          },
          nb::arg("state"), nb::arg("prompt"), nb::arg("max_tokens"), nb::arg("stop_tokens") = std::vector<int32_t>{},
          "The same after a prompt (a list of token ids, none in the state yet), prefilled in chunks; on a GPU "
          "backend the last chunk's argmax is the first token and never leaves the device before step 2.")
      .def(
          "begin_device_decode",
          [](Engine& e, State& st, int32_t token, int max_steps, Sampler* sampler) {
            nb::gil_scoped_release release;
            return e.begin_device_decode(st, token, max_steps, sampler);
          },
          nb::arg("state"), nb::arg("token"), nb::arg("max_steps"), nb::arg("sampler").none() = nb::none(),
          "Starts a decode loop whose tokens stay on the device (GPU backends): feeds `token` and commits "
          "the first step, choosing each token by argmax (sampler None) or by `sampler`'s draw, continuing "
          "its random stream. False (nothing changed) on a backend without one.")
      .def(
          "next_device_token",
          [](Engine& e, State& st) {
            nb::gil_scoped_release release;
            return e.next_device_token(st);
          },
          nb::arg("state"), "Commits the following step (depth 2), waits for the oldest and returns its token.")
      .def(
          "end_device_decode",
          [](Engine& e, State& st) {
            nb::gil_scoped_release release;
            e.end_device_decode(st);
          },
          nb::arg("state"), "Ends the loop, undoing a step whose token was not read.")
      .def(
          "begin_device_batch",
          [](Engine& e, const std::vector<State*>& states, const std::vector<int32_t>& tokens, int max_steps,
             const std::vector<nb::object>& samplers) {
            if (tokens.size() != states.size() || samplers.size() != states.size())
              throw RequestError("[engine] begin_device_batch: " + std::to_string(states.size()) + " states, " +
                                 std::to_string(tokens.size()) + " tokens and " + std::to_string(samplers.size()) +
                                 " samplers");
            std::vector<Engine::DeviceRow> rows(states.size());
            for (size_t i = 0; i < states.size(); ++i)
              rows[i] = {states[i], &tokens[i], 1, samplers[i].is_none() ? nullptr : nb::cast<Sampler*>(samplers[i])};
            nb::gil_scoped_release release;
            return e.begin_device_decode(rows, max_steps);
          },
          nb::arg("states"), nb::arg("tokens"), nb::arg("max_steps"), nb::arg("samplers"),
          "A device decode loop over several sequences (GPU backends): feeds tokens[i] to states[i] and "
          "commits the first batched step; samplers[i] None chooses by argmax. False (nothing changed) on a "
          "backend without one or for a sampler with a token mask or logit bias.")
      .def(
          "next_device_tokens",
          [](Engine& e) {
            std::vector<int32_t> tokens(e.device_loop_rows());
            std::vector<std::string> errors;
            {
              nb::gil_scoped_release release;
              e.next_device_tokens(tokens.data(), &errors);
            }
            std::vector<std::optional<std::string>> err(errors.size());
            for (size_t i = 0; i < errors.size(); ++i)
              if (!errors[i].empty()) err[i] = errors[i];
            return std::make_pair(tokens, err);
          },
          "Commits the following step (depth 2), waits for the oldest and returns (tokens, errors), one each per "
          "sequence: errors[i] is the sampler's error (str) for a sequence whose logits held a NaN / +inf or were "
          "all -inf (its token is then meaningless), else None.")
      .def(
          "end_device_batch",
          [](Engine& e) {
            nb::gil_scoped_release release;
            e.end_device_decode();
          },
          "Ends the device loop (of any number of sequences), undoing a step whose tokens were not read.")
      .def_prop_ro("device_loop_running", &Engine::device_loop_running)
      .def_prop_ro(
          "has_device_loop", [](Engine& e) { return e.backend().has_device_loop(); },
          "Whether the backend chooses tokens on the device (GPU backends: begin_device_batch).");

  m.def(
      "gpu_plan",
      [](const ModelConfig& c, int context, int bits, int group, int gate_bits, int split_threshold,
         int split_len, bool kv_half, int tokens, int gemm_min_rows, int block_threshold, int batch) {
        gpu::PlanQuantization q{bits, group, gate_bits};
        gpu::GpuOptions opt;
        opt.kv_half = kv_half;
        if (block_threshold >= 0) opt.block_threshold = block_threshold;
        if (split_threshold >= 0) opt.split_threshold = split_threshold;
        if (split_len > 0) opt.split_len = split_len;
        if (gemm_min_rows > 0) opt.gemm_min_rows = gemm_min_rows;
        gpu::DecodePlan p = gpu::plan_batch(c, q, opt, context, tokens, batch);
        return std::make_tuple(dispatch_rows(p.dispatches), std::make_tuple(p.stats.dispatches, p.stats.barriers,
                                                     p.stats.command_buffers, p.stats.waits),
                               p.scratch_bytes);
      },
      nb::arg("config"), nb::arg("context"), nb::arg("bits") = 4, nb::arg("group_size") = 64,
      nb::arg("gate_bits") = 8, nb::arg("split_threshold") = -1, nb::arg("split_len") = -1,
      nb::arg("kv_half") = false, nb::arg("tokens") = 1, nb::arg("gemm_min_rows") = -1,
      nb::arg("block_threshold") = -1, nb::arg("batch") = 1,
      "The GPU backend's dispatch sequence for one decode step (or a prefill chunk of `tokens` "
      "tokens ending at `context`) of `batch` sequences (in the passes Engine.step makes), recorded without running it: "
      "([(kernel, stage, weight bytes, state bytes, other bytes, threadgroups, threads per threadgroup)], (dispatches, barriers, "
      "command buffers, CPU waits), scratch bytes allocated while encoding it).");

  m.def(
      "gpu_plan_prefill",
      [](const ModelConfig& c, int prompt, int chunk, int bits, int group, int gate_bits, bool kv_half) {
        gpu::PlanQuantization q{bits, group, gate_bits};
        gpu::GpuOptions opt;
        opt.kv_half = kv_half;
        gpu::PrefillPlan p = gpu::plan_prefill(c, q, opt, prompt, chunk);
        nb::dict out;
        out["last_chunk"] = dispatch_rows(p.last_chunk);
        out["last_tokens"] = p.last_tokens;
        out["chunks"] = p.chunks;
        out["last_stats"] = std::make_tuple(p.last_stats.dispatches, p.last_stats.barriers,
                                            p.last_stats.command_buffers, p.last_stats.waits);
        out["total"] = std::make_tuple(p.total.dispatches, p.total.barriers, p.total.command_buffers,
                                       p.total.waits);
        out["waits_inside_chunks"] = p.waits_inside_chunks;
        out["device_bytes"] = p.device_bytes;
        out["state_bytes"] = p.state_bytes;
        return out;
      },
      nb::arg("config"), nb::arg("prompt"), nb::arg("chunk") = 512, nb::arg("bits") = 4, nb::arg("group_size") = 64,
      nb::arg("gate_bits") = 8, nb::arg("kv_half") = false,
      "The GPU backend's dispatch sequence for a prompt prefilled in chunks (the last chunk as device greedy "
      "step 0), recorded without running it: a dict with the last chunk's dispatches [(kernel, stage, weight "
      "bytes, state bytes, other bytes, threadgroups, threads per threadgroup)], last_stats / total (dispatches, barriers, command buffers, CPU "
      "waits), waits_inside_chunks, device_bytes (backend buffers, no weights) and state_bytes.");

  // Whether this build has the Metal backend, and the device it would run on: what
  // backend="auto" and `lily doctor` ask before choosing Metal (lily/backend_choice.py).
#if defined(LILY_HAVE_METAL)
  m.attr("has_metal") = true;
#else
  m.attr("has_metal") = false;
#endif
  m.def(
      "metal_device",
      []() -> std::shared_ptr<gpu::Device> {
#if defined(LILY_HAVE_METAL)
        if (metal::system_device_present()) return metal::make_device();
#endif
        return nullptr;
      },
      nb::sig("def metal_device() -> typing.Any"),  // lily._core.msl_cpu.Device | None (see gpu_device)
      "The system's default Metal device as the Metal backend opens it (lily._core.msl_cpu.Device), or None "
      "where there is none (a build without Metal, a machine without a Metal GPU); raises LilyError naming "
      "why where there is one lily cannot use (older than Apple7 / M1).");

  m.def(
      "dequantize",
      [](PackedArray packed, F32In scales, F32In biases, int bits, int group_size) {
        const Linear W = affine_from_arrays("dequantize", packed, scales, biases, bits, group_size);
        const size_t rows = size_t(W.out), cols = size_t(W.in);
        float* p;
        F32Array out = new_f32({rows, cols}, &p);
        for (size_t r = 0; r < rows; ++r) cpu::dequantize_row(W, int(r), p + r * cols);
        return out;
      },
      nb::arg("packed"), nb::arg("scales"), nb::arg("biases"), nb::arg("bits"), nb::arg("group_size"));

  m.def(
      "dequantize_microscaled",
      [](PackedArray packed, nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig> scales, const std::string& mode,
         std::optional<float> global_scale) {
        Linear W;
        W.format = Linear::Format::Microscaled;
        if (!microscale_from_name(mode, &W.microscale))
          throw Error("[dequantize_microscaled] mode must be 'mxfp4', 'mxfp8' or 'nvfp4', got '" + mode + "'");
        W.bits = microscale_bits(W.microscale);
        W.group = microscale_group(W.microscale);
        W.dtype = DType::U8;
        W.out = int(packed.shape(0));
        W.in = int(packed.shape(1) * 32 / size_t(W.bits));
        if (scales.shape(0) != packed.shape(0) || scales.shape(1) != size_t(W.in / W.group))
          throw Error("[dequantize_microscaled] packed and scales shapes disagree");
        W.w = reinterpret_cast<const uint8_t*>(packed.data());
        W.scales = scales.data();
        if (global_scale) {
          if (W.microscale != Microscale::Nvfp4) throw Error("[dequantize_microscaled] only nvfp4 takes a global_scale");
          W.scale_mult = nvfp4_scale_mult(*global_scale);
        }
        float* p;
        F32Array out = new_f32({size_t(W.out), size_t(W.in)}, &p);
        for (int r = 0; r < W.out; ++r) cpu::dequantize_row(W, r, p + size_t(r) * W.in);
        return out;
      },
      nb::arg("packed"), nb::arg("scales"), nb::arg("mode"), nb::arg("global_scale") = nb::none(),
      "An MLX mxfp4 / mxfp8 / nvfp4 matrix (packed uint32, uint8 scales; nvfp4's optional float32 global "
      "scale) as float32, by the CPU backend (tests).");

  m.def(
      "quantized_matmul",
      [](F32In x, PackedArray packed, F32In scales, F32In biases, int bits, int group_size, const std::string& mode,
         int threads) {
        const Linear W = affine_from_arrays("quantized_matmul", packed, scales, biases, bits, group_size);
        const size_t rows = size_t(W.out), T = x.shape(0);
        if (x.shape(1) != size_t(W.in))
          throw Error("[quantized_matmul] x has " + std::to_string(x.shape(1)) + " columns, W has " +
                      std::to_string(W.in));
        if (mode != "f32" && mode != "int8") throw Error("[quantized_matmul] mode must be 'int8' or 'f32'");
        float* p;
        F32Array out = new_f32({T, rows}, &p);
        if (T > 0) {
          cpu::ThreadPool pool(threads);
          cpu::linear(W, x.data(), int(T), p, pool, mode == "int8" ? cpu::Matmul::Int8 : cpu::Matmul::F32);
        }
        return out;
      },
      nb::arg("x"), nb::arg("packed"), nb::arg("scales"), nb::arg("biases"), nb::arg("bits"), nb::arg("group_size"),
      nb::arg("mode") = "f32", nb::arg("threads") = 1,
      "y[T, out] = x[T, in] @ dequantize(W).T by the CPU backend's kernels (mode 'f32' or 'int8'), for tests.");

  m.def(
      "cpu_int8_supported",
      [](int bits, int group_size, int in) {
        Linear W;
        W.format = Linear::Format::Affine;
        W.in = in;
        W.bits = bits;
        W.group = group_size;
        return group_size > 0 && in % group_size == 0 && cpu::int8_supported(W);
      },
      nb::arg("bits"), nb::arg("group_size"), nb::arg("in_features"),
      "Whether this build's CPU backend has int8 kernels for such weights (else cpu_matmul='int8' runs f32).");
}

}  // namespace lily::python
