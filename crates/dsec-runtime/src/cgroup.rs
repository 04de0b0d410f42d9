//! Sandbox cgroups on cgroup v2 and on v1/hybrid hosts.
//!
//! Every sandbox cgroup lives beneath the cgroup the server itself runs in, inside a
//! directory named `dsec-<tag>` (the tag is derived from the state directory, so two
//! servers never touch each other's sandboxes). Production hosts are unified (v2); some
//! hosts, this project's CI among them, mount cpu, memory, pids and freezer as v1
//! hierarchies: [`CgroupLayout::detect`] finds out which and the rest of the code asks the
//! layout rather than the host.
//!
//! The `dsec-<tag>` parents carry limits of their own ([`ParentLimits`]): all sandboxes
//! together cannot take the memory or the pids the server and the host need.
//!
//! On v1 hosts, init and the commands are charged apart: the sandbox's memory cgroup, with
//! its limit, holds the commands only, and every init of the server lives in one shared
//! memory cgroup, `dsec-<tag>/inits`, without a limit of its own. The kernel's OOM killer
//! then only ever chooses among a sandbox's commands, and memory an agent pins without a
//! process to kill (tmpfs files, inodes, dentries) fills its commands' cgroup, never the
//! budget init allocates from: a full sandbox OOM-kills its commands and keeps answering.
//! `oom_score_adj` cannot give that guarantee: lowering it needs `CAP_SYS_RESOURCE`, which
//! not every host grants (see `init::protect_from_oom_killer`). One shared cgroup, not one
//! more per sandbox, because each memory cgroup costs the kernel ~1 KiB per 64 memory-aware
//! shrinkers on the host (every sandbox's superblocks register some), so a second cgroup per
//! sandbox would double a cost that grows with the square of the sandbox count.
//!
//! On v2 init shares its sandbox's memory cgroup, as before: there a cgroup with children
//! holds no process, so the split costs two more memory cgroups per sandbox, and where
//! cgroup namespaces are delegation boundaries (`nsdelegate`) init could not place its
//! commands in a cgroup outside its own namespace without a per-exec `cgroup.procs` write,
//! which waits for an RCU grace period. On v2 init's protection is its OOM score.
//!
//! On v1 a sandbox's five `mkdir`s (the memory controller's alone ~0.3 ms) would be on its
//! create's path; [`SpareCgroups`] makes sets ahead, named `.spare-<n>`, and a create
//! renames one to the sandbox's id (v1 allows a rename within the parent) and writes its
//! limits. cgroup2 refuses every rename, so on v2 each create makes its own.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Which cgroup API the host offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum CgroupVersion {
    /// v1 hierarchies (legacy or hybrid hosts).
    V1,
    /// The unified hierarchy.
    V2,
}

/// A cgroup operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// A controller dsec needs is not mounted.
    #[error("cgroup controller '{0}' is not available on this host")]
    MissingController(&'static str),
    /// Reading or writing a cgroup file failed.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// The v2 cgroup the server runs in holds other processes, so it cannot delegate.
    #[error("cannot enable controllers in {0}: other processes share the server's cgroup; start dsec in a cgroup of its own (e.g. `systemd-run --scope dsec serve`)")]
    NotDelegatable(PathBuf),
}

fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> CgroupError + 'a {
    move |source| CgroupError::Io {
        action,
        path: path.to_owned(),
        source,
    }
}

fn write_file(path: &Path, value: &str) -> Result<(), CgroupError> {
    fs::write(path, value).map_err(io_err("write", path))
}

/// Where this server's sandbox cgroups go, per hierarchy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CgroupLayout {
    /// `<unified mount>/<own cgroup>/dsec-<tag>`.
    V2 {
        /// Parent of the sandbox cgroups.
        base: PathBuf,
    },
    /// One parent directory per v1 hierarchy.
    V1 {
        /// memory hierarchy.
        memory: PathBuf,
        /// pids hierarchy.
        pids: PathBuf,
        /// cpu hierarchy (CFS bandwidth).
        cpu: PathBuf,
        /// cpuacct hierarchy, for CPU usage, when mounted apart from cpu.
        cpuacct: Option<PathBuf>,
        /// freezer hierarchy: pause, and per-command process tracking.
        freezer: PathBuf,
    },
}

/// Limits on the `dsec-<tag>` parents, shared by all sandboxes of this server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParentLimits {
    /// Memory all sandboxes together may use, in bytes.
    pub memory_bytes: u64,
    /// Tasks (processes and threads) all sandboxes together may hold.
    pub pids: u64,
}

/// The tightest limits the cgroups above the server set (its own cgroup included), per
/// resource; `None` where no ancestor sets one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InheritedLimits {
    /// Memory, in bytes.
    pub memory_bytes: Option<u64>,
    /// Tasks.
    pub pids: Option<u64>,
}

/// The v1 memory cgroup, beside the sandboxes', that every init of the server lives in.
const INITS_DIR: &str = "inits";
/// The start of a spare set's name; a sandbox id never starts with a dot.
const SPARE_PREFIX: &str = ".spare-";
/// Spare sets kept on a v1 host: enough for a burst of creates one after another.
const SPARE_SETS: usize = 4;
/// v1 memory limits at or above this mean "no limit" (the kernel's `PAGE_COUNTER_MAX`
/// in bytes, rounded to a page).
const V1_UNLIMITED: u64 = 1 << 62;

