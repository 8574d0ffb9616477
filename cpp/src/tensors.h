// Tensors through TVM's runtime functions (allocation, views, copies): device-agnostic, so the
// same code runs a CPU or a CUDA build.
#ifndef SPECPILOT_TENSORS_H_
#define SPECPILOT_TENSORS_H_

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

#include <cstdint>
#include <optional>
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
// A view sharing t's storage at byte_offset (its data pointer moved, byte_offset 0, as kernels take it).
Tensor View(const Tensor& t, const Shape& shape, DLDataType dtype, size_t byte_offset);
Tensor View(const Tensor& t, const Shape& shape, size_t byte_offset);   // same dtype
// A view when byte_offset keeps the 64-byte alignment TVM's kernels assume, else a copy.
Tensor AlignedView(const Tensor& t, const Shape& shape, size_t byte_offset);
void CopyInto(const Tensor& from, const Tensor& to);
Tensor Clone(const Tensor& t);

// A step's small inputs, packed on the host at 64-byte aligned offsets and sent to the device in one
// copy into a buffer kept between steps; each input is a view of it.  Reusing the buffer is safe:
// the copy and the kernels that read the previous views are ordered on the device's stream.
class Staging {
 public:
  explicit Staging(DLDevice device) : device_(device) {}
  void Add(const void* data, const Shape& shape, DLDataType dtype);
  void AddInt32(const std::vector<int32_t>& values, const Shape& shape);
  void AddBool(const std::vector<uint8_t>& values, const Shape& shape);
  std::vector<Tensor> Send();   // the views, in the order added; starts a new batch of inputs

 private:
  struct Part {
    size_t offset;
    Shape shape;
    DLDataType dtype;
  };
  DLDevice device_;
  std::vector<uint8_t> host_;
  std::vector<Part> parts_;
  std::optional<Tensor> buffer_;
};

Tensor Int32(const std::vector<int32_t>& values, const Shape& shape, DLDevice device);
Tensor Bool(const std::vector<uint8_t>& values, const Shape& shape, DLDevice device);

// Rows [first, first + count) of a (..., V) tensor read back as float32 (bf16 / fp16 widened).
std::vector<float> FloatRows(const Tensor& t, int64_t first, int64_t count);

}  // namespace specpilot
#endif  // SPECPILOT_TENSORS_H_
