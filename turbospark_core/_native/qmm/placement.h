#pragma once

#include <cstdint>
#include <vector>

#include "mlx/mlx.h"
#include "pool.h"

namespace tsq {

namespace mx = mlx::core;

// Move the evaluated `arrays` into one new buffer, on transparent huge pages where the kernel
// gives them (Linux): each buffer that only these arrays read (an array and its views), dense, is
// copied once (over `pool`'s threads) and its arrays read the copy. They keep their identity (every
// holder, a compiled graph's included, sees the moved data); the old buffers are freed, batch_bytes
// at a time handed back to the system. Arrays not evaluated, and buffers other arrays read too, stay.
// Returns the bytes moved.
int64_t place_on_huge_pages(std::vector<mx::array> arrays, int64_t batch_bytes, Pool& pool);

}  // namespace tsq
