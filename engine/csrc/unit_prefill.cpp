// The other translation unit of the operators' library (unit_decode.cpp
// says why two): the prefill operator, the greedy argmax of the logits,
// sampling at a temperature, the RMSNorm and rotary operators, and the bf16
// projections' GEMMs (on bf16 weights, and on the codes a GGUF weight was
// decoded from).
#include "paged_prefill.cpp"
#include "logits.cpp"
#include "sample_rows.cpp"
#include "norm_rotary.cpp"
#include "gemm_bf16.cpp"
#include "gemm_bf16_codes.cpp"
