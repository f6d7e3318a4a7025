// How the CPU prefill kernels split a step over threads: each sequence's keys and values are packed per KV
// head first (tasks of a few units of keys), then (sequence, KV head, query rows) items attend, the longest
// (the last rows) first so that dynamic scheduling ends evenly. A kernel supplies its packing and its item.
#pragma once
#include <cstdint>
#include <vector>

namespace prefill_schedule {

// The work elements the packed heads of every sequence take: each KV head's K elements and as many V elements,
// `head_size(len)` apiece for a sequence of `len` tokens (whole units of keys).
template <typename HeadSize>
int64_t packed_size(const int32_t *seq_lens, int batch, int num_kv_heads, HeadSize head_size) {
    int64_t total = 0;
    for (int b = 0; b < batch; ++b) total += head_size(seq_lens[b]) * 2 * num_kv_heads;
    return total;
}

// Where those elements sit in the work buffer: every sequence's KV heads one after another, a head's K then its V.
template <typename T>
class PackedHeads {
  public:
    template <typename HeadSize>
    PackedHeads(T *work, const int32_t *seq_lens, int batch, int num_kv_heads, HeadSize head_size)
        : work_(work), size_(batch), base_(batch) {
        int64_t at = 0;
        for (int b = 0; b < batch; ++b) {
            size_[b] = head_size(seq_lens[b]);
            base_[b] = at;
            at += size_[b] * 2 * num_kv_heads;
        }
    }
    T *keys(int b, int h) const { return work_ + base_[b] + (int64_t)h * size_[b] * 2; }
    T *values(int b, int h) const { return keys(b, h) + size_[b]; }

  private:
    T *work_;
    std::vector<int64_t> size_, base_;
};

// pack(b, h, unit_begin, unit_end): units of `unit_keys` keys of sequence b's KV head h, [unit_begin, unit_end);
// attend(b, h, r0, rows): rows [r0, r0 + rows) of sequence b's new tokens with KV head h.
template <typename Pack, typename Attend>
void run(const int32_t *seq_lens, const int32_t *query_start_loc, int batch, int num_kv_heads, int rows_per_item,
         int64_t unit_keys, int64_t units_per_task, int num_threads, Pack pack, Attend attend) {
    int64_t item_base[batch + 1];   // each sequence's first item
    item_base[0] = 0;
    for (int b = 0; b < batch; ++b) {
        const int64_t q_len = query_start_loc[b + 1] - query_start_loc[b];
        item_base[b + 1] = item_base[b] + num_kv_heads * ((q_len + rows_per_item - 1) / rows_per_item);
    }
#pragma omp parallel num_threads(num_threads)
    {
        for (int b = 0; b < batch; ++b) {
            const int64_t units = (seq_lens[b] + unit_keys - 1) / unit_keys;
            const int64_t tasks = num_kv_heads * ((units + units_per_task - 1) / units_per_task);
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t task = 0; task < tasks; ++task) {
                const int64_t u0 = task / num_kv_heads * units_per_task;
                pack(b, (int)(task % num_kv_heads), u0, u0 + units_per_task < units ? u0 + units_per_task : units);
            }
        }
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
        for (int64_t rev = 0; rev < item_base[batch]; ++rev) {
            const int64_t item = item_base[batch] - 1 - rev;
            int b = 0;
            while (item >= item_base[b + 1]) ++b;
            const int64_t local = item - item_base[b];
            const int64_t r0 = local / num_kv_heads * rows_per_item;
            const int64_t q_len = query_start_loc[b + 1] - query_start_loc[b];
            attend(b, (int)(local % num_kv_heads), r0, (int)(q_len - r0 < rows_per_item ? q_len - r0 : rows_per_item));
        }
    }
}

}  // namespace prefill_schedule
