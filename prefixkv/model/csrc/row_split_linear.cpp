// A linear layer's rows handed out in blocks to the threads of torch's OpenMP team as they come
// free, each block multiplied by oneDNN's own packed-weight kernel (mkldnn::_linear_pointwise).
//
// Why: oneDNN splits one product statically between the team's threads, so beside another process
// that takes half of one core every product runs at the pace of the thread on that core. With the
// rows handed out as threads come free, the thread on the shared core simply takes fewer blocks.
// Each row's result is the same bits as in the whole product (the kernel's sums over the inner
// dimension do not depend on how many rows are multiplied: checked before use by
// prefixkv/model/row_split.py, and by tests/model/test_model_row_split.py).
//
// Unlike the kernels of cpu_kernels.py (plain C, called through ctypes) this one calls a torch
// operator, so it is built against torch's headers and registered as `prefixkv::row_split_linear`
// (loaded with torch.ops.load_library). It links the OpenMP runtime torch has already loaded: its
// team is torch's team, sized by torch.set_num_threads.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/slice_ops.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>
#include <omp.h>

#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>

namespace {

using LinearPointwise = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                   c10::string_view, c10::List<std::optional<at::Scalar>>,
                                   std::optional<c10::string_view>);

// x [rows, in] (contiguous) times a weight packed by mkldnn::_reorder_linear_weight, plus bias;
// blocks of `block` rows, a short tail (under half a block) joined to the block before it.
at::Tensor row_split_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                            int64_t out_features, int64_t block) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<LinearPointwise>();
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "row_split_linear: x must be a contiguous matrix");
  TORCH_CHECK(block > 0 && out_features > 0, "row_split_linear: block and out_features must be positive");
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  int64_t blocks = (rows + block - 1) / block;
  if (blocks > 1 && rows - (blocks - 1) * block < block / 2) blocks -= 1;
  const size_t row_bytes = static_cast<size_t>(out_features) * out.element_size();
  char* dst = static_cast<char*>(out.data_ptr());
  std::atomic<int64_t> next{0};
  std::exception_ptr failure;  // the first error of any thread: an exception must not leave the region
  std::mutex failure_lock;
#pragma omp parallel
  {
    c10::InferenceMode inference;  // a team thread's own state: no autograd records on it
    int64_t i;
    while ((i = next.fetch_add(1, std::memory_order_relaxed)) < blocks) {
      const int64_t first = i * block, end = i == blocks - 1 ? rows : first + block;
      try {
        at::Tensor y = op.call(x.slice(0, first, end), packed, bias, "none", c10::List<std::optional<at::Scalar>>(),
                               std::nullopt);
        TORCH_CHECK(y.is_contiguous() && y.size(1) == out_features, "row_split_linear: unexpected product shape");
        std::memcpy(dst + first * row_bytes, y.data_ptr(), (end - first) * row_bytes);
      } catch (...) {
        std::lock_guard<std::mutex> hold(failure_lock);
        if (!failure) failure = std::current_exception();
        next.store(blocks);  // hand out nothing more
      }
    }
  }
  if (failure) std::rethrow_exception(failure);
  return out;
}

}  // namespace

TORCH_LIBRARY(prefixkv, m) {
  m.def("row_split_linear(Tensor x, Tensor packed, Tensor? bias, int out_features, int block) -> Tensor",
        &row_split_linear);
}
