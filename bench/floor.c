// floor: the raw cost of a container on this host, with nothing but the kernel.
//
// Each container is created the cheapest way we know:
//   clone(CLONE_NEWNS|CLONE_NEWPID|CLONE_NEWUTS|CLONE_NEWIPC|CLONE_NEWNET)
//   -> make / private (MS_REC|MS_PRIVATE)
//   -> tmpfs for the writable layer, overlay(lowerdir=ROOTFS, upper/work on the tmpfs)
//   -> pivot_root(".", ".") + detach the old root
//   -> exec /bin/true
// and the parent waits for it. The latency of one container is clone() -> waitpid().
//
// usage: floor -r ROOTFS [-n N] [-p P] [-w WARMUP] [-d SCRATCH]
//   -n N        containers to create (default 1000)
//   -p P        P concurrent worker processes (default 1: sequential); with P > 1 the
//               output adds containers/s over the whole run
//   -w WARMUP   unmeasured containers first (default 10)
//   -d SCRATCH  an empty directory each container mounts its tmpfs on, inside its own
//               mount namespace (default: a fresh directory under /tmp)
//
// Output: one JSON line on stdout, e.g.
//   {"bench":"floor","n":1000,"concurrency":1,"failed":0,"p50_ms":1.2,"p99_ms":2.0,
//    "mean_ms":1.3,"min_ms":1.0,"max_ms":3.1,"wall_s":1.3,"per_s":770.0}
// Exit status: 0 when every container ran /bin/true successfully, 1 otherwise.
//
// Build: gcc -O2 -Wall -Wextra -o floor floor.c    (run as root)
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define STACK_SIZE (64 * 1024)

static const char *g_rootfs;
static const char *g_scratch;
static char g_upper[4096], g_work[4096], g_merged[4096], g_opts[16384];

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

// Child side: runs as pid 1 of fresh namespaces. Reports the failing step via exit code.
static void fail(int code, const char *what) {
    // Only the first failures are worth reading; the parent counts the rest.
    fprintf(stderr, "floor: child: %s: %s\n", what, strerror(errno));
    _exit(code);
}

static int child_main(void *arg) {
    (void)arg;
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) fail(10, "make / private");
    if (mount("tmpfs", g_scratch, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=0755") != 0)
        fail(11, "mount tmpfs");
    if (mkdir(g_upper, 0755) != 0) fail(12, "mkdir upper");
    if (mkdir(g_work, 0755) != 0) fail(12, "mkdir work");
    if (mkdir(g_merged, 0755) != 0) fail(12, "mkdir merged");
    if (mount("overlay", g_merged, "overlay", 0, g_opts) != 0) fail(13, "mount overlay");
    if (chdir(g_merged) != 0) fail(14, "chdir merged");
    if (syscall(SYS_pivot_root, ".", ".") != 0) fail(15, "pivot_root");
    if (umount2(".", MNT_DETACH) != 0) fail(16, "detach old root");
    if (chdir("/") != 0) fail(17, "chdir /");
    char *const argv[] = {"/bin/true", NULL};
    char *const envp[] = {"PATH=/usr/sbin:/usr/bin:/sbin:/bin", NULL};
    execve(argv[0], argv, envp);
    fail(18, "exec /bin/true");
    return 127;
}

static const int CLONE_FLAGS =
    CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWNET | SIGCHLD;

// One container, start to finish. Returns its latency in seconds, or -1 on failure.
static double one_container(char *stack_top) {
    double t0 = now_s();
    pid_t pid = clone(child_main, stack_top, CLONE_FLAGS, NULL);
    if (pid < 0) {
        perror("floor: clone");
        return -1;
    }
    int status;
    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR) {
            perror("floor: waitpid");
            return -1;
        }
    }
    double dt = now_s() - t0;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return -1;
    return dt;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double percentile(const double *sorted, long n, double q) {
    if (n == 0) return 0;
    double pos = q * (double)(n - 1);
    long lo = (long)pos;
    long hi = lo + 1 < n ? lo + 1 : lo;
    double frac = pos - (double)lo;
    return sorted[lo] + (sorted[hi] - sorted[lo]) * frac;
}

static void usage(const char *argv0) {
    fprintf(stderr, "usage: %s -r ROOTFS [-n N] [-p P] [-w WARMUP] [-d SCRATCH]\n", argv0);
    exit(2);
}

