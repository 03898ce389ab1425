/* Fake libnvidia-ml.so.1 for tests: a JSON-configured NVML subset that lets the real pynvml run without a GPU. */

/*
 * Configuration (read by every nvmlInit*):
 *   FAKE_NVML_CONFIG  path to a JSON file:
 *     {"driverVersion": "550.54.15", "cudaDriverVersion": 12040, "initError": 0,
 *      "memoryLimits": false, "cgroupLayout": "unified", "cgroupRoot": "/sys/fs/cgroup",
 *      "gpus": [{"uuid": "GPU-...", "name": "...", "memoryTotal": 85520809984, "memoryUsed": 0,
 *                "major": 9, "minor": 0, "pciBusId": "00000000:18:00.0",
 *                "pciDeviceId": 2335379678, "pciSubSystemId": 381751518, "minorNumber": 0,
 *                "migMode": 0, "computeMode": 0, "setComputeModeError": 0, "lost": false,
 *                "supportedEventTypes": 15, "registerEventsError": 0, "processUtilizationError": 0}]}
 *     Every key is optional; unknown keys are ignored. A GPU's index is its position in "gpus".
 *     migMode -1 means MIG is not supported. setComputeModeError / registerEventsError /
 *     processUtilizationError, when non-zero, is the nvmlReturn_t that nvmlDeviceSetComputeMode /
 *     nvmlDeviceRegisterEvents / both per-process utilization calls return (e.g. 3, NOT_SUPPORTED:
 *     a GPU or driver that does not sample processes; see "Per-process utilization" below).
 *     supportedEventTypes is what nvmlDeviceGetSupportedEventTypes reports (default 0xF:
 *     SingleBitEccError 0x1 | DoubleBitEccError 0x2 | PState 0x4 | XidCriticalError 0x8);
 *     registering any other type fails with NVML_ERROR_NOT_SUPPORTED.
 *     memoryLimits (default false) and cgroupLayout / cgroupRoot: see "Per-cgroup memory limits" below.
 *
 *   FAKE_NVML_STATE   optional path of the shared state that stands in for the driver:
 *     {"computeModes": {"GPU-...": 3},
 *      "lost": ["GPU-..."],
 *      "processes": {"GPU-...": [{"pid": 1234, "usedGpuMemory": 1048576}]},
 *      "mpsProcesses": {"GPU-...": [{"pid": 1234, "usedGpuMemory": 1048576}]},
 *      "processUtilization": {"GPU-...": [{"pid": 1234, "smUtil": 40, "memUtil": 10,
 *                             "timeStamp": 1764547200250000}]},
 *      "memoryLimits": {"/sys/fs/cgroup/kubepods.slice/...": {"GPU-...":
 *                       {"soft": 0, "hard": 8589934592, "setAt": 1764547200.25, "setBy": 1234}}}}
 *     Every key is optional; a missing file is an empty state. It is re-read by nvmlInit* and by
 *     every call that takes a device handle (except nvmlDeviceGetHandleBy*), so changes written
 *     by other processes show up at once:
 *       computeModes  a GPU's entry wins over its config "computeMode". nvmlDeviceSetComputeMode
 *                     rewrites the file (temp file + rename, under an exclusive flock of
 *                     "<path>.lock"), keeping every other key and other UUIDs' entries.
 *       lost          a GPU is lost if its config says "lost": true or the list names it. Lost
 *                     GPUs still have handles, a UUID and their registered events; every other
 *                     device call returns NVML_ERROR_GPU_IS_LOST. Removing a UUID from the list
 *                     makes the GPU usable again.
 *       processes     what nvmlDeviceGetComputeRunningProcesses{,_v2,_v3} report per GPU;
 *       mpsProcesses  what nvmlDeviceGetMPSComputeRunningProcesses{,_v2,_v3} report. Per process:
 *                     "pid"; "usedGpuMemory" (default 0, null = NVML_VALUE_NOT_AVAILABLE);
 *                     "gpuInstanceId" / "computeInstanceId" (default 0xFFFFFFFF, i.e. not MIG).
 *       processUtilization  the driver's utilization samples per GPU, one per process: "pid";
 *                     "smUtil" / "memUtil", percent in [0, 100] (default 0); "timeStamp", CPU time
 *                     in microseconds since the epoch (default: the time of the call, i.e. a sample
 *                     always newer than any earlier read). See "Per-process utilization" below.
 *       memoryLimits  the per-cgroup memory limits set (below), by cgroup path and GPU UUID.
 *     Writers other than this library must take the same flock and replace the file atomically.
 *     Integers may go up to 2^64-1 (NVML_DEVICE_MEMORY_LIMIT_MAX); the fake writes back what it read.
 *
 *   FAKE_NVML_EVENTS  optional path of an append-only JSON-lines file of events, e.g.
 *       {"uuid": "GPU-...", "xid": 79}            XidCriticalError (0x8) with eventData 79
 *       {"uuid": "GPU-...", "eventType": 2}       any other type; "eventData" defaults to 0
 *       {"error": 999}                            the next nvmlEventSetWait* returns this code
 *     Optional per event: "eventType" (default 0x8), "eventData" (default: "xid", else 0),
 *     "gpuInstanceId" / "computeInstanceId" (default 0xFFFFFFFF). Lines whose "uuid" is not in
 *     the config, blank lines and malformed lines (the last are reported on stderr) are skipped.
 *     Each event set reads the file from where it stood when nvmlEventSetCreate ran (a missing
 *     file counts as empty) and consumes each complete line once, in order: an event is delivered
 *     when its GPU is registered to the set with at least one of its type bits (lost or not); an
 *     "error" line is returned once by every set that reaches it. A last line without its '\n'
 *     is left until it is complete; a file that shrinks is read again from its start. Writers
 *     must append whole lines with one write(). nvmlEventSetWait* polls the file every 5 ms
 *     without holding the library lock, and returns NVML_ERROR_TIMEOUT after timeoutms (at once
 *     for 0; always, when FAKE_NVML_EVENTS is unset). nvmlEventSetWait_v2 fills nvmlEventData_t
 *     (device, eventType, eventData, gpuInstanceId, computeInstanceId); the unversioned
 *     nvmlEventSetWait fills the older layout without the instance IDs. Registrations are kept
 *     by GPU index, so a set outlives nvmlShutdown/nvmlInit only while "gpus" keeps its order.
 *   mpsagent_testing/nvml/control.py (FakeNvmlDriver) writes both files from Python.
 *
 * Per-process utilization: nvmlDeviceGetProcessUtilization(device, nvmlProcessUtilizationSample_t *utilization,
 * unsigned int *processSamplesCount, unsigned long long lastSeenTimeStamp) and
 * nvmlDeviceGetProcessesUtilizationInfo(device, nvmlProcessesUtilizationInfo_t *) (version 1; count, lastSeenTimeStamp
 * and the array are its processSamplesCount, lastSeenTimeStamp and procUtilArray) report the GPU's
 * "processUtilization" samples whose timeStamp is greater than lastSeenTimeStamp, in the state's order, with
 * pid, timeStamp, smUtil and memUtil (encUtil, decUtil, jpgUtil and ofaUtil are 0).
 *   Both calls check, in this order, and return the first failure, writing no sample:
 *     not initialized: UNINITIALIZED; a bad handle: INVALID_ARGUMENT; a lost GPU: GPU_IS_LOST; a NULL count
 *     (or struct): INVALID_ARGUMENT; a struct version other than nvmlProcessesUtilizationInfo_v1:
 *     ARGUMENT_VERSION_MISMATCH; the GPU's processUtilizationError, if non-zero; a GPU whose config migMode is 1
 *     (NVML does not sample processes on MIG-enabled GPUs): NOT_SUPPORTED; no sample newer than lastSeenTimeStamp:
 *     NOT_FOUND (not an empty success); a NULL array, or a count below the number of samples:
 *     INSUFFICIENT_SIZE with the count set to that number (the first of pynvml's two calls).
 *   Otherwise the samples are written and the count set to how many.
 *
 * Per-cgroup memory limits (driver r615 and later): nvmlDeviceSetMemoryLimits_v1(device,
 * nvmlSetMemoryLimits_v1_t *) and nvmlDeviceGetMemoryLimits_v1(device, nvmlGetMemoryLimits_v1_t *), whose
 * nameSpace is a cgroup v2 directory (the driver's "full path to sysfs cgroup file name").
 *   Config:
 *     memoryLimits  false (the default) is a driver before r615: both calls return
 *                   NVML_ERROR_FUNCTION_NOT_FOUND, as pynvml reports a missing symbol.
 *     cgroupLayout  where the node has cgroup v2, i.e. the fake's "cgroup root": "unified" (the default; pure
 *                   cgroup v2 at /sys/fs/cgroup), "hybrid" (v1 controllers, v2 at /sys/fs/cgroup/unified, as
 *                   on the machines these tests run on) or "legacy" (no cgroup v2: both calls return
 *                   NVML_ERROR_NOT_SUPPORTED).
 *     cgroupRoot    an absolute path in place of the layout's root (trailing slashes dropped), e.g. a
 *                   scratch directory whose subdirectories stand in for cgroups: the fake only checks that a
 *                   nameSpace is a directory below it.
 *   Both calls check, in this order, and return the first failure, changing nothing:
 *     not initialized: UNINITIALIZED; memoryLimits false: FUNCTION_NOT_FOUND; a bad handle:
 *     INVALID_ARGUMENT; a lost GPU: GPU_IS_LOST; the legacy layout, or a GPU whose config migMode is 1
 *     (MIG handles are not supported): NOT_SUPPORTED; a NULL struct, or a nameSpace that is NULL, empty,
 *     not absolute or without room for its NUL in PATH_MAX (4096 bytes): INVALID_ARGUMENT; then Set only:
 *     hardLimit 0 or softLimit > hardLimit: INVALID_ARGUMENT; geteuid() != 0: NO_PERMISSION.
 *   Then, under the state file's flock, the state is read and the limits of every cgroup whose directory no
 *   longer exists are dropped (removing a cgroup clears its limits), and written back even if the call then
 *   fails with NOT_FOUND: a nameSpace (taken without its trailing slashes) that is not strictly below the
 *   cgroup root as written (an empty, "." or ".." component counts as outside), or not an existing directory.
 *   Otherwise:
 *     Set  stores {"soft", "hard", "setAt": CLOCK_REALTIME epoch seconds (a real number), "setBy": pid} as
 *          "memoryLimits"[nameSpace][uuid], in place of what was there, and replaces the file (temp file +
 *          rename) keeping every other key. softLimit 0 with hardLimit NVML_DEVICE_MEMORY_LIMIT_MAX clears
 *          the entry instead; a cgroup left without entries is dropped, and "memoryLimits" once empty.
 *     Get  fills softLimit / hardLimit (0 / NVML_DEVICE_MEMORY_LIMIT_MAX when none is set) and currentUsed:
 *          the usedGpuMemory (null counts 0) of the GPU's "processes" and "mpsProcesses" entries whose
 *          process is in the cgroup or below it, by the "0::<path>" line of /proc/<pid>/cgroup read as
 *          <cgroup root><path>. A pid listed more than once counts once (its first entry, "processes"
 *          first); a process that is gone counts nothing.
 *   Without FAKE_NVML_STATE the limits live in this process only (and currentUsed is 0: no processes).
 */

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------------------------------
 * NVML types (ABI-compatible subset of nvml.h)
 * ---------------------------------------------------------------------------------------------- */