/// Limits as the kernel takes them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CgroupLimits {
    /// CPU bandwidth in cores.
    pub cpus: f64,
    /// Memory limit in bytes.
    pub memory_bytes: u64,
    /// Process limit.
    pub pids: u64,
}

/// Resource usage read back from a sandbox cgroup.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CgroupUsage {
    /// Bytes charged.
    pub memory_bytes: u64,
    /// Live tasks.
    pub pids: u64,
    /// CPU time in nanoseconds.
    pub cpu_ns: u64,
    /// Most bytes charged at once (v2: `memory.peak`, 0 on kernels without it).
    pub memory_peak_bytes: u64,
    /// Forks refused by the pids limit.
    pub pids_limit_hits: u64,
    /// Time the CPU quota held runnable tasks back, in nanoseconds (CFS bandwidth
    /// throttling: `throttled_time` on v1, `throttled_usec` on v2).
    pub cpu_throttled_ns: u64,
}

const CFS_PERIOD_US: u64 = 100_000;

impl CgroupLayout {
    /// Reads the host's layout from `/proc/self/mountinfo` and `/proc/self/cgroup`.
    pub fn detect(tag: &str) -> Result<CgroupLayout, CgroupError> {
        let read = |p: &'static str| fs::read_to_string(p).map_err(io_err("read", Path::new(p)));
        Self::from_proc(
            &read("/proc/self/mountinfo")?,
            &read("/proc/self/cgroup")?,
            tag,
        )
    }

    /// The pure part of [`detect`](Self::detect), unit-tested on captured files.
    pub fn from_proc(
        mountinfo: &str,
        proc_cgroup: &str,
        tag: &str,
    ) -> Result<CgroupLayout, CgroupError> {
        let leaf = format!("dsec-{tag}");
        let mounts = CgroupMounts::parse(mountinfo);
        let own_path = |controller: &str| own_path(proc_cgroup, controller);
        let v1_base = |controller: &'static str| -> Result<PathBuf, CgroupError> {
            let mount = mounts
                .v1(controller)
                .ok_or(CgroupError::MissingController(controller))?;
            let own = own_path(controller).ok_or(CgroupError::MissingController(controller))?;
            Ok(mount.join(own).join(&leaf))
        };
        if mounts.v1("memory").is_some() {
            let cpu = v1_base("cpu")?;
            let cpuacct = v1_base("cpuacct").ok().filter(|p| *p != cpu);
            return Ok(CgroupLayout::V1 {
                memory: v1_base("memory")?,
                pids: v1_base("pids")?,
                cpu,
                cpuacct,
                freezer: v1_base("freezer")?,
            });
        }
        let mount = mounts
            .unified
            .ok_or(CgroupError::MissingController("memory"))?;
        let own = own_path("").unwrap_or_default();
        Ok(CgroupLayout::V2 {
            base: mount.join(own).join(&leaf),
        })
    }

    /// Which API this layout speaks.
    pub fn version(&self) -> CgroupVersion {
        match self {
            CgroupLayout::V1 { .. } => CgroupVersion::V1,
            CgroupLayout::V2 { .. } => CgroupVersion::V2,
        }
    }

    fn bases(&self) -> Vec<&Path> {
        match self {
            CgroupLayout::V2 { base } => vec![base],
            CgroupLayout::V1 {
                memory,
                pids,
                cpu,
                cpuacct,
                freezer,
            } => {
                let mut v = vec![memory.as_path(), pids, cpu, freezer];
                v.extend(cpuacct.as_deref());
                v
            }
        }
    }

    /// Creates the `dsec-<tag>` parents (on v1 with the inits' memory cgroup) and sets
    /// their limits. On v2 the server first moves itself into a leaf (`dsec-<tag>-server`)
    /// so that its own cgroup may delegate controllers.
    pub fn prepare(&self, limits: &ParentLimits) -> Result<(), CgroupError> {
        for base in self.bases() {
            fs::create_dir_all(base).map_err(io_err("create", base))?;
        }
        if let CgroupLayout::V1 { memory, .. } = self {
            let inits = memory.join(INITS_DIR);
            fs::create_dir_all(&inits).map_err(io_err("create", &inits))?;
        }
        if let CgroupLayout::V2 { base } = self {
            let own = base.parent().expect("base has a parent");
            let server_leaf = own.join(format!(
                "{}-server",
                base.file_name().expect("named").to_string_lossy()
            ));
            fs::create_dir_all(&server_leaf).map_err(io_err("create", &server_leaf))?;
            write_file(
                &server_leaf.join("cgroup.procs"),
                &std::process::id().to_string(),
            )?;
            for dir in [own, base.as_path()] {
                let control = dir.join("cgroup.subtree_control");
                fs::write(&control, "+cpu +memory +pids").map_err(|e| {
                    if e.raw_os_error() == Some(libc::EBUSY) {
                        CgroupError::NotDelegatable(dir.to_owned())
                    } else {
                        io_err("write", &control)(e)
                    }
                })?;
            }
        }
        let (memory, pids) = match self {
            CgroupLayout::V2 { base } => (base.join("memory.max"), base.join("pids.max")),
            CgroupLayout::V1 { memory, pids, .. } => {
                (memory.join("memory.limit_in_bytes"), pids.join("pids.max"))
            }
        };
        write_file(&memory, &limits.memory_bytes.to_string())?;
        write_file(&pids, &limits.pids.to_string())
    }

    /// The limits the server's own cgroup and its ancestors set: sandboxes cannot use
    /// more than those, whatever the host has.
    pub fn inherited_limits(&self) -> InheritedLimits {
        let (memory_dir, memory_file, pids_dir) = match self {
            CgroupLayout::V2 { base } => (base.as_path(), "memory.max", base.as_path()),
            CgroupLayout::V1 { memory, pids, .. } => {
                (memory.as_path(), "memory.limit_in_bytes", pids.as_path())
            }
        };
        InheritedLimits {
            memory_bytes: tightest_above(memory_dir, memory_file),
            pids: tightest_above(pids_dir, "pids.max"),
        }
    }

    /// Removes the `dsec-<tag>` parents when they are empty (graceful shutdown).
    pub fn remove_parents(&self) {
        if let CgroupLayout::V1 { memory, .. } = self {
            let _ = fs::remove_dir(memory.join(INITS_DIR));
        }
        for base in self.bases() {
            let _ = fs::remove_dir(base);
        }
    }

    /// The cgroup paths of sandbox `id`; nothing is created yet.
    pub fn sandbox(&self, id: &str) -> SandboxCgroup {
        match self {
            CgroupLayout::V2 { base } => SandboxCgroup {
                version: CgroupVersion::V2,
                dirs: vec![base.join(id)],
            },
            CgroupLayout::V1 { .. } => SandboxCgroup {
                version: CgroupVersion::V1,
                dirs: self.bases().iter().map(|b| b.join(id)).collect(),
            },
        }
    }

    /// Sandbox cgroups present on the host, whether or not this run created them: what a
    /// crashed earlier run left behind.
    pub fn existing_sandboxes(&self) -> Vec<String> {
        self.children()
            .into_iter()
            .filter(|name| name != INITS_DIR && !name.starts_with(SPARE_PREFIX))
            .collect()
    }

    /// Removes the spare sets present on the host: what an earlier run left.
    pub fn remove_spares(&self) {
        for name in self.children() {
            if name.starts_with(SPARE_PREFIX) {
                let _ = self.sandbox(&name).destroy();
            }
        }
    }

    /// The names of the cgroups in the `dsec-<tag>` parents, each once.
    fn children(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .bases()
            .iter()
            .filter_map(|b| fs::read_dir(b).ok())
            .flatten()
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names.dedup();
        names
    }
}

