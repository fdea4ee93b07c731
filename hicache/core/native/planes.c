/* Byte planes of 16-bit values, for the lossless codec (hicache/backends/codec.py has the contract
 * and a numpy twin): n values v_i (little-endian) <-> a plane of their low bytes and a plane of
 * their high bytes. The high byte of a bf16/fp16 value (sign, most of the exponent) takes few
 * values, so its plane compresses; the low plane is stored as it is.
 */
#include <stdint.h>

void hicache_planes_split(const uint8_t *src, int64_t n, uint8_t *lo, uint8_t *hi)
{
    for (int64_t i = 0; i < n; i++) {
        lo[i] = src[2 * i];
        hi[i] = src[2 * i + 1];
    }
}

void hicache_planes_merge(const uint8_t *lo, const uint8_t *hi, int64_t n, uint8_t *dst)
{
    for (int64_t i = 0; i < n; i++) {
        dst[2 * i] = lo[i];
        dst[2 * i + 1] = hi[i];
    }
}
