/*
 * plan.h - the planner: decides, per leaf, how it reaches the target device,
 * and lays packed leaves out in chunks.
 *
 * Pure C, no Python, no locks: the binding layer fills an array of mtc_leaf
 * (metadata read during traversal), calls mtc_plan_build() (microseconds:
 * it keeps the GIL), then creates outputs and copy operations from the result.
 *
 * Packed layout. Packed leaves are grouped by (dtype, ndim, trailing dims), so
 * that the outputs of a group can be created with one torch call on a view of
 * the chunk: a group whose members all share one shape is a UNIFORM segment
 * (members at a fixed slot stride: as_strided + unbind), any other group is a
 * SPLIT segment (the segment viewed as (rows, *trailing), cut with one
 * split_with_sizes; members start on rows whose byte offset is aligned, and
 * the rows between them are padding). Groups are placed by dtype, so that a
 * chunk's bytes of one dtype are one span (host-placed groups after all the
 * others): the binding layer gives each span a storage of its own (outputs.h,
 * storage groups). Every member's byte offset from the
 * chunk's base is a multiple of round_up(max(min alignment, element size),
 * element size), the reference implementation's rule. The binding layer puts
 * each span's first segment at offset 0 of its own storage, so that a user
 * observes (data_ptr() - untyped_storage().data_ptr()) an offset on that rule
 * too.
 *
 * Names starting with `_` are internal to plan.c. Functions return 0 or a
 * negative errno.
 */
#ifndef MTC_PLAN_H
#define MTC_PLAN_H

#include <stddef.h>
#include <stdint.h>

#define MTC_DEV_CPU (-1)
/* Most dims of a leaf. torch allows any number (numpy 64); every loop over
 * dims is O(ndim) with no fixed-size arrays, and the layout stores ndim in
 * 16 bits. The binding layer refuses a deeper tensor naming this limit. */
#define MTC_MAX_NDIM 1024
/* The planner caps max_chunk here (2^61): its sums of offsets and sizes then
 * cannot overflow int64. */
#define MTC_PLAN_MAX_CHUNK (INT64_MAX / 4)

/* leaf flags */
#define MTC_LEAF_CONTIGUOUS 0x1  /* row-major contiguous (strides may be ignored) */
#define MTC_LEAF_NUMPY      0x2  /* a numpy.ndarray, not a torch.Tensor */
#define MTC_LEAF_ZEROCOPY   0x4  /* numpy array that torch.from_numpy can wrap as is */
#define MTC_LEAF_FILE       0x8  /* bytes in files (a FileTensor): `data` is its spec (uring.h), read, never copied */
/* Dense and non-overlapping in another order (strides.h): its nbytes bytes at
 * `data` are all of it, laid out as its output (copied as one block) */
#define MTC_LEAF_DENSE      0x10
/* Its output's strides are not torch.empty(shape)'s: they are in the
 * binding layer's output strides (elements; the tree's and the layout's
 * `ostrides`), and the leaf is packed in a segment of its own. A leaf that
 * is neither CONTIGUOUS nor DENSE is gathered in the order of those strides. */
#define MTC_LEAF_STRIDED    0x20
/* Placed on the host: a packed batch's leaf under an OnHost (traverse.h).
 * Grouped apart from the others and laid out after all of them (their bytes
 * are the end of the chunk), and unpacked into CPU memory of its own */
#define MTC_LEAF_HOST       0x40
/* Its bytes are one block in the order of its output: copied as is */
#define MTC_LEAF_BLOCK      (MTC_LEAF_CONTIGUOUS | MTC_LEAF_DENSE)

/* actions */
enum {
    MTC_ACT_REUSE = 1,    /* already on the target: returned as is */
    MTC_ACT_FROM_NUMPY,   /* CPU target, numpy: torch.from_numpy, zero-copy */
    MTC_ACT_HOST_COPY,    /* CPU target, host source: memcpy / strided copy into a new tensor */
    MTC_ACT_PACK,         /* small tensor packed into a chunk (H2D, or D2H into a pinned chunk) */
    MTC_ACT_H2D_STAGED,   /* own output; piped through pinned slabs in pieces */
    MTC_ACT_H2D_DIRECT,   /* own output; DMA from pageable memory (staging off) */
    MTC_ACT_D2H,          /* own output (pinned when staging is on) */
    MTC_ACT_D2D,          /* own output on another device */
    MTC_ACT_COUNT
};

enum { MTC_SEG_SPLIT = 1, MTC_SEG_UNIFORM = 2 };

