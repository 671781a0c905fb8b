// The core's VDPBF16PS rate with nothing else in the loop: 24 independent
// float32 accumulators in zmm registers, no loads, so that neither memory nor
// the instruction's latency (each sum waits on its own previous one) bounds
// it.  A ceiling for the GEMM's GFLOP/s (gemm_bf16.py), which also loads the
// weight and broadcasts x.  Also the clock, from a chain of dependent adds
// (one a cycle).
//
//   gcc -O2 -mavx512f -mavx512bf16 studies/engine_cpu/vdpbf16ps_peak.c -o /tmp/vdpbf16ps_peak
//   taskset -c 1 /tmp/vdpbf16ps_peak
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
  const long adds = 2000000000L;
  long x = 0;
  double t0 = now();
  for (long i = 0; i < adds; i++) __asm__ volatile("add $1, %0" : "+r"(x));
  const double ghz = adds / (now() - t0) / 1e9;

  __m512 acc[24];
  for (int i = 0; i < 24; i++) acc[i] = _mm512_set1_ps((float)i);
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // pairs of bf16 1.0
  const __m512bh b = a;
  const long steps = 100000000L;
  t0 = now();
  for (long s = 0; s < steps; s++) {
#pragma GCC unroll 24
    for (int i = 0; i < 24; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    __asm__ volatile("" : "+v"(a));  // keeps the loop from being folded
  }
  const double secs = now() - t0;
  float sum = 0;
  for (int i = 0; i < 24; i++) sum += _mm512_reduce_add_ps(acc[i]);
  const double per_ns = steps * 24.0 / secs / 1e9;
  // 16 float32 lanes, each two bf16 products and their two adds: 64 FLOP.
  printf("clock ~%.2f GHz; VDPBF16PS zmm %.3f a ns (%.2f a cycle), %.1f GFLOP/s (sum %g)\n",
         ghz, per_ns, per_ns / ghz, per_ns * 64, sum);
  return 0;
}
