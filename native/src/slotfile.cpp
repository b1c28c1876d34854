#include "slotfile.h"

#include "errors.h"
#include "hash.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>

#include <cerrno>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef SK_ENGINE_VERSION
#define SK_ENGINE_VERSION "0.1.0"
#endif
#ifndef SK_LLAMA_BUILD
#define SK_LLAMA_BUILD "unknown"
#endif

namespace sk {

FileBytes FileBytes::map_or_read(int fd, uint64_t size, const std::string & path) {
    FileBytes out;
    out.size_ = size_t(size);
    // MAP_PRIVATE: the state prefix written in place never reaches the file, and only the page it
    // is written to becomes this process's own copy; every other page stays the page cache's,
    // shared and reclaimable. No MAP_POPULATE: on a private writable mapping it copies every page
    // (the whole file in anonymous memory, beside the state restored from it); the kernel reads
    // ahead instead (MADV_WILLNEED) and the CRC pass faults the pages in, read-only.
    void * m = ::mmap(nullptr, out.size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    if (m != MAP_FAILED) {
        ::madvise(m, out.size_, MADV_WILLNEED);  // advice only: a refusal changes nothing
        out.data_ = static_cast<uint8_t *>(m);
        out.mapped_ = true;
        return out;
    }
    // Out of mappings or address space (ENOMEM), or a file system that cannot map: read it.
    out.copy_.resize(out.size_);
    for (size_t done = 0; done < out.size_;) {
        const ssize_t got = ::pread(fd, out.copy_.data() + done, out.size_ - done, off_t(done));
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) throw SlotFileError("io", "cannot read " + path + ": " + std::strerror(errno));
        if (got == 0) throw SlotFileError("truncated", "slot file shrank while being read");
        done += size_t(got);
    }
    out.data_ = out.copy_.data();
    return out;
}

FileBytes::~FileBytes() {
    if (mapped_) ::munmap(data_, size_);
}

FileBytes::FileBytes(FileBytes && o) noexcept
    : data_(o.data_), size_(o.size_), mapped_(o.mapped_), copy_(std::move(o.copy_)) {
    if (!mapped_) data_ = copy_.data();
    o.data_ = nullptr;
    o.size_ = 0;
    o.mapped_ = false;
}

FileBytes & FileBytes::operator=(FileBytes && o) noexcept {
    if (this != &o) {
        if (mapped_) ::munmap(data_, size_);
        mapped_ = o.mapped_;
        size_ = o.size_;
        copy_ = std::move(o.copy_);
        data_ = mapped_ ? o.data_ : copy_.data();
        o.data_ = nullptr;
        o.size_ = 0;
        o.mapped_ = false;
    }
    return *this;
}

namespace {

constexpr uint32_t kGgsq = 0x67677371;       // 'ggsq', llama.cpp's sequence state file magic
constexpr uint32_t kSckp = 0x504B4353;       // bytes "SCKP"
constexpr uint32_t kSkmd = 0x444D4B53;       // bytes "SKMD"
constexpr uint32_t kStatePrefixMagic = 0xaf143cd8;  // llama.cpp's in-memory sequence state magic
constexpr char kTrailerMagic[8] = {'S', 'L', 'O', 'T', 'K', 'E', 'E', 'P'};
constexpr uint16_t kFormatMajor = 1;
constexpr uint16_t kFormatMinor = 0;
constexpr size_t kTrailerSize = 64;
constexpr uint32_t kTagMeta = 1;
constexpr uint32_t kTagLastLogits = 2;
constexpr uint32_t kTagCkptLogits = 3;

struct FileCloser {
    void operator()(FILE * f) const { std::fclose(f); }
};

// Sequential writer that keeps the running CRC and offset of what it wrote.
class Writer {
public:
    explicit Writer(FILE * f) : f_(f) {}
    void raw(const void * p, size_t n) {
        if (n == 0) return;
        if (std::fwrite(p, 1, n, f_) != n) throw SlotFileError("io", "write failed (disk full?)");
        crc_ = crc32_update(crc_, p, n);
        pos_ += n;
    }
    template <typename T> void put(T v) { raw(&v, sizeof(v)); }
    void blob(const void * p, uint64_t n) { put<uint64_t>(n); raw(p, n); }
    uint64_t pos() const { return pos_; }
    uint32_t crc() const { return crc_; }

private:
    FILE * f_;
    uint32_t crc_ = 0;
    uint64_t pos_ = 0;
};

std::string json_escape(const std::string & s) {
    std::string out;
    for (unsigned char c : s) {
        switch (c) {
            case '"': out += "\\\""; break;
            case '\\': out += "\\\\"; break;
            case '\n': out += "\\n"; break;
            case '\t': out += "\\t"; break;
            case '\r': out += "\\r"; break;
            default:
                if (c < 0x20) {
                    char buf[8];
                    std::snprintf(buf, sizeof(buf), "\\u%04x", c);
                    out += buf;
                } else {
                    out.push_back(char(c));
                }
        }
    }
    return out;
}

std::string meta_json(const SlotFileMeta & m, size_t n_tokens, const std::vector<Checkpoint> & ckpts) {
    const ModelIdentity & id = m.model;
    const double now =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    std::ostringstream o;
    o.precision(17);
    o << "{\"format\":1,\"engine_version\":\"" << SK_ENGINE_VERSION << "\",\"created\":" << now
      << ",\"n_tokens\":" << n_tokens << ",\"source_slot\":" << m.source_slot << ",\"model\":{\"fingerprint\":\""
      << json_escape(id.fingerprint) << "\",\"arch\":\"" << json_escape(id.arch) << "\",\"n_vocab\":" << id.n_vocab
      << ",\"n_embd\":" << id.n_embd << ",\"n_layer\":" << id.n_layer
      << ",\"recurrent\":" << (id.recurrent ? "true" : "false") << ",\"hybrid\":" << (id.hybrid ? "true" : "false")
      << ",\"n_swa\":" << id.n_swa << "},\"llama\":{\"state_seq_version\":" << LLAMA_STATE_SEQ_VERSION
      << ",\"build\":\"" << json_escape(SK_LLAMA_BUILD) << "\"},\"context\":{\"n_ctx\":" << m.n_ctx
      << ",\"n_slots\":" << m.n_slots << ",\"n_ctx_slot\":" << m.n_ctx_slot
      << ",\"kv_unified\":true,\"type_k\":\"" << json_escape(m.type_k)
      << "\",\"type_v\":\"" << json_escape(m.type_v) << "\",\"swa_full\":" << (m.swa_full ? "true" : "false")
      << ",\"flash_attn\":" << (m.flash_attn ? "true" : "false")
      << "},\"checkpoints\":[";
    for (size_t i = 0; i < ckpts.size(); i++) {
        if (i) o << ",";
        o << "{\"n_tokens\":" << ckpts[i].n_tokens << ",\"kind\":\"" << checkpoint_kind_name(ckpts[i].kind)
          << "\",\"bytes\":" << ckpts[i].state.size() << "}";
    }
    o << "]}";
    return o.str();
}

// The value of a string field in a flat JSON document we wrote ourselves ("" when absent).
std::string json_string_field(const std::string & doc, const std::string & key) {
    const std::string needle = "\"" + key + "\"";
    size_t i = doc.find(needle);
    if (i == std::string::npos) return "";
    i += needle.size();
    while (i < doc.size() && (doc[i] == ' ' || doc[i] == ':')) i++;
    if (i >= doc.size() || doc[i] != '"') return "";
    const size_t end = doc.find('"', i + 1);
    return end == std::string::npos ? "" : doc.substr(i + 1, end - i - 1);
}

std::vector<std::pair<std::string, CheckpointKind>> checkpoint_kinds(const std::string & doc) {
    std::vector<std::pair<std::string, CheckpointKind>> out;
    size_t i = 0;
    while ((i = doc.find("\"kind\"", i)) != std::string::npos) {
        i += 6;
        while (i < doc.size() && (doc[i] == ' ' || doc[i] == ':')) i++;
        if (i >= doc.size() || doc[i] != '"') continue;
        const size_t end = doc.find('"', i + 1);
        if (end == std::string::npos) break;
        const std::string name = doc.substr(i + 1, end - i - 1);
        out.emplace_back(name, checkpoint_kind_from_name(name));
        i = end;
    }
    return out;
}

// Bounds-checked cursor over the in-memory body: every read states what it reads so the error
// names the field.
class Cursor {
public:
    Cursor(const uint8_t * base, size_t begin, size_t end) : base_(base), pos_(begin), end_(end) {}
    void need(uint64_t n, const char * what) const {
        if (n > end_ - pos_) {
            throw SlotFileError("truncated", std::string("slot file truncated: ") + what + " needs " + std::to_string(n) +
                                                 " bytes, " + std::to_string(end_ - pos_) + " left in its section");
        }
    }
    template <typename T> T get(const char * what) {
        need(sizeof(T), what);
        T v;
        std::memcpy(&v, base_ + pos_, sizeof(T));
        pos_ += sizeof(T);
        return v;
    }
    const uint8_t * take(uint64_t n, const char * what) {
        need(n, what);
        const uint8_t * p = base_ + pos_;
        pos_ += size_t(n);
        return p;
    }
    size_t pos() const { return pos_; }
    size_t left() const { return end_ - pos_; }

private:
    const uint8_t * base_;
    size_t pos_;
    size_t end_;
};

// A Slotkeeper section (the records, the checkpoints) opens with its magic, version 1 and an entry
// count. No entry is smaller than min_entry_bytes, so a count that cannot fit is refused up front.
struct SectionHeader {
    uint32_t magic;
    const char * name;        // in errors: "<name> magic 'SCKP' missing", "<name> version 2"
    const char * magic_text;
    const char * entry;       // "<entry> count larger than the section"
    uint64_t min_entry_bytes;
};
constexpr SectionHeader kRecordsHeader{kSkmd, "slotkeeper section", "'SKMD'", "record", 16};  // tag, flags, length
constexpr SectionHeader kCheckpointsHeader{kSckp, "checkpoint section", "'SCKP'", "checkpoint", 40};  // n_tokens, pos range, 3 lengths

// Reads the header `h` at the cursor; returns its entry count.
uint32_t read_section_header(Cursor & c, const SectionHeader & h) {
    const std::string name = h.name;
    const std::string entry = h.entry;
    if (c.get<uint32_t>((name + " magic").c_str()) != h.magic) {
        throw SlotFileError("bad_magic", name + " magic " + h.magic_text + " missing");
    }
    const uint32_t version = c.get<uint32_t>((name + " version").c_str());
    if (version != 1) throw SlotFileError("unsupported_version", name + " version " + std::to_string(version));
    const uint32_t count = c.get<uint32_t>((entry + " count").c_str());
    if (uint64_t(count) * h.min_entry_bytes > c.left()) throw SlotFileError("truncated", entry + " count larger than the section");
    return count;
}

}  // namespace

const char * checkpoint_kind_name(CheckpointKind k) {
    switch (k) {
        case CheckpointKind::PromptEnd: return "prompt_end";
        case CheckpointKind::Hint: return "hint";
        case CheckpointKind::Interval: return "interval";
    }
    return "interval";
}

CheckpointKind checkpoint_kind_from_name(const std::string & s) {
    if (s == "prompt_end") return CheckpointKind::PromptEnd;
    if (s == "hint") return CheckpointKind::Hint;
    return CheckpointKind::Interval;
}

uint64_t write_slot_file(const std::string & path, const SlotFileMeta & meta, const std::vector<llama_token> & tokens,
                         const std::vector<ByteSpan> & memory_state, const std::vector<float> & last_logits,
                         const std::vector<Checkpoint> & checkpoints, bool durable) {
    const std::string tmp = path + ".tmp." + std::to_string(::getpid());
    {
        std::unique_ptr<FILE, FileCloser> f(std::fopen(tmp.c_str(), "wb"));
        if (!f) throw SlotFileError("io", "cannot create " + tmp + ": " + std::strerror(errno));
        std::setvbuf(f.get(), nullptr, _IOFBF, 1 << 20);
        Writer w(f.get());
        try {
            // 1. base payload, byte for byte what llama_state_seq_save_file writes
            w.put<uint32_t>(kGgsq);
            w.put<uint32_t>(LLAMA_STATE_SEQ_VERSION);
            w.put<uint32_t>(uint32_t(tokens.size()));
            w.raw(tokens.data(), tokens.size() * sizeof(llama_token));
            for (const ByteSpan & part : memory_state) w.raw(part.data, part.size);
            const uint64_t base_len = w.pos();

            // 2. checkpoints
            uint64_t ckpt_off = 0;
            uint64_t ckpt_len = 0;
            if (!checkpoints.empty()) {
                ckpt_off = w.pos();
                w.put<uint32_t>(kSckp);
                w.put<uint32_t>(1);
                w.put<uint32_t>(uint32_t(checkpoints.size()));
                for (const auto & c : checkpoints) {
                    w.put<int64_t>(c.n_tokens);
                    w.put<int32_t>(c.pos_min);
                    w.put<int32_t>(c.pos_max);
                    w.blob(c.state.data(), c.state.size());
                    w.put<uint64_t>(0);  // draft state
                    w.put<uint64_t>(0);  // speculative state
                }
                ckpt_len = w.pos() - ckpt_off;
            }

            // 3. slotkeeper records
            const uint64_t meta_off = w.pos();
            uint32_t n_records = 1 + (last_logits.empty() ? 0 : 1);
            for (const auto & c : checkpoints) n_records += c.logits.empty() ? 0 : 1;
            w.put<uint32_t>(kSkmd);
            w.put<uint32_t>(1);
            w.put<uint32_t>(n_records);
            const std::string doc = meta_json(meta, tokens.size(), checkpoints);
            w.put<uint32_t>(kTagMeta);
            w.put<uint32_t>(0);
            w.blob(doc.data(), doc.size());
            if (!last_logits.empty()) {
                w.put<uint32_t>(kTagLastLogits);
                w.put<uint32_t>(0);
                w.blob(last_logits.data(), last_logits.size() * sizeof(float));
            }
            for (size_t i = 0; i < checkpoints.size(); i++) {
                const auto & lg = checkpoints[i].logits;
                if (lg.empty()) continue;
                w.put<uint32_t>(kTagCkptLogits);
                w.put<uint32_t>(0);
                w.put<uint64_t>(4 + lg.size() * sizeof(float));
                w.put<uint32_t>(uint32_t(i));
                w.raw(lg.data(), lg.size() * sizeof(float));
            }
            const uint64_t meta_len = w.pos() - meta_off;

            // 4. trailer
            uint8_t tr[kTrailerSize] = {};
            std::memcpy(tr, kTrailerMagic, 8);
            std::memcpy(tr + 8, &kFormatMajor, 2);
            std::memcpy(tr + 10, &kFormatMinor, 2);
            std::memcpy(tr + 16, &base_len, 8);
            std::memcpy(tr + 24, &ckpt_off, 8);
            std::memcpy(tr + 32, &ckpt_len, 8);
            std::memcpy(tr + 40, &meta_off, 8);
            std::memcpy(tr + 48, &meta_len, 8);
            const uint32_t body_crc = w.crc();
            std::memcpy(tr + 56, &body_crc, 4);
            const uint32_t tr_crc = crc32_update(0, tr, 60);
            std::memcpy(tr + 60, &tr_crc, 4);
            w.raw(tr, kTrailerSize);
            if (std::fflush(f.get()) != 0 || (durable && ::fsync(::fileno(f.get())) != 0)) {
                throw SlotFileError("io", "flush failed for " + tmp + ": " + std::strerror(errno));
            }
        } catch (...) {
            f.reset();
            std::remove(tmp.c_str());
            throw;
        }
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
        const std::string err = std::strerror(errno);
        std::remove(tmp.c_str());
        throw SlotFileError("io", "cannot rename " + tmp + " to " + path + ": " + err);
    }
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) throw SlotFileError("io", "cannot stat " + path);
    return uint64_t(st.st_size);
}

