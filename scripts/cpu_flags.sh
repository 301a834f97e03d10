#!/usr/bin/env bash
# Print the CMAKE_ARGS for a llama.cpp build that runs on *this* CPU.
#
# Not -march=native (GGML_NATIVE): on VMs the CPU can advertise instructions
# the hypervisor does not execute, and a native build then dies with
# "Illegal instruction". Instead: a portable AVX2 baseline, plus AVX-512
# (F/CD/VL/DQ/BW, VNNI, VBMI, BF16) only if a probe program using one
# instruction of each of those sets compiles and runs here.
set -uo pipefail
BASE="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
AVX512="-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON"
CC="${CC:-cc}"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
cat > "$dir/probe.c" <<'C'
#include <immintrin.h>
#include <stdio.h>
int main(void) {
    volatile int seed = 3;
    __m512i a = _mm512_set1_epi32(seed), z = _mm512_setzero_si512();
    __m512i s = _mm512_add_epi32(a, a);                                  /* F */
    s = _mm512_add_epi32(s, _mm512_conflict_epi32(a));                    /* CD */
    s = _mm512_add_epi64(s, _mm512_mullo_epi64(a, a));                    /* DQ */
    s = _mm512_add_epi16(s, _mm512_maddubs_epi16(a, a));                  /* BW */
    s = _mm512_dpbusd_epi32(s, a, a);                                     /* VNNI */
    s = _mm512_add_epi8(s, _mm512_permutexvar_epi8(a, a));                /* VBMI */
    __m256i h = _mm256_max_epi64(_mm512_castsi512_si256(s), _mm256_setzero_si256()); /* VL */
    __m512 f = _mm512_cvtepi32_ps(a);
    __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), _mm512_cvtne2ps_pbh(f, f),
                                _mm512_cvtne2ps_pbh(f, f));               /* BF16 */
    int out[8];
    _mm256_storeu_si256((__m256i *)out, h);
    printf("%d %f %d\n", out[0], (double)_mm512_reduce_add_ps(d),
           _mm512_reduce_add_epi32(_mm512_max_epi32(s, z)) > 0);
    return 0;
}
C
if "$CC" -O1 -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw -mavx512vnni \
     -mavx512vbmi -mavx512bf16 "$dir/probe.c" -o "$dir/probe" >/dev/null 2>&1 \
   && "$dir/probe" >/dev/null 2>&1; then
  echo "$BASE $AVX512"
else
  echo "$BASE"
fi