/// Sandbox cgroup sets made ahead on v1 hosts (see the module documentation).
#[derive(Debug)]
pub struct SpareCgroups {
    layout: CgroupLayout,
    /// The spares' names; `None` where none are kept (cgroup2) or once closed (the
    /// server is stopping).
    names: Mutex<Option<Vec<String>>>,
    next: AtomicU64,
    /// Held by the one refill at work, and by [`close`](Self::close) so that no refill
    /// is still making a set when the parents are removed.
    refilling: Mutex<()>,
}

impl SpareCgroups {
    /// Spares for `layout`'s sandboxes; none are made before [`refill`](Self::refill).
    pub fn new(layout: CgroupLayout) -> SpareCgroups {
        let kept = layout.version() == CgroupVersion::V1;
        SpareCgroups {
            layout,
            names: Mutex::new(kept.then(Vec::new)),
            next: AtomicU64::new(0),
            refilling: Mutex::new(()),
        }
    }

    fn names(&self) -> std::sync::MutexGuard<'_, Option<Vec<String>>> {
        self.names
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether [`refill`](Self::refill) has anything to do.
    pub fn short(&self) -> bool {
        self.names().as_ref().is_some_and(|n| n.len() < SPARE_SETS)
    }

    /// Turns a spare into `cgroup`'s directories (renamed; limits not written yet);
    /// whether there was one. A spare that cannot be renamed is removed.
    pub fn take_as(&self, cgroup: &SandboxCgroup) -> bool {
        let Some(name) = self.names().as_mut().and_then(Vec::pop) else {
            return false;
        };
        let spare = self.layout.sandbox(&name);
        for (done, (from, to)) in spare.dirs.iter().zip(&cgroup.dirs).enumerate() {
            if let Err(e) = fs::rename(from, to) {
                tracing::warn!(error = %e, from = %from.display(), "renaming a spare cgroup");
                for (from, to) in spare.dirs.iter().zip(&cgroup.dirs).take(done) {
                    let _ = fs::rename(to, from);
                }
                let _ = spare.destroy();
                return false;
            }
        }
        true
    }

    /// Makes spares until there are [`SPARE_SETS`]; one caller at a time, the others
    /// return at once. Blocking: a few `mkdir`s per spare.
    pub fn refill(&self) {
        let Ok(_refilling) = self.refilling.try_lock() else {
            return;
        };
        while self.short() {
            let name = format!(
                "{SPARE_PREFIX}{}",
                self.next.fetch_add(1, Ordering::Relaxed)
            );
            let spare = self.layout.sandbox(&name);
            if let Err(e) = spare.make_dirs() {
                tracing::warn!(error = %e, "making a spare cgroup set");
                let _ = spare.destroy();
                break;
            }
            if let Some(names) = self.names().as_mut() {
                names.push(name);
            }
        }
    }

