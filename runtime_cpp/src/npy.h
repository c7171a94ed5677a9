// Reading NumPy .npy files (format versions 1 to 3, C order): TensorRT-LLM's LoRA
// adapters come as model.lora_weights.npy and model.lora_config.npy.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace switchyard::rt {

struct NpyArray {
  std::string dtype;               // NumPy's descr, e.g. "<f2", "<f4", "<i4", "<i8"
  std::vector<std::int64_t> shape;
  std::size_t item_size = 0;       // bytes per element
  std::vector<unsigned char> data; // row-major
  std::int64_t elements() const;
};

// Throws std::runtime_error naming what is wrong with the file.
NpyArray read_npy(const std::string& path);
NpyArray parse_npy(const std::vector<unsigned char>& bytes);

// A TensorRT-LLM LoRA adapter directory: model.lora_weights.npy (fp16 or fp32, one row per
// module and layer) and model.lora_config.npy (int32 rows of module id, layer, rank),
// each 2-D or with a leading dimension of 1 (as TensorRT-LLM's converter writes them).
struct LoraFiles {
  NpyArray weights;  // 2-D
  NpyArray config;   // 2-D int32, [rows, 3]
  std::int32_t rank = 0;  // the largest adapter size among the rows
};
// Throws InvalidRequest("path", ...) naming what is wrong, or a rank above max_rank.
LoraFiles read_lora_dir(const std::string& dir, std::int32_t max_rank);

}  // namespace switchyard::rt
