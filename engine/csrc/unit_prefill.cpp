// The other translation unit of the operators' library (unit_decode.cpp
// says why two): the prefill operator, the greedy argmax of the logits,
// and the RMSNorm and rotary operators.
#include "paged_prefill.cpp"
#include "logits.cpp"
#include "norm_rotary.cpp"
