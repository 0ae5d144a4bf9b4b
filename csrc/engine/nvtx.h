/*
 * nvtx.h - NVTX ranges around the engine's stages, for Nsight Systems and any
 * other NVTX tool: one "mtc_loader" domain, one registered name per stage.
 *
 * Free when no tool is attached: a tool attaches through the environment
 * variable NVTX_INJECTION64_PATH (Nsight Systems sets it for the process it
 * profiles); without it, mtc_nvtx_push / mtc_nvtx_pop are a load and a branch
 * (inline here) and NVTX is never initialised. Built against the header-only NVTX v3 (the
 * nvtx3 headers of the nvidia-nvtx-cu12 package, a build requirement, or of a
 * CUDA toolkit); without those headers (MTC_HAVE_NVTX undefined) every entry
 * point does nothing and mtc_nvtx_compiled() is 0. No CUDA library is linked.
 *
 * Any thread may call every function; a range is pushed and popped by the
 * same thread (NVTX keeps a range stack per thread). Internal helpers start
 * with _.
 */
#ifndef MTC_NVTX_H
#define MTC_NVTX_H

/* The stages, in the order a batch meets them. */
typedef enum {
    MTC_NVTX_PACK,        /* DataLoader worker: the batch's leaves into an arena region */
    MTC_NVTX_UNPACK,      /* main process: a region to the output structure (one DMA) */
    MTC_NVTX_START_COPY,  /* calling thread: start_copy, from the walk to the views */
    MTC_NVTX_TRAVERSE,    /* calling thread: the walk over the structure */
    MTC_NVTX_VIEWS,       /* calling thread: output views and the rebuilt structure */
    MTC_NVTX_JOB,         /* transfer thread: one job (every copy of one call) */
    MTC_NVTX_OP,          /* transfer thread: one copy operation of a job */
    MTC_NVTX_NRANGES
} mtc_nvtx_range;

/* Nonzero when a tool may be attached (NVTX_INJECTION64_PATH set at
 * mtc_nvtx_init), read by every push and pop. */
extern int mtc_nvtx_on;

/* Reads the environment once (module initialisation, any thread). */
void mtc_nvtx_init(void);
/* 1 when the engine was built with the NVTX headers. */
int mtc_nvtx_compiled(void);

/* The tool's side of the calls below, out of line: called only while
 * mtc_nvtx_on, so that without a tool a range costs a load and a branch
 * where it stands, not a call. */
void mtc_nvtx_push_tool(mtc_nvtx_range r);
void mtc_nvtx_push_name_tool(const char *name);
void mtc_nvtx_pop_tool(void);

static inline void mtc_nvtx_push(mtc_nvtx_range r)
{
    if (mtc_nvtx_on) mtc_nvtx_push_tool(r);
}

/* A range with a name that is not one of the stages (the Python side's). */
static inline void mtc_nvtx_push_name(const char *name)
{
    if (mtc_nvtx_on) mtc_nvtx_push_name_tool(name);
}

static inline void mtc_nvtx_pop(void)
{
    if (mtc_nvtx_on) mtc_nvtx_pop_tool();
}

#endif
