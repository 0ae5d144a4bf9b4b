/*
 * nvtx_tool.c - a minimal NVTX tool for tests/test_nvtx.py: loaded by NVTX
 * through NVTX_INJECTION64_PATH (as Nsight Systems is), it takes over the
 * domain calls mtc_loader makes and appends one line per event to the file
 * named by MTC_NVTX_LOG: "<pid> <tid> push <domain> <name>" / "<pid> <tid> pop".
 * With MTC_NVTX_TIMES set, each line starts with CLOCK_MONOTONIC nanoseconds
 * ("<ns> <pid> ..."; tools/diagnostics/nvtx_summary.py reads such a log).
 */
#define _GNU_SOURCE
#include <nvtx3/nvToolsExt.h>

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static const char *strings[256];
static unsigned nstrings;

static void emit(const char *what, const char *domain, const char *name)
{
    const char *path = getenv("MTC_NVTX_LOG");
    if (!path) return;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    pthread_mutex_lock(&mu);
    FILE *f = fopen(path, "a");
    if (f) {
        if (getenv("MTC_NVTX_TIMES")) fprintf(f, "%lld ", (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
        fprintf(f, "%d %ld %s %s %s\n", (int)getpid(), (long)syscall(SYS_gettid), what, domain ? domain : "-",
                name ? name : "-");
        fclose(f);
    }
    pthread_mutex_unlock(&mu);
}

static nvtxDomainHandle_t domain_create(const char *name) { return (nvtxDomainHandle_t)strdup(name); }

static nvtxStringHandle_t register_string(nvtxDomainHandle_t d, const char *s)
{
    pthread_mutex_lock(&mu);
    unsigned k = nstrings < 256 ? nstrings++ : 255;
    strings[k] = strdup(s);
    pthread_mutex_unlock(&mu);
    return (nvtxStringHandle_t)(uintptr_t)(k + 1);
}

static int range_push(nvtxDomainHandle_t d, const nvtxEventAttributes_t *a)
{
    const char *name = a->messageType == NVTX_MESSAGE_TYPE_REGISTERED
                           ? strings[(uintptr_t)a->message.registered - 1]
                           : a->messageType == NVTX_MESSAGE_TYPE_ASCII ? a->message.ascii : "?";
    emit("push", (const char *)d, name);
    return 0;
}

static int range_pop(nvtxDomainHandle_t d)
{
    emit("pop", (const char *)d, NULL);
    return 0;
}

__attribute__((visibility("default"))) int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get)
{
    const NvtxExportTableCallbacks *cb = (const NvtxExportTableCallbacks *)get(NVTX_ETID_CALLBACKS);
    NvtxFunctionTable t = NULL;
    unsigned size = 0;
    if (!cb || !cb->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &t, &size) || !t) return 0;
    *t[NVTX_CBID_CORE2_DomainCreateA] = (NvtxFunctionPointer)domain_create;
    *t[NVTX_CBID_CORE2_DomainRegisterStringA] = (NvtxFunctionPointer)register_string;
    *t[NVTX_CBID_CORE2_DomainRangePushEx] = (NvtxFunctionPointer)range_push;
    *t[NVTX_CBID_CORE2_DomainRangePop] = (NvtxFunctionPointer)range_pop;
    emit("init", NULL, NULL);
    return 1;
}
