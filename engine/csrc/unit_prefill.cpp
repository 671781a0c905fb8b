// The other translation unit of the operators' library (unit_decode.cpp
// says why two): the prefill operator, the greedy argmax of the logits,
// sampling at a temperature, and the RMSNorm and rotary operators.
#include "paged_prefill.cpp"
#include "logits.cpp"
#include "sample_rows.cpp"
#include "norm_rotary.cpp"