SlotImage read_slot_file(const std::string & path, const ReadLimits & lim) {
    std::unique_ptr<FILE, FileCloser> f(std::fopen(path.c_str(), "rb"));
    if (!f) throw SlotFileError("io", "cannot open slot file " + path + ": " + std::strerror(errno));
    struct stat st {};
    if (::fstat(::fileno(f.get()), &st) != 0 || !S_ISREG(st.st_mode)) {
        throw SlotFileError("io", "not a regular file: " + path);
    }
    const uint64_t size = uint64_t(st.st_size);
    if (size < kTrailerSize + 12) {
        throw SlotFileError("truncated", "slot file is " + std::to_string(size) + " bytes, smaller than a header and trailer");
    }
    if (lim.max_file_bytes > 0 && size > lim.max_file_bytes) {
        throw SlotFileError("too_large", "slot file is " + std::to_string(size) + " bytes, over the limit of " +
                                             std::to_string(lim.max_file_bytes));
    }

    // Trailer first: magic, its own CRC, version, then the layout.
    uint8_t tr[kTrailerSize];
    if (std::fseek(f.get(), long(size - kTrailerSize), SEEK_SET) != 0 ||
        std::fread(tr, 1, kTrailerSize, f.get()) != kTrailerSize) {
        throw SlotFileError("io", "cannot read the trailer of " + path);
    }
    if (std::memcmp(tr, kTrailerMagic, 8) != 0) {
        throw SlotFileError("bad_magic", "no slot file trailer (missing 'SLOTKEEP' magic at the end): truncated or not a slot file");
    }
    uint32_t tr_crc;
    std::memcpy(&tr_crc, tr + 60, 4);
    if (crc32_update(0, tr, 60) != tr_crc) throw SlotFileError("checksum_mismatch", "slot file trailer checksum mismatch");
    uint16_t major;
    std::memcpy(&major, tr + 8, 2);
    if (major != kFormatMajor) {
        throw SlotFileError("unsupported_version", "slot file format " + std::to_string(major) + ".x, this engine reads 1.x");
    }
    uint64_t base_len, ckpt_off, ckpt_len, meta_off, meta_len;
    uint32_t body_crc;
    std::memcpy(&base_len, tr + 16, 8);
    std::memcpy(&ckpt_off, tr + 24, 8);
    std::memcpy(&ckpt_len, tr + 32, 8);
    std::memcpy(&meta_off, tr + 40, 8);
    std::memcpy(&meta_len, tr + 48, 8);
    std::memcpy(&body_crc, tr + 56, 4);
    const uint64_t body = size - kTrailerSize;
    const bool has_ckpt = ckpt_len != 0;
    const bool layout_ok = base_len >= 12 && base_len <= body && meta_len <= body && meta_off <= body &&
                           meta_off + meta_len == body &&
                           (has_ckpt ? (ckpt_off == base_len && ckpt_len <= body - base_len && meta_off == ckpt_off + ckpt_len)
                                     : (ckpt_off == 0 && meta_off == base_len));
    if (!layout_ok) throw SlotFileError("bad_layout", "slot file sections are not contiguous or lie outside the file");

    // The whole file, mapped (or read where it cannot be), and the body checksummed.
    SlotImage img;
    img.file_size = size;
    img.bytes = FileBytes::map_or_read(::fileno(f.get()), size, path);
    if (crc32_update(0, img.bytes.data(), size_t(body)) != body_crc) {
        throw SlotFileError("checksum_mismatch", "slot file checksum mismatch: the file is damaged");
    }
    const uint8_t * b = img.bytes.data();

    // Base payload.
    Cursor base(b, 0, size_t(base_len));
    if (base.get<uint32_t>("base magic") != kGgsq) throw SlotFileError("bad_magic", "base payload is not a llama.cpp sequence state ('ggsq')");
    const uint32_t state_version = base.get<uint32_t>("state version");
    if (state_version != LLAMA_STATE_SEQ_VERSION) {
        throw SlotFileError("unsupported_version", "llama.cpp sequence state version " + std::to_string(state_version) +
                                                       ", this engine's llama.cpp reads version " +
                                                       std::to_string(LLAMA_STATE_SEQ_VERSION));
    }
    const uint32_t n_tokens = base.get<uint32_t>("token count");
    base.need(uint64_t(n_tokens) * sizeof(llama_token), "tokens");
    if (lim.n_ctx_slot > 0 && n_tokens > uint32_t(lim.n_ctx_slot)) {
        throw SlotFileError("too_large", "slot file holds " + std::to_string(n_tokens) + " tokens, the slot has room for " +
                                             std::to_string(lim.n_ctx_slot));
    }
    img.tokens.resize(n_tokens);
    std::memcpy(img.tokens.data(), base.take(uint64_t(n_tokens) * sizeof(llama_token), "tokens"),
                n_tokens * sizeof(llama_token));
    for (llama_token t : img.tokens) {
        if (t < 0 || (lim.n_vocab > 0 && t >= lim.n_vocab)) throw SlotFileError("model_mismatch", "slot file has a token outside this model's vocabulary");
    }
    // Write llama.cpp's in-memory prefix over the bytes just before the state (header/tokens, copied
    // out; at least 12 bytes precede the state: magic, version, token count).
    img.state_offset = base.pos() - 8;
    img.state_size = base.left() + 8;
    const int32_t any_seq = 0;
    std::memcpy(img.bytes.data() + img.state_offset, &kStatePrefixMagic, 4);
    std::memcpy(img.bytes.data() + img.state_offset + 4, &any_seq, 4);

    // Slotkeeper records: identity first, so a foreign file is named as such.
    Cursor md(b, size_t(meta_off), size_t(meta_off + meta_len));
    const uint32_t n_records = read_section_header(md, kRecordsHeader);
    std::string doc;
    std::vector<std::pair<uint32_t, std::vector<float>>> ckpt_logits;
    const uint64_t logits_bytes = uint64_t(lim.n_vocab) * sizeof(float);
    for (uint32_t r = 0; r < n_records; r++) {
        const uint32_t tag = md.get<uint32_t>("record tag");
        md.get<uint32_t>("record flags");
        const uint64_t len = md.get<uint64_t>("record length");
        const uint8_t * p = md.take(len, "record payload");
        if (tag == kTagMeta) {
            doc.assign(reinterpret_cast<const char *>(p), size_t(len));
        } else if (tag == kTagLastLogits) {
            if (len != logits_bytes) throw SlotFileError("model_mismatch", "stored logits do not match this model's vocabulary size");
            img.last_logits.resize(size_t(lim.n_vocab));
            std::memcpy(img.last_logits.data(), p, size_t(len));
        } else if (tag == kTagCkptLogits) {
            if (len != 4 + logits_bytes) throw SlotFileError("model_mismatch", "checkpoint logits do not match this model's vocabulary size");
            uint32_t idx;
            std::memcpy(&idx, p, 4);
            std::vector<float> lg(size_t(lim.n_vocab));
            std::memcpy(lg.data(), p + 4, size_t(logits_bytes));
            ckpt_logits.emplace_back(idx, std::move(lg));
        }  // unknown tags are skipped
    }
    img.fingerprint = json_string_field(doc, "fingerprint");
    if (img.fingerprint.empty()) throw SlotFileError("bad_layout", "slot file metadata has no model fingerprint");
    if (!lim.fingerprint.empty() && img.fingerprint != lim.fingerprint) {
        throw SlotFileError("model_mismatch", "slot file was written by another model (fingerprint " +
                                                  img.fingerprint.substr(0, 12) + ", this model " + lim.fingerprint.substr(0, 12) + ")");
    }
    // The KV types are part of the state's shape (llama.cpp would refuse the state too, with only a
    // log line to say why). Checked before anything is loaded, and named.
    if (!lim.type_k.empty() || !lim.type_v.empty()) {
        const std::string fk = json_string_field(doc, "type_k");
        const std::string fv = json_string_field(doc, "type_v");
        if (fk != lim.type_k || fv != lim.type_v) {
            throw SlotFileError("shape_mismatch", "slot file KV cache types are k=" + (fk.empty() ? "?" : fk) + " v=" +
                                                      (fv.empty() ? "?" : fv) + ", this engine's are k=" + lim.type_k +
                                                      " v=" + lim.type_v + " (-ctk/-ctv)");
        }
    }

    // Checkpoints.
    if (has_ckpt) {
        Cursor ck(b, size_t(ckpt_off), size_t(ckpt_off + ckpt_len));
        const uint32_t count = read_section_header(ck, kCheckpointsHeader);
        const auto kinds = checkpoint_kinds(doc);
        // Parse every entry (bounds), keep the newest max_checkpoints.
        const size_t first_kept = count > lim.max_checkpoints ? count - lim.max_checkpoints : 0;
        int64_t prev = 0;
        for (uint32_t i = 0; i < count; i++) {
            Checkpoint c;
            c.n_tokens = ck.get<int64_t>("checkpoint n_tokens");
            c.pos_min = ck.get<int32_t>("checkpoint pos_min");
            c.pos_max = ck.get<int32_t>("checkpoint pos_max");
            if (c.n_tokens <= prev || c.n_tokens > int64_t(n_tokens)) {
                throw SlotFileError("bad_layout", "checkpoint " + std::to_string(i) + " covers " + std::to_string(c.n_tokens) +
                                                      " tokens: not ascending or past the saved tokens");
            }
            prev = c.n_tokens;
            const uint64_t len = ck.get<uint64_t>("checkpoint state length");
            const uint8_t * p = ck.take(len, "checkpoint state");
            for (int extra = 0; extra < 2; extra++) ck.take(ck.get<uint64_t>("checkpoint draft/spec length"), "checkpoint draft/spec state");
            if (i < first_kept) continue;
            c.state.assign(p, p + len);
            if (i < kinds.size()) c.kind = kinds[i].second;
            for (auto & [idx, lg] : ckpt_logits) {
                if (idx == i) c.logits = std::move(lg);
            }
            img.checkpoints.push_back(std::move(c));
        }
        if (ck.left() != 0) throw SlotFileError("bad_layout", "checkpoint section has trailing bytes");
    }
    return img;
}

}  // namespace sk
