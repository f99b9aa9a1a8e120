/* Byte copies of KV pages between two host caches mapped in one process.
 *
 * pd_copy_pages copies n pages of one layer, page src_ids[i] of the source to
 * page dst_ids[i] of the destination. Its one argument packs, as int64:
 * dst base, dst V offset, dst blocks, src base, src V offset, src blocks, page
 * bytes, n, parallel_from, then the n src_ids and the n dst_ids (one buffer, so
 * a call converts one argument). A layer is laid out [2, blocks, page]:
 * K page b at base + b * page_bytes, V page b at base + v_offset + b * page_bytes.
 * Consecutive pages on both sides are copied as one range. From parallel_from
 * bytes in all, the bytes are split evenly over the OpenMP threads (the runtime
 * torch runs its own copies on, so the two share one pool); below that, the
 * calling thread copies them all. Returns 1, copying nothing, when a page id is
 * outside its layer; 2 when out of memory; 0 otherwise.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

/* The bytes [begin, end) of the chunks (dst, src, bytes triples) laid end to end. */
static void copy_share(const int64_t *chunks, int64_t n, int64_t begin, int64_t end) {
    int64_t off = 0;
    for (int64_t i = 0; i < n && off < end; i++) {
        int64_t size = chunks[3 * i + 2];
        int64_t lo = begin > off ? begin : off;
        int64_t hi = end < off + size ? end : off + size;
        if (lo < hi)
            memcpy((char *)(intptr_t)chunks[3 * i] + (lo - off),
                   (const char *)(intptr_t)chunks[3 * i + 1] + (lo - off), (size_t)(hi - lo));
        off += size;
    }
}

static void copy_chunks(const int64_t *chunks, int64_t n, int64_t total, int64_t parallel_from) {
    if (total < parallel_from || omp_get_max_threads() < 2) {
        copy_share(chunks, n, 0, total);
        return;
    }
#pragma omp parallel
    {
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t begin = (total * t / nt) & ~(int64_t)63;
        int64_t end = t == nt - 1 ? total : (total * (t + 1) / nt) & ~(int64_t)63;
        copy_share(chunks, n, begin, end);
    }
}

int pd_copy_pages(const int64_t *args) {
    int64_t dst_base = args[0], dst_v_offset = args[1], dst_blocks = args[2];
    int64_t src_base = args[3], src_v_offset = args[4], src_blocks = args[5];
    int64_t page_bytes = args[6], n = args[7], parallel_from = args[8];
    const int64_t *src_ids = args + 9, *dst_ids = args + 9 + n;
    for (int64_t i = 0; i < n; i++)
        if (src_ids[i] < 0 || src_ids[i] >= src_blocks || dst_ids[i] < 0 || dst_ids[i] >= dst_blocks)
            return 1;
    int64_t local[3 * 2 * 8];
    int64_t *chunks = n <= 8 ? local : malloc(sizeof(int64_t) * 3 * 2 * (size_t)n);
    if (chunks == NULL)
        return 2;
    int64_t runs = 0;
    for (int64_t i = 0; i < n;) {
        int64_t len = 1;
        while (i + len < n && src_ids[i + len] == src_ids[i] + len && dst_ids[i + len] == dst_ids[i] + len)
            len++;
        int64_t dst = dst_base + dst_ids[i] * page_bytes, src = src_base + src_ids[i] * page_bytes;
        int64_t *k = chunks + 6 * runs;
        k[0] = dst, k[1] = src, k[2] = len * page_bytes;
        k[3] = dst + dst_v_offset, k[4] = src + src_v_offset, k[5] = len * page_bytes;
        runs++;
        i += len;
    }
    copy_chunks(chunks, 2 * runs, 2 * n * page_bytes, parallel_from);
    if (chunks != local)
        free(chunks);
    return 0;
}
