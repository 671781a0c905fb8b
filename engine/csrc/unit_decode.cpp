// One of the two translation units the operators' library is built from
// (engine/cpp_ops.py): ATen's and torch's headers take about ten
// seconds to parse in each unit, longer than most of our sources take to
// compile, so the sources are grouped into two units, one per core of a
// small machine, instead of one unit each.  This one: the decode operator,
// the K/V write, the SwiGLU product, a probe of the build's threads, the
// decoder layer that calls them and the other unit's operators, and the
// float32 projections' GEMMs (on float32 weights, and on the codes a GGUF
// weight was decoded from).
#include "paged_decode.cpp"
#include "kv_write.cpp"
#include "silu_mul.cpp"
#include "parallel_probe.cpp"
#include "decode_layer.cpp"
#include "gemm_f32.cpp"
#include "gemm_f32_codes.cpp"