    /// Removes every spare and makes no more (the server is stopping), once a refill at
    /// work has finished its set.
    pub fn close(&self) {
        let _refilling = self
            .refilling
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for name in self.names().take().unwrap_or_default() {
            let _ = self.layout.sandbox(&name).destroy();
        }
    }
}

/// The cgroups of one sandbox. On v1 the directories are, in order: memory, pids, cpu,
/// freezer, then cpuacct when it is a separate hierarchy. Each holds init; the commands
/// live in the memory hierarchy's child `cmd` (see the module documentation).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SandboxCgroup {
    version: CgroupVersion,
    dirs: Vec<PathBuf>,
}

impl SandboxCgroup {
    /// Every directory, for `cgroup.procs` joins and for cleanup.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Which API this sandbox's cgroups speak.
    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// The files init writes `0` to, to join its cgroups, before it unshares its cgroup
    /// namespace (whose root they so become): on v1 the `tasks` file of every
    /// hierarchy's sandbox cgroup (init is a single thread then, and a thread moving
    /// itself through `tasks` skips the global lock a `cgroup.procs` write takes, which
    /// waits for an RCU grace period: ~20 µs instead of ~10 ms on an idle host), on v2
    /// its `cgroup.procs`.
    pub fn init_joins(&self) -> Vec<PathBuf> {
        match self.version {
            CgroupVersion::V1 => self.dirs.iter().map(|d| d.join("tasks")).collect(),
            CgroupVersion::V2 => vec![self.dirs[0].join("cgroup.procs")],
        }
    }

    /// v1: the file init writes `0` to once in its namespace, to move its memory to the
    /// shared cgroup of inits (see the module documentation).
    pub fn init_memory_home(&self) -> Option<PathBuf> {
        (self.version == CgroupVersion::V1).then(|| self.inits().join("tasks"))
    }

    /// v1: the file each command's first process writes `0` to before it execs, to enter
    /// the sandbox's memory cgroup (init is elsewhere); the same fast path as
    /// [`init_joins`](Self::init_joins). On v2 commands stay in init's cgroup.
    pub fn commands_join(&self) -> Option<PathBuf> {
        (self.version == CgroupVersion::V1).then(|| self.memory().join("tasks"))
    }

    fn inits(&self) -> PathBuf {
        let base = self.memory().parent().unwrap_or_else(|| Path::new("/"));
        base.join(INITS_DIR)
    }

    fn memory(&self) -> &Path {
        &self.dirs[0]
    }

    fn pids(&self) -> &Path {
        &self.dirs[if self.version == CgroupVersion::V1 {
            1
        } else {
            0
        }]
    }

    fn cpu(&self) -> &Path {
        &self.dirs[if self.version == CgroupVersion::V1 {
            2
        } else {
            0
        }]
    }

    fn cpuacct(&self) -> &Path {
        self.dirs
            .get(4)
            .map_or_else(|| self.cpu(), PathBuf::as_path)
    }

    /// The directory whose `freezer.state` (v1) or `cgroup.freeze` (v2) pauses the sandbox.
    pub fn freezer(&self) -> &Path {
        &self.dirs[if self.version == CgroupVersion::V1 {
            3
        } else {
            0
        }]
    }

    /// Makes the directories and writes the limits.
    pub fn create(&self, limits: &CgroupLimits) -> Result<(), CgroupError> {
        self.make_dirs()?;
        self.set_limits(limits)
    }

    fn make_dirs(&self) -> Result<(), CgroupError> {
        for dir in &self.dirs {
            fs::create_dir(dir).map_err(io_err("create", dir))?;
        }
        Ok(())
    }

    /// Writes the limits.
    pub fn set_limits(&self, limits: &CgroupLimits) -> Result<(), CgroupError> {
        // A float-to-integer `as` saturates (NaN and negatives to 0), and 1000 is the floor.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let quota = ((limits.cpus * CFS_PERIOD_US as f64).round() as u64).max(1000);
        match self.version {
            CgroupVersion::V2 => {
                let d = &self.dirs[0];
                write_file(&d.join("memory.max"), &limits.memory_bytes.to_string())?;
                // Without swap the memory limit is the limit; hosts with swap keep it so.
                let _ = fs::write(d.join("memory.swap.max"), "0");
                write_file(&d.join("pids.max"), &limits.pids.to_string())?;
                write_file(&d.join("cpu.max"), &format!("{quota} {CFS_PERIOD_US}"))?;
            }
            CgroupVersion::V1 => {
                write_file(
                    &self.memory().join("memory.limit_in_bytes"),
                    &limits.memory_bytes.to_string(),
                )?;
                write_file(&self.pids().join("pids.max"), &limits.pids.to_string())?;
                write_file(
                    &self.cpu().join("cpu.cfs_period_us"),
                    &CFS_PERIOD_US.to_string(),
                )?;
                write_file(&self.cpu().join("cpu.cfs_quota_us"), &quota.to_string())?;
            }
        }
        Ok(())
    }

    /// What usage and OOM kills are read from.
    fn reader(&self) -> CgroupReader {
        CgroupReader {
            version: self.version,
            memory: self.memory().to_owned(),
            pids: Some(self.pids().to_owned()),
            cpuacct: Some(self.cpuacct().to_owned()),
            cpu: Some(self.cpu().to_owned()),
        }
    }

    /// Reads memory, pids and CPU usage; missing files read as zero.
    pub fn usage(&self) -> CgroupUsage {
        self.reader().usage()
    }

