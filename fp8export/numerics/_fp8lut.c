/* E4M3 quantization of 16-bit floats by table lookup (fp8export/numerics/lut.py).
 *
 * A bf16/fp16 tensor has at most 65,536 distinct bit patterns, so the E4M3 byte of each is
 * computed once per scale (in Python, by the reference arithmetic) and applied here as a
 * gather. The same pass counts every pattern: amax and the exact SQNR follow from the counts.
 * numpy has no fused gather + histogram, and its separate np.take / np.bincount passes are no
 * faster than the float cast they replace: this loop is the one piece written in C.
 *
 * Plain C with no Python API: loaded with ctypes, which releases the GIL during the call, so
 * several worker threads quantize at once. Built as an optional extension; when it is absent
 * lut.py computes identical bytes with numpy.
 */
#include <stddef.h>
#include <stdint.h>

/* dst[i] = table[src[i]]; hist[src[i]] += 1 (hist: 65,536 counters, accumulated). */
void fp8lut_quantize(const uint16_t *src, size_t n, const uint8_t *table, uint8_t *dst,
                     uint64_t *hist)
{
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        uint16_t a = src[i], b = src[i + 1], c = src[i + 2], d = src[i + 3];
        dst[i] = table[a];
        dst[i + 1] = table[b];
        dst[i + 2] = table[c];
        dst[i + 3] = table[d];
        hist[a]++;
        hist[b]++;
        hist[c]++;
        hist[d]++;
    }
    for (; i < n; i++) {
        dst[i] = table[src[i]];
        hist[src[i]]++;
    }
}

/* hist[src[i]] += 1 only. */
void fp8lut_histogram(const uint16_t *src, size_t n, uint64_t *hist)
{
    for (size_t i = 0; i < n; i++)
        hist[src[i]]++;
}
