#include "tensors.h"

#include <tvm/ffi/dtype.h>

#include <algorithm>
#include <cstring>

#include "specpilot/engine.hpp"

namespace specpilot {
namespace {

ffi::Function Lookup(const char* name) {
  auto f = ffi::Function::GetGlobal(name);
  if (!f.has_value()) throw Error(Status::kRuntime, std::string("TVM runtime lacks ") + name);
  return *f;
}

// TVM's runtime registers these; each looked up once (thread-safe static initialisation)
#define GLOBAL(name) ([]() -> const ffi::Function& { static const ffi::Function f = Lookup(name); return f; }())

float HalfToFloat(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {   // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400u)) { man <<= 1; --exp; }
      bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

DLDataType ParseDtype(const std::string& name) {
  try {
    return ffi::StringToDLDataType(name);
  } catch (const std::exception&) {
    throw Error(Status::kBuild, "unknown element type " + name);
  }
}

size_t ElementBytes(DLDataType dtype) { return (dtype.bits * dtype.lanes + 7) / 8; }

int64_t Elements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Shape ShapeOf(const Tensor& t) {
  auto s = t.shape();
  return Shape(s.begin(), s.end());
}

size_t Bytes(const Tensor& t) { return Elements(ShapeOf(t)) * ElementBytes(t.dtype()); }

Tensor Empty(const Shape& shape, DLDataType dtype, DLDevice device) {
  return GLOBAL("runtime.TVMTensorAllocWithScope")(ffi::Shape(shape), dtype, device, ffi::Optional<ffi::String>())
      .cast<Tensor>();
}

Tensor Zeros(const Shape& shape, DLDataType dtype, DLDevice device) {
  std::vector<uint8_t> zeros(std::max<size_t>(Elements(shape) * ElementBytes(dtype), 1), 0);
  return Upload(zeros.data(), shape, dtype, device);
}

Tensor Upload(const void* data, const Shape& shape, DLDataType dtype, DLDevice device) {
  Tensor t = Empty(shape, dtype, device);
  size_t n = Elements(shape) * ElementBytes(dtype);
  if (n) GLOBAL("runtime.TVMTensorCopyFromBytes")(t, const_cast<void*>(data), n);
  return t;
}

void Download(const Tensor& t, void* out, size_t nbytes) {
  if (nbytes) GLOBAL("runtime.TVMTensorCopyToBytes")(t, out, nbytes);
}

namespace {

// keeps the viewed tensor alive; the view's data pointer is moved instead of its byte_offset
struct ViewAlloc {
  Tensor base;
  size_t offset;
  void AllocData(DLTensor* t) {
    t->data = static_cast<char*>(base.data_ptr()) + base.byte_offset() + offset;
    t->byte_offset = 0;
  }
  void FreeData(DLTensor*) {}
};

}  // namespace

Tensor View(const Tensor& t, const Shape& shape, DLDataType dtype, size_t byte_offset) {
  if (byte_offset + Elements(shape) * ElementBytes(dtype) > Bytes(t)) {
    throw Error(Status::kRuntime, "a view past the end of its tensor");
  }
  return Tensor::FromNDAlloc(ViewAlloc{t, byte_offset}, ffi::Shape(shape), dtype, t.device());
}

Tensor View(const Tensor& t, const Shape& shape, size_t byte_offset) { return View(t, shape, t.dtype(), byte_offset); }

Tensor AlignedView(const Tensor& t, const Shape& shape, size_t byte_offset) {
  Tensor view = View(t, shape, byte_offset);
  return byte_offset % 64 == 0 ? view : Clone(view);
}

void Staging::Add(const void* data, const Shape& shape, DLDataType dtype) {
  size_t offset = (host_.size() + 63) / 64 * 64, n = Elements(shape) * ElementBytes(dtype);
  host_.resize(offset + std::max<size_t>(n, 1));
  if (n) std::memcpy(host_.data() + offset, data, n);
  parts_.push_back(Part{offset, shape, dtype});
}

void Staging::AddInt32(const std::vector<int32_t>& values, const Shape& shape) {
  if (static_cast<int64_t>(values.size()) != Elements(shape)) throw Error(Status::kRuntime, "staging: size mismatch");
  Add(values.data(), shape, DLDataType{kDLInt, 32, 1});
}

void Staging::AddBool(const std::vector<uint8_t>& values, const Shape& shape) {
  if (static_cast<int64_t>(values.size()) != Elements(shape)) throw Error(Status::kRuntime, "staging: size mismatch");
  Add(values.data(), shape, DLDataType{kDLBool, 8, 1});
}

std::vector<Tensor> Staging::Send() {
  DLDataType u8{kDLUInt, 8, 1};
  if (!buffer_ || Bytes(*buffer_) < host_.size()) {   // grown by half again, so it settles
    buffer_ = Empty({static_cast<int64_t>(std::max<size_t>(host_.size() * 3 / 2, 4096))}, u8, device_);
  }
  GLOBAL("runtime.TVMTensorCopyFromBytes")(View(*buffer_, {static_cast<int64_t>(host_.size())}, u8, 0),
                                           static_cast<void*>(host_.data()), host_.size());
  std::vector<Tensor> views;
  for (const Part& p : parts_) views.push_back(View(*buffer_, p.shape, p.dtype, p.offset));
  host_.clear();
  parts_.clear();
  return views;
}

void CopyInto(const Tensor& from, const Tensor& to) { GLOBAL("runtime.TVMTensorCopyFromTo")(from, to); }

Tensor Clone(const Tensor& t) {
  Tensor out = Empty(ShapeOf(t), t.dtype(), t.device());
  CopyInto(t, out);
  return out;
}

Tensor Int32(const std::vector<int32_t>& values, const Shape& shape, DLDevice device) {
  if (static_cast<int64_t>(values.size()) != Elements(shape)) throw Error(Status::kRuntime, "Int32: size mismatch");
  return Upload(values.data(), shape, DLDataType{kDLInt, 32, 1}, device);
}

Tensor Bool(const std::vector<uint8_t>& values, const Shape& shape, DLDevice device) {
  if (static_cast<int64_t>(values.size()) != Elements(shape)) throw Error(Status::kRuntime, "Bool: size mismatch");
  return Upload(values.data(), shape, DLDataType{kDLBool, 8, 1}, device);
}

std::vector<float> FloatRows(const Tensor& t, int64_t first, int64_t count) {
  Shape shape = ShapeOf(t);
  int64_t vocab = shape.back();
  DLDataType dt = t.dtype();
  size_t eb = ElementBytes(dt);
  Tensor rows = View(t, {count, vocab}, first * vocab * eb);   // a copy source only: any offset
  std::vector<float> out(count * vocab);
  if (dt.code == kDLFloat && dt.bits == 32) {
    Download(rows, out.data(), out.size() * 4);
    return out;
  }
  std::vector<uint16_t> raw(count * vocab);
  Download(rows, raw.data(), raw.size() * 2);
  for (size_t i = 0; i < raw.size(); ++i) {
    if (dt.code == kDLBfloat && dt.bits == 16) {
      uint32_t bits = static_cast<uint32_t>(raw[i]) << 16;
      std::memcpy(&out[i], &bits, 4);
    } else if (dt.code == kDLFloat && dt.bits == 16) {
      out[i] = HalfToFloat(raw[i]);
    } else {
      throw Error(Status::kRuntime, "logits of an unsupported element type");
    }
  }
  return out;
}

}  // namespace specpilot
