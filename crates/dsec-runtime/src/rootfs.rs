//! The sandbox's filesystem view, built by init inside its fresh mount namespace.
//!
//! Every mount made here belongs to the sandbox's mount namespace alone: the host never
//! sees them, and the kernel drops them all when the sandbox's last process exits, so no
//! crash of the server can leak a mount.
//!
//! Layout: a size-limited tmpfs holds the writable layer (`disk_mb` is its size, and its
//! pages are charged to the sandbox's memory cgroup), an overlay stacks it over the
//! image's read-only layers, then `/proc`, a minimal `/dev` and a read-only `/sys` go on
//! top, with runc's masked and read-only paths, and `pivot_root` makes it `/`.

use std::ffi::CString;
use std::fs;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use rustix::mount::{
    mount, mount_bind, mount_bind_recursive, mount_change, mount_move, mount_remount, MountFlags,
    MountPropagationFlags, UnmountFlags,
};

use crate::spec::SandboxSpec;

/// A step of the root filesystem setup failed.
#[derive(Debug, thiserror::Error)]
#[error("{step} {path}: {source}")]
pub struct RootfsError {
    step: &'static str,
    path: PathBuf,
    source: std::io::Error,
}

impl RootfsError {
    /// The OS error number, for reports across a pipe.
    pub fn errno(&self) -> i32 {
        self.source.raw_os_error().unwrap_or(libc::EIO)
    }
}

trait Step<T> {
    fn step(self, step: &'static str, path: &Path) -> Result<T, RootfsError>;
}

impl<T, E: Into<std::io::Error>> Step<T> for Result<T, E> {
    fn step(self, step: &'static str, path: &Path) -> Result<T, RootfsError> {
        self.map_err(|e| RootfsError {
            step,
            path: path.to_owned(),
            source: e.into(),
        })
    }
}

/// Paths hidden from the sandbox (runc's defaults, plus the kpage* files that expose
/// host physical memory layout). Public so that other backends mask the same list.
pub const MASKED_PATHS: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/interrupts",
    "/proc/kcore",
    "/proc/keys",
    "/proc/kpagecgroup",
    "/proc/kpagecount",
    "/proc/kpageflags",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];

/// Paths the sandbox may read but not write (runc's defaults).
const READONLY_PATHS: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

/// The OOM scores of the sandbox's PID 1 (init, a VM guest's agent), read-only inside:
/// raising a process's score needs no privilege, so any process of the sandbox could
/// otherwise make its init the OOM killer's first choice. `/proc/1/task` (the same files
/// per thread) is masked. A fncall call is PID 1 of a namespace of its own and keeps its
/// score writable: nothing else lives there to protect.
const PID1_READONLY: &[&str] = &["/proc/1/oom_score_adj", "/proc/1/oom_adj"];
const PID1_MASKED: &str = "/proc/1/task";

/// Device nodes of the minimal `/dev`: name, major, minor.
const DEVICES: &[(&str, u32, u32)] = &[
    ("null", 1, 3),
    ("zero", 1, 5),
    ("full", 1, 7),
    ("random", 1, 8),
    ("urandom", 1, 9),
    ("tty", 5, 0),
];

const NOSUID_NODEV_NOEXEC: MountFlags = MountFlags::NOSUID
    .union(MountFlags::NODEV)
    .union(MountFlags::NOEXEC);

/// Where a fncall worker keeps what its calls build their roots from.
pub const WORKER_DIR: &str = "/.dsec";

/// Builds the sandbox's root and pivots into it. Runs in init, in the new namespaces.
///
/// Returns an `O_PATH` descriptor of the writable layer's upper directory: after the
/// pivot nothing in the sandbox can name it, but the edge reaches it through
/// `/proc/<init>/fd/<n>` to snapshot the sandbox.
///
/// A fncall worker's root gets no `/proc`, `/dev` or `/sys` (nothing runs in it directly);
/// instead the image layers are bound read-only under [`WORKER_DIR`], where each call
/// builds a root of its own ([`setup_call`]).
pub fn setup(spec: &SandboxSpec) -> Result<OwnedFd, RootfsError> {
    make_private()?;
    let rootfs = spec.dir.join("rootfs");
    let rw = spec.dir.join("rw");
    let upper = build_overlay(&rw, &rootfs, &spec.layers, spec.disk_bytes)?;
    let root = Root::open(&rootfs)?;
    if spec.worker {
        expose_layers(&root, &spec.layers)?;
    } else {
        build_view(&root, &rw, Pid1::Protected, spec.sysfs.as_deref())?;
    }
    pivot(&rootfs)?;
    Ok(upper)
}

