#pragma once

#include <cstdint>
#include <vector>

#include "mlx/mlx.h"
#include "pool.h"

namespace tsq {

namespace mx = mlx::core;

// What a move did: the bytes moved of those that could move, and the seconds it took.
struct Placed {
  int64_t bytes = 0, movable = 0;
  double seconds = 0.0;
};

// Move the evaluated `arrays` into new buffers, on transparent huge pages where the kernel gives
// them (Linux), unless less than min_bytes could move: each buffer that only these arrays read (an array and its views), dense, is
// copied once (over `pool`'s threads) and its arrays read the copy. They keep their identity (every
// holder, a compiled graph's included, sees the moved data); the old buffers are freed, batch_bytes
// at a time handed back to the system. Arrays not evaluated, and buffers other arrays read too, stay.
// The largest buffers go first; once budget_seconds (> 0) have passed no further one starts
// (the first always does).
Placed place_on_huge_pages(std::vector<mx::array> arrays, int64_t batch_bytes, double budget_seconds,
                           int64_t min_bytes, Pool& pool);

}  // namespace tsq
