// Probe (not picc code): how long reading a random subset of a matrix's rows takes, in row order,
// against reading all of them: the most a sparse FFN can save over a dense one on this memory,
// before any arithmetic.
//
//   gcc -O2 -mavx2 -pthread bench/proto/row_subsets.c -o /tmp/row_subsets
//   /tmp/row_subsets 360 2 8        # ROW_BYTES THREADS PREFETCH_ROWS_AHEAD (0: none)
//
// 256 MiB of rows (far past any L3), each thread reading its half of the selected rows with
// 32-byte loads summed; PREFETCH_ROWS_AHEAD > 0 also prefetches every line of the selected row
// that many rows ahead, as picc's gathered kernels do. Each repetition draws a new random subset
// at the given share (each row independently); the median of 9 is printed, as milliseconds, GB/s
// of the selected rows' bytes, and the time against reading every row in the same run. A q4_1 row
// of SmolLM2's FFN (hidden 576) is 360 bytes; a neuron's up row and down column side by side 720;
// a row of hidden 4096 (bench/kernels.py's large shape) 2560. docs/codegen_cpu.md has the numbers.
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define REGION ((size_t)256 << 20)
#define REPS 9

static size_t row_bytes, n_rows, ahead;
static uint8_t *rows;
static int32_t *selected;
static size_t n_selected;

typedef struct {
  size_t lo, hi;
  long long sum;
} part_t;

static void *read_part(void *arg) {
  part_t *p = arg;
  __m256i acc = _mm256_setzero_si256();
  for (size_t k = p->lo; k < p->hi; k++) {
    if (ahead && k + ahead < p->hi) {
      const char *next = (const char *)rows + (size_t)selected[k + ahead] * row_bytes;
      for (size_t o = 0; o < row_bytes; o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
    }
    const uint8_t *r = rows + (size_t)selected[k] * row_bytes;
    for (size_t o = 0; o + 32 <= row_bytes; o += 32)
      acc = _mm256_add_epi64(acc, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)(r + o)), _mm256_setzero_si256()));
  }
  long long lanes[4];
  _mm256_storeu_si256((__m256i *)lanes, acc);
  p->sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  return NULL;
}

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

static double timed_read(int threads) {
  pthread_t tid[64];
  part_t parts[64];
  double start = seconds();
  for (int t = 0; t < threads; t++) {
    parts[t].lo = n_selected * t / threads;
    parts[t].hi = n_selected * (t + 1) / threads;
    pthread_create(&tid[t], NULL, read_part, &parts[t]);
  }
  for (int t = 0; t < threads; t++) pthread_join(tid[t], NULL);
  return seconds() - start;
}

static int by_value(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s ROW_BYTES THREADS [PREFETCH_ROWS_AHEAD]\n", argv[0]);
    return 2;
  }
  row_bytes = strtoul(argv[1], NULL, 10);
  int threads = atoi(argv[2]);
  ahead = argc > 3 ? strtoul(argv[3], NULL, 10) : 0;
  if (row_bytes < 32 || threads < 1 || threads > 64) {
    fprintf(stderr, "ROW_BYTES must be at least 32 and THREADS 1 to 64\n");
    return 2;
  }
  n_rows = REGION / row_bytes;
  rows = aligned_alloc(2 << 20, REGION);
  selected = malloc(n_rows * sizeof *selected);
  if (rows == NULL || selected == NULL) return 1;
  memset(rows, 1, REGION);
  const double shares[] = {1.0, 0.9, 0.8, 0.7, 0.5, 0.3, 0.1};
  const int n_shares = sizeof shares / sizeof shares[0];
  double all_rows = 0;
  srand(1);
  printf("| active | ms | GB/s of the rows read | time against all rows |\n|---|---|---|---|\n");
  for (int s = 0; s < n_shares; s++) {
    double times[REPS];
    for (int rep = 0; rep < REPS; rep++) {
      n_selected = 0;
      for (size_t r = 0; r < n_rows; r++)
        if (rand() < shares[s] * RAND_MAX) selected[n_selected++] = (int32_t)r;
      times[rep] = timed_read(threads);
    }
    qsort(times, REPS, sizeof times[0], by_value);
    double median = times[REPS / 2];
    if (s == 0) all_rows = median;
    printf("| %.0f%% | %.2f | %.1f | %.2f |\n", 100 * shares[s], 1e3 * median,
           shares[s] * REGION / median / 1e9, median / all_rows);
  }
  return 0;
}
