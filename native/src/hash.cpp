#include "hash.h"

#include <algorithm>
#include <cstring>

#ifdef SK_HAVE_ZLIB
#include <zlib.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SK_HAVE_CLMUL 1
#include <immintrin.h>
#endif

namespace sk {

namespace {

// Slicing-by-8 tables for the reflected polynomial 0xEDB88320 (same as zlib.crc32).
struct CrcTables {
    uint32_t t[8][256];
    CrcTables() {
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++) c = (c & 1) ? (0xEDB88320u ^ (c >> 1)) : (c >> 1);
            t[0][i] = c;
        }
        for (uint32_t i = 0; i < 256; i++) {
            for (int s = 1; s < 8; s++) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
        }
    }
};

const CrcTables & tables() {
    static const CrcTables tb;
    return tb;
}

inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

}  // namespace


#ifdef SK_HAVE_CLMUL
namespace {

// CRC-32 by carry-less multiplication (PCLMULQDQ): four 128-bit lanes folded 64 bytes at a time,
// then folded to one lane, to 64 bits and Barrett-reduced, after Intel's "Fast CRC Computation for
// Generic Polynomials Using PCLMULQDQ" (2009), with its bit-reflected constants for the zlib
// polynomial. `crc` is the register (the inverted running CRC); n >= 64 and a multiple of 16.
// Several times zlib's braided CRC, which matters: the CRC is the largest single cost of restoring
// a slot file after reading it (figures: docs/benchmarks.md).
#define SK_CLMUL_TARGET __attribute__((target("pclmul,sse4.1")))

SK_CLMUL_TARGET inline __m128i load16(const uint8_t * q) { return _mm_loadu_si128(reinterpret_cast<const __m128i *>(q)); }

// acc folded forward by the distance `k` holds, xored with the next block.
SK_CLMUL_TARGET inline __m128i fold16(__m128i acc, __m128i next, __m128i k) {
    const __m128i lo = _mm_clmulepi64_si128(acc, k, 0x00);
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(acc, k, 0x11), next), lo);
}

SK_CLMUL_TARGET uint32_t crc32_clmul_blocks(uint32_t crc, const uint8_t * p, size_t n) {
    alignas(16) static const uint64_t k1k2[2] = {0x0154442bd4, 0x01c6e41596};
    alignas(16) static const uint64_t k3k4[2] = {0x01751997d0, 0x00ccaa009e};
    alignas(16) static const uint64_t k5k0[2] = {0x0163cd6124, 0x0000000000};
    alignas(16) static const uint64_t poly[2] = {0x01db710641, 0x01f7011641};

    __m128i x1 = load16(p), x2 = load16(p + 16), x3 = load16(p + 32), x4 = load16(p + 48);
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128(int(crc)));
    __m128i k = _mm_load_si128(reinterpret_cast<const __m128i *>(k1k2));
    p += 64;
    n -= 64;
    while (n >= 64) {
        x1 = fold16(x1, load16(p), k);
        x2 = fold16(x2, load16(p + 16), k);
        x3 = fold16(x3, load16(p + 32), k);
        x4 = fold16(x4, load16(p + 48), k);
        p += 64;
        n -= 64;
    }
    // Four lanes into one, then the remaining 16-byte blocks into it.
    k = _mm_load_si128(reinterpret_cast<const __m128i *>(k3k4));
    x1 = fold16(x1, x2, k);
    x1 = fold16(x1, x3, k);
    x1 = fold16(x1, x4, k);
    while (n >= 16) {
        x1 = fold16(x1, load16(p), k);
        p += 16;
        n -= 16;
    }
    // 128 bits to 64, then Barrett reduction to 32.
    const __m128i mask32 = _mm_setr_epi32(~0, 0, ~0, 0);
    x2 = _mm_clmulepi64_si128(x1, k, 0x10);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
    k = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(k5k0));
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k, 0x00), x2);
    k = _mm_load_si128(reinterpret_cast<const __m128i *>(poly));
    x2 = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k, 0x10);
    x2 = _mm_clmulepi64_si128(_mm_and_si128(x2, mask32), k, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return uint32_t(_mm_extract_epi32(x1, 1));
}

bool have_clmul() {
    static const bool yes = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
    return yes;
}

}  // namespace
#endif

uint32_t crc32_update(uint32_t crc, const void * data, size_t n) {
#ifdef SK_HAVE_CLMUL
    if (n >= 64 && have_clmul()) {
        const size_t blocks = n & ~size_t(15);
        crc = ~crc32_clmul_blocks(~crc, static_cast<const uint8_t *>(data), blocks);
        data = static_cast<const uint8_t *>(data) + blocks;
        n -= blocks;
        if (n == 0) return crc;
    }
#endif
#ifdef SK_HAVE_ZLIB
    // zlib's braided/folded CRC-32 of the same polynomial (CMakeLists.txt: where zlib is found).
    return uint32_t(::crc32_z(crc, static_cast<const Bytef *>(data), n));
#endif
    return crc32_portable(crc, data, n);
}

uint32_t crc32_portable(uint32_t crc, const void * data, size_t n) {
    const auto & t = tables().t;
    const uint8_t * p = static_cast<const uint8_t *>(data);
    uint32_t c = ~crc;
    while (n >= 8) {
        uint32_t lo;
        uint32_t hi;
        std::memcpy(&lo, p, 4);
        std::memcpy(&hi, p + 4, 4);
        lo ^= c;  // little-endian hosts only (x86-64, aarch64)
        c = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
            t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) c = t[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return ~c;
}

Sha256::Sha256()
    : h_{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19} {}

void Sha256::block(const uint8_t * p) {
    uint32_t w[64];
    for (int i = 0; i < 16; i++) {
        w[i] = (uint32_t(p[4 * i]) << 24) | (uint32_t(p[4 * i + 1]) << 16) | (uint32_t(p[4 * i + 2]) << 8) |
               uint32_t(p[4 * i + 3]);
    }
    for (int i = 16; i < 64; i++) {
        const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
        const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
    for (int i = 0; i < 64; i++) {
        const uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
        const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    h_[0] += a; h_[1] += b; h_[2] += c; h_[3] += d; h_[4] += e; h_[5] += f; h_[6] += g; h_[7] += h;
}

void Sha256::update(const void * data, size_t n) {
    const uint8_t * p = static_cast<const uint8_t *>(data);
    total_ += n;
    while (n > 0) {
        const size_t take = std::min(n, size_t(64) - buf_len_);
        std::memcpy(buf_ + buf_len_, p, take);
        buf_len_ += take;
        p += take;
        n -= take;
        if (buf_len_ == 64) {
            block(buf_);
            buf_len_ = 0;
        }
    }
}

std::string Sha256::hexdigest() {
    const uint64_t bits = total_ * 8;
    const uint8_t pad = 0x80;
    update(&pad, 1);
    const uint8_t zero = 0;
    while (buf_len_ != 56) update(&zero, 1);
    uint8_t len[8];
    for (int i = 0; i < 8; i++) len[i] = uint8_t(bits >> (56 - 8 * i));
    update(len, 8);
    static const char * hex = "0123456789abcdef";
    std::string out;
    for (uint32_t v : h_) {
        for (int s = 28; s >= 0; s -= 4) out.push_back(hex[(v >> s) & 0xf]);
    }
    return out;
}

}  // namespace sk