/// Builds a call's root inside a fncall worker and pivots into it. Runs in the call's
/// first process, in mount, pid and IPC namespaces of its own: its writable layer, mounts
/// and processes all vanish when it exits, and the worker is untouched.
///
/// The same as [`prepare_call_root`] then [`finish_call_root`] in one process; a worker's
/// standby builds its next call's root ahead, in two (see `init::standby`).
pub fn setup_call(layer_count: usize, disk_bytes: u64) -> Result<(), RootfsError> {
    prepare_call_root(layer_count, disk_bytes)?;
    finish_call_root()
}

/// Everything of a call's root that does not depend on the call's pid namespace: the
/// writable layer, `/dev`, `/sys` and its masks, and an empty read-only directory on
/// `/proc` for [`finish_call_root`] to mask with; then the pivot. Runs in a mount
/// namespace of its own.
///
/// The detach of the old root after the pivot waits for an RCU grace period (about 2 ms
/// here): a process that builds this ahead keeps that wait off the call's path.
pub fn prepare_call_root(layer_count: usize, disk_bytes: u64) -> Result<(), RootfsError> {
    make_private()?;
    let base = Path::new(WORKER_DIR);
    let layers: Vec<PathBuf> = (0..layer_count)
        .map(|i| base.join("layers").join(i.to_string()))
        .collect();
    let (rootfs, rw) = (base.join("root"), base.join("rw"));
    build_overlay(&rw, &rootfs, &layers, disk_bytes)?;
    let root = Root::open(&rootfs)?;
    mount_dev_sys(&root, &rw, None)?;
    let empty = make_empty_dir(&rw)?;
    mask_all(&root, &empty, non_proc(MASKED_PATHS), &mut None)?;
    bind_with(
        &empty,
        &root.dir("proc")?,
        MountFlags::RDONLY | NOSUID_NODEV_NOEXEC,
    )?;
    pivot(&rootfs)
}

