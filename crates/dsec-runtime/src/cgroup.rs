//! Sandbox cgroups on cgroup v2 and on v1/hybrid hosts.
//!
//! Every sandbox cgroup lives beneath the cgroup the server itself runs in, inside a
//! directory named `dsec-<tag>` (the tag is derived from the state directory, so two
//! servers never touch each other's sandboxes). Production hosts are unified (v2); some
//! hosts, this project's CI among them, mount cpu, memory, pids and freezer as v1
//! hierarchies: [`CgroupLayout::detect`] finds out which and the rest of the code asks the
//! layout rather than the host.
//!
//! Each command runs in a child cgroup of the sandbox (`e<N>`) on the *tracking* hierarchy
//! (v2, or the v1 freezer), which is how a timeout kills a whole process tree, double
//! forks included.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
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
        let mut unified_mount = None;
        let mut v1_mounts: Vec<(Vec<String>, PathBuf)> = Vec::new();
        for line in mountinfo.lines() {
            let Some((left, right)) = line.split_once(" - ") else {
                continue;
            };
            let mount_point = left.split(' ').nth(4).unwrap_or_default();
            let mut rfields = right.split(' ');
            let fstype = rfields.next().unwrap_or_default();
            let super_opts = rfields.nth(1).unwrap_or_default();
            match fstype {
                "cgroup2" => unified_mount = Some(PathBuf::from(mount_point)),
                "cgroup" => v1_mounts.push((
                    super_opts.split(',').map(str::to_owned).collect(),
                    PathBuf::from(mount_point),
                )),
                _ => {}
            }
        }
        let own_path = |controller: &str| -> Option<String> {
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
        };
        let v1_base = |controller: &'static str| -> Result<PathBuf, CgroupError> {
            let mount = v1_mounts
                .iter()
                .find(|(opts, _)| opts.iter().any(|o| o == controller))
                .map(|(_, m)| m)
                .ok_or(CgroupError::MissingController(controller))?;
            let own = own_path(controller).ok_or(CgroupError::MissingController(controller))?;
            Ok(mount.join(own).join(&leaf))
        };
        if v1_mounts
            .iter()
            .any(|(o, _)| o.iter().any(|c| c == "memory"))
        {
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
        let mount = unified_mount.ok_or(CgroupError::MissingController("memory"))?;
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

    /// Creates the `dsec-<tag>` parents. On v2 the server first moves itself into a leaf
    /// (`dsec-<tag>-server`) so that its own cgroup may delegate controllers.
    pub fn prepare(&self) -> Result<(), CgroupError> {
        for base in self.bases() {
            fs::create_dir_all(base).map_err(io_err("create", base))?;
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
        Ok(())
    }

    /// Removes the `dsec-<tag>` parents when they are empty (graceful shutdown).
    pub fn remove_parents(&self) {
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
        let mut ids: Vec<String> = self
            .bases()
            .iter()
            .filter_map(|b| fs::read_dir(b).ok())
            .flatten()
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }
}

/// The cgroups of one sandbox. On v1 the directories are, in order: memory, pids, cpu,
/// freezer, then cpuacct when it is a separate hierarchy.
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
        for dir in &self.dirs {
            fs::create_dir(dir).map_err(io_err("create", dir))?;
        }
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

    /// Reads memory, pids and CPU usage; missing files read as zero.
    pub fn usage(&self) -> CgroupUsage {
        let num = |p: PathBuf| -> u64 {
            fs::read_to_string(p)
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(0)
        };
        match self.version {
            CgroupVersion::V2 => {
                let d = &self.dirs[0];
                let cpu_us = fs::read_to_string(d.join("cpu.stat"))
                    .ok()
                    .and_then(|s| stat_field(&s, "usage_usec"))
                    .unwrap_or(0);
                CgroupUsage {
                    memory_bytes: num(d.join("memory.current")),
                    pids: num(d.join("pids.current")),
                    cpu_ns: cpu_us * 1000,
                }
            }
            CgroupVersion::V1 => CgroupUsage {
                memory_bytes: num(self.memory().join("memory.usage_in_bytes")),
                pids: num(self.pids().join("pids.current")),
                cpu_ns: num(self.cpuacct().join("cpuacct.usage")),
            },
        }
    }

    /// How many times the kernel's OOM killer fired in this sandbox.
    pub fn oom_kills(&self) -> u64 {
        let (file, key) = match self.version {
            CgroupVersion::V2 => (self.dirs[0].join("memory.events"), "oom_kill"),
            CgroupVersion::V1 => (self.memory().join("memory.oom_control"), "oom_kill"),
        };
        fs::read_to_string(file)
            .ok()
            .and_then(|s| stat_field(&s, key))
            .unwrap_or(0)
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
    for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
        // Processes of a sandbox's own cgroup: found by dsec's path, not by name.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
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
        for b in layout.bases() {
            fs::create_dir_all(b).unwrap();
        }
        let sb = layout.sandbox("s");
        sb.create(&CgroupLimits {
            cpus: 1.5,
            memory_bytes: 64 << 20,
            pids: 32,
        })
        .unwrap();
        let read = |p: PathBuf| fs::read_to_string(p).unwrap();
        assert_eq!(read(base("cpu/s/cpu.cfs_quota_us")), "150000");
        assert_eq!(read(base("memory/s/memory.limit_in_bytes")), "67108864");
        assert_eq!(read(base("pids/s/pids.max")), "32");
        fs::write(
            base("memory/s/memory.oom_control"),
            "oom_kill_disable 0\noom_kill 3\n",
        )
        .unwrap();
        assert_eq!(sb.oom_kills(), 3);
        fs::write(base("pids/s/pids.current"), "7\n").unwrap();
        assert_eq!(sb.usage().pids, 7);
        assert_eq!(layout.existing_sandboxes(), vec!["s".to_owned()]);
    }
}
