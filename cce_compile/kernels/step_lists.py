"""Filtered mode's work lists: which d-logits tiles each backward step computes, and the
orders its two block-sparse GEMMs walk them in (ops/filtering.StepLists)."""

import triton
import triton.language as tl


@triton.jit
def step_lists_kernel(
    mask_ptr, step_bounds_ptr, bounds_stride, step_tiles_ptr, step_counts_ptr, de_begin_ptr, de_count_ptr,
    de_slots_ptr, de_cols_ptr, dc_begin_ptr, dc_count_ptr, dc_rows_ptr,
    n_steps, rows, cols, capacity,
    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """One program per (token chunk, step): the step's tile columns [first, end) from
    step_bounds [chunk, n_steps + 1] (int32, rows bounds_stride apart), its kept tiles from mask
    [chunk, tile row, tile column] (int8). A step's kept tiles take slots in column-major
    order; each tile row's entries for the dE GEMM follow its first entry in column order.
    Two passes over BLOCK_C columns at a time: the kept tiles per tile row (where each row's
    entries begin), then the lists, whose positions are prefix sums across the block.

    Writes, all int32: per slot, step_tiles (column * rows + row) and dc_rows (row); per entry,
    de_slots and de_cols; per tile row, de_begin and de_count; per column, dc_begin (its
    first slot) and dc_count; step_counts. Entries past a count are left as they are.
    """
    program = tl.program_id(0)  # chunk * n_steps + step
    chunk = program // n_steps
    bounds = step_bounds_ptr + chunk * bounds_stride + program - chunk * n_steps
    first = tl.load(bounds)
    end = tl.load(bounds + 1)
    tile_rows = tl.arange(0, BLOCK_R)
    row_ok = tile_rows < rows
    chunk_mask = mask_ptr + chunk.to(tl.int64) * rows * cols

    row_count = tl.zeros((BLOCK_R,), dtype=tl.int32)
    for start in range(first, end, BLOCK_C):
        columns = start + tl.arange(0, BLOCK_C)
        inside = (columns < end)[:, None] & row_ok[None, :]
        kept = tl.load(chunk_mask + tile_rows[None, :] * cols + columns[:, None], mask=inside, other=0).to(tl.int32)
        row_count += tl.sum(kept, axis=0)
    de_begin = tl.cumsum(row_count, axis=0) - row_count
    tl.store(de_begin_ptr + program * rows + tile_rows, de_begin, mask=row_ok)
    tl.store(de_count_ptr + program * rows + tile_rows, row_count, mask=row_ok)

    lists = program.to(tl.int64) * capacity
    slot_start = first * 0  # the step's kept tiles before this block of columns
    row_seen = tl.zeros((BLOCK_R,), dtype=tl.int32)  # each row's entries before this block
    for start in range(first, end, BLOCK_C):
        columns = start + tl.arange(0, BLOCK_C)
        in_step = columns < end
        inside = in_step[:, None] & row_ok[None, :]
        kept = tl.load(chunk_mask + tile_rows[None, :] * cols + columns[:, None], mask=inside, other=0).to(tl.int32)
        is_kept = kept > 0
        column_count = tl.sum(kept, axis=1)
        column_begin = slot_start + tl.cumsum(column_count, axis=0) - column_count
        tl.store(dc_begin_ptr + chunk * cols + columns, column_begin, mask=in_step)
        tl.store(dc_count_ptr + chunk * cols + columns, column_count, mask=in_step)
        slot = column_begin[:, None] + tl.cumsum(kept, axis=1) - kept
        tl.store(step_tiles_ptr + lists + slot, columns[:, None] * rows + tile_rows[None, :], mask=is_kept)
        tl.store(dc_rows_ptr + lists + slot, tl.broadcast_to(tile_rows[None, :], (BLOCK_C, BLOCK_R)), mask=is_kept)
        entry = (de_begin + row_seen)[None, :] + tl.cumsum(kept, axis=0) - kept
        tl.store(de_slots_ptr + lists + entry, slot, mask=is_kept)
        tl.store(de_cols_ptr + lists + entry, tl.broadcast_to(columns[:, None], (BLOCK_C, BLOCK_R)), mask=is_kept)
        row_seen += tl.sum(kept, axis=0)
        slot_start += tl.sum(column_count, axis=0)
    tl.store(step_counts_ptr + program, slot_start)
