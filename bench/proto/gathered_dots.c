// Prototype (not picc code): how fast one core can dot the gathered up and gate rows of a sparse
// q4_1 FFN with int16 x, one row at a time, four blocks to a 512-bit vector, in two layouts.
//
//   gcc -O3 -march=icelake-server -mtune=znver3 bench/proto/gathered_dots.c -o /tmp/gathered_dots
//   /tmp/gathered_dots planes 11008 0.3 20     # LAYOUT N_FF ACTIVE_SHARE REPS
//
// LAYOUT "gguf": the rows as GGUF stores them (20-byte blocks: f16 d, f16 m, 16 bytes of nibbles),
// the four blocks' nibbles and scales picked out of 128 loaded bytes with two vpermt2w.
// LAYOUT "planes": a row's nibbles first (16 bytes a block, GGUF's order inside the block), then
// its f16 d of every block, then its f16 m: one aligned 64-byte load is four blocks' nibbles.
//
// Either way a 32-bit lane of the vector holds eight elements of one block (four low nibbles, four
// high), so vpdpbusd against x's high and low bytes, arranged once per x in the same order, leaves
// exact per-lane integer sums with no transpose: lanes 4b..4b+3 belong to block b, whose d * x's
// scale is broadcast to them (a 128-bit multiply and one permute), and q4_1's m * sum(x) goes in
// a 128-bit FMA. The rows of the neuron PF ahead in the active list go into L2 a line per line
// read (prefetcht0 of a whole record at once was 2-3x slower from memory).
//
// Prints ns per neuron (an up and a gate row of hidden 4096) and GB/s of those rows read, of the
// best repetition and the median one; each repetition reads another layer of 1 GiB of them with a new random active set,
// so its rows come from memory, as bench/kernels.py's do. docs/codegen_cpu.md has the numbers.
// Run it alone: two copies started together do not time the same seconds (each writes its 1 GiB
// first, for seconds, then times ~0.1 s), so their rates are not what two cores read at once.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define K 4096
#define NB (K / 32)
#define NU (NB / 4)
#define ROWB (NB * 20)
#define DOFF (NB * 16)
#define MOFF (NB * 18)
#define PF 2

typedef struct { __m512i xh_lo[NU], xh_hi[NU], xl_lo[NU], xl_hi[NU]; __m128 xs[NU], xq[NU]; } X;
static __m512i NIB, SC;
static int planes;

static int by_value(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static inline void dot2(const uint8_t *rows[2], const uint8_t *next[2], const X *x, float *out) {
  const __m512i m4 = _mm512_set1_epi8(15);
  const __m512i pd = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  __m128 accm[2] = {_mm_setzero_ps(), _mm_setzero_ps()};
  for (int u = 0; u < NU; u++) {
    for (int q = 0; q < 2; q++) {
      const uint8_t *p = rows[q], *n = next[q];
      __m512i w;
      __m256 dm;  // d0..3, m0..3
      if (planes) {
        _mm_prefetch((const char *)n + 64 * u, _MM_HINT_T1);
        if ((u & 7) == 0) {
          _mm_prefetch((const char *)n + DOFF + 8 * u, _MM_HINT_T1);
          _mm_prefetch((const char *)n + MOFF + 8 * u, _MM_HINT_T1);
        }
        w = _mm512_load_si512(p + 64 * u);
        dm = _mm256_cvtph_ps(_mm_set_epi64x(*(const long long *)(p + MOFF + 8 * u), *(const long long *)(p + DOFF + 8 * u)));
      } else {
        _mm_prefetch((const char *)n + 80 * u, _MM_HINT_T1);
        if (u & 1) _mm_prefetch((const char *)n + 80 * u + 64, _MM_HINT_T1);
        __m512i a = _mm512_loadu_si512(p + 80 * u), b = _mm512_loadu_si512(p + 80 * u + 64);
        w = _mm512_permutex2var_epi16(a, NIB, b);
        dm = _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutex2var_epi16(a, SC, b)));
      }
      __m512i lo = _mm512_and_si512(w, m4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
      __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x->xh_lo[u]);
      h = _mm512_dpbusd_epi32(h, hi, x->xh_hi[u]);
      __m512i l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x->xl_lo[u], lo);
      l = _mm512_dpbusd_epi32(l, x->xl_hi[u], hi);
      __m512i dots = _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);
      __m128 ds = _mm_mul_ps(_mm256_castps256_ps128(dm), x->xs[u]);
      acc[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_permutexvar_ps(pd, _mm512_castps128_ps512(ds)), acc[q]);
      accm[q] = _mm_fmadd_ps(_mm256_extractf128_ps(dm, 1), x->xq[u], accm[q]);
    }
  }
  for (int q = 0; q < 2; q++) out[q] = _mm512_reduce_add_ps(acc[q]) + accm[q][0] + accm[q][1] + accm[q][2] + accm[q][3];
}

