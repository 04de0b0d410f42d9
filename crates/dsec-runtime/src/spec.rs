//! What the edge tells the zygote about a sandbox to create.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Everything init needs to build a sandbox; sent to the zygote as JSON.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SandboxSpec {
    /// Sandbox id; also its hostname.
    pub id: String,
    /// `<state>/sandboxes/<id>`: `rootfs/` (overlay mount point) and `rw/` (writable
    /// layer tmpfs) live here. Both mounts exist only in the sandbox's mount namespace.
    pub dir: PathBuf,
    /// Image layer directories, topmost first (overlayfs `lowerdir` order).
    pub layers: Vec<PathBuf>,
    /// Size of the writable layer.
    pub disk_bytes: u64,
    /// Files init writes `0` to, to join its cgroups, before anything else (see
    /// [`crate::cgroup::SandboxCgroup::init_joins`]).
    pub init_cgroups: Vec<PathBuf>,
    /// The file init writes `0` to once in its cgroup namespace, to leave its sandbox's
    /// memory limit (see [`crate::cgroup::SandboxCgroup::init_memory_home`]).
    pub init_memory_home: Option<PathBuf>,
    /// The file each command writes `0` to, to enter its sandbox's memory cgroup (see
    /// [`crate::cgroup::SandboxCgroup::commands_join`]).
    pub commands_cgroup: Option<PathBuf>,
    /// A fncall worker: each command runs in mount, pid and IPC namespaces of its own
    /// with a fresh writable layer, so the worker stays pristine between calls.
    #[serde(default)]
    pub worker: bool,
    /// The server's [`crate::rootfs::SharedSysfs`], bound read-only on the sandbox's
    /// `/sys`; without one, the sandbox mounts a sysfs of its own.
    #[serde(default)]
    pub sysfs: Option<PathBuf>,
}
