// Checksums used by slot files (CRC-32, zlib polynomial, the one S3 and Python's zlib speak) and
// the model fingerprint (SHA-256).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace sk {

uint32_t crc32_update(uint32_t crc, const void * data, size_t n);
// The portable slicing-by-8 implementation crc32_update uses where zlib is not linked.
uint32_t crc32_portable(uint32_t crc, const void * data, size_t n);

class Sha256 {
public:
    Sha256();
    void update(const void * data, size_t n);
    std::string hexdigest();  // finalises; call once

private:
    void block(const uint8_t * p);
    uint32_t h_[8];
    uint8_t buf_[64];
    size_t buf_len_ = 0;
    uint64_t total_ = 0;
};

}  // namespace sk