    /// CPU time in nanoseconds, alone (one file read; see [`CgroupReader::cpu_ns`]).
    pub fn cpu_ns(&self) -> u64 {
        self.reader().cpu_ns()
    }

    /// How many of the sandbox's processes the kernel's OOM killer killed (v1: of its
    /// commands; v2: init included).
    pub fn oom_kills(&self) -> u64 {
        self.reader().oom_kills()
    }

    /// The OOM kills of the cgroup init is charged to: on v1 the inits of all sandboxes
    /// (only a host-wide or all-sandboxes shortage reaches them), on v2 the sandbox.
    pub fn init_oom_kills(&self) -> u64 {
        match self.version {
            CgroupVersion::V1 => oom_kills_in(&self.inits(), self.version),
            CgroupVersion::V2 => self.oom_kills(),
        }
    }

    /// Thaws the sandbox without waiting, so that its killed processes can exit: v1's
    /// freezer holds even a SIGKILLed task until it is thawed. Called once the kill is
    /// pending, so no process runs user code again. Best effort: a cgroup already gone is
    /// fine.
    pub fn thaw_for_kill(&self) {
        let (file, value) = match self.version {
            CgroupVersion::V2 => (self.dirs[0].join("cgroup.freeze"), "0"),
            CgroupVersion::V1 => (self.freezer().join("freezer.state"), "THAWED"),
        };
        let _ = fs::write(file, value);
    }

    /// Freezes or thaws every process of the sandbox, and waits (up to a second) until the
    /// kernel reports it done: a paused sandbox must not run one more instruction.
    pub fn set_frozen(&self, frozen: bool) -> Result<(), CgroupError> {
        let (file, value, state_file, done): (PathBuf, &str, PathBuf, &str) = match self.version {
            CgroupVersion::V2 => (
                self.dirs[0].join("cgroup.freeze"),
                if frozen { "1" } else { "0" },
                self.dirs[0].join("cgroup.events"),
                if frozen { "frozen 1" } else { "frozen 0" },
            ),
            CgroupVersion::V1 => (
                self.freezer().join("freezer.state"),
                if frozen { "FROZEN" } else { "THAWED" },
                self.freezer().join("freezer.state"),
                if frozen { "FROZEN" } else { "THAWED" },
            ),
        };
        write_file(&file, value)?;
        let deadline = Instant::now() + Duration::from_secs(1);
        while Instant::now() < deadline {
            let state = fs::read_to_string(&state_file).map_err(io_err("read", &state_file))?;
            if state.lines().any(|l| l.trim() == done) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Err(CgroupError::Io {
            action: "wait for",
            path: state_file,
            source: io::Error::new(io::ErrorKind::TimedOut, format!("not {done} after 1 s")),
        })
    }

    /// Kills whatever is still inside, removes the per-command children and the sandbox
    /// directories. Directories that are already gone are fine: cleanup is idempotent.
    pub fn destroy(&self) -> Result<(), CgroupError> {
        // A paused sandbox's processes (found frozen after a crash, say) could not die.
        self.thaw_for_kill();
        for dir in &self.dirs {
            if !dir.exists() {
                continue;
            }
            let children: Vec<PathBuf> = fs::read_dir(dir)
                .map_err(io_err("list", dir))?
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect();
            for child in children.iter().chain(std::iter::once(dir)) {
                remove_cgroup_dir(child)?;
            }
        }
        Ok(())
    }
}

/// The cgroup mounts of `/proc/self/mountinfo`.
struct CgroupMounts {
    /// The cgroup2 mount (on a hybrid host, the one beside the v1 hierarchies).
    unified: Option<PathBuf>,
    /// Each v1 hierarchy's mount point, with its super options (which name its controllers).
    v1: Vec<(Vec<String>, PathBuf)>,
}

impl CgroupMounts {
    fn parse(mountinfo: &str) -> CgroupMounts {
        let mut mounts = CgroupMounts {
            unified: None,
            v1: Vec::new(),
        };
        for line in mountinfo.lines() {
            let Some((left, right)) = line.split_once(" - ") else {
                continue;
            };
            let mount_point = left.split(' ').nth(4).unwrap_or_default();
            let mut rfields = right.split(' ');
            let fstype = rfields.next().unwrap_or_default();
            let super_opts = rfields.nth(1).unwrap_or_default();
            match fstype {
                "cgroup2" => mounts.unified = Some(PathBuf::from(mount_point)),
                "cgroup" => mounts.v1.push((
                    super_opts.split(',').map(str::to_owned).collect(),
                    PathBuf::from(mount_point),
                )),
                _ => {}
            }
        }
        mounts
    }

    /// The mount point of the v1 hierarchy holding `controller`.
    fn v1(&self, controller: &str) -> Option<&PathBuf> {
        self.v1
            .iter()
            .find(|(opts, _)| opts.iter().any(|o| o == controller))
            .map(|(_, m)| m)
    }
}

/// A process's cgroup for `controller` (`""`: the unified hierarchy's), relative to the
/// hierarchy's root, from the text of `/proc/<pid>/cgroup`.
fn own_path(proc_cgroup: &str, controller: &str) -> Option<String> {
    proc_cgroup.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
        let matches = if controller.is_empty() {
            ctrls.is_empty()
        } else {
            ctrls.split(',').any(|c| c == controller)
        };
        matches.then(|| path.trim_start_matches('/').to_owned())
    })
}

