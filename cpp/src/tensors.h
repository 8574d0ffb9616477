// Tensors through TVM's runtime functions (allocation, views, copies): device-agnostic, so the
// same code runs a CPU or a CUDA build.
#ifndef SPECPILOT_TENSORS_H_
#define SPECPILOT_TENSORS_H_

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

#include <cstdint>
#include <string>
#include <vector>

namespace specpilot {

namespace ffi = tvm::ffi;
using Tensor = ffi::Tensor;
using Shape = std::vector<int64_t>;

DLDataType ParseDtype(const std::string& name);   // "float32", "bfloat16", "int32", "bool", ...
size_t ElementBytes(DLDataType dtype);
int64_t Elements(const Shape& shape);
Shape ShapeOf(const Tensor& t);
size_t Bytes(const Tensor& t);

Tensor Empty(const Shape& shape, DLDataType dtype, DLDevice device);
Tensor Zeros(const Shape& shape, DLDataType dtype, DLDevice device);
Tensor Upload(const void* data, const Shape& shape, DLDataType dtype, DLDevice device);
void Download(const Tensor& t, void* out, size_t nbytes);
Tensor View(const Tensor& t, const Shape& shape, size_t byte_offset);   // same dtype, shares storage
void CopyInto(const Tensor& from, const Tensor& to);
Tensor Clone(const Tensor& t);

// A step's small int32 / bool inputs, written on the host and sent to the device at once.
Tensor Int32(const std::vector<int32_t>& values, const Shape& shape, DLDevice device);
Tensor Bool(const std::vector<uint8_t>& values, const Shape& shape, DLDevice device);

// Rows [first, first + count) of a (..., V) tensor read back as float32 (bf16 / fp16 widened).
std::vector<float> FloatRows(const Tensor& t, int64_t first, int64_t count);

}  // namespace specpilot
#endif  // SPECPILOT_TENSORS_H_