typedef struct mtc_leaf {
    uintptr_t data;     /* address of the first element (host or device) */
    int64_t nbytes;     /* numel * elsize */
    int32_t dev;        /* MTC_DEV_CPU or a CUDA device index */
    uint16_t dtype;     /* dtype code: index in the binding layer's dtype table */
    uint16_t elsize;    /* bytes per element (>= 1) */
    int32_t ndim;
    uint32_t dims;      /* shape at shape[dims .. dims+ndim), byte strides at the same index of strides */
    uint32_t flags;     /* MTC_LEAF_* */
    /* set by mtc_plan_build */
    uint8_t action;     /* MTC_ACT_* */
    uint8_t needs_contig; /* action needs a block source (MTC_LEAF_BLOCK), and this one is not */
    int32_t seg;        /* MTC_ACT_PACK: segment index, else -1 */
    int64_t slot;       /* MTC_ACT_PACK: first row (SPLIT) or member index (UNIFORM) in its segment */
} mtc_leaf;

typedef struct mtc_seg {
    int32_t chunk;
    int32_t kind;       /* MTC_SEG_SPLIT or MTC_SEG_UNIFORM */
    int64_t offset;     /* byte offset of the segment from the chunk's base */
    int64_t bytes;      /* bytes spanned by the segment */
    int64_t rows;       /* SPLIT: rows spanned (members and padding); UNIFORM: member count */
    int64_t row_bytes;  /* SPLIT: bytes per row; UNIFORM: bytes between members (the slot) */
    uint32_t first;     /* members[first .. first+count) are its leaves, in layout order */
    uint32_t count;
    uint32_t proto;     /* index of one member: dtype, ndim and trailing dims of all */
} mtc_seg;

typedef struct mtc_chunk {
    int64_t payload;    /* bytes from the base to the end of the last segment */
    int64_t align;      /* lcm of its members' alignments: a base aligned to it aligns every member's address */
} mtc_chunk;

typedef struct mtc_plan_opts {
    int32_t target;     /* MTC_DEV_CPU or a CUDA device index */
    int pack;           /* pack_cpu_tensors */
    int staging;        /* use_pinned_staging */
    int64_t align;      /* min_packed_alignment_bytes, > 0 */
    int64_t max_chunk;  /* max_packed_chunk_bytes, > 0 */
    int64_t pack_limit; /* largest tensor that is packed (256 KiB) */
    int64_t max_pad;    /* largest padding per member a SPLIT segment may use (else: one segment per member) */
} mtc_plan_opts;

typedef struct mtc_plan {
    mtc_seg *segs;
    uint32_t nsegs;
    uint32_t *members;  /* leaf indices, grouped by segment */
    uint32_t nmembers;
    mtc_chunk *chunks;
    uint32_t nchunks;
    uint32_t count[MTC_ACT_COUNT]; /* leaves per action */
    uint32_t need_contig;          /* leaves with needs_contig set */
    int64_t packed_bytes;          /* sum of packed leaves' nbytes, saturated at INT64_MAX */
} mtc_plan;

/* Fills opts with the reference defaults for `target`. */
void mtc_plan_default_opts(mtc_plan_opts *o, int32_t target);

/*
 * Decides the action of every leaf and lays out packed leaves.
 * Preconditions: leaves[i].elsize >= 1, nbytes >= 0, ndim <= MTC_MAX_NDIM,
 * shape holds the dims the leaves point at; opts->align and max_chunk > 0.
 * Returns 0, -EINVAL (bad options or leaf), -ENOMEM, or -EOVERFLOW when an
 * alignment cannot be represented. On error the plan is left empty.
 */
int mtc_plan_build(mtc_plan *p, mtc_leaf *leaves, uint32_t n, const int64_t *shape,
                   const mtc_plan_opts *opts);

/* Frees what mtc_plan_build allocated; the plan may be reused afterwards. */
void mtc_plan_free(mtc_plan *p);

/* Effective alignment of a packed leaf, the reference's rule:
 * round_up(max(opts->align, elsize), elsize); 0 past 2^40. */
int64_t mtc_plan_leaf_align(const mtc_plan_opts *o, uint32_t elsize);

/*
 * Invariant checker (tests, debug builds): every packed leaf lies inside its
 * chunk's payload at an offset aligned to its alignment, packed leaves do not
 * overlap, segments describe their members, actions match the options.
 * Returns 1 valid, 0 broken.
 */
int mtc_plan_valid(const mtc_plan *p, const mtc_leaf *leaves, uint32_t n, const int64_t *shape,
                   const mtc_plan_opts *opts);

/* Byte offset of packed leaf `i` from its chunk's base. */
int64_t mtc_plan_leaf_offset(const mtc_plan *p, const mtc_leaf *leaf);

#endif /* MTC_PLAN_H */