/// Where one cgroup's usage and OOM kills are read, on either API: a sandbox's own, or
/// the cgroup another runtime (Docker) put a process in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupReader {
    version: CgroupVersion,
    /// The memory controller's directory (v2: the cgroup's one directory).
    memory: PathBuf,
    /// The pids controller's, where mounted.
    pids: Option<PathBuf>,
    /// The CPU accounting controller's, where mounted.
    cpuacct: Option<PathBuf>,
    /// The CPU controller's (its `cpu.stat` counts throttling), where mounted.
    cpu: Option<PathBuf>,
}

impl CgroupReader {
    /// The cgroup of process `pid` as this host mounts it; `None` when its memory
    /// controller is not mounted here (or the process is gone).
    pub fn of_process(pid: i32) -> Option<CgroupReader> {
        CgroupReader::from_proc(
            &fs::read_to_string("/proc/self/mountinfo").ok()?,
            &fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?,
        )
    }

    /// The pure part of [`of_process`](Self::of_process): a host with a v1 memory
    /// hierarchy is read as v1 (as [`CgroupLayout::from_proc`] decides).
    pub fn from_proc(mountinfo: &str, proc_cgroup: &str) -> Option<CgroupReader> {
        let mounts = CgroupMounts::parse(mountinfo);
        let v1_dir = |controller: &str| {
            Some(
                mounts
                    .v1(controller)?
                    .join(own_path(proc_cgroup, controller)?),
            )
        };
        if mounts.v1("memory").is_some() {
            return Some(CgroupReader {
                version: CgroupVersion::V1,
                memory: v1_dir("memory")?,
                pids: v1_dir("pids"),
                cpuacct: v1_dir("cpuacct"),
                cpu: v1_dir("cpu"),
            });
        }
        let dir = mounts.unified?.join(own_path(proc_cgroup, "")?);
        Some(CgroupReader {
            version: CgroupVersion::V2,
            memory: dir.clone(),
            pids: Some(dir.clone()),
            cpuacct: Some(dir.clone()),
            cpu: Some(dir),
        })
    }

    /// Memory, pids and CPU usage; missing files read as zero.
    pub fn usage(&self) -> CgroupUsage {
        let (memory, pids, cpuacct) = (
            Some(self.memory.as_path()),
            self.pids.as_deref(),
            self.cpuacct.as_deref(),
        );
        let cpu_stat = read_text(self.cpu.as_deref(), "cpu.stat").unwrap_or_default();
        match self.version {
            CgroupVersion::V2 => {
                // One cpu.stat has both: usage and throttling.
                let usec = |key| stat_field(&cpu_stat, key).unwrap_or(0) * 1000;
                CgroupUsage {
                    memory_bytes: read_number(memory, "memory.current"),
                    pids: read_number(pids, "pids.current"),
                    cpu_ns: usec("usage_usec"),
                    memory_peak_bytes: read_number(memory, "memory.peak"),
                    pids_limit_hits: pids.map_or(0, pids_limit_hits),
                    cpu_throttled_ns: usec("throttled_usec"),
                }
            }
            CgroupVersion::V1 => CgroupUsage {
                memory_bytes: read_number(memory, "memory.usage_in_bytes"),
                pids: read_number(pids, "pids.current"),
                cpu_ns: read_number(cpuacct, "cpuacct.usage"),
                memory_peak_bytes: read_number(memory, "memory.max_usage_in_bytes"),
                pids_limit_hits: pids.map_or(0, pids_limit_hits),
                cpu_throttled_ns: stat_field(&cpu_stat, "throttled_time").unwrap_or(0),
            },
        }
    }

    /// CPU time in nanoseconds, alone: one file read where [`usage`](Self::usage) makes
    /// seven, for a caller that only wants to know whether the cgroup ran at all.
    pub fn cpu_ns(&self) -> u64 {
        let cpuacct = self.cpuacct.as_deref();
        match self.version {
            CgroupVersion::V2 => read_text(cpuacct, "cpu.stat")
                .and_then(|s| stat_field(&s, "usage_usec"))
                .unwrap_or(0)
                .saturating_mul(1000),
            CgroupVersion::V1 => read_number(cpuacct, "cpuacct.usage"),
        }
    }

    /// The OOM kills of processes charged to this cgroup (v1 counts per cgroup, v2 with
    /// its descendants).
    pub fn oom_kills(&self) -> u64 {
        oom_kills_in(&self.memory, self.version)
    }
}

/// `file` of the controller directory `dir`, if both are there.
fn read_text(dir: Option<&Path>, file: &str) -> Option<String> {
    fs::read_to_string(dir?.join(file)).ok()
}

