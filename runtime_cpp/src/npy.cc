#include "npy.h"

#include <fstream>
#include <iterator>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <regex>

#include "executor.h"

namespace switchyard::rt {

std::int64_t NpyArray::elements() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

NpyArray parse_npy(const std::vector<unsigned char>& bytes) {
  static const unsigned char kMagic[] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  if (bytes.size() < 10 || !std::equal(std::begin(kMagic), std::end(kMagic), bytes.begin())) {
    throw std::runtime_error("not a .npy file (no \\x93NUMPY magic)");
  }
  const unsigned major = bytes[6];
  std::size_t header_len = 0;
  std::size_t offset = 0;
  if (major == 1) {
    header_len = bytes[8] | (static_cast<std::size_t>(bytes[9]) << 8);
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) throw std::runtime_error("truncated .npy header");
    header_len = bytes[8] | (static_cast<std::size_t>(bytes[9]) << 8) |
                 (static_cast<std::size_t>(bytes[10]) << 16) |
                 (static_cast<std::size_t>(bytes[11]) << 24);
    offset = 12;
  } else {
    throw std::runtime_error(".npy format version " + std::to_string(major) + " is not known");
  }
  if (offset + header_len > bytes.size()) throw std::runtime_error("truncated .npy header");
  const std::string header(bytes.begin() + static_cast<std::ptrdiff_t>(offset),
                           bytes.begin() + static_cast<std::ptrdiff_t>(offset + header_len));
  std::smatch m;
  NpyArray out;
  if (!std::regex_search(header, m, std::regex("'descr'\\s*:\\s*'([^']+)'"))) {
    throw std::runtime_error(".npy header has no descr");
  }
  out.dtype = m[1];
  if (std::regex_search(header, m, std::regex("'fortran_order'\\s*:\\s*True"))) {
    throw std::runtime_error(".npy array is in Fortran order; save it in C order");
  }
  if (!std::regex_search(header, m, std::regex("'shape'\\s*:\\s*\\(([^)]*)\\)"))) {
    throw std::runtime_error(".npy header has no shape");
  }
  const std::string dims = m[1];
  const std::regex number("[0-9]+");
  for (auto it = std::sregex_iterator(dims.begin(), dims.end(), number);
       it != std::sregex_iterator(); ++it) {
    out.shape.push_back(std::stoll(it->str()));
  }
  static const std::regex kind("[<|=]([fiu])([0-9]+)");
  if (!std::regex_match(out.dtype, m, kind)) {
    throw std::runtime_error(".npy dtype " + out.dtype + " is not a little-endian number type");
  }
  out.item_size = static_cast<std::size_t>(std::stoul(m[2]));
  const std::size_t want = static_cast<std::size_t>(out.elements()) * out.item_size;
  const std::size_t start = offset + header_len;
  if (bytes.size() - start != want) {
    throw std::runtime_error(".npy data is " + std::to_string(bytes.size() - start) +
                             " bytes; its shape and dtype need " + std::to_string(want));
  }
  out.data.assign(bytes.begin() + static_cast<std::ptrdiff_t>(start), bytes.end());
  return out;
}

NpyArray read_npy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)),
                                   std::istreambuf_iterator<char>());
  try {
    return parse_npy(bytes);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(path + ": " + e.what());
  }
}

namespace {
void squeeze_to_2d(NpyArray* a, const std::string& what) {
  if (a->shape.size() == 3 && a->shape[0] == 1) a->shape.erase(a->shape.begin());
  if (a->shape.size() != 2) {
    throw InvalidRequest("path", what + " must be 2-D (or [1, rows, columns])");
  }
}
}  // namespace

LoraFiles read_lora_dir(const std::string& dir, std::int32_t max_rank) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    throw InvalidRequest("path", "'" + dir + "' is not a directory on this worker");
  }
  LoraFiles out;
  try {
    out.weights = read_npy((fs::path(dir) / "model.lora_weights.npy").string());
    out.config = read_npy((fs::path(dir) / "model.lora_config.npy").string());
  } catch (const std::runtime_error& e) {
    throw InvalidRequest("path", std::string("not a TensorRT-LLM LoRA directory: ") + e.what());
  }
  squeeze_to_2d(&out.weights, "model.lora_weights.npy");
  squeeze_to_2d(&out.config, "model.lora_config.npy");
  if (out.weights.dtype != "<f2" && out.weights.dtype != "<f4") {
    throw InvalidRequest("path", "model.lora_weights.npy must be float16 or float32, not " +
                                     out.weights.dtype);
  }
  if (out.config.shape[1] != 3) {
    throw InvalidRequest("path", "model.lora_config.npy rows must be (module, layer, rank)");
  }
  if (out.config.dtype == "<i8") {  // to int32, as the executor takes it
    std::vector<unsigned char> narrow(static_cast<std::size_t>(out.config.elements()) * 4);
    for (std::int64_t i = 0; i < out.config.elements(); ++i) {
      std::int64_t v = 0;
      std::memcpy(&v, out.config.data.data() + i * 8, 8);
      const auto w = static_cast<std::int32_t>(v);
      std::memcpy(narrow.data() + i * 4, &w, 4);
    }
    out.config.data.swap(narrow);
    out.config.dtype = "<i4";
    out.config.item_size = 4;
  } else if (out.config.dtype != "<i4") {
    throw InvalidRequest("path", "model.lora_config.npy must be int32 or int64, not " +
                                     out.config.dtype);
  }
  if (out.config.shape[0] != out.weights.shape[0]) {
    throw InvalidRequest("path", "model.lora_config.npy has " +
                                     std::to_string(out.config.shape[0]) + " rows and the weights " +
                                     std::to_string(out.weights.shape[0]));
  }
  for (std::int64_t row = 0; row < out.config.shape[0]; ++row) {
    std::int32_t size = 0;
    std::memcpy(&size, out.config.data.data() + (row * 3 + 2) * 4, 4);
    out.rank = std::max(out.rank, size);
  }
  if (out.rank < 1 || out.rank > max_rank) {
    throw InvalidRequest("path", "adapter rank " + std::to_string(out.rank) +
                                     " exceeds the engine's max_lora_rank " +
                                     std::to_string(max_rank));
  }
  return out;
}

}  // namespace switchyard::rt
