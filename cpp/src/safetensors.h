// A safetensors file read in place (memory-mapped): its header checked, each tensor's bytes located.
#ifndef SPECPILOT_SAFETENSORS_H_
#define SPECPILOT_SAFETENSORS_H_

#include <map>
#include <string>

#include "tensors.h"

namespace specpilot {

struct StoredTensor {
  DLDataType dtype;
  Shape shape;
  const uint8_t* data;
  size_t nbytes;
};

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);   // throws Error(kBuild) on a malformed file
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  const std::map<std::string, StoredTensor>& tensors() const { return tensors_; }

 private:
  void Unmap();
  void* map_ = nullptr;
  size_t size_ = 0;
  std::map<std::string, StoredTensor> tensors_;
};

}  // namespace specpilot
#endif  // SPECPILOT_SAFETENSORS_H_