/// The rest of a call's root, made by the call's first process, PID 1 of its new pid
/// namespace, in the root [`prepare_call_root`] built and pivoted into: its `/proc`,
/// masked and read-only paths.
pub fn finish_call_root() -> Result<(), RootfsError> {
    let root = Root::open(Path::new("/"))?;
    let proc_dir = Path::new("/proc");
    // The empty directory on /proc, named through this descriptor once proc covers it.
    let empty = rustix::fs::open(
        proc_dir,
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .step("open", proc_dir)?;
    mount_proc(&root)?;
    // Already a read-only bind: masks bind it as it is.
    let empty = PathBuf::from(format!("/proc/self/fd/{}", empty.as_raw_fd()));
    mount_proc_masks(&root, &empty, Pid1::Alone, &mut Some(empty.clone()))
}

/// Builds a VM guest's root on `rootfs` and makes it `/`. Runs in the guest's agent
/// (PID 1, still in its initramfs), after it mounted the image's read-only disks on
/// `lowers` (top layer first) and the sandbox's own scratch disk on `scratch`: an
/// overlay of the scratch disk's `upper/` over the image, then the container backend's `/proc`, `/dev`, `/sys`,
/// masked and read-only paths (their `/dev` on the initramfs, which the guest's root then
/// hides). An initramfs cannot be `pivot_root`ed: the new root is moved over `/` and the
/// agent chroots into it, as `switch_root` does.
pub fn setup_guest(lowers: &[PathBuf], scratch: &Path, rootfs: &Path) -> Result<(), RootfsError> {
    let (upper, work) = (scratch.join("upper"), scratch.join("work"));
    for dir in [&upper, &work, &rootfs.to_path_buf()] {
        fs::create_dir_all(dir).step("mkdir", dir)?;
    }
    let lowerdir: Vec<String> = lowers
        .iter()
        .map(|l| l.to_string_lossy().into_owned())
        .collect();
    mount_overlay(&lowerdir.join(":"), &upper, &work, rootfs)?;
    let view = ensure_dir(Path::new("/.view"))?;
    build_view(&Root::open(rootfs)?, &view, Pid1::Protected, None)?;
    rustix::process::chdir(rootfs).step("chdir", rootfs)?;
    mount_move(".", "/").step("move the new root over", Path::new("/"))?;
    rustix::process::chroot(".").step("chroot", rootfs)?;
    rustix::process::chdir("/").step("chdir", Path::new("/"))
}

fn make_private() -> Result<(), RootfsError> {
    let root = Path::new("/");
    mount_change(
        root,
        MountPropagationFlags::REC | MountPropagationFlags::PRIVATE,
    )
    .step("make private", root)
}

/// Bytes of a writable layer's size per inode it may hold (ext4's `small` ratio is 4096).
const BYTES_PER_INODE: u64 = 2048;
/// The fewest inodes a writable layer holds, however small.
const MIN_LAYER_INODES: u64 = 16_384;

/// How many files and directories a writable layer of `disk_bytes` may hold. Without a
/// bound a tmpfs takes an inode per empty file until the sandbox's memory limit is full of
/// them (each costs about 1 KiB of kernel memory, charged to the sandbox and not
/// reclaimable): the OOM killer ends the filler instead of `ENOSPC`, and the memory stays
/// taken. With it, an inode filler gets `ENOSPC` like on any disk, and `limit.disk`.
pub fn layer_inodes(disk_bytes: u64) -> u64 {
    (disk_bytes / BYTES_PER_INODE).max(MIN_LAYER_INODES)
}

/// Mounts a `disk_bytes` tmpfs on `rw` and an overlay of it over `layers` on `rootfs`;
/// returns the upper directory.
fn build_overlay(
    rw: &Path,
    rootfs: &Path,
    layers: &[PathBuf],
    disk_bytes: u64,
) -> Result<OwnedFd, RootfsError> {
    let size = options(format!(
        "size={disk_bytes},nr_inodes={},mode=0755",
        layer_inodes(disk_bytes)
    ))
    .step("mount tmpfs on", rw)?;
    mount(
        "tmpfs",
        rw,
        "tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV,
        size.as_c_str(),
    )
    .step("mount writable layer on", rw)?;
    let (upper, work) = (rw.join("upper"), rw.join("work"));
    fs::create_dir(&upper).step("mkdir", &upper)?;
    let upper_fd = rustix::fs::open(
        &upper,
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .step("open", &upper)?;
    fs::create_dir(&work).step("mkdir", &work)?;
    // The whole option string must fit in one page. The edge mounts every layer under one
    // directory with a short name (`dsec_image`'s mounts): naming them relative to it
    // fits the 500 layers overlayfs can stack.
    let parent = layers.first().and_then(|l| l.parent());
    let shared = parent.filter(|p| layers.iter().all(|l| l.parent() == Some(*p)));
    if let Some(dir) = shared {
        rustix::process::chdir(dir).step("chdir", dir)?;
    }
    let lower: Vec<String> = layers
        .iter()
        .map(|l| match shared {
            Some(_) => l
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned(),
            None => l.to_string_lossy().into_owned(),
        })
        .collect();
    mount_overlay(&lower.join(":"), &upper, &work, rootfs)?;
    Ok(upper_fd)
}

/// Mounts an overlay of `upper` over `lowerdir` (overlayfs' colon-separated list) on
/// `rootfs`.
///
/// The overlay is `nodev`: image layers may hold device nodes (a registry image, a
/// rootfs tarball, a snapshot of one), and dsec has no device cgroup to stop a sandbox
/// from opening them, so a node `b 8 0` in an image would be the host's disk. Only the
/// nodes dsec makes in the sandbox's own `/dev` (a mount of its own) open. Setuid bits
/// keep their meaning here: whether they may raise privileges is the sandbox's
/// `no_new_privs` to decide, not the filesystem's.
fn mount_overlay(
    lowerdir: &str,
    upper: &Path,
    work: &Path,
    rootfs: &Path,
) -> Result<(), RootfsError> {
    let opts = options(format!(
        "lowerdir={lowerdir},upperdir={},workdir={}",
        upper.display(),
        work.display()
    ))
    .step("mount overlay on", rootfs)?;
    mount(
        "overlay",
        rootfs,
        "overlay",
        MountFlags::NODEV,
        opts.as_c_str(),
    )
    .step("mount overlay on", rootfs)
}

/// Whether a root's `/proc/1` gets [`PID1_READONLY`]; its builder is that PID 1.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pid1 {
    Protected,
    /// A fncall call: PID 1 of its own pid namespace, alone there.
    Alone,
}

/// `/proc`, `/dev`, `/sys`, the masked and the read-only paths.
///
/// `scratch` is a directory on a filesystem the root's processes can never name (the
/// writable layer's tmpfs, outside its `upper/`): `/dev` and the empty directory masks
/// bind are made there rather than on filesystems of their own. Each superblock costs the
/// host more than its memory: every memory cgroup on the host keeps a slot for each one
/// (1 KiB per 64), and reclaim visits those slots, so on an edge of thousands of sandboxes
/// a superblock per sandbox costs as much as the rest of the sandbox.
/// `sysfs`: a [`SharedSysfs`] to bind, else the root gets a sysfs of its own.
fn build_view(
    root: &Root<'_>,
    scratch: &Path,
    pid1: Pid1,
    sysfs: Option<&Path>,
) -> Result<(), RootfsError> {
    mount_proc(root)?;
    mount_dev_sys(root, scratch, sysfs)?;
    let empty = make_empty_dir(scratch)?;
    let mut masked_dir = None;
    mask_all(root, &empty, non_proc(MASKED_PATHS), &mut masked_dir)?;
    mount_proc_masks(root, &empty, pid1, &mut masked_dir)
}

/// The empty directory masks bind, made in `scratch`.
fn make_empty_dir(scratch: &Path) -> Result<PathBuf, RootfsError> {
    let empty = scratch.join("empty");
    fs::create_dir(&empty).step("mkdir", &empty)?;
    Ok(empty)
}

/// The paths of `paths` outside `/proc`.
fn non_proc<'a>(paths: &'a [&'a str]) -> impl Iterator<Item = &'a str> {
    paths.iter().copied().filter(|p| !p.starts_with("/proc/"))
}

/// Masks each of `paths` in `root`: a directory with `empty` (read-only), a file with
/// `/dev/null`; see [`mask`] for `masked_dir`.
fn mask_all<'a>(
    root: &Root<'_>,
    empty: &Path,
    paths: impl Iterator<Item = &'a str>,
    masked_dir: &mut Option<PathBuf>,
) -> Result<(), RootfsError> {
    for path in paths {
        mask(root, path, empty, masked_dir)?;
    }
    Ok(())
}

/// The masked and read-only paths under `root`'s mounted `/proc`.
fn mount_proc_masks(
    root: &Root<'_>,
    empty: &Path,
    pid1: Pid1,
    masked_dir: &mut Option<PathBuf>,
) -> Result<(), RootfsError> {
    let masked = MASKED_PATHS
        .iter()
        .copied()
        .filter(|p| p.starts_with("/proc/"))
        .chain((pid1 == Pid1::Protected).then_some(PID1_MASKED));
    mask_all(root, empty, masked, masked_dir)?;
    let readonly = READONLY_PATHS
        .iter()
        .chain(PID1_READONLY.iter().filter(|_| pid1 == Pid1::Protected));
    for path in readonly {
        if let Some((target, _)) = root.existing(path)? {
            make_readonly(&target)?;
        }
    }
    Ok(())
}

/// Binds each image layer read-only at `WORKER_DIR/layers/<i>` (topmost first, as
/// overlayfs wants them) and makes the mount points a call needs.
fn expose_layers(root: &Root<'_>, layers: &[PathBuf]) -> Result<(), RootfsError> {
    for dir in ["", "/layers", "/rw", "/root"] {
        root.dir(&format!("{WORKER_DIR}{dir}"))?;
    }
    for (i, layer) in layers.iter().enumerate() {
        let target = root.dir(&format!("{WORKER_DIR}/layers/{i}"))?;
        mount_bind(layer, &target).step("bind layer on", &target)?;
        mount_remount(&target, MountFlags::BIND | MountFlags::RDONLY, "")
            .step("remount read-only", &target)?;
    }
    Ok(())
}

/// A procfs of the calling process's pid namespace on `rootfs`'s `/proc`.
fn mount_proc(root: &Root<'_>) -> Result<(), RootfsError> {
    let proc_dir = root.dir("/proc")?;
    mount("proc", &proc_dir, "proc", NOSUID_NODEV_NOEXEC, None).step("mount proc on", &proc_dir)
}

/// `/dev` (made in `scratch`, then bound: its files and `/dev/shm` count against the
/// writable layer's size) and `/sys` (`sysfs` bound, or a sysfs of its own).
fn mount_dev_sys(root: &Root<'_>, scratch: &Path, sysfs: Option<&Path>) -> Result<(), RootfsError> {
    let dev = scratch.join("dev");
    fs::create_dir(&dev).step("mkdir", &dev)?;
    fs::set_permissions(&dev, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .step("chmod", &dev)?;
    for (name, major, minor) in DEVICES {
        let node = dev.join(name);
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &node,
            FileType::CharacterDevice,
            Mode::from_bits_truncate(0o666),
            rustix::fs::makedev(*major, *minor),
        )
        .step("mknod", &node)?;
        // mknod honours the umask; the nodes must be usable by every uid.
        rustix::fs::chmod(&node, Mode::from_bits_truncate(0o666)).step("chmod", &node)?;
    }
    for (link, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        let path = dev.join(link);
        symlink(target, &path).step("symlink", &path)?;
    }
    // POSIX shared memory only needs a world-writable directory on a tmpfs.
    let shm = ensure_dir(&dev.join("shm"))?;
    fs::set_permissions(&shm, std::os::unix::fs::PermissionsExt::from_mode(0o1777))
        .step("chmod", &shm)?;
    ensure_dir(&dev.join("pts"))?;
    // The writable layer's tmpfs is `nodev`; this one view of it is where the nodes open.
    let dev = bind_with(
        &dev,
        &root.dir("/dev")?,
        MountFlags::NOSUID | MountFlags::NOEXEC | MountFlags::STRICTATIME,
    )?;
    let pts = dev.join("pts");
    mount(
        "devpts",
        &pts,
        "devpts",
        MountFlags::NOSUID | MountFlags::NOEXEC,
        c"newinstance,ptmxmode=0666,mode=0620",
    )
    .step("mount devpts on", &pts)?;

    let sys = root.dir("/sys")?;
    match sysfs {
        Some(shared) => bind_with(shared, &sys, NOSUID_NODEV_NOEXEC | MountFlags::RDONLY).map(drop),
        None => mount(
            "sysfs",
            &sys,
            "sysfs",
            NOSUID_NODEV_NOEXEC | MountFlags::RDONLY,
            None,
        )
        .step("mount sysfs on", &sys),
    }
}

/// One sysfs for every sandbox of a server, each binding it read-only on its `/sys`.
///
/// A sysfs mounted in a network namespace is a superblock of its own (what it shows of
/// `/sys/class/net` depends on the namespace), and the kernel finds it by walking every
/// sysfs superblock on the host: a sysfs per sandbox makes each create slower the more
/// sandboxes there are, and costs every memory cgroup a slot (see [`build_view`]). This
/// one belongs to an empty network namespace the server keeps: what differs from a
/// sandbox's own is `/sys/class/net`, which shows a loopback device that is down, never
/// the sandbox's `eth0` (network tools read netlink and `/proc/net`, not sysfs).
#[derive(Debug)]
pub struct SharedSysfs {
    dir: PathBuf,
    /// Holds the namespace alive: the mount alone would keep it, but emptied of devices.
    _netns: OwnedFd,
}

impl SharedSysfs {
    /// Mounts it on `dir` (made if missing; whatever an earlier run of the server left
    /// mounted there is unmounted first).
    pub fn mount(dir: &Path) -> Result<SharedSysfs, RootfsError> {
        fs::create_dir_all(dir).step("mkdir", dir)?;
        while rustix::mount::unmount(dir, UnmountFlags::DETACH).is_ok() {}
        Self::mount_in_new_netns(dir)
            .map(|netns| SharedSysfs {
                dir: dir.to_owned(),
                _netns: netns,
            })
            .inspect_err(|_| {
                let _ = fs::remove_dir(dir);
            })
    }

    /// Mounts a sysfs on `dir` from a network namespace of its own; returns that namespace.
    fn mount_in_new_netns(dir: &Path) -> Result<OwnedFd, RootfsError> {
        let target = dir.to_owned();
        // A thread of its own enters the new namespace: the server's threads stay where
        // they are, and the mount is made in the host's mount namespace.
        std::thread::spawn(move || -> Result<OwnedFd, RootfsError> {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(std::io::Error::from)
                .step("unshare the network namespace for", &target)?;
            let netns = rustix::fs::open(
                "/proc/thread-self/ns/net",
                rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
                Mode::empty(),
            )
            .step("open the network namespace for", &target)?;
            mount(
                "sysfs",
                &target,
                "sysfs",
                NOSUID_NODEV_NOEXEC | MountFlags::RDONLY,
                None,
            )
            .step("mount sysfs on", &target)?;
            Ok(netns)
        })
        .join()
        .map_err(|_| std::io::Error::other("the sysfs thread panicked"))
        .step("mount sysfs on", dir)?
    }

    /// Where it is mounted.
    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for SharedSysfs {
    fn drop(&mut self) {
        let _ = rustix::mount::unmount(&self.dir, UnmountFlags::DETACH);
        let _ = fs::remove_dir(&self.dir);
    }
}

/// A root being built, whose paths are the image's: every mount point and directory made
/// under it is looked up beneath it, and no symbolic link on the way is followed.
///
/// Before the pivot, a link an image carries would be followed from the host's `/`: an
/// image whose `/.dsec` was a link to `/etc` had a fncall worker make directories in the
/// host's `/etc`, and a linked `/proc` or `/dev` put its mount outside the root. After the
/// pivot (a call's root) it would lead elsewhere in the sandbox, not where dsec means to
/// mount. Images have real directories there, so a link is refused (`ELOOP`, saying
/// where), not resolved. The image cannot change while this runs: its layers are
/// read-only, the writable layer is new, and nothing of the sandbox runs yet.
struct Root<'a> {
    path: &'a Path,
    fd: OwnedFd,
}

/// Beneath the root, no link of any kind.
const NO_LINKS: ResolveFlags = ResolveFlags::BENEATH.union(ResolveFlags::NO_SYMLINKS);

impl<'a> Root<'a> {
    /// Opens `path`, where the root is mounted already (the descriptor names that mount).
    fn open(path: &'a Path) -> Result<Self, RootfsError> {
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let fd = rustix::fs::open(path, flags, Mode::empty()).step("open", path)?;
        Ok(Root { path, fd })
    }

    /// `path` (written from the root: `/proc/kcore`) under the root, and an `O_PATH`
    /// descriptor of it, if it is there.
    fn existing(&self, path: &str) -> Result<Option<(PathBuf, OwnedFd)>, RootfsError> {
        let rel = path.trim_start_matches('/');
        let full = self.path.join(rel);
        let flags = OFlags::PATH | OFlags::CLOEXEC;
        match rustix::fs::openat2(&self.fd, rel, flags, Mode::empty(), NO_LINKS) {
            Ok(fd) => Ok(Some((full, fd))),
            Err(Errno::NOENT) => Ok(None),
            Err(e) => Err(refusal(e, path, &full)),
        }
    }

    /// `path` under the root, a directory made if missing (in the writable layer, never
    /// in the shared image); its parent must be there.
    fn dir(&self, path: &str) -> Result<PathBuf, RootfsError> {
        if let Some((full, _)) = self.existing(path)? {
            return Ok(full);
        }
        let rel = Path::new(path.trim_start_matches('/'));
        let full = self.path.join(rel);
        let (parent, name) = match (rel.parent(), rel.file_name()) {
            (Some(parent), Some(name)) => (parent, name),
            _ => return Err(Errno::INVAL).step("mkdir", &full),
        };
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let parent_fd = if parent.as_os_str().is_empty() {
            None
        } else {
            match rustix::fs::openat2(&self.fd, parent, flags, Mode::empty(), NO_LINKS) {
                Ok(fd) => Some(fd),
                Err(e) => return Err(refusal(e, path, &full)),
            }
        };
        let at = parent_fd.as_ref().map_or(self.fd.as_fd(), AsFd::as_fd);
        rustix::fs::mkdirat(at, name, Mode::from_bits_truncate(0o777)).step("mkdir", &full)?;
        Ok(full)
    }
}

/// A failed look-up of `path` in a [`Root`] (`full` on the host): a link on the way is
/// named as the image has it.
fn refusal(e: Errno, path: &str, full: &Path) -> RootfsError {
    let (step, path) = match e {
        Errno::LOOP | Errno::XDEV => (
            "the image has a symbolic link (dsec follows none where it mounts) at or above",
            Path::new(path),
        ),
        _ => ("open", full),
    };
    RootfsError {
        step,
        path: path.to_owned(),
        source: e.into(),
    }
}

/// Creates a directory in dsec's own scratch space (or the guest's), where no image path
/// leads; see [`Root::dir`] for directories in a root.
fn ensure_dir(path: &Path) -> Result<PathBuf, RootfsError> {
    match fs::create_dir(path) {
        Ok(()) => Ok(path.to_owned()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(path.to_owned()),
        Err(e) => Err(e).step("mkdir", path),
    }
}

/// Hides `path`: a file under a bind of `/dev/null`, a directory under a read-only bind
/// of `empty`. The first directory masked (`masked_dir`) is bound and remounted read-only;
/// the others bind it, inheriting its flags: one remount per sandbox, not one per mask.
fn mask(
    root: &Root<'_>,
    path: &str,
    empty: &Path,
    masked_dir: &mut Option<PathBuf>,
) -> Result<(), RootfsError> {
    let Some((target, fd)) = root.existing(path)? else {
        return Ok(());
    };
    let mode = rustix::fs::fstat(&fd).step("stat", &target)?.st_mode;
    if FileType::from_raw_mode(mode) != FileType::Directory {
        return mount_bind(root.path.join("dev/null"), &target).step("mask", &target);
    }
    match masked_dir {
        Some(first) => mount_bind(&*first, &target).step("mask", &target),
        None => {
            let first = bind_with(empty, &target, MountFlags::RDONLY | NOSUID_NODEV_NOEXEC)?;
            *masked_dir = Some(first);
            Ok(())
        }
    }
}

/// Binds `source` on `target` with exactly `flags` (a bind starts with its source mount's);
/// returns `target`.
fn bind_with(source: &Path, target: &Path, flags: MountFlags) -> Result<PathBuf, RootfsError> {
    mount_bind(source, target).step("bind", target)?;
    mount_remount(target, MountFlags::BIND | flags, "").step("remount", target)?;
    Ok(target.to_owned())
}

fn make_readonly(target: &Path) -> Result<(), RootfsError> {
    mount_bind_recursive(target, target).step("bind", target)?;
    mount_remount(
        target,
        MountFlags::BIND | MountFlags::RDONLY | NOSUID_NODEV_NOEXEC,
        "",
    )
    .step("remount read-only", target)
}

/// `pivot_root(".", ".")` then detaching the old root, as runc does: no temporary
/// directory is needed inside the image.
fn pivot(rootfs: &Path) -> Result<(), RootfsError> {
    rustix::process::chdir(rootfs).step("chdir", rootfs)?;
    rustix::process::pivot_root(".", ".").step("pivot_root", rootfs)?;
    rustix::mount::unmount(".", UnmountFlags::DETACH).step("detach old root", rootfs)?;
    rustix::process::chdir("/").step("chdir", Path::new("/"))?;
    Ok(())
}

/// A mount's option string, as the kernel takes it.
fn options(text: String) -> std::io::Result<CString> {
    CString::new(text).map_err(|_| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "mount options hold a NUL")
    })
}

/// Brings up `lo` in the current (new) network namespace.
pub fn loopback_up() -> std::io::Result<()> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    let fd = rustix::net::socket_with(
        AddressFamily::INET,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    // SAFETY: ifreq is plain old data; all-zeroes is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    // An ASCII name, byte for byte (c_char is i8 or u8 by architecture); the flags are
    // 0x41.
    #[allow(clippy::cast_possible_truncation, clippy::cast_possible_wrap)]
    {
        for (dst, src) in ifr.ifr_name.iter_mut().zip(c"lo".to_bytes_with_nul()) {
            *dst = *src as libc::c_char;
        }
        ifr.ifr_ifru.ifru_flags = (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    }
    // SAFETY: SIOCSIFFLAGS reads a valid, initialised ifreq that outlives the call.
    let rc = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            libc::SIOCSIFFLAGS,
            &ifr,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Sets the hostname inside the sandbox's UTS namespace.
pub fn set_hostname(name: &str) -> std::io::Result<()> {
    Ok(rustix::system::sethostname(name.as_bytes())?)
}