int main(int argc, char **argv) {
  if (argc != 5) { fprintf(stderr, "usage: %s gguf|planes N_FF ACTIVE_SHARE REPS\n", argv[0]); return 2; }
  planes = strcmp(argv[1], "planes") == 0;
  int n = atoi(argv[2]), reps = atoi(argv[4]);
  double share = atof(argv[3]);
  short nib[32] = {0}, sc[32] = {0};
  for (int b = 0; b < 4; b++) {
    for (int j = 0; j < 8; j++) nib[8 * b + j] = 10 * b + 2 + j;  // words of block b's nibbles
    sc[b] = 10 * b, sc[4 + b] = 10 * b + 1;                        // its d and m
  }
  NIB = _mm512_loadu_si512(nib), SC = _mm512_loadu_si512(sc);
  // Layers over 1 GiB, a new layer and a new active set each repetition: the rows come from memory.
  size_t rec = 2 * ROWB, layer = (size_t)n * rec, layers = ((size_t)1 << 30) / layer + 1;
  size_t total = (layers * layer + 128 + (2 << 20)) & ~((size_t)(2 << 20) - 1);
  uint8_t *w = aligned_alloc(2 << 20, total);
  madvise(w, total, MADV_HUGEPAGE);
  for (size_t i = 0; i < total; i++) w[i] = rand();
  for (size_t r = 0; r < 2 * (size_t)n * layers; r++)
    for (int b = 0; b < NB; b++) {  // d = m = 1.0
      uint16_t *s = planes ? (uint16_t *)(w + r * ROWB + DOFF) + b : (uint16_t *)(w + r * ROWB + 20 * b);
      s[0] = 0x3c00;
      if (planes) s[NB] = 0x3c00; else s[1] = 0x3c00;
    }
  X *x = aligned_alloc(64, sizeof(X));
  memset(x, 1, sizeof(X));
  for (int u = 0; u < NU; u++) x->xs[u] = _mm_set1_ps(1e-3f), x->xq[u] = _mm_set1_ps(1e-2f);
  int *active = malloc(n * sizeof(int)), na = 0;
  float *out = malloc(2 * n * sizeof(float));
  double best = 1e9, neurons = 0, *per = malloc(reps * sizeof(double));
  for (int rep = 0; rep < reps; rep++) {
    na = 0;
    for (int i = 0; i < n; i++)
      if (rand() < share * RAND_MAX) active[na++] = i;
    const uint8_t *base = w + (rep % layers) * layer;
    double t0 = now();
    for (int j = 0; j < na; j++) {
      const uint8_t *r = base + (size_t)active[j] * rec, *nx = base + (size_t)active[j + PF < na ? j + PF : j] * rec;
      const uint8_t *rows[2] = {r, r + ROWB}, *next[2] = {nx, nx + ROWB};
      dot2(rows, next, x, out + 2 * j);
    }
    double dt = (now() - t0) / na;
    per[rep] = dt;
    if (dt < best) best = dt, neurons = na;
  }
  qsort(per, reps, sizeof(double), by_value);
  printf("%s n_ff=%d active=%.0f: best %.1f ns a neuron, %.1f GB/s; median %.1f ns, %.1f GB/s (checksum %g)\n",
         argv[1], n, neurons, best * 1e9, rec / best / 1e9, per[reps / 2] * 1e9, rec / per[reps / 2] / 1e9, out[0]);
  return 0;
}
