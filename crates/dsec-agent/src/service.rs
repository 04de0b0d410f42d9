//! The agent as a service of a guest's own init (`dsec-agent --service`): how a bootable
//! disk of the user's own (the `vm` backend's disk images) serves dsec.
//!
//! The guest has booted its own kernel, initramfs and init (systemd, from a unit with
//! `Delegate=yes`), so the agent builds nothing: no modules, no root overlay, no fresh
//! `/dev`. It opens the virtio-serial port named [`guest::PORT_NAME`] (virtio-serial
//! allows one open, and the agent holds it), moves itself into a leaf of its own cgroup
//! so that a sibling `commands` cgroup can take the memory and pids limits, and serves the
//! same protocol as in dsec's own guests ([`dsec_runtime::init::serve_guest`]): identity,
//! then the container backend's capabilities, no_new_privs and seccomp filter for itself
//! and every command, files confined beneath the guest's `/`.
//!
//! What needs dsec's initramfs is not there: the commands see the guest's whole root
//! (their writes go to the user's disk, through the sandbox's own overlay qcow2 on the
//! host), disk usage is that root filesystem's, and no network driver is held for the
//! identity to load.

use std::path::{Path, PathBuf};
use std::time::Duration;

use dsec_runtime::guest;

/// The command-line flag that selects this mode.
pub const FLAG: &str = "--service";

/// How long the guest's init may take to load the virtio console driver.
const PORT_WAIT: Duration = Duration::from_secs(60);

/// The cgroup2 hierarchy as the guest's init mounts it.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// Serves the host until it closes the channel.
pub fn run() -> Result<(), String> {
    let node = super::wait_within(
        &format!("the virtio-serial port {}", guest::PORT_NAME),
        PORT_WAIT,
        super::serial_port,
    )?;
    let control: std::os::fd::OwnedFd = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&node)
        .map_err(|e| format!("{}: {e}", node.display()))?
        .into();
    let cgroup = own_cgroup().and_then(|parent| super::commands_cgroup(&parent, Path::new("/")));
    super::serve(control, cgroup, Vec::new())
}

/// The agent's own cgroup (delegated to it by the guest's init), emptied of processes:
/// the agent moves itself into its leaf `agent`, so that the cgroup may enable
/// controllers for `commands` beside it (cgroup v2 has no processes in inner nodes).
fn own_cgroup() -> Result<PathBuf, String> {
    let text = std::fs::read_to_string("/proc/self/cgroup")
        .map_err(|e| format!("/proc/self/cgroup: {e}"))?;
    let relative = text.lines().find_map(|l| l.strip_prefix("0::")).ok_or(
        "the guest has no cgroup v2 hierarchy (the agent needs one for its commands' limits)",
    )?;
    let own = Path::new(CGROUP_ROOT).join(relative.trim_start_matches('/'));
    let leaf = own.join("agent");
    std::fs::create_dir_all(&leaf).map_err(|e| format!("mkdir {}: {e}", leaf.display()))?;
    let procs = leaf.join("cgroup.procs");
    std::fs::write(&procs, "0").map_err(|e| {
        format!(
            "{}: {e} (the agent's unit needs Delegate=yes)",
            procs.display()
        )
    })?;
    Ok(own)
}