/// A one-number controller file; missing or unreadable reads as zero.
fn read_number(dir: Option<&Path>, file: &str) -> u64 {
    read_text(dir, file)
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// How many forks the pids controller of `dir` refused (`max` in `pids.events`, the same
/// file on v1 and v2); 0 when unreadable.
pub fn pids_limit_hits(dir: &Path) -> u64 {
    fs::read_to_string(dir.join("pids.events"))
        .ok()
        .and_then(|s| stat_field(&s, "max"))
        .unwrap_or(0)
}

/// The OOM kills of processes charged to `dir` (v1 counts per cgroup, v2 with its
/// descendants).
fn oom_kills_in(dir: &Path, version: CgroupVersion) -> u64 {
    let file = match version {
        CgroupVersion::V2 => "memory.events",
        CgroupVersion::V1 => "memory.oom_control",
    };
    read_text(Some(dir), file)
        .and_then(|s| stat_field(&s, "oom_kill"))
        .unwrap_or(0)
}

/// The smallest numeric `file` among the ancestors of `dir` (`dir` itself excluded,
/// walking up while the file exists: the hierarchy's root has none). `max` and v1's
/// huge "unlimited" values count as no limit.
fn tightest_above(dir: &Path, file: &str) -> Option<u64> {
    dir.ancestors()
        .skip(1)
        .map(|d| fs::read_to_string(d.join(file)))
        .take_while(Result::is_ok)
        .filter_map(|text| text.ok()?.trim().parse::<u64>().ok())
        .filter(|v| *v < V1_UNLIMITED)
        .min()
}

fn stat_field(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// Removes one cgroup directory, killing what is left in it and retrying while the
/// kernel finishes tearing dying tasks down (rmdir says EBUSY until then).
fn remove_cgroup_dir(dir: &Path) -> Result<(), CgroupError> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                kill_all(dir);
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(io_err("remove", dir)(e)),
        }
    }
}

