// Shared by every kernel library (quant/csrc, attention/csrc). The slice of torch a kernel library
// needs: ATen tensors and op registration, without <torch/extension.h> (pybind11 and the C++
// frontend), which tripled each file's compile time (33 s vs 9 s a file on 2 cores), paid once per
// instruction-set variant.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>

namespace torch {
using at::Tensor;
using at::empty;
using at::empty_like;
using at::kInt;
constexpr auto kInt64 = at::kLong;
}  // namespace torch