typedef enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22,
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
    NVML_ERROR_FREQ_NOT_SUPPORTED = 24,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_DEPRECATED = 26,
    NVML_ERROR_NOT_READY = 27,
    NVML_ERROR_GPU_NOT_FOUND = 28,
    NVML_ERROR_INVALID_STATE = 29,
    NVML_ERROR_UNKNOWN = 999
} nvmlReturn_t;

typedef unsigned int nvmlComputeMode_t;

#define NVML_COMPUTEMODE_COUNT 4
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE 32
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE 16
#define NVML_DEVICE_UUID_V2_BUFFER_SIZE 96
#define NVML_DEVICE_NAME_V2_BUFFER_SIZE 96
#define NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE 80

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

#define NVML_STRUCT_VERSION(type, ver) ((unsigned int)(sizeof(type) | ((ver) << 24U)))
#define nvmlMemory_v2 NVML_STRUCT_VERSION(nvmlMemory_v2_t, 2)

/* Layout used by nvmlDeviceGetPciInfo and nvmlDeviceGetPciInfo_v2. */
typedef struct {
    char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    unsigned int reserved0;
    unsigned int reserved1;
    unsigned int reserved2;
    unsigned int reserved3;
} nvmlPciInfo_v2_t;

/* Layout used by nvmlDeviceGetPciInfo_v3 (nvml.h's current nvmlPciInfo_t). */
typedef struct {
    char busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
} nvmlPciInfo_t;

/* nvmlProcessInfo_v1_t: what the unversioned nvmlDevice*RunningProcesses take. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

/* nvmlProcessInfo_v2_t, also nvml.h's nvmlProcessInfo_t: what the _v2 and _v3 calls take. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

/* What nvmlDeviceGetProcessUtilization fills, one per process. */
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp; /* CPU time, microseconds */
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

/* What nvmlDeviceGetProcessesUtilizationInfo fills, one per process. */
typedef struct {
    unsigned long long timeStamp;
    unsigned int pid;
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
    unsigned int jpgUtil;
    unsigned int ofaUtil;
} nvmlProcessUtilizationInfo_v1_t;

typedef struct {
    unsigned int version;             /* nvmlProcessesUtilizationInfo_v1 */
    unsigned int processSamplesCount; /* in: room in procUtilArray; out: samples written, or needed */
    unsigned long long lastSeenTimeStamp;
    nvmlProcessUtilizationInfo_v1_t *procUtilArray;
} nvmlProcessesUtilizationInfo_v1_t;

#define nvmlProcessesUtilizationInfo_v1 NVML_STRUCT_VERSION(nvmlProcessesUtilizationInfo_v1_t, 1)

/* nvmlDeviceSetMemoryLimits_v1 / nvmlDeviceGetMemoryLimits_v1 (driver r615 and later). */
typedef struct {
    const char *nameSpace; /* a cgroup v2 directory */
    unsigned long long softLimit;
    unsigned long long hardLimit;
} nvmlSetMemoryLimits_v1_t;

typedef struct {
    const char *nameSpace; /* in */
    unsigned long long softLimit;
    unsigned long long hardLimit;
    unsigned long long currentUsed;
} nvmlGetMemoryLimits_v1_t;

#define NVML_DEVICE_MEMORY_LIMIT_MAX 0xFFFFFFFFFFFFFFFFULL

#define NVML_VALUE_NOT_AVAILABLE_ULL 0xFFFFFFFFFFFFFFFFULL
#define NVML_NO_INSTANCE_ID 0xFFFFFFFFU

#define nvmlEventTypeSingleBitEccError 0x1ULL
#define nvmlEventTypeDoubleBitEccError 0x2ULL
#define nvmlEventTypePState 0x4ULL
#define nvmlEventTypeXidCriticalError 0x8ULL
#define FAKE_DEFAULT_EVENT_TYPES                                                                   \
    (nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError | nvmlEventTypePState |        \
     nvmlEventTypeXidCriticalError)

/* ------------------------------------------------------------------------------------------------
 * Fake state
 * ---------------------------------------------------------------------------------------------- */

#define MAX_GPUS 64

struct fake_gpu {
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    unsigned int index;
    unsigned int minor_number;
    unsigned long long memory_total;
    unsigned long long memory_used;
    int cc_major;
    int cc_minor;
    unsigned int pci_domain, pci_bus, pci_device, pci_function;
    unsigned int pci_device_id;
    unsigned int pci_subsystem_id;
    int mig_mode;                /* -1: MIG not supported */
    unsigned int config_compute_mode; /* from FAKE_NVML_CONFIG */
    unsigned int compute_mode;   /* effective: state file entry if any, else config */
    int set_compute_mode_error;  /* non-zero: nvmlDeviceSetComputeMode returns it */
    int config_lost;             /* "lost" in FAKE_NVML_CONFIG */
    int lost;                    /* effective: config_lost, or listed in the state file's "lost" */
    unsigned long long supported_event_types;
    int register_events_error;   /* non-zero: nvmlDeviceRegisterEvents returns it */
    int process_utilization_error; /* non-zero: both per-process utilization calls return it */
};

typedef struct fake_gpu *nvmlDevice_t;

/* nvmlEventData_t as nvmlEventSetWait_v2 fills it. */
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

/* The older layout that the unversioned nvmlEventSetWait fills. */
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
} nvmlEventData_v1_t;

struct fake_event_set {
    struct fake_event_set *next;          /* in g_event_sets */
    off_t offset;                         /* bytes of FAKE_NVML_EVENTS already consumed */
    unsigned long long registered[MAX_GPUS]; /* event types registered, by GPU index */
};

typedef struct fake_event_set *nvmlEventSet_t;

