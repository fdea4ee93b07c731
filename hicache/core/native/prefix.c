/* The length of the common prefix of two byte strings, for the prefix memo (hicache/keys.py):
 * a next turn of a conversation is compared with the previous prompt to reuse its page keys.
 * numpy can only compare whole arrays; this stops at the first difference and compares with
 * memcmp, so a prompt that shares 100 KB with a remembered one costs a few microseconds.
 */
#include <stddef.h>
#include <string.h>

enum { STEP = 4096 };

size_t hicache_common_prefix(const unsigned char *a, const unsigned char *b, size_t n)
{
    size_t i = 0;
    while (i + STEP <= n && memcmp(a + i, b + i, STEP) == 0) i += STEP;
    while (i < n && a[i] == b[i]) i++;
    return i;
}
