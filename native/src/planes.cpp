// storage.chunks._planes: f32 byte planes for storage.chunks.codec — a state's bytes split so that byte k of
// every float lies with the others' (the sign-and-exponent plane compresses, the mantissa planes
// are noise), and put back. Both run with the GIL released, so a restore's decodes run beside its
// other reads and writes. No libllama: storage loads it on nodes and tools that never load a model.
//
// numpy's strided copies do the same a byte at a time in four strided passes, which shows on the
// restore's path; a 16-byte interleave does it at memory speed (figures: docs/benchmarks.md).

#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace py = pybind11;

namespace {

constexpr size_t kStride = 4;  // f32

// out[4i + k] = plane[k][i] for i < n
void interleave4(uint8_t * out, const uint8_t * p0, const uint8_t * p1, const uint8_t * p2,
                 const uint8_t * p3, size_t n) {
    size_t i = 0;
#if defined(__SSE2__)
    for (; i + 16 <= n; i += 16) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p0 + i));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p1 + i));
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p2 + i));
        const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p3 + i));
        const __m128i ab_lo = _mm_unpacklo_epi8(a, b), ab_hi = _mm_unpackhi_epi8(a, b);  // a0 b0 a1 b1 ...
        const __m128i cd_lo = _mm_unpacklo_epi8(c, d), cd_hi = _mm_unpackhi_epi8(c, d);
        __m128i * o = reinterpret_cast<__m128i *>(out + kStride * i);
        _mm_storeu_si128(o + 0, _mm_unpacklo_epi16(ab_lo, cd_lo));  // a0 b0 c0 d0 a1 b1 c1 d1 ...
        _mm_storeu_si128(o + 1, _mm_unpackhi_epi16(ab_lo, cd_lo));
        _mm_storeu_si128(o + 2, _mm_unpacklo_epi16(ab_hi, cd_hi));
        _mm_storeu_si128(o + 3, _mm_unpackhi_epi16(ab_hi, cd_hi));
    }
#endif
    for (; i < n; i++) {  // (the rest; all of it where the compiler vectorizes this loop itself)
        out[kStride * i + 0] = p0[i];
        out[kStride * i + 1] = p1[i];
        out[kStride * i + 2] = p2[i];
        out[kStride * i + 3] = p3[i];
    }
}

// plane[k][i] = raw[4i + k] for i < n: the planes back to back in out (4n bytes)
void split4(uint8_t * out, const uint8_t * raw, size_t n) {
    uint8_t * p0 = out, * p1 = out + n, * p2 = out + 2 * n, * p3 = out + 3 * n;
    size_t i = 0;
#if defined(__SSE2__)
    const __m128i low = _mm_set1_epi32(0xff);
    for (; i + 16 <= n; i += 16) {
        const __m128i * r = reinterpret_cast<const __m128i *>(raw + kStride * i);
        const __m128i w0 = _mm_loadu_si128(r), w1 = _mm_loadu_si128(r + 1);
        const __m128i w2 = _mm_loadu_si128(r + 2), w3 = _mm_loadu_si128(r + 3);
        __m128i planes[kStride];
        for (size_t k = 0; k < kStride; k++) {
            // byte k of each 32-bit word, narrowed 32 -> 16 -> 8 (values < 256: no saturation)
            const int s = static_cast<int>(8 * k);
            const __m128i b0 = _mm_and_si128(_mm_srli_epi32(w0, s), low);
            const __m128i b1 = _mm_and_si128(_mm_srli_epi32(w1, s), low);
            const __m128i b2 = _mm_and_si128(_mm_srli_epi32(w2, s), low);
            const __m128i b3 = _mm_and_si128(_mm_srli_epi32(w3, s), low);
            planes[k] = _mm_packus_epi16(_mm_packs_epi32(b0, b1), _mm_packs_epi32(b2, b3));
        }
        _mm_storeu_si128(reinterpret_cast<__m128i *>(p0 + i), planes[0]);
        _mm_storeu_si128(reinterpret_cast<__m128i *>(p1 + i), planes[1]);
        _mm_storeu_si128(reinterpret_cast<__m128i *>(p2 + i), planes[2]);
        _mm_storeu_si128(reinterpret_cast<__m128i *>(p3 + i), planes[3]);
    }
#endif
    for (; i < n; i++) {
        p0[i] = raw[kStride * i + 0];
        p1[i] = raw[kStride * i + 1];
        p2[i] = raw[kStride * i + 2];
        p3[i] = raw[kStride * i + 3];
    }
}

// A 1-D contiguous buffer of bytes (writable when asked: a read-only one is refused by the request).
py::buffer_info bytes_of(const py::buffer & b, const char * what, bool writable = false) {
    py::buffer_info info = b.request(writable);
    if (info.ndim != 1 || info.itemsize != 1 || info.strides[0] != 1 || (writable && info.readonly)) {
        throw py::value_error(std::string(what) + (writable ? ": a writable" : ": a") +
                              " contiguous buffer of bytes is wanted");
    }
    return info;
}

}  // namespace

PYBIND11_MODULE(_planes, m) {
    m.doc() = "f32 byte planes (storage.chunks.codec): split a state's bytes into planes and put them back";

    m.def(
        "split",
        [](const py::buffer & raw, size_t n) {
            py::buffer_info in = bytes_of(raw, "raw");
            if (static_cast<size_t>(in.size) < kStride * n) {
                throw py::value_error("raw holds fewer than " + std::to_string(n) + " floats");
            }
            py::bytes out(nullptr, kStride * n);
            uint8_t * dst = reinterpret_cast<uint8_t *>(PyBytes_AS_STRING(out.ptr()));
            const uint8_t * src = static_cast<const uint8_t *>(in.ptr);
            {
                py::gil_scoped_release free;
                split4(dst, src, n);
            }
            return out;
        },
        py::arg("raw"), py::arg("n"),
        "The first 4n bytes of raw as four planes back to back: byte k of float i at k*n + i.");

    m.def(
        "interleave",
        [](const py::buffer & out, const py::buffer & p0, const py::buffer & p1, const py::buffer & p2,
           const py::buffer & p3) {
            py::buffer_info o = bytes_of(out, "out", true);
            const size_t n = static_cast<size_t>(o.size) / kStride;
            py::buffer_info planes[kStride] = {bytes_of(p0, "plane 0"), bytes_of(p1, "plane 1"),
                                               bytes_of(p2, "plane 2"), bytes_of(p3, "plane 3")};
            for (size_t k = 0; k < kStride; k++) {
                if (static_cast<size_t>(planes[k].size) != n) {
                    throw py::value_error("plane " + std::to_string(k) + " is " + std::to_string(planes[k].size) +
                                          " bytes, not " + std::to_string(n));
                }
            }
            {
                py::gil_scoped_release free;
                interleave4(static_cast<uint8_t *>(o.ptr), static_cast<const uint8_t *>(planes[0].ptr),
                            static_cast<const uint8_t *>(planes[1].ptr), static_cast<const uint8_t *>(planes[2].ptr),
                            static_cast<const uint8_t *>(planes[3].ptr), n);
            }
        },
        py::arg("out"), py::arg("p0"), py::arg("p1"), py::arg("p2"), py::arg("p3"),
        "Byte k of float i of out from plane k (each len(out) // 4 bytes): the first 4 * (len(out) // 4) bytes.");
}