struct fake_system {
    char driver_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    int cuda_driver_version;
    int init_error;
    int memory_limits;           /* nvmlDevice{Set,Get}MemoryLimits_v1 exist (driver r615+) */
    int cgroup_v2;               /* 0: the "legacy" layout, no cgroup v2 */
    char cgroup_root[PATH_MAX];  /* where cgroup v2 directories are, without a trailing slash ("/" as is) */
    unsigned int gpu_count;
    struct fake_gpu gpus[MAX_GPUS];
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned int g_init_count;   /* nvmlInit/nvmlShutdown reference count */
static struct fake_system g_sys;    /* handles point into g_sys.gpus, so it is updated in place */
static struct fake_system g_scratch; /* config being loaded; copied to g_sys on success */
static struct json *g_state;        /* FAKE_NVML_STATE as last read by enter_device(); may be NULL */
static struct fake_event_set *g_event_sets; /* live event sets, to validate handles */
static struct json *g_own_state;    /* the memory limits, when FAKE_NVML_STATE is unset */

static void complain(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void complain(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("fake_nvml: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* ------------------------------------------------------------------------------------------------
 * Minimal JSON reader
 * ---------------------------------------------------------------------------------------------- */

enum json_type { J_NULL, J_BOOL, J_NUMBER, J_STRING, J_ARRAY, J_OBJECT };

struct json {
    enum json_type type;
    char *key;          /* member name, when inside an object */
    char *str;          /* J_STRING */
    double num;         /* J_NUMBER */
    long long inum;     /* J_NUMBER, when is_int (LLONG_MAX when is_big) */
    unsigned long long unum; /* J_NUMBER, when is_int and not negative: the value, up to 2^64-1 */
    int is_int;
    int is_big;         /* an integer above LLONG_MAX, held by unum only */
    int boolean;        /* J_BOOL */
    struct json *child; /* J_ARRAY / J_OBJECT: first element or member */
    struct json *next;  /* next sibling */
};

struct parser {
    const char *s;
    size_t pos, len;
    const char *error;
};

static void json_free(struct json *v)
{
    while (v) {
        struct json *next = v->next;
        json_free(v->child);
        free(v->key);
        free(v->str);
        free(v);
        v = next;
    }
}

static void skip_ws(struct parser *p)
{
    while (p->pos < p->len) {
        char c = p->s[p->pos];
        if (c != ' ' && c != '\t' && c != '\r' && c != '\n')
            break;
        p->pos++;
    }
}

static int peek(struct parser *p)
{
    return p->pos < p->len ? (unsigned char)p->s[p->pos] : -1;
}

static int fail(struct parser *p, const char *msg)
{
    if (!p->error)
        p->error = msg;
    return -1;
}

static int hex4(struct parser *p, unsigned int *out)
{
    unsigned int v = 0;
    for (int i = 0; i < 4; i++) {
        int c = peek(p);
        v <<= 4;
        if (c >= '0' && c <= '9')
            v |= (unsigned int)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v |= (unsigned int)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            v |= (unsigned int)(c - 'A' + 10);
        else
            return fail(p, "bad \\u escape");
        p->pos++;
    }
    *out = v;
    return 0;
}

static size_t put_utf8(char *dst, unsigned int cp)
{
    if (cp < 0x80) {
        dst[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        dst[0] = (char)(0xC0 | (cp >> 6));
        dst[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        dst[0] = (char)(0xE0 | (cp >> 12));
        dst[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        dst[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    dst[0] = (char)(0xF0 | (cp >> 18));
    dst[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    dst[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    dst[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Parses a string literal at p->pos (which is at the opening quote) into a malloc'd buffer. */
static int parse_string(struct parser *p, char **out)
{
    /* The decoded string is never longer than the literal, so the rest of the input bounds it. */
    char *buf = malloc(p->len - p->pos + 1);
    size_t n = 0;
    if (!buf)
        return fail(p, "out of memory");
    p->pos++; /* opening quote */
    for (;;) {
        int c = peek(p);
        if (c < 0) {
            free(buf);
            return fail(p, "unterminated string");
        }
        p->pos++;
        if (c == '"')
            break;
        if (c < 0x20) {
            free(buf);
            return fail(p, "control character in string");
        }
        if (c != '\\') {
            buf[n++] = (char)c;
            continue;
        }
        c = peek(p);
        p->pos++;
        switch (c) {
        case '"': buf[n++] = '"'; break;
        case '\\': buf[n++] = '\\'; break;
        case '/': buf[n++] = '/'; break;
        case 'b': buf[n++] = '\b'; break;
        case 'f': buf[n++] = '\f'; break;
        case 'n': buf[n++] = '\n'; break;
        case 'r': buf[n++] = '\r'; break;
        case 't': buf[n++] = '\t'; break;
        case 'u': {
            unsigned int cp, lo;
            if (hex4(p, &cp) < 0) {
                free(buf);
                return -1;
            }
            if (cp >= 0xD800 && cp < 0xDC00 && p->pos + 1 < p->len && p->s[p->pos] == '\\' &&
                p->s[p->pos + 1] == 'u') {
                p->pos += 2;
                if (hex4(p, &lo) < 0) {
                    free(buf);
                    return -1;
                }
                if (lo >= 0xDC00 && lo < 0xE000)
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                else
                    p->pos -= 6; /* not a low surrogate: decode it on its own */
            }
            n += put_utf8(buf + n, cp);
            break;
        }
        default:
            free(buf);
            return fail(p, "bad escape in string");
        }
    }
    buf[n] = '\0';
    *out = buf;
    return 0;
}

static int parse_value(struct parser *p, struct json **out, int depth);

static int parse_container(struct parser *p, struct json *v, int depth)
{
    int is_object = v->type == J_OBJECT;
    char close = is_object ? '}' : ']';
    struct json **tail = &v->child;

    p->pos++; /* opening bracket */
    skip_ws(p);
    if (peek(p) == close) {
        p->pos++;
        return 0;
    }
    for (;;) {
        char *key = NULL;
        struct json *item;
        skip_ws(p);
        if (is_object) {
            if (peek(p) != '"')
                return fail(p, "expected member name");
            if (parse_string(p, &key) < 0)
                return -1;
            skip_ws(p);
            if (peek(p) != ':') {
                free(key);
                return fail(p, "expected ':'");
            }
            p->pos++;
        }
        if (parse_value(p, &item, depth + 1) < 0) {
            free(key);
            return -1;
        }
        item->key = key;
        *tail = item;
        tail = &item->next;
        skip_ws(p);
        if (peek(p) == ',') {
            p->pos++;
            continue;
        }
        if (peek(p) == close) {
            p->pos++;
            return 0;
        }
        return fail(p, is_object ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

static int parse_number(struct parser *p, struct json *v)
{
    const char *start = p->s + p->pos;
    char *end;
    size_t n = strspn(start, "+-0123456789.eE");
    if (n == 0)
        return fail(p, "unexpected character");
    v->type = J_NUMBER;
    v->is_int = strcspn(start, ".eE") >= n;
    errno = 0;
    if (v->is_int && *start == '-') {
        v->inum = strtoll(start, &end, 10);
        v->num = (double)v->inum;
    } else if (v->is_int) {
        v->unum = strtoull(start, &end, 10);
        v->is_big = v->unum > LLONG_MAX;
        v->inum = v->is_big ? LLONG_MAX : (long long)v->unum;
        v->num = (double)v->unum;
    } else {
        v->num = strtod(start, &end);
        v->inum = (long long)v->num;
    }
    if (end != start + n || errno == ERANGE)
        return fail(p, "bad number");
    p->pos += n;
    return 0;
}

static int parse_value(struct parser *p, struct json **out, int depth)
{
    struct json *v;
    int c, rc = 0;

    if (depth > 32)
        return fail(p, "nesting too deep");
    v = calloc(1, sizeof(*v));
    if (!v)
        return fail(p, "out of memory");
    skip_ws(p);
    c = peek(p);
    if (c == '{' || c == '[') {
        v->type = c == '{' ? J_OBJECT : J_ARRAY;
        rc = parse_container(p, v, depth);
    } else if (c == '"') {
        v->type = J_STRING;
        rc = parse_string(p, &v->str);
    } else if (p->len - p->pos >= 4 && strncmp(p->s + p->pos, "true", 4) == 0) {
        v->type = J_BOOL;
        v->boolean = 1;
        p->pos += 4;
    } else if (p->len - p->pos >= 5 && strncmp(p->s + p->pos, "false", 5) == 0) {
        v->type = J_BOOL;
        p->pos += 5;
    } else if (p->len - p->pos >= 4 && strncmp(p->s + p->pos, "null", 4) == 0) {
        v->type = J_NULL;
        p->pos += 4;
    } else if (c < 0) {
        rc = fail(p, "unexpected end of input");
    } else {
        rc = parse_number(p, v);
    }
    if (rc < 0) {
        json_free(v);
        return -1;
    }
    *out = v;
    return 0;
}

/* Reads and parses a JSON file. Returns NULL (after complaining) on error; *missing is set when
 * the file does not exist and missing is non-NULL, in which case nothing is reported. */
static struct json *json_load(const char *path, int *missing)
{
    FILE *f = fopen(path, "rb");
    char *text = NULL;
    size_t len = 0, cap = 0;
    struct parser p = {0};
    struct json *root = NULL;

    if (missing)
        *missing = 0;
    if (!f) {
        if (missing && errno == ENOENT)
            *missing = 1;
        else
            complain("cannot open %s: %s", path, strerror(errno));
        return NULL;
    }
    for (;;) {
        if (len + 4096 + 1 > cap) {
            char *bigger = realloc(text, cap = (cap + 4096) * 2);
            if (!bigger) {
                complain("out of memory reading %s", path);
                free(text);
                fclose(f);
                return NULL;
            }
            text = bigger;
        }
        size_t got = fread(text + len, 1, cap - len - 1, f);
        len += got;
        if (got == 0)
            break;
    }
    fclose(f);
    text[len] = '\0';

    p.s = text;
    p.len = len;
    if (parse_value(&p, &root, 0) == 0) {
        skip_ws(&p);
        if (p.pos != p.len) {
            fail(&p, "trailing characters after JSON value");
            json_free(root);
            root = NULL;
        }
    }
    if (!root)
        complain("%s: invalid JSON at byte %zu: %s", path, p.pos, p.error ? p.error : "?");
    free(text);
    return root;
}

static const struct json *json_get(const struct json *obj, const char *key)
{
    if (!obj || obj->type != J_OBJECT)
        return NULL;
    for (const struct json *m = obj->child; m; m = m->next)
        if (strcmp(m->key, key) == 0)
            return m;
    return NULL;
}

/* Typed member accessors: a missing (or null) member leaves *out unchanged; a wrong type fails. */

static int get_string(const struct json *obj, const char *key, char *out, size_t cap, const char *where)
{
    const struct json *v = json_get(obj, key);
    if (!v || v->type == J_NULL)
        return 0;
    if (v->type != J_STRING) {
        complain("%s: \"%s\" must be a string", where, key);
        return -1;
    }
    if (strlen(v->str) >= cap) {
        complain("%s: \"%s\" is longer than %zu characters", where, key, cap - 1);
        return -1;
    }
    strcpy(out, v->str);
    return 0;
}

static int get_int(const struct json *obj, const char *key, long long lo, long long hi, long long *out,
                   const char *where)
{
    const struct json *v = json_get(obj, key);
    if (!v || v->type == J_NULL)
        return 0;
    if (v->type != J_NUMBER || !v->is_int || v->is_big || v->inum < lo || v->inum > hi) {
        complain("%s: \"%s\" must be an integer in [%lld, %lld]", where, key, lo, hi);
        return -1;
    }
    *out = v->inum;
    return 0;
}

static int get_bool(const struct json *obj, const char *key, int *out, const char *where)
{
    const struct json *v = json_get(obj, key);
    if (!v || v->type == J_NULL)
        return 0;
    if (v->type != J_BOOL) {
        complain("%s: \"%s\" must be true or false", where, key);
        return -1;
    }
    *out = v->boolean;
    return 0;
}

/* Building and editing values, for the state that the setters write back. */

static struct json *json_new(enum json_type type)
{
    struct json *v = calloc(1, sizeof(*v));
    if (v)
        v->type = type;
    return v;
}

static struct json *json_new_uint(unsigned long long n)
{
    struct json *v = json_new(J_NUMBER);
    if (v) {
        v->is_int = 1;
        v->unum = n;
        v->is_big = n > LLONG_MAX;
        v->inum = v->is_big ? LLONG_MAX : (long long)n;
        v->num = (double)n;
    }
    return v;
}

static struct json *json_new_real(double x)
{
    struct json *v = json_new(J_NUMBER);
    if (v) {
        v->num = x;
        v->inum = (long long)x;
    }
    return v;
}

/* Makes value (which it takes, NULL or not) obj's member key, in place of one of that name. Returns value, or
 * NULL when out of memory. */
static struct json *json_put(struct json *obj, const char *key, struct json *value)
{
    struct json **link = &obj->child;
    if (!value)
        return NULL;
    value->key = strdup(key);
    if (!value->key) {
        json_free(value);
        return NULL;
    }
    while (*link && strcmp((*link)->key, key) != 0)
        link = &(*link)->next;
    if (*link) {
        value->next = (*link)->next;
        (*link)->next = NULL;
        json_free(*link);
    }
    *link = value;
    return value;
}

/* The member key of obj as an object to edit: a missing (or null) one is added. NULL when out of memory. */
static struct json *json_object_member(struct json *obj, const char *key)
{
    for (struct json *m = obj->child; m; m = m->next)
        if (strcmp(m->key, key) == 0 && m->type == J_OBJECT)
            return m;
    return json_put(obj, key, json_new(J_OBJECT));
}

static void json_remove(struct json *obj, const char *key)
{
    for (struct json **link = &obj->child; *link; link = &(*link)->next) {
        if (strcmp((*link)->key, key) == 0) {
            struct json *gone = *link;
            *link = gone->next;
            gone->next = NULL;
            json_free(gone);
            return;
        }
    }
}

/* ------------------------------------------------------------------------------------------------
 * Config and compute-mode state files
 * ---------------------------------------------------------------------------------------------- */

static int load_gpu(const struct json *obj, unsigned int index, struct fake_gpu *g)
{
    char where[64], bus_id[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    long long total = 80LL << 30, used = 0, major = 9, minor = 0, minor_number = index;
    long long device_id = 0x233010DE, subsystem_id = 0x16C110DE;
    long long mig = 0, mode = 0, set_error = 0, events = (long long)FAKE_DEFAULT_EVENT_TYPES, register_error = 0;
    long long utilization_error = 0;
    unsigned int domain, bus, device, function;
    int lost = 0, rc = 0;

    snprintf(where, sizeof(where), "gpus[%u]", index);
    if (obj->type != J_OBJECT) {
        complain("%s must be an object", where);
        return -1;
    }
    memset(g, 0, sizeof(*g));
    snprintf(g->uuid, sizeof(g->uuid), "GPU-00000000-0000-0000-0000-%012x", index);
    snprintf(g->name, sizeof(g->name), "NVIDIA Fake GPU");
    snprintf(bus_id, sizeof(bus_id), "00000000:%02X:00.0", index + 1);

    rc |= get_string(obj, "uuid", g->uuid, sizeof(g->uuid), where);
    rc |= get_string(obj, "name", g->name, sizeof(g->name), where);
    rc |= get_string(obj, "pciBusId", bus_id, sizeof(bus_id), where);
    rc |= get_int(obj, "memoryTotal", 0, INT64_MAX, &total, where);
    rc |= get_int(obj, "memoryUsed", 0, INT64_MAX, &used, where);
    rc |= get_int(obj, "major", 0, INT32_MAX, &major, where);
    rc |= get_int(obj, "minor", 0, INT32_MAX, &minor, where);
    rc |= get_int(obj, "minorNumber", 0, UINT32_MAX, &minor_number, where);
    rc |= get_int(obj, "pciDeviceId", 0, UINT32_MAX, &device_id, where);
    rc |= get_int(obj, "pciSubSystemId", 0, UINT32_MAX, &subsystem_id, where);
    rc |= get_int(obj, "migMode", -1, 1, &mig, where);
    rc |= get_int(obj, "computeMode", 0, NVML_COMPUTEMODE_COUNT - 1, &mode, where);
    rc |= get_int(obj, "setComputeModeError", 0, INT32_MAX, &set_error, where);
    rc |= get_bool(obj, "lost", &lost, where);
    rc |= get_int(obj, "supportedEventTypes", 0, INT64_MAX, &events, where);
    rc |= get_int(obj, "registerEventsError", 0, INT32_MAX, &register_error, where);
    rc |= get_int(obj, "processUtilizationError", 0, INT32_MAX, &utilization_error, where);
    if (rc)
        return -1;
    if (used > total) {
        complain("%s: memoryUsed exceeds memoryTotal", where);
        return -1;
    }
    /* Accept both "00000000:18:00.0" and the legacy "0000:18:00.0". */
    if (sscanf(bus_id, "%x:%x:%x.%x", &domain, &bus, &device, &function) != 4 || bus > 0xFF ||
        device > 0x1F || function > 7) {
        complain("%s: pciBusId \"%s\" is not DOMAIN:BUS:DEVICE.FUNCTION", where, bus_id);
        return -1;
    }

    g->index = index;
    g->minor_number = (unsigned int)minor_number;
    g->memory_total = (unsigned long long)total;
    g->memory_used = (unsigned long long)used;
    g->cc_major = (int)major;
    g->cc_minor = (int)minor;
    g->pci_domain = domain;
    g->pci_bus = bus;
    g->pci_device = device;
    g->pci_function = function;
    g->pci_device_id = (unsigned int)device_id;
    g->pci_subsystem_id = (unsigned int)subsystem_id;
    g->mig_mode = (int)mig;
    g->config_compute_mode = g->compute_mode = (unsigned int)mode;
    g->set_compute_mode_error = (int)set_error;
    g->config_lost = g->lost = lost;
    g->supported_event_types = (unsigned long long)events;
    g->register_events_error = (int)register_error;
    g->process_utilization_error = (int)utilization_error;
    return 0;
}

/* "cgroupLayout" and "cgroupRoot": where the driver finds cgroup v2 directories, if anywhere. */
static int load_cgroup_layout(const struct json *root, struct fake_system *sys)
{
    char layout[16] = "unified";
    size_t len;

    if (get_string(root, "cgroupLayout", layout, sizeof(layout), "config") == 0) {
        if (strcmp(layout, "unified") == 0)
            strcpy(sys->cgroup_root, "/sys/fs/cgroup");
        else if (strcmp(layout, "hybrid") == 0)
            strcpy(sys->cgroup_root, "/sys/fs/cgroup/unified");
        else if (strcmp(layout, "legacy") != 0)
            layout[0] = '\0';
    } else
        layout[0] = '\0';
    if (!layout[0]) {
        complain("config: \"cgroupLayout\" must be \"unified\", \"hybrid\" or \"legacy\"");
        return -1;
    }
    sys->cgroup_v2 = strcmp(layout, "legacy") != 0;
    if (get_string(root, "cgroupRoot", sys->cgroup_root, sizeof(sys->cgroup_root), "config") != 0)
        return -1;
    if (json_get(root, "cgroupRoot") && sys->cgroup_root[0] != '/') {
        complain("config: \"cgroupRoot\" must be an absolute path");
        return -1;
    }
    for (len = strlen(sys->cgroup_root); len > 1 && sys->cgroup_root[len - 1] == '/';)
        sys->cgroup_root[--len] = '\0';
    return 0;
}

/* Loads FAKE_NVML_CONFIG into *sys. */
static int load_config(struct fake_system *sys)
{
    const char *path = getenv("FAKE_NVML_CONFIG");
    const char *where = "config";
    long long cuda = 12040, init_error = 0;
    const struct json *gpus;
    struct json *root;
    int rc = 0;

    memset(sys, 0, sizeof(*sys));
    if (!path || !*path) {
        complain("FAKE_NVML_CONFIG is not set");
        return -1;
    }
    root = json_load(path, NULL);
    if (!root)
        return -1;
    if (root->type != J_OBJECT) {
        complain("%s: top level must be an object", path);
        json_free(root);
        return -1;
    }

    strcpy(sys->driver_version, "550.54.15");
    rc |= get_string(root, "driverVersion", sys->driver_version, sizeof(sys->driver_version), where);
    rc |= get_int(root, "cudaDriverVersion", 0, INT32_MAX, &cuda, where);
    rc |= get_int(root, "initError", 0, INT32_MAX, &init_error, where);
    rc |= get_bool(root, "memoryLimits", &sys->memory_limits, where);
    rc |= load_cgroup_layout(root, sys);
    sys->cuda_driver_version = (int)cuda;
    sys->init_error = (int)init_error;

    gpus = json_get(root, "gpus");
    if (gpus && gpus->type != J_ARRAY && gpus->type != J_NULL) {
        complain("config: \"gpus\" must be an array");
        rc = -1;
    }
    for (const struct json *item = gpus ? gpus->child : NULL; item && !rc; item = item->next) {
        if (sys->gpu_count == MAX_GPUS) {
            complain("config: more than %d GPUs", MAX_GPUS);
            rc = -1;
            break;
        }
        struct fake_gpu *g = &sys->gpus[sys->gpu_count];
        rc = load_gpu(item, sys->gpu_count, g);
        for (unsigned int i = 0; i < sys->gpu_count && !rc; i++) {
            if (strcmp(sys->gpus[i].uuid, g->uuid) == 0) {
                complain("config: duplicate uuid %s", g->uuid);
                rc = -1;
            }
        }
        sys->gpu_count++;
    }
    json_free(root);
    return rc ? -1 : 0;
}

/* Checks a "processes"/"mpsProcesses" entry's keys besides "pid": "usedGpuMemory" (N or null), the instance IDs. */
static int check_process(const struct json *p, const char *where)
{
    const struct json *mem = json_get(p, "usedGpuMemory");
    long long scratch;
    int rc = 0;

    if (!mem || mem->type != J_NULL)
        rc |= get_int(p, "usedGpuMemory", 0, INT64_MAX, &scratch, where);
    rc |= get_int(p, "gpuInstanceId", 0, UINT32_MAX, &scratch, where);
    rc |= get_int(p, "computeInstanceId", 0, UINT32_MAX, &scratch, where);
    return rc;
}

/* Checks a "processUtilization" sample's keys besides "pid": "smUtil" / "memUtil" in percent, "timeStamp". */
static int check_utilization_sample(const struct json *s, const char *where)
{
    long long scratch;
    int rc = 0;

    rc |= get_int(s, "smUtil", 0, 100, &scratch, where);
    rc |= get_int(s, "memUtil", 0, 100, &scratch, where);
    rc |= get_int(s, "timeStamp", 0, INT64_MAX, &scratch, where);
    return rc;
}

/* Checks a member {uuid: [{"pid": N, ...}, ...]} ("processes", "mpsProcesses", "processUtilization"), each entry's
 * other keys by check_entry. */
static int check_pid_lists(const char *path, const struct json *table,
                           int (*check_entry)(const struct json *entry, const char *where))
{
    long long scratch;
    int rc = 0;

    if (!table || table->type == J_NULL)
        return 0;
    if (table->type != J_OBJECT) {
        complain("%s: \"%s\" must be an object {uuid: [{\"pid\": N, ...}, ...]}", path, table->key);
        return -1;
    }
    for (const struct json *list = table->child; list && !rc; list = list->next) {
        char where[160];
        snprintf(where, sizeof(where), "%s: %s[%.100s]", path, table->key, list->key);
        if (list->type != J_ARRAY) {
            complain("%s must be an array", where);
            return -1;
        }
        for (const struct json *e = list->child; e && !rc; e = e->next) {
            if (e->type != J_OBJECT || !json_get(e, "pid")) {
                complain("%s: every entry must be an object with a \"pid\"", where);
                return -1;
            }
            rc |= get_int(e, "pid", 0, UINT32_MAX, &scratch, where);
            rc |= check_entry(e, where);
        }
    }
    return rc ? -1 : 0;
}

static int is_byte_count(const struct json *v)
{
    return v && v->type == J_NUMBER && v->is_int && v->inum >= 0;
}

/* Checks the "memoryLimits" member: {cgroup path: {uuid: {"soft": N, "hard": N, ...}}}. */
static int check_memory_limits(const char *path, const struct json *limits)
{
    if (!limits || limits->type == J_NULL)
        return 0;
    if (limits->type != J_OBJECT)
        goto bad;
    for (const struct json *cgroup = limits->child; cgroup; cgroup = cgroup->next) {
        if (cgroup->type != J_OBJECT)
            goto bad;
        for (const struct json *l = cgroup->child; l; l = l->next)
            if (l->type != J_OBJECT || !is_byte_count(json_get(l, "soft")) || !is_byte_count(json_get(l, "hard")))
                goto bad;
    }
    return 0;
bad:
    complain("%s: \"memoryLimits\" must be {cgroup path: {uuid: {\"soft\": bytes, \"hard\": bytes, ...}}}", path);
    return -1;
}

/* Reads FAKE_NVML_STATE (if set and present) into *out; NULL means "no state". */
static nvmlReturn_t read_state(struct json **out)
{
    const char *path = getenv("FAKE_NVML_STATE");
    const struct json *modes, *lost;
    struct json *root;
    int missing;

    *out = NULL;
    if (!path || !*path)
        return NVML_SUCCESS;
    root = json_load(path, &missing);
    if (!root)
        return missing ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
    if (root->type != J_OBJECT) {
        complain("%s: expected {\"computeModes\": {...}, \"lost\": [...], \"processes\": {...}}", path);
        goto bad;
    }
    modes = json_get(root, "computeModes");
    if (modes && modes->type != J_OBJECT && modes->type != J_NULL) {
        complain("%s: \"computeModes\" must be an object {uuid: mode}", path);
        goto bad;
    }
    for (const struct json *m = modes ? modes->child : NULL; m; m = m->next) {
        if (m->type != J_NUMBER || !m->is_int || m->inum < 0 || m->inum >= NVML_COMPUTEMODE_COUNT) {
            complain("%s: compute mode of %s must be an integer in [0, 3]", path, m->key);
            goto bad;
        }
    }
    lost = json_get(root, "lost");
    if (lost && lost->type != J_ARRAY && lost->type != J_NULL) {
        complain("%s: \"lost\" must be an array of UUIDs", path);
        goto bad;
    }
    for (const struct json *u = lost ? lost->child : NULL; u; u = u->next) {
        if (u->type != J_STRING) {
            complain("%s: \"lost\" must be an array of UUIDs", path);
            goto bad;
        }
    }
    if (check_pid_lists(path, json_get(root, "processes"), check_process) ||
        check_pid_lists(path, json_get(root, "mpsProcesses"), check_process) ||
        check_pid_lists(path, json_get(root, "processUtilization"), check_utilization_sample) ||
        check_memory_limits(path, json_get(root, "memoryLimits")))
        goto bad;
    *out = root;
    return NVML_SUCCESS;
bad:
    json_free(root);
    return NVML_ERROR_UNKNOWN;
}

static int state_lists_lost(const struct json *state, const char *uuid)
{
    const struct json *lost = json_get(state, "lost");
    for (const struct json *u = lost ? lost->child : NULL; u; u = u->next)
        if (u->type == J_STRING && strcmp(u->str, uuid) == 0)
            return 1;
    return 0;
}

/* Effective compute modes (the state file's entry for a GPU wins over the config) and lost flags.
 * Without a state, compute modes stay as they are (changed in this process only). */
static void apply_state(struct fake_system *sys, const struct json *state)
{
    const struct json *modes = json_get(state, "computeModes");
    for (unsigned int i = 0; i < sys->gpu_count; i++) {
        struct fake_gpu *g = &sys->gpus[i];
        if (state) {
            const struct json *m = json_get(modes, g->uuid);
            g->compute_mode = m ? (unsigned int)m->inum : g->config_compute_mode;
        }
        g->lost = g->config_lost || state_lists_lost(state, g->uuid);
    }
}

/* Re-reads the state file into g_sys and g_state (the caller holds g_lock). */
static nvmlReturn_t refresh_state(void)
{
    struct json *state;
    nvmlReturn_t rc = read_state(&state);
    if (rc == NVML_SUCCESS) {
        apply_state(&g_sys, state);
        json_free(g_state);
        g_state = state;
    }
    return rc;
}

static void write_json_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

static void write_json_value(FILE *f, const struct json *v)
{
    const char *sep = "";
    switch (v->type) {
    case J_NULL: fputs("null", f); break;
    case J_BOOL: fputs(v->boolean ? "true" : "false", f); break;
    case J_NUMBER:
        if (v->is_big)
            fprintf(f, "%llu", v->unum);
        else if (v->is_int)
            fprintf(f, "%lld", v->inum);
        else {
            char text[32];
            snprintf(text, sizeof(text), "%.17g", v->num);
            fprintf(f, "%s%s", text, strpbrk(text, ".e") ? "" : ".0"); /* stays a real number when read */
        }
        break;
    case J_STRING: write_json_string(f, v->str); break;
    case J_ARRAY:
    case J_OBJECT:
        fputc(v->type == J_ARRAY ? '[' : '{', f);
        for (const struct json *c = v->child; c; c = c->next) {
            fputs(sep, f);
            if (v->type == J_OBJECT) {
                write_json_string(f, c->key);
                fputs(": ", f);
            }
            write_json_value(f, c);
            sep = ", ";
        }
        fputc(v->type == J_ARRAY ? ']' : '}', f);
        break;
    }
}

/* Replaces the state file with the JSON object state, via temp file + rename. */
static nvmlReturn_t write_state(const char *path, const struct json *state)
{
    size_t tmp_len = strlen(path) + 32;
    char *tmp = malloc(tmp_len);
    FILE *f;
    int ok;

    if (!tmp)
        return NVML_ERROR_MEMORY;
    snprintf(tmp, tmp_len, "%s.tmp.%ld", path, (long)getpid());
    f = fopen(tmp, "w");
    if (!f) {
        complain("cannot write %s: %s", tmp, strerror(errno));
        free(tmp);
        return NVML_ERROR_UNKNOWN;
    }
    write_json_value(f, state);
    fputc('\n', f);
    ok = fflush(f) == 0 && !ferror(f);
    ok &= fclose(f) == 0;
    if (!ok || rename(tmp, path) != 0) {
        complain("cannot replace %s: %s", path, strerror(errno));
        unlink(tmp);
        free(tmp);
        return NVML_ERROR_UNKNOWN;
    }
    free(tmp);
    return NVML_SUCCESS;
}

/* Exclusive cross-process lock for read-modify-write of the state file; returns an fd or -1. */
static int lock_state(const char *path)
{
    size_t len = strlen(path) + 8;
    char *lock_path = malloc(len);
    int fd;

    if (!lock_path)
        return -1;
    snprintf(lock_path, len, "%s.lock", path);
    fd = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        complain("cannot open %s: %s", lock_path, strerror(errno));
    else if (flock(fd, LOCK_EX) != 0) {
        complain("cannot lock %s: %s", lock_path, strerror(errno));
        close(fd);
        fd = -1;
    }
    free(lock_path);
    return fd;
}

/* ------------------------------------------------------------------------------------------------
 * Helpers for the API functions: every entry point locks g_lock and leaves through leave().
 * ---------------------------------------------------------------------------------------------- */

static nvmlReturn_t enter(void)
{
    pthread_mutex_lock(&g_lock);
    return g_init_count ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

/* Resolves a handle and re-reads the state file (g_lock held); lost GPUs fail unless allow_lost. */
static nvmlReturn_t check_device(nvmlDevice_t device, int allow_lost)
{
    uintptr_t offset = (uintptr_t)device - (uintptr_t)g_sys.gpus;
    nvmlReturn_t rc;

    if (!device || offset % sizeof(struct fake_gpu) != 0 || offset / sizeof(struct fake_gpu) >= g_sys.gpu_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    rc = refresh_state();
    if (rc != NVML_SUCCESS)
        return rc;
    if (device->lost && !allow_lost)
        return NVML_ERROR_GPU_IS_LOST;
    return NVML_SUCCESS;
}

/* Locks the library, resolves a handle and re-reads the state file; lost GPUs fail unless allow_lost. */
static nvmlReturn_t enter_device(nvmlDevice_t device, int allow_lost)
{
    nvmlReturn_t rc = enter();
    return rc == NVML_SUCCESS ? check_device(device, allow_lost) : rc;
}

static nvmlReturn_t leave(nvmlReturn_t rc)
{
    pthread_mutex_unlock(&g_lock);
    return rc;
}

static nvmlReturn_t copy_string(char *dst, unsigned int length, const char *src)
{
    size_t need = strlen(src) + 1;
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (length < need)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, need);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------------------------------
 * Initialization and errors
 * ---------------------------------------------------------------------------------------------- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    struct json *state = NULL;
    nvmlReturn_t rc;

    (void)flags;
    pthread_mutex_lock(&g_lock);
    if (load_config(&g_scratch) != 0)
        return leave(NVML_ERROR_UNKNOWN);
    if (g_scratch.init_error)
        return leave((nvmlReturn_t)g_scratch.init_error);
    rc = read_state(&state);
    if (rc != NVML_SUCCESS)
        return leave(rc);
    if (state) {
        apply_state(&g_scratch, state);
        json_free(state);
    }
    g_sys = g_scratch;
    g_init_count++;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

nvmlReturn_t nvmlInit(void)
{
    return nvmlInitWithFlags(0);
}

nvmlReturn_t nvmlShutdown(void)
{
    nvmlReturn_t rc = enter();
    if (rc == NVML_SUCCESS)
        g_init_count--;
    return leave(rc);
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_VGPU_ECC_NOT_SUPPORTED: return "vGPU ECC not supported";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_FREQ_NOT_SUPPORTED: return "Frequency not supported";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    case NVML_ERROR_DEPRECATED: return "Deprecated";
    case NVML_ERROR_NOT_READY: return "Not ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    case NVML_ERROR_INVALID_STATE: return "Invalid state";
    case NVML_ERROR_UNKNOWN: return "Unknown Error";
    }
    return "Unknown Error";
}

/* ------------------------------------------------------------------------------------------------
 * System queries
 * ---------------------------------------------------------------------------------------------- */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t rc = enter();
    if (rc == NVML_SUCCESS)
        rc = copy_string(version, length, g_sys.driver_version);
    return leave(rc);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    char buf[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE + 16];
    nvmlReturn_t rc = enter();
    if (rc == NVML_SUCCESS) {
        snprintf(buf, sizeof(buf), "%d.%s", g_sys.cuda_driver_version / 1000, g_sys.driver_version);
        rc = copy_string(version, length, buf);
    }
    return leave(rc);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    nvmlReturn_t rc = enter();
    if (rc == NVML_SUCCESS && !cudaDriverVersion)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *cudaDriverVersion = g_sys.cuda_driver_version;
    return leave(rc);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

/* ------------------------------------------------------------------------------------------------
 * Device enumeration
 * ---------------------------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    nvmlReturn_t rc = enter();
    if (rc == NVML_SUCCESS && !deviceCount)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *deviceCount = g_sys.gpu_count;
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return nvmlDeviceGetCount_v2(deviceCount);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    nvmlReturn_t rc = enter();
    if (rc == NVML_SUCCESS && (!device || index >= g_sys.gpu_count))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *device = &g_sys.gpus[index];
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    nvmlReturn_t rc = enter();
    if (rc == NVML_SUCCESS && (!uuid || !device))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        rc = NVML_ERROR_NOT_FOUND;
        for (unsigned int i = 0; i < g_sys.gpu_count; i++) {
            if (strcmp(g_sys.gpus[i].uuid, uuid) == 0) {
                *device = &g_sys.gpus[i];
                rc = NVML_SUCCESS;
                break;
            }
        }
    }
    return leave(rc);
}

/* ------------------------------------------------------------------------------------------------
 * Device queries
 * ---------------------------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    nvmlReturn_t rc = enter_device(device, 1);
    if (rc == NVML_SUCCESS)
        rc = copy_string(uuid, length, device->uuid);
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    nvmlReturn_t rc = enter_device(device, 0);
    if (rc == NVML_SUCCESS)
        rc = copy_string(name, length, device->name);
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    nvmlReturn_t rc = enter_device(device, 0);
    if (rc == NVML_SUCCESS && !index)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *index = device->index;
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)
{
    nvmlReturn_t rc = enter_device(device, 0);
    if (rc == NVML_SUCCESS && !minorNumber)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *minorNumber = device->minor_number;
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    nvmlReturn_t rc = enter_device(device, 0);
    if (rc == NVML_SUCCESS && !memory)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        memory->total = device->memory_total;
        memory->used = device->memory_used;
        memory->free = device->memory_total - device->memory_used;
    }
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    nvmlReturn_t rc = enter_device(device, 0);
    if (rc == NVML_SUCCESS && !memory)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && memory->version != nvmlMemory_v2)
        rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (rc == NVML_SUCCESS) {
        memory->total = device->memory_total;
        memory->reserved = 0;
        memory->used = device->memory_used;
        memory->free = device->memory_total - device->memory_used;
    }
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    nvmlReturn_t rc = enter_device(device, 0);
    if (rc == NVML_SUCCESS && (!major || !minor))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        *major = device->cc_major;
        *minor = device->cc_minor;
    }
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    nvmlReturn_t rc = enter_device(device, 0);
    if (rc == NVML_SUCCESS && !pci)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        memset(pci, 0, sizeof(*pci));
        unsigned int bus = device->pci_bus & 0xFF, dev = device->pci_device & 0x1F, fn = device->pci_function & 7;
        snprintf(pci->busIdLegacy, sizeof(pci->busIdLegacy), "%04X:%02X:%02X.%X", device->pci_domain & 0xFFFF,
                 bus, dev, fn);
        snprintf(pci->busId, sizeof(pci->busId), "%08X:%02X:%02X.%X", device->pci_domain, bus, dev, fn);
        pci->domain = device->pci_domain;
        pci->bus = device->pci_bus;
        pci->device = device->pci_device;
        pci->pciDeviceId = device->pci_device_id;
        pci->pciSubSystemId = device->pci_subsystem_id;
    }
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_v2_t *pci)
{
    nvmlPciInfo_t full;
    nvmlReturn_t rc = pci ? nvmlDeviceGetPciInfo_v3(device, &full) : NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS) {
        memset(pci, 0, sizeof(*pci));
        memcpy(pci->busId, full.busIdLegacy, sizeof(pci->busId));
        pci->domain = full.domain;
        pci->bus = full.bus;
        pci->device = full.device;
        pci->pciDeviceId = full.pciDeviceId;
        pci->pciSubSystemId = full.pciSubSystemId;
    }
    return rc;
}

nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_v2_t *pci)
{
    return nvmlDeviceGetPciInfo_v2(device, pci);
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode)
{
    nvmlReturn_t rc = enter_device(device, 0);
    if (rc == NVML_SUCCESS && (!currentMode || !pendingMode))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && device->mig_mode < 0)
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS)
        *currentMode = *pendingMode = (unsigned int)device->mig_mode;
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, nvmlComputeMode_t *mode)
{
    nvmlReturn_t rc = enter_device(device, 0);
    if (rc == NVML_SUCCESS && !mode)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *mode = device->compute_mode;
    return leave(rc);
}

/* Writes every one of our GPUs' compute mode into the state's "computeModes" (made when *state is NULL), keeping
 * other UUIDs' entries and every other member. */
static nvmlReturn_t put_compute_modes(struct json **state)
{
    struct json *modes;

    if (!*state && !(*state = json_new(J_OBJECT)))
        return NVML_ERROR_MEMORY;
    modes = json_object_member(*state, "computeModes");
    for (unsigned int i = 0; modes && i < g_sys.gpu_count; i++)
        if (!json_put(modes, g_sys.gpus[i].uuid, json_new_uint(g_sys.gpus[i].compute_mode)))
            return NVML_ERROR_MEMORY;
    return modes ? NVML_SUCCESS : NVML_ERROR_MEMORY;
}

nvmlReturn_t nvmlDeviceSetComputeMode(nvmlDevice_t device, nvmlComputeMode_t mode)
{
    const char *path = getenv("FAKE_NVML_STATE");
    struct json *state = NULL;
    int lock_fd;
    nvmlReturn_t rc = enter_device(device, 0);

    if (rc == NVML_SUCCESS && mode >= NVML_COMPUTEMODE_COUNT)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && device->set_compute_mode_error)
        rc = (nvmlReturn_t)device->set_compute_mode_error;
    if (rc != NVML_SUCCESS)
        return leave(rc);
    if (!path || !*path) {
        device->compute_mode = mode; /* no state file: the change lives in this process only */
        return leave(NVML_SUCCESS);
    }

    lock_fd = lock_state(path);
    if (lock_fd < 0)
        return leave(NVML_ERROR_UNKNOWN);
    rc = read_state(&state);
    if (rc == NVML_SUCCESS) {
        if (state)
            apply_state(&g_sys, state);
        device->compute_mode = mode;
        rc = put_compute_modes(&state);
        if (rc == NVML_SUCCESS)
            rc = write_state(path, state);
        json_free(state);
    }
    close(lock_fd);
    return leave(rc);
}

/* ------------------------------------------------------------------------------------------------
 * Running processes: the state file's "processes" / "mpsProcesses" for the GPU
 * ---------------------------------------------------------------------------------------------- */

static unsigned long long json_ull(const struct json *obj, const char *key, unsigned long long dflt,
                                   unsigned long long null_value)
{
    const struct json *v = json_get(obj, key);
    if (!v)
        return dflt;
    return v->type == J_NULL ? null_value : (unsigned long long)v->inum;
}

/* layout 1: nvmlProcessInfo_v1_t; layout 2: nvmlProcessInfo_t (the _v2 and _v3 calls). */
static nvmlReturn_t list_processes(nvmlDevice_t device, const char *key, int layout, unsigned int *infoCount,
                                   void *infos)
{
    nvmlReturn_t rc = enter_device(device, 0);
    const struct json *list;
    unsigned int need = 0, i = 0;

    if (rc == NVML_SUCCESS && !infoCount)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc != NVML_SUCCESS)
        return leave(rc);
    list = json_get(json_get(g_state, key), device->uuid); /* checked by read_state() */
    for (const struct json *p = list ? list->child : NULL; p; p = p->next)
        need++;
    if (*infoCount < need) {
        *infoCount = need;
        return leave(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    if (need && !infos)
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    for (const struct json *p = list ? list->child : NULL; p; p = p->next, i++) {
        unsigned int pid = (unsigned int)json_ull(p, "pid", 0, 0);
        unsigned long long used = json_ull(p, "usedGpuMemory", 0, NVML_VALUE_NOT_AVAILABLE_ULL);
        if (layout == 1) {
            nvmlProcessInfo_v1_t *out = (nvmlProcessInfo_v1_t *)infos + i;
            memset(out, 0, sizeof(*out));
            out->pid = pid;
            out->usedGpuMemory = used;
        } else {
            nvmlProcessInfo_t *out = (nvmlProcessInfo_t *)infos + i;
            memset(out, 0, sizeof(*out));
            out->pid = pid;
            out->usedGpuMemory = used;
            out->gpuInstanceId = (unsigned int)json_ull(p, "gpuInstanceId", NVML_NO_INSTANCE_ID, NVML_NO_INSTANCE_ID);
            out->computeInstanceId =
                (unsigned int)json_ull(p, "computeInstanceId", NVML_NO_INSTANCE_ID, NVML_NO_INSTANCE_ID);
        }
    }
    *infoCount = need;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                  nvmlProcessInfo_v1_t *infos)
{
    return list_processes(device, "processes", 1, infoCount, infos);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos)
{
    return list_processes(device, "processes", 2, infoCount, infos);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos)
{
    return list_processes(device, "processes", 2, infoCount, infos);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_v1_t *infos)
{
    return list_processes(device, "mpsProcesses", 1, infoCount, infos);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                        nvmlProcessInfo_t *infos)
{
    return list_processes(device, "mpsProcesses", 2, infoCount, infos);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                        nvmlProcessInfo_t *infos)
{
    return list_processes(device, "mpsProcesses", 2, infoCount, infos);
}

/* ------------------------------------------------------------------------------------------------
 * Per-process utilization: the state's "processUtilization" samples for the GPU
 * ---------------------------------------------------------------------------------------------- */

/* Which struct the samples are written as: nvmlProcessUtilizationSample_t or nvmlProcessUtilizationInfo_v1_t. */
enum sample_layout { SAMPLE_LEGACY, SAMPLE_INFO_V1 };

/* The GPU's samples newer than lastSeen into out (room for *count; NULL to ask), *count set to how many (g_lock held,
 * device checked): processUtilizationError, MIG, NOT_FOUND and INSUFFICIENT_SIZE as the header says. */
static nvmlReturn_t utilization_samples(nvmlDevice_t device, unsigned long long lastSeen, enum sample_layout layout,
                                        void *out, unsigned int *count)
{
    const struct json *list = json_get(json_get(g_state, "processUtilization"), device->uuid); /* checked */
    struct timespec ts;
    unsigned long long now;
    unsigned int need = 0, i = 0;

    if (device->process_utilization_error)
        return (nvmlReturn_t)device->process_utilization_error;
    if (device->mig_mode == 1)
        return NVML_ERROR_NOT_SUPPORTED;
    clock_gettime(CLOCK_REALTIME, &ts);
    now = (unsigned long long)ts.tv_sec * 1000000ULL + (unsigned long long)ts.tv_nsec / 1000ULL;
    for (const struct json *s = list ? list->child : NULL; s; s = s->next)
        need += json_ull(s, "timeStamp", now, now) > lastSeen;
    if (!need)
        return NVML_ERROR_NOT_FOUND;
    if (!out || *count < need) {
        *count = need;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (const struct json *s = list->child; s; s = s->next) {
        nvmlProcessUtilizationInfo_v1_t sample = {
            .timeStamp = json_ull(s, "timeStamp", now, now),
            .pid = (unsigned int)json_ull(s, "pid", 0, 0),
            .smUtil = (unsigned int)json_ull(s, "smUtil", 0, 0),
            .memUtil = (unsigned int)json_ull(s, "memUtil", 0, 0),
        };
        if (sample.timeStamp <= lastSeen)
            continue;
        if (layout == SAMPLE_INFO_V1)
            ((nvmlProcessUtilizationInfo_v1_t *)out)[i++] = sample;
        else
            ((nvmlProcessUtilizationSample_t *)out)[i++] = (nvmlProcessUtilizationSample_t){
                .pid = sample.pid, .timeStamp = sample.timeStamp, .smUtil = sample.smUtil, .memUtil = sample.memUtil};
    }
    *count = need;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *processSamplesCount, unsigned long long lastSeenTimeStamp)
{
    nvmlReturn_t rc = enter_device(device, 0);
    if (rc == NVML_SUCCESS && !processSamplesCount)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        rc = utilization_samples(device, lastSeenTimeStamp, SAMPLE_LEGACY, utilization, processSamplesCount);
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device, nvmlProcessesUtilizationInfo_v1_t *info)
{
    nvmlReturn_t rc = enter_device(device, 0);
    if (rc == NVML_SUCCESS && !info)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && info->version != nvmlProcessesUtilizationInfo_v1)
        rc = NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (rc == NVML_SUCCESS)
        rc = utilization_samples(device, info->lastSeenTimeStamp, SAMPLE_INFO_V1, info->procUtilArray,
                                 &info->processSamplesCount);
    return leave(rc);
}

/* ------------------------------------------------------------------------------------------------
 * Per-cgroup memory limits: the state's "memoryLimits", by cgroup v2 directory and GPU
 * ---------------------------------------------------------------------------------------------- */

/* Checks nameSpace and copies it to path (PATH_MAX bytes) without its trailing slashes. */
static nvmlReturn_t cgroup_path(const char *nameSpace, char *path)
{
    size_t len;

    if (!nameSpace || nameSpace[0] != '/')
        return NVML_ERROR_INVALID_ARGUMENT; /* NULL, empty or relative */
    len = strnlen(nameSpace, PATH_MAX);
    if (len == PATH_MAX)
        return NVML_ERROR_INVALID_ARGUMENT; /* no room for its NUL in PATH_MAX */
    memcpy(path, nameSpace, len + 1);
    while (len > 1 && path[len - 1] == '/')
        path[--len] = '\0';
    return NVML_SUCCESS;
}

static int is_directory(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* path is strictly below the cgroup root as written (no empty, "." or ".." component) and a directory. */
static int is_cgroup(const char *path)
{
    const char *root = g_sys.cgroup_root;
    size_t n = strcmp(root, "/") == 0 ? 0 : strlen(root);

    if (strncmp(path, root, n) != 0 || path[n] != '/')
        return 0;
    for (const char *c = path + n; *c;) {
        const char *name = c + 1;
        size_t len = strcspn(name, "/");
        if (len == 0 || (len == 1 && name[0] == '.') || (len == 2 && name[0] == '.' && name[1] == '.'))
            return 0;
        c = name + len;
    }
    return is_directory(path);
}

/* Whether the process pid is in the cgroup path or below it, by the cgroup v2 line ("0::<dir>") of its
 * /proc/<pid>/cgroup, <dir> taken below the cgroup root. A process that is gone is in none. */
static int process_in_cgroup(unsigned int pid, const char *path)
{
    char proc[32], line[PATH_MAX + 8], where[2 * PATH_MAX + 8];
    const char *root = strcmp(g_sys.cgroup_root, "/") == 0 ? "" : g_sys.cgroup_root;
    size_t n = strlen(path), len;
    int inside = 0;
    FILE *f;

    snprintf(proc, sizeof(proc), "/proc/%u/cgroup", pid);
    f = fopen(proc, "re");
    if (!f)
        return 0;
    while (fgets(line, sizeof(line), f)) {
        if (strncmp(line, "0::", 3) != 0)
            continue;
        line[strcspn(line, "\n")] = '\0';
        snprintf(where, sizeof(where), "%s%s", root, line + 3);
        for (len = strlen(where); len > 1 && where[len - 1] == '/';)
            where[--len] = '\0'; /* "0::/": the root itself */
        inside = strncmp(where, path, n) == 0 && (where[n] == '\0' || where[n] == '/');
        break;
    }
    fclose(f);
    return inside;
}

/* Whether an entry before entry (lists[0] first, then lists[1]) names pid. */
static int listed_before(const struct json *const lists[2], const struct json *entry, unsigned int pid)
{
    for (int l = 0; l < 2; l++)
        for (const struct json *p = lists[l] ? lists[l]->child : NULL; p; p = p->next) {
            if (p == entry)
                return 0;
            if ((unsigned int)json_ull(p, "pid", 0, 0) == pid)
                return 1;
        }
    return 0;
}

/* GPU memory that the state's "processes" and "mpsProcesses" of the GPU uuid use in the cgroup path or below
 * it; a process listed twice counts once, by its first entry; "usedGpuMemory": null counts 0. */
static unsigned long long cgroup_used(const struct json *state, const char *uuid, const char *path)
{
    const struct json *lists[2] = {json_get(json_get(state, "processes"), uuid),
                                   json_get(json_get(state, "mpsProcesses"), uuid)};
    unsigned long long used = 0;

    for (int l = 0; l < 2; l++)
        for (const struct json *p = lists[l] ? lists[l]->child : NULL; p; p = p->next) {
            unsigned int pid = (unsigned int)json_ull(p, "pid", 0, 0);
            if (!listed_before(lists, p, pid) && process_in_cgroup(pid, path))
                used += json_ull(p, "usedGpuMemory", 0, 0);
        }
    return used;
}

/* Drops the limits of cgroups whose directory is gone: removing a cgroup clears its limits. Returns how many. */
static int drop_removed_cgroups(struct json *state)
{
    struct json *limits = (struct json *)json_get(state, "memoryLimits");
    int dropped = 0;

    if (!limits || limits->type != J_OBJECT)
        return 0;
    for (struct json **link = &limits->child; *link;) {
        struct json *cgroup = *link;
        if (is_directory(cgroup->key)) {
            link = &cgroup->next;
            continue;
        }
        *link = cgroup->next;
        cgroup->next = NULL;
        json_free(cgroup);
        dropped++;
    }
    if (dropped && !limits->child)
        json_remove(state, "memoryLimits");
    return dropped;
}

/* Sets the GPU's limit for the cgroup path in state, or clears it (soft 0, hard NVML_DEVICE_MEMORY_LIMIT_MAX),
 * dropping what is left empty. */
static nvmlReturn_t put_memory_limit(struct json *state, nvmlDevice_t device, const char *path,
                                     const nvmlSetMemoryLimits_v1_t *set)
{
    struct json *limits, *cgroup, *limit;
    struct timespec now;

    if (set->softLimit == 0 && set->hardLimit == NVML_DEVICE_MEMORY_LIMIT_MAX) {
        limits = (struct json *)json_get(state, "memoryLimits");
        cgroup = (struct json *)json_get(limits, path);
        if (cgroup && cgroup->type == J_OBJECT)
            json_remove(cgroup, device->uuid);
        if (cgroup && !cgroup->child)
            json_remove(limits, path);
        if (limits && !limits->child)
            json_remove(state, "memoryLimits");
        return NVML_SUCCESS;
    }
    clock_gettime(CLOCK_REALTIME, &now);
    limits = json_object_member(state, "memoryLimits");
    cgroup = limits ? json_object_member(limits, path) : NULL;
    limit = cgroup ? json_put(cgroup, device->uuid, json_new(J_OBJECT)) : NULL;
    if (!limit || !json_put(limit, "soft", json_new_uint(set->softLimit)) ||
        !json_put(limit, "hard", json_new_uint(set->hardLimit)) ||
        !json_put(limit, "setAt", json_new_real((double)now.tv_sec + (double)now.tv_nsec / 1e9)) ||
        !json_put(limit, "setBy", json_new_uint((unsigned long long)getpid())))
        return NVML_ERROR_MEMORY;
    return NVML_SUCCESS;
}

/* Reads, and with set changes, the limits of the cgroup path on device, under the state file's lock (without
 * FAKE_NVML_STATE: in this process's own state). Cgroups that are gone are dropped first, so a path that is no
 * longer a cgroup is NOT_FOUND. get (when not NULL) is filled on success. */
static nvmlReturn_t use_memory_limits(nvmlDevice_t device, const char *path, const nvmlSetMemoryLimits_v1_t *set,
                                      nvmlGetMemoryLimits_v1_t *get)
{
    const char *file = getenv("FAKE_NVML_STATE");
    struct json *state = NULL;
    int lock_fd = -1, changed;
    nvmlReturn_t rc = NVML_SUCCESS, written;

    if (!file || !*file) {
        file = NULL;
        if (!g_own_state && !(g_own_state = json_new(J_OBJECT)))
            return NVML_ERROR_MEMORY;
        state = g_own_state;
    } else {
        lock_fd = lock_state(file);
        if (lock_fd < 0)
            return NVML_ERROR_UNKNOWN;
        rc = read_state(&state);
        if (rc == NVML_SUCCESS && !state && !(state = json_new(J_OBJECT)))
            rc = NVML_ERROR_MEMORY;
    }
    if (rc == NVML_SUCCESS) {
        changed = drop_removed_cgroups(state);
        if (!is_cgroup(path))
            rc = NVML_ERROR_NOT_FOUND;
        else if (set) {
            rc = put_memory_limit(state, device, path, set);
            changed = 1;
        } else {
            const struct json *limit = json_get(json_get(json_get(state, "memoryLimits"), path), device->uuid);
            get->softLimit = limit ? json_get(limit, "soft")->unum : 0; /* checked by read_state() */
            get->hardLimit = limit ? json_get(limit, "hard")->unum : NVML_DEVICE_MEMORY_LIMIT_MAX;
            get->currentUsed = cgroup_used(state, device->uuid, path);
        }
        if (file && changed && (written = write_state(file, state)) != NVML_SUCCESS && rc == NVML_SUCCESS)
            rc = written;
    }
    if (file) {
        json_free(state);
        close(lock_fd);
    }
    return rc;
}

/* What both calls check before the nameSpace, in this order (g_lock held). */
static nvmlReturn_t check_memory_limits_call(nvmlDevice_t device, const void *limits)
{
    nvmlReturn_t rc;

    if (!g_sys.memory_limits)
        return NVML_ERROR_FUNCTION_NOT_FOUND; /* a driver before r615: pynvml finds no such symbol */
    rc = check_device(device, 0);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!g_sys.cgroup_v2 || device->mig_mode == 1)
        return NVML_ERROR_NOT_SUPPORTED;
    return limits ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device, const nvmlSetMemoryLimits_v1_t *limits)
{
    char path[PATH_MAX];
    nvmlReturn_t rc = enter();

    if (rc == NVML_SUCCESS)
        rc = check_memory_limits_call(device, limits);
    if (rc == NVML_SUCCESS)
        rc = cgroup_path(limits->nameSpace, path);
    if (rc == NVML_SUCCESS && (limits->hardLimit == 0 || limits->softLimit > limits->hardLimit))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && geteuid() != 0)
        rc = NVML_ERROR_NO_PERMISSION;
    if (rc == NVML_SUCCESS)
        rc = use_memory_limits(device, path, limits, NULL);
    return leave(rc);
}

nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device, nvmlGetMemoryLimits_v1_t *limits)
{
    char path[PATH_MAX];
    nvmlReturn_t rc = enter();

    if (rc == NVML_SUCCESS)
        rc = check_memory_limits_call(device, limits);
    if (rc == NVML_SUCCESS)
        rc = cgroup_path(limits->nameSpace, path);
    if (rc == NVML_SUCCESS)
        rc = use_memory_limits(device, path, NULL, limits);
    return leave(rc);
}

/* ------------------------------------------------------------------------------------------------
 * Events: event sets read the JSON lines that tests append to FAKE_NVML_EVENTS
 * ---------------------------------------------------------------------------------------------- */

#define EVENT_POLL_NS 5000000L /* 5 ms */

static int event_set_valid(nvmlEventSet_t set)
{
    for (struct fake_event_set *s = g_event_sets; s; s = s->next)
        if (s == set)
            return 1;
    return 0;
}

static off_t events_file_size(void)
{
    const char *path = getenv("FAKE_NVML_EVENTS");
    struct stat st;
    if (!path || !*path || stat(path, &st) != 0)
        return 0;
    return st.st_size;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    struct fake_event_set *s;
    nvmlReturn_t rc = enter();

    if (rc == NVML_SUCCESS && !set)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc != NVML_SUCCESS)
        return leave(rc);
    s = calloc(1, sizeof(*s));
    if (!s)
        return leave(NVML_ERROR_MEMORY);
    s->offset = events_file_size(); /* only events appended from now on */
    s->next = g_event_sets;
    g_event_sets = s;
    *set = s;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    nvmlReturn_t rc = enter();
    if (rc != NVML_SUCCESS)
        return leave(rc);
    for (struct fake_event_set **link = &g_event_sets; *link; link = &(*link)->next) {
        if (*link == set) {
            *link = set->next;
            free(set);
            return leave(NVML_SUCCESS);
        }
    }
    return leave(NVML_ERROR_INVALID_ARGUMENT);
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    nvmlReturn_t rc = enter_device(device, 0);
    if (rc == NVML_SUCCESS && !eventTypes)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS)
        *eventTypes = device->supported_event_types;
    return leave(rc);
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set)
{
    nvmlReturn_t rc = enter_device(device, 0);
    if (rc == NVML_SUCCESS && !event_set_valid(set))
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc == NVML_SUCCESS && device->register_events_error)
        rc = (nvmlReturn_t)device->register_events_error;
    if (rc == NVML_SUCCESS && (eventTypes & ~device->supported_event_types))
        rc = NVML_ERROR_NOT_SUPPORTED;
    if (rc == NVML_SUCCESS)
        set->registered[device - g_sys.gpus] |= eventTypes;
    return leave(rc);
}

/* Handles one complete line (NUL-terminated). Returns 1 when it ends the wait: *rc is then the
 * result and, on success, *data is filled in (legacy: the nvmlEventData_v1_t layout). */
static int handle_event_line(nvmlEventSet_t set, char *line, size_t len, const char *path, void *data, int legacy,
                             nvmlReturn_t *rc)
{
    struct parser p = {.s = line, .len = len};
    struct json *ev = NULL;
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = "";
    long long error = 0, xid = -1, type = (long long)nvmlEventTypeXidCriticalError, value = 0;
    long long gi = NVML_NO_INSTANCE_ID, ci = NVML_NO_INSTANCE_ID;
    unsigned int i;
    int bad = 0;

    skip_ws(&p);
    if (p.pos == p.len)
        return 0; /* blank line */
    if (parse_value(&p, &ev, 0) == 0) {
        skip_ws(&p);
        if (p.pos != p.len)
            fail(&p, "trailing characters after JSON value");
    }
    if (p.error || ev->type != J_OBJECT) {
        complain("%s: skipping malformed event line: %s", path, p.error ? p.error : "not an object");
        json_free(ev);
        return 0;
    }
    bad |= get_int(ev, "error", 0, INT32_MAX, &error, path);
    bad |= get_string(ev, "uuid", uuid, sizeof(uuid), path);
    bad |= get_int(ev, "xid", 0, INT64_MAX, &xid, path);
    bad |= get_int(ev, "eventType", 1, INT64_MAX, &type, path);
    bad |= get_int(ev, "eventData", 0, INT64_MAX, &value, path);
    bad |= get_int(ev, "gpuInstanceId", 0, UINT32_MAX, &gi, path);
    bad |= get_int(ev, "computeInstanceId", 0, UINT32_MAX, &ci, path);
    if (!bad && json_get(ev, "error") && error == 0) {
        complain("%s: \"error\" must be a non-zero nvmlReturn_t", path);
        bad = 1;
    }
    if (xid >= 0 && !json_get(ev, "eventData"))
        value = xid;
    json_free(ev);
    if (bad) {
        complain("%s: skipping event line %s", path, line);
        return 0;
    }
    if (error) {
        *rc = (nvmlReturn_t)error;
        return 1;
    }
    for (i = 0; i < g_sys.gpu_count; i++)
        if (strcmp(g_sys.gpus[i].uuid, uuid) == 0)
            break;
    if (i == g_sys.gpu_count || !((unsigned long long)type & set->registered[i]))
        return 0; /* unknown GPU, or not registered for this set */
    if (legacy) {
        nvmlEventData_v1_t *out = data;
        out->device = &g_sys.gpus[i];
        out->eventType = (unsigned long long)type;
        out->eventData = (unsigned long long)value;
    } else {
        nvmlEventData_t *out = data;
        out->device = &g_sys.gpus[i];
        out->eventType = (unsigned long long)type;
        out->eventData = (unsigned long long)value;
        out->gpuInstanceId = (unsigned int)gi;
        out->computeInstanceId = (unsigned int)ci;
    }
    *rc = NVML_SUCCESS;
    return 1;
}

/* Consumes the complete lines appended since the set last looked (the caller holds g_lock).
 * Returns 1 when a line ended the wait (*rc says how), 0 when there is nothing for the set yet. */
static int next_event(nvmlEventSet_t set, void *data, int legacy, nvmlReturn_t *rc)
{
    const char *path = getenv("FAKE_NVML_EVENTS");
    struct stat st;
    char *buf, *line, *end;
    size_t len, got = 0;
    int fd, done = 0;

    if (!path || !*path)
        return 0;
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno != ENOENT)
            complain("cannot open %s: %s", path, strerror(errno));
        set->offset = 0; /* a file created later is read from its start */
        return 0;
    }
    if (fstat(fd, &st) != 0 || st.st_size == set->offset) {
        close(fd);
        return 0;
    }
    if (st.st_size < set->offset)
        set->offset = 0; /* truncated or replaced: start over */
    len = (size_t)(st.st_size - set->offset);
    buf = malloc(len + 1);
    if (!buf) {
        close(fd);
        *rc = NVML_ERROR_MEMORY;
        return 1;
    }
    while (got < len) {
        ssize_t n = pread(fd, buf + got, len - got, set->offset + (off_t)got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    close(fd);
    buf[got] = '\0';
    for (line = buf; !done && (end = memchr(line, '\n', got - (size_t)(line - buf))); line = end + 1) {
        *end = '\0';
        set->offset += end - line + 1;
        done = handle_event_line(set, line, (size_t)(end - line), path, data, legacy, rc);
    }
    free(buf);
    return done;
}

static long long elapsed_ms(const struct timespec *start)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - start->tv_sec) * 1000LL + (now.tv_nsec - start->tv_nsec) / 1000000L;
}

/* Polls for the set's next event; g_lock is held only while looking, never while sleeping. */
static nvmlReturn_t event_wait(nvmlEventSet_t set, void *data, unsigned int timeoutms, int legacy)
{
    struct timespec start;

    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        nvmlReturn_t rc = enter();
        int done = 1;
        if (rc == NVML_SUCCESS && (!data || !event_set_valid(set)))
            rc = NVML_ERROR_INVALID_ARGUMENT;
        if (rc == NVML_SUCCESS)
            done = next_event(set, data, legacy, &rc);
        leave(rc);
        if (done)
            return rc;

        long long left = (long long)timeoutms - elapsed_ms(&start);
        if (left <= 0)
            return NVML_ERROR_TIMEOUT;
        struct timespec nap = {0, left * 1000000LL < EVENT_POLL_NS ? (long)(left * 1000000LL) : EVENT_POLL_NS};
        nanosleep(&nap, NULL);
    }
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return event_wait(set, data, timeoutms, 0);
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_v1_t *data, unsigned int timeoutms)
{
    return event_wait(set, data, timeoutms, 1);
}
