// Weights placed on huge pages: an open's evaluated weights moved into buffers whose memory the
// kernel backs with 2 MiB pages (Linux transparent huge pages, asked for with madvise).
//
// A decode step streams every weight once. On 4 KiB pages that is a TLB miss (and a page walk)
// every 4 KiB, and the hardware prefetchers stop at each page's end; weights that MLX read from
// the file one buffer at a time sit on scattered small pages. On Zen 4 (2 cores, THP "madvise"),
// the weights moved onto huge pages decoded Gemma 3 270M and SmolLM2-135M 10-13% faster.
#include "placement.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <unordered_map>
#include <unordered_set>

#if defined(__linux__)
#include <malloc.h>
#include <sys/mman.h>
#endif

namespace tsq {
namespace {

constexpr int64_t kAlign = 64;                   // each buffer starts on a cache line
constexpr int64_t kHugePage = int64_t(2) << 20;  // a transparent huge page on x86-64 and aarch64 (4 KiB granule)
constexpr int64_t kSegment = int64_t(64) << 20;  // the new buffer, allocated this much at a time

int64_t padded(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// The whole pages inside [lo, hi) of an old buffer, copied and never read again, handed back
// before the buffer is freed (a buffer larger than a batch would otherwise be held twice).
void drop_pages(const char* lo, const char* hi) {
#if defined(__linux__)
  const uintptr_t page = 4096, a = (reinterpret_cast<uintptr_t>(lo) + page - 1) / page * page,
                  b = reinterpret_cast<uintptr_t>(hi) / page * page;
  if (b > a) madvise(reinterpret_cast<void*>(a), b - a, MADV_DONTNEED);
#endif
}

// Freed buffers back to the system: MLX's cache, and malloc's heap (where small buffers live)
void release_freed() {
  mx::clear_cache();
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

// Room for `capacity` bytes of arrays in an MLX buffer, starting on a huge page's boundary and
// advised onto huge pages; arrays are taken a cache line apart.
class Segment {
 public:
  explicit Segment(int64_t capacity)
      : buffer(mx::allocator::malloc((size_t)(rows(capacity) * kHugePage)), {(int)rows(capacity), (int)kHugePage},
               mx::uint8) {
    const auto raw = reinterpret_cast<uintptr_t>(buffer.data<char>());
    at_ = (int64_t)((kHugePage - raw % kHugePage) % kHugePage);
    end_ = at_ + (rows(capacity) - 1) * kHugePage;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    // advice only: where the kernel has no huge page to give (THP "never", memory fragmented) the
    // pages are small, as MLX's own would be
    madvise(base() + at_, (size_t)(end_ - at_), MADV_HUGEPAGE);
#endif
  }
  bool fits(int64_t bytes) const { return at_ + padded(bytes) <= end_; }
  char* take(int64_t bytes) {
    char* p = base() + at_;
    at_ += padded(bytes);
    return p;
  }
  char* base() { return buffer.data<char>(); }

  mx::array buffer;

 private:
  // the capacity as rows of one huge page (an array's dimensions are 32-bit), and one more to align
  static int64_t rows(int64_t capacity) { return (capacity + kHugePage - 1) / kHugePage + 1; }
  int64_t at_ = 0, end_ = 0;
};

// The arrays that read one buffer (an array and its views): the bytes [lo, hi) they span.
struct Shared {
  std::vector<mx::array> arrays;
  const char* lo = nullptr;
  const char* hi = nullptr;
  bool dense = true;  // every one a dense run of elements
};

// The buffers that can move, in the order first seen: evaluated, read only through the arrays
// given (a buffer some other array also reads would stay, held twice), each array one dense run.
std::vector<Shared> movable_buffers(const std::vector<mx::array>& arrays) {
  std::vector<Shared> out;
  std::unordered_map<const void*, size_t> index;
  std::unordered_set<std::uintptr_t> seen;
  for (const auto& a : arrays) {
    if (!a.is_available() || a.data_shared_ptr() == nullptr || a.nbytes() == 0 || !seen.insert(a.id()).second) continue;
    auto [it, fresh] = index.try_emplace(a.data_shared_ptr().get(), out.size());
    if (fresh) out.emplace_back();
    Shared& s = out[it->second];
    const char* p = a.data<char>();
    const char* e = p + a.data_size() * a.itemsize();
    s.lo = s.arrays.empty() ? p : std::min(s.lo, p);
    s.hi = s.arrays.empty() ? e : std::max(s.hi, e);
    s.dense = s.dense && a.flags().row_contiguous;
    s.arrays.push_back(a);
  }
  std::erase_if(out, [](const Shared& s) {
    if (!s.dense || (long)s.arrays.size() != s.arrays[0].data_shared_ptr().use_count()) return true;
    // each array's place in the copy must be a whole number of its elements from the buffer's start
    return std::any_of(s.arrays.begin(), s.arrays.end(),
                       [&](const mx::array& a) { return (a.data<char>() - s.lo) % (int64_t)a.itemsize() != 0; });
  });
  return out;
}

}  // namespace

Placed place_on_huge_pages(std::vector<mx::array> arrays, int64_t batch_bytes, double budget_seconds,
                           int64_t min_bytes, Pool& pool) {
  mx::synchronize(mx::default_stream(mx::Device::cpu));  // no task still reads an old buffer
  std::vector<Shared> buffers = movable_buffers(arrays);
  arrays.clear();
  int64_t left = 0, movable = 0;  // padded bytes still to move; bytes that can move
  for (const auto& s : buffers) {
    left += padded(s.hi - s.lo);
    movable += s.hi - s.lo;
  }
  if (movable < min_bytes) return {0, movable, 0.0};
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  // Faulting the new pages in is the move's cost: a fraction of a millisecond a huge page on most
  // machines, but ~10 ms in a virtual machine whose host backs the guest's free memory lazily. So
  // the largest buffers (whose pages gain the most) go first, and once budget_seconds (> 0) have
  // passed no further buffer starts after the first: the rest stay where they are (a buffer's
  // arrays move together). The new buffer is allocated a segment at a time, each filled first fit,
  // so a move the budget stops leaves little unused room (which MLX counts as allocated).
  std::stable_sort(buffers.begin(), buffers.end(),
                   [](const Shared& a, const Shared& b) { return a.hi - a.lo > b.hi - b.lo; });
  std::vector<Segment> segments;
  int64_t moved = 0, since_release = 0;
  for (auto& s : buffers) {
    if (budget_seconds > 0 && moved > 0 && elapsed() > budget_seconds) break;
    const int64_t bytes = s.hi - s.lo;
    // the first segment with room (smaller buffers fill what larger ones left), else a new one
    auto segment = std::find_if(segments.begin(), segments.end(), [&](const Segment& g) { return g.fits(bytes); });
    if (segment == segments.end()) {
      try {
        segments.emplace_back(std::max(padded(bytes), std::min(kSegment, left)));
      } catch (const std::exception&) {
        break;  // no memory for another segment: the rest stay where they are
      }
      segment = segments.end() - 1;
    }
    char* const to = segment->take(bytes);
    left -= padded(bytes);
    // a huge page at a time over the pool's threads: the copy is what faults the new pages in, and
    // the threads fault theirs side by side
    for (int64_t done = 0; done < bytes;) {
      const int64_t n = std::min(bytes - done, batch_bytes);
      pool.run((n + kHugePage - 1) / kHugePage, [&](int64_t i) {
        const int64_t off = done + i * kHugePage;
        std::memcpy(to + off, s.lo + off, (size_t)std::min(kHugePage, done + n - off));
      });
      done += n;
      drop_pages(s.lo + done - n, s.lo + done);  // copied: a large buffer's old pages go as it moves
    }
    for (auto& a : s.arrays) {
      const int64_t offset = (to - segment->base()) + (a.data<char>() - s.lo);
      a.copy_shared_buffer(segment->buffer, a.strides(), a.flags(), a.data_size(), offset / (int64_t)a.itemsize());
    }
    s.arrays.clear();  // the last holder of the old buffer gone: MLX frees it
    moved += bytes;
    // a batch at a time the freed buffers go back to the system: the open holds at most one twice
    if ((since_release += bytes) >= batch_bytes) {
      release_freed();
      since_release = 0;
    }
  }
  release_freed();
  return {moved, movable, elapsed()};
}

}  // namespace tsq