int main(int argc, char **argv) {
    long n = 1000, warmup = 10;
    int workers = 1;
    char scratch_buf[] = "/tmp/dsec-floor.XXXXXX";
    int own_scratch = 0;
    int opt;
    while ((opt = getopt(argc, argv, "r:n:p:w:d:h")) != -1) {
        switch (opt) {
        case 'r': g_rootfs = optarg; break;
        case 'n': n = atol(optarg); break;
        case 'p': workers = atoi(optarg); break;
        case 'w': warmup = atol(optarg); break;
        case 'd': g_scratch = optarg; break;
        default: usage(argv[0]);
        }
    }
    if (!g_rootfs || n <= 0 || workers <= 0 || warmup < 0) usage(argv[0]);
    if (geteuid() != 0) {
        fprintf(stderr, "floor: needs root (namespaces, mounts)\n");
        return 2;
    }
    char rootfs_abs[4096];
    if (!realpath(g_rootfs, rootfs_abs)) {
        fprintf(stderr, "floor: rootfs %s: %s\n", g_rootfs, strerror(errno));
        return 2;
    }
    char true_path[8192];
    snprintf(true_path, sizeof true_path, "%s/bin/true", rootfs_abs);
    if (access(true_path, F_OK) != 0 && faccessat(AT_FDCWD, true_path, F_OK, AT_SYMLINK_NOFOLLOW) != 0) {
        fprintf(stderr, "floor: %s/bin/true not found\n", rootfs_abs);
        return 2;
    }
    if (!g_scratch) {
        if (!mkdtemp(scratch_buf)) {
            perror("floor: mkdtemp");
            return 2;
        }
        g_scratch = scratch_buf;
        own_scratch = 1;
    }
    // Every child mounts its own tmpfs on the same scratch directory: the mount lives in
    // the child's private mount namespace, so concurrent children never see each other's.
    snprintf(g_upper, sizeof g_upper, "%s/upper", g_scratch);
    snprintf(g_work, sizeof g_work, "%s/work", g_scratch);
    snprintf(g_merged, sizeof g_merged, "%s/merged", g_scratch);
    snprintf(g_opts, sizeof g_opts, "lowerdir=%s,upperdir=%s,workdir=%s", rootfs_abs, g_upper,
             g_work);

    // Latencies from every worker, in shared memory.
    double *lat = mmap(NULL, sizeof(double) * (size_t)n, PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (lat == MAP_FAILED) {
        perror("floor: mmap");
        return 2;
    }
    for (long i = 0; i < n; i++) lat[i] = -1;

    char *stack = malloc(STACK_SIZE);
    if (!stack) return 2;
    char *stack_top = stack + STACK_SIZE;

    for (long i = 0; i < warmup; i++) one_container(stack_top);

    double t0 = now_s();
    if (workers == 1) {
        for (long i = 0; i < n; i++) lat[i] = one_container(stack_top);
    } else {
        pid_t *pids = calloc((size_t)workers, sizeof(pid_t));
        for (int w = 0; w < workers; w++) {
            pid_t pid = fork();
            if (pid < 0) {
                perror("floor: fork");
                return 2;
            }
            if (pid == 0) {
                // Worker w takes containers w, w+P, w+2P, ...
                for (long i = w; i < n; i += workers) lat[i] = one_container(stack_top);
                _exit(0);
            }
            pids[w] = pid;
        }
        for (int w = 0; w < workers; w++) waitpid(pids[w], NULL, 0);
        free(pids);
    }
    double wall = now_s() - t0;

    double *ok = malloc(sizeof(double) * (size_t)n);
    long nok = 0;
    double sum = 0;
    for (long i = 0; i < n; i++) {
        if (lat[i] >= 0) {
            ok[nok++] = lat[i] * 1e3;
            sum += lat[i] * 1e3;
        }
    }
    qsort(ok, (size_t)nok, sizeof(double), cmp_double);
    long failed = n - nok;
    printf("{\"bench\":\"floor\",\"n\":%ld,\"concurrency\":%d,\"failed\":%ld,"
           "\"p50_ms\":%.3f,\"p99_ms\":%.3f,\"mean_ms\":%.3f,\"min_ms\":%.3f,\"max_ms\":%.3f,"
           "\"wall_s\":%.3f,\"per_s\":%.1f}\n",
           n, workers, failed, percentile(ok, nok, 0.50), percentile(ok, nok, 0.99),
           nok ? sum / (double)nok : 0.0, nok ? ok[0] : 0.0, nok ? ok[nok - 1] : 0.0, wall,
           wall > 0 ? (double)nok / wall : 0.0);
    fflush(stdout);
    if (own_scratch) rmdir(g_scratch);
    free(ok);
    free(stack);
    return failed ? 1 : 0;
}
