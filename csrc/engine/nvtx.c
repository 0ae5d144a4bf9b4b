/*
 * nvtx.c - NVTX ranges around the engine's stages (see nvtx.h).
 */
#include "nvtx.h"

#include <pthread.h>
#include <stdlib.h>

int mtc_nvtx_on;

static const char *const _names[MTC_NVTX_NRANGES] = {
    [MTC_NVTX_PACK] = "pack",
    [MTC_NVTX_UNPACK] = "unpack",
    [MTC_NVTX_START_COPY] = "start_copy",
    [MTC_NVTX_TRAVERSE] = "traverse",
    [MTC_NVTX_VIEWS] = "views and rebuild",
    [MTC_NVTX_JOB] = "transfer job",
    [MTC_NVTX_OP] = "copy op",
};

void mtc_nvtx_init(void)
{
    /* an empty value attaches nothing either (NVTX's own rule) */
    const char *path = getenv("NVTX_INJECTION64_PATH");
    mtc_nvtx_on = mtc_nvtx_compiled() && path && *path;
}

#ifdef MTC_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>

static pthread_once_t _once = PTHREAD_ONCE_INIT;
static nvtxDomainHandle_t _domain;
static nvtxStringHandle_t _handles[MTC_NVTX_NRANGES];

/* The domain and its registered names, once: the first call also loads the
 * tool (NVTX's own initialisation), which may take a while. */
static void _register(void)
{
    _domain = nvtxDomainCreateA("mtc_loader");
    for (int i = 0; i < MTC_NVTX_NRANGES; i++) _handles[i] = nvtxDomainRegisterStringA(_domain, _names[i]);
}

int mtc_nvtx_compiled(void) { return 1; }

static void _push(nvtxEventAttributes_t *a)
{
    a->version = NVTX_VERSION;
    a->size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    nvtxDomainRangePushEx(_domain, a);
}

void mtc_nvtx_push_tool(mtc_nvtx_range r)
{
    pthread_once(&_once, _register);
    nvtxEventAttributes_t a = {0};
    a.messageType = NVTX_MESSAGE_TYPE_REGISTERED;
    a.message.registered = _handles[r];
    _push(&a);
}

void mtc_nvtx_push_name_tool(const char *name)
{
    pthread_once(&_once, _register);
    nvtxEventAttributes_t a = {0};
    a.messageType = NVTX_MESSAGE_TYPE_ASCII;
    a.message.ascii = name;
    _push(&a);
}

void mtc_nvtx_pop_tool(void) { nvtxDomainRangePop(_domain); }

#else /* built without the NVTX headers: nothing to emit */

int mtc_nvtx_compiled(void) { return 0; }
void mtc_nvtx_push_tool(mtc_nvtx_range r) { (void)r; (void)_names; }
void mtc_nvtx_push_name_tool(const char *name) { (void)name; }
void mtc_nvtx_pop_tool(void) {}

#endif
