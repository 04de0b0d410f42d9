//! dsec's VM drivers: sandboxes behind a kernel boundary.
//!
//! The pieces, in the order a VM sandbox meets them:
//! - [`assets`]: the guest kernel (Debian's cloud kernel by default) and an initramfs
//!   holding the static `dsec-agent` and the modules it loads, built once and cached;
//! - [`disk`]: one read-only disk per image (ext4 or EROFS, the same images containers
//!   use) shared by every VM, and a qcow2 scratch disk per sandbox for its writes;
//! - [`qemu`]: the QEMU process (the `microvm` machine or q35), its accelerator (KVM
//!   when a probe shows it works, TCG otherwise), boot templates snapshotted once and
//!   restored for each new sandbox, and the control [`dsec_runtime::channel`] to the
//!   guest's agent over virtio-serial;
//! - [`qmp`]: the QEMU monitor protocol, for pause, resume and snapshots;
//! - [`bootdisk`]: bootable disks of the user's own, booted by the firmware, whose agent
//!   runs as a service of the guest's own init.
#![warn(missing_docs)]

pub mod assets;
pub mod bootdisk;
pub mod disk;
pub mod qemu;
pub mod qmp;

use std::path::{Path, PathBuf};

/// A VM operation failed.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// This host cannot run VMs as asked (missing QEMU, kernel, agent...).
    #[error("{0}")]
    Unavailable(String),
    /// Host filesystem work failed.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// Where.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A host tool (`mkfs.ext4`, `qemu-img`...) failed.
    #[error("{program} failed ({status}): {stderr}")]
    Tool {
        /// The program.
        program: String,
        /// How it ended.
        status: String,
        /// What it said.
        stderr: String,
    },
    /// QEMU refused a request or died.
    #[error("QEMU: {0}")]
    Qemu(String),
    /// The guest did not boot or its agent failed; carries the console's last lines.
    #[error("the guest failed to start: {reason}{}", console_tail(.console))]
    Boot {
        /// What went wrong.
        reason: String,
        /// The end of the guest's serial console.
        console: String,
    },
    /// The control channel failed.
    #[error(transparent)]
    Runtime(#[from] dsec_runtime::container::RuntimeError),
}

fn console_tail(console: &str) -> String {
    match console.trim() {
        "" => String::new(),
        text => format!("; guest console ends with:\n{text}"),
    }
}

impl VmError {
    /// Maps an I/O error on `path` during `action`.
    pub fn io<'a>(
        action: &'static str,
        path: &'a Path,
    ) -> impl FnOnce(std::io::Error) -> VmError + 'a {
        move |source| VmError::Io {
            action,
            path: path.to_owned(),
            source,
        }
    }
}