/// SIGKILLs every process listed in a cgroup (v1 freezer-less fallback as well as v2).
fn kill_all(dir: &Path) {
    if fs::write(dir.join("cgroup.kill"), "1").is_ok() {
        return;
    }
    let Ok(procs) = fs::read_to_string(dir.join("cgroup.procs")) else {
        return;
    };
    // A process outside this pid namespace reads as 0, which `Pid` leaves out: kill(0)
    // would be our own process group.
    let pids = procs
        .lines()
        .filter_map(|l| rustix::process::Pid::from_raw(l.trim().parse().ok()?));
    for pid in pids {
        // Processes of a sandbox's own cgroup: found by dsec's path, not by name.
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID_MOUNTINFO: &str = "\
30 25 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw
33 30 0:29 / /sys/fs/cgroup/cpu rw,nosuid - cgroup cgroup rw,cpu
34 30 0:30 / /sys/fs/cgroup/cpuacct rw,nosuid - cgroup cgroup rw,cpuacct
35 30 0:31 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
36 30 0:32 / /sys/fs/cgroup/pids rw,nosuid - cgroup cgroup rw,pids
37 30 0:33 / /sys/fs/cgroup/freezer rw,nosuid - cgroup cgroup rw,freezer
";
    const HYBRID_CGROUP: &str = "\
8:pids:/
6:freezer:/
4:memory:/process_api/abc
2:cpuacct:/
1:cpu:/
0::/
";

    #[test]
    fn hybrid_host_nests_each_hierarchy_under_the_servers_cgroup() {
        let layout = CgroupLayout::from_proc(HYBRID_MOUNTINFO, HYBRID_CGROUP, "t1").unwrap();
        assert_eq!(
            layout,
            CgroupLayout::V1 {
                memory: "/sys/fs/cgroup/memory/process_api/abc/dsec-t1".into(),
                pids: "/sys/fs/cgroup/pids/dsec-t1".into(),
                cpu: "/sys/fs/cgroup/cpu/dsec-t1".into(),
                cpuacct: Some("/sys/fs/cgroup/cpuacct/dsec-t1".into()),
                freezer: "/sys/fs/cgroup/freezer/dsec-t1".into(),
            }
        );
        let sb = layout.sandbox("e0-1");
        assert_eq!(
            sb.freezer(),
            Path::new("/sys/fs/cgroup/freezer/dsec-t1/e0-1")
        );
        assert_eq!(sb.dirs().len(), 5);
    }

    #[test]
    fn a_process_cgroup_is_read_where_the_host_mounts_it() {
        let reader = CgroupReader::from_proc(HYBRID_MOUNTINFO, HYBRID_CGROUP).unwrap();
        assert_eq!(reader.version, CgroupVersion::V1);
        assert_eq!(
            reader.memory,
            Path::new("/sys/fs/cgroup/memory/process_api/abc")
        );
        assert_eq!(
            reader.cpuacct.as_deref(),
            Some(Path::new("/sys/fs/cgroup/cpuacct"))
        );
        let unified = "25 20 0:22 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n";
        let reader = CgroupReader::from_proc(unified, "0::/docker/c1\n").unwrap();
        assert_eq!(reader.version, CgroupVersion::V2);
        assert_eq!(
            reader.pids.as_deref(),
            Some(Path::new("/sys/fs/cgroup/docker/c1"))
        );
        // No memory controller mounted here: nothing to read.
        assert_eq!(CgroupReader::from_proc("", "0::/docker/c1\n"), None);
    }

    #[test]
    fn usage_and_oom_kills_are_read_on_v2() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::write(d.join("memory.current"), "4096\n").unwrap();
        fs::write(d.join("pids.current"), "3\n").unwrap();
        fs::write(
            d.join("cpu.stat"),
            "usage_usec 1500\nuser_usec 1000\nnr_throttled 4\nthrottled_usec 700\n",
        )
        .unwrap();
        fs::write(d.join("memory.events"), "low 0\noom 2\noom_kill 2\n").unwrap();
        fs::write(d.join("memory.peak"), "8192\n").unwrap();
        fs::write(d.join("pids.events"), "max 5\n").unwrap();
        let reader = CgroupReader {
            version: CgroupVersion::V2,
            memory: d.to_owned(),
            pids: Some(d.to_owned()),
            cpuacct: Some(d.to_owned()),
            cpu: Some(d.to_owned()),
        };
        assert_eq!(
            reader.usage(),
            CgroupUsage {
                memory_bytes: 4096,
                pids: 3,
                cpu_ns: 1_500_000,
                memory_peak_bytes: 8192,
                pids_limit_hits: 5,
                cpu_throttled_ns: 700_000,
            }
        );
        assert_eq!(reader.oom_kills(), 2);
    }

    #[test]
    fn unified_host_uses_one_directory() {
        let mountinfo = "25 20 0:22 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n";
        let layout =
            CgroupLayout::from_proc(mountinfo, "0::/system.slice/dsec.service\n", "t").unwrap();
        assert_eq!(
            layout,
            CgroupLayout::V2 {
                base: "/sys/fs/cgroup/system.slice/dsec.service/dsec-t".into()
            }
        );
        assert_eq!(layout.sandbox("x").freezer(), layout.sandbox("x").dirs()[0]);
    }

    #[test]
    fn limits_and_usage_on_a_fake_v1_tree() {
        let root = tempfile::tempdir().unwrap();
        let base = |n: &str| root.path().join(n);
        let layout = CgroupLayout::V1 {
            memory: base("memory"),
            pids: base("pids"),
            cpu: base("cpu"),
            cpuacct: None,
            freezer: base("freezer"),
        };
        layout
            .prepare(&ParentLimits {
                memory_bytes: 1 << 30,
                pids: 1000,
            })
            .unwrap();
        let read = |p: PathBuf| fs::read_to_string(p).unwrap();
        assert_eq!(read(base("memory/memory.limit_in_bytes")), "1073741824");
        assert_eq!(read(base("pids/pids.max")), "1000");
        let sb = layout.sandbox("s");
        sb.create(&CgroupLimits {
            cpus: 1.5,
            memory_bytes: 64 << 20,
            pids: 32,
        })
        .unwrap();
        assert_eq!(read(base("cpu/s/cpu.cfs_quota_us")), "150000");
        assert_eq!(read(base("memory/s/memory.limit_in_bytes")), "67108864");
        assert_eq!(read(base("pids/s/pids.max")), "32");
        // init joins every hierarchy, then moves its memory to the inits' cgroup; the
        // commands take its place under the limit.
        assert_eq!(sb.init_joins()[0], base("memory/s/tasks"));
        assert_eq!(sb.init_memory_home(), Some(base("memory/inits/tasks")));
        assert_eq!(sb.commands_join(), Some(base("memory/s/tasks")));
        fs::write(
            base("memory/s/memory.oom_control"),
            "oom_kill_disable 0\noom_kill 3\n",
        )
        .unwrap();
        fs::write(base("memory/inits/memory.oom_control"), "oom_kill 1\n").unwrap();
        assert_eq!(sb.oom_kills(), 3);
        assert_eq!(sb.init_oom_kills(), 1);
        fs::write(base("pids/s/pids.current"), "7\n").unwrap();
        fs::write(
            base("cpu/s/cpu.stat"),
            "nr_periods 9\nnr_throttled 2\nthrottled_time 4500\n",
        )
        .unwrap();
        assert_eq!(sb.usage().pids, 7);
        assert_eq!(sb.usage().cpu_throttled_ns, 4500);
        // The inits' cgroup is no sandbox: a restart must not clean it as one.
        assert_eq!(layout.existing_sandboxes(), vec!["s".to_owned()]);
    }

    #[test]
    fn v2_init_and_commands_share_the_sandbox_cgroup() {
        let root = tempfile::tempdir().unwrap();
        let layout = CgroupLayout::V2 {
            base: root.path().join("dsec-t"),
        };
        let sb = layout.sandbox("s");
        let d = root.path().join("dsec-t/s");
        assert_eq!(sb.init_joins(), vec![d.join("cgroup.procs")]);
        assert_eq!((sb.init_memory_home(), sb.commands_join()), (None, None));
    }

    #[test]
    fn inherited_limits_are_the_tightest_above_the_server() {
        let root = tempfile::tempdir().unwrap();
        // mount root (no limit files), then own/ and own/slice/ with limits, then the base.
        let own = root.path().join("own");
        let slice = own.join("slice");
        let base = slice.join("dsec-t");
        fs::create_dir_all(&base).unwrap();
        fs::write(own.join("memory.max"), "4294967296\n").unwrap();
        fs::write(slice.join("memory.max"), "max\n").unwrap();
        fs::write(own.join("pids.max"), "max\n").unwrap();
        fs::write(slice.join("pids.max"), "900\n").unwrap();
        // The base's own limit is dsec's, not inherited.
        fs::write(base.join("memory.max"), "1024\n").unwrap();
        let layout = CgroupLayout::V2 { base };
        assert_eq!(
            layout.inherited_limits(),
            InheritedLimits {
                memory_bytes: Some(4 << 30),
                pids: Some(900),
            }
        );
        fs::write(own.join("memory.max"), "9223372036854771712\n").unwrap();
        assert_eq!(layout.inherited_limits().memory_bytes, None);
    }
}
