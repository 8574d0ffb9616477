#include "safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "specpilot/engine.hpp"

namespace specpilot {
namespace {

DLDataType StoredDtype(const std::string& name, const std::string& path) {
  static const std::map<std::string, std::string> names = {
      {"F64", "float64"}, {"F32", "float32"}, {"F16", "float16"}, {"BF16", "bfloat16"}, {"I64", "int64"},
      {"I32", "int32"},   {"I16", "int16"},   {"I8", "int8"},     {"U8", "uint8"},      {"U16", "uint16"},
      {"U32", "uint32"},  {"U64", "uint64"},  {"BOOL", "bool"}};
  auto it = names.find(name);
  if (it == names.end()) throw Error(Status::kBuild, path + ": tensor element type " + name + " is not supported");
  return ParseDtype(it->second);
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw Error(Status::kBuild, path + ": cannot open (" + std::strerror(errno) + ")");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size < 8) {
    ::close(fd);
    throw Error(Status::kBuild, path + ": not a safetensors file (too short)");
  }
  size_ = static_cast<size_t>(st.st_size);
  map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw Error(Status::kBuild, path + ": cannot map (" + std::strerror(errno) + ")");
  }
  const auto* bytes = static_cast<const uint8_t*>(map_);
  uint64_t header = 0;
  std::memcpy(&header, bytes, 8);   // little-endian, as the format says (x86-64 / aarch64 hosts)
  if (header > size_ - 8) {
    Unmap();
    throw Error(Status::kBuild, path + ": header length past the end of the file (truncated or corrupt)");
  }
  nlohmann::json meta = nlohmann::json::parse(bytes + 8, bytes + 8 + header, nullptr, false);
  if (meta.is_discarded() || !meta.is_object()) {
    Unmap();
    throw Error(Status::kBuild, path + ": header is not a JSON object (corrupt)");
  }
  const uint8_t* data = bytes + 8 + header;
  size_t data_size = size_ - 8 - header;
  try {
    for (auto& [name, entry] : meta.items()) {
      if (name == "__metadata__") continue;
      StoredTensor t{};
      t.dtype = StoredDtype(entry.at("dtype").get<std::string>(), path);
      t.shape = entry.at("shape").get<Shape>();
      auto offsets = entry.at("data_offsets").get<std::vector<uint64_t>>();
      int64_t n = Elements(t.shape);
      if (offsets.size() != 2 || offsets[0] > offsets[1] || offsets[1] > data_size || n < 0 ||
          offsets[1] - offsets[0] != static_cast<uint64_t>(n) * ElementBytes(t.dtype)) {
        throw Error(Status::kBuild, path + ": tensor " + name + " has offsets that do not fit its shape or the file");
      }
      t.data = data + offsets[0];
      t.nbytes = offsets[1] - offsets[0];
      tensors_.emplace(name, t);
    }
  } catch (const nlohmann::json::exception& e) {
    Unmap();
    throw Error(Status::kBuild, path + ": malformed header (" + e.what() + ")");
  } catch (...) {
    Unmap();
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() { Unmap(); }

void SafetensorsFile::Unmap() {
  if (map_ != nullptr) ::munmap(map_, size_);
  map_ = nullptr;
}

}  // namespace specpilot
