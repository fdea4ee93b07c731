/* hicache's page-key chain, the one hot loop of `match` that Python cannot run fast enough.
 *
 *   key[-1] = seed
 *   key[i]  = SHA-256(key[i-1] || page i as int32 little-endian)[0:16]
 *
 * SHA-256 is OpenSSL's: the Python loader passes in the addresses of SHA256_Init, _Update and
 * _Final from the very libcrypto that Python's hashlib already loaded (the one-shot SHA256() of
 * OpenSSL 3 looks the algorithm up on every call and costs twice as much). So this file needs no
 * headers or libraries beyond libc, and gives exactly the bytes of the pure-Python fallback.
 */
#include <stddef.h>
#include <string.h>

typedef int (*init_fn)(void *ctx);
typedef int (*update_fn)(void *ctx, const void *data, size_t len);
typedef int (*final_fn)(unsigned char *md, void *ctx);

enum { KEY_BYTES = 16, CTX_BYTES = 256 }; /* OpenSSL's SHA256_CTX is 112 bytes */

/* Writes n_pages keys of 16 bytes to out. Returns 0. */
int hicache_chain(void *init, void *update, void *final, const unsigned char *seed,
                  const unsigned char *pages, size_t page_bytes, size_t n_pages,
                  unsigned char *out)
{
    _Alignas(16) unsigned char ctx[CTX_BYTES];
    unsigned char md[32];
    const unsigned char *prev = seed;
    for (size_t i = 0; i < n_pages; i++) {
        ((init_fn)init)(ctx);
        ((update_fn)update)(ctx, prev, KEY_BYTES);
        ((update_fn)update)(ctx, pages + i * page_bytes, page_bytes);
        ((final_fn)final)(md, ctx);
        memcpy(out + i * KEY_BYTES, md, KEY_BYTES);
        prev = out + i * KEY_BYTES;
    }
    return 0;
}
