//! Bootable disks of the user's own (the `vm` backend's disk images): a guest that boots
//! its own bootloader, kernel and init from one disk, through the firmware (SeaBIOS on
//! q35), instead of dsec's kernel and initramfs, and runs `dsec-agent --service`.
//!
//! The stored disk is one standalone qcow2 (the image store normalises imports and refuses
//! a qcow2 that names another file) and is never written: each sandbox boots a qcow2
//! overlay of its own over it ([`create_disk_overlay`]), named with its format so QEMU
//! never probes one. Everything else — the agent's virtio-serial port, QMP, the console
//! log, the network namespace, `PR_SET_PDEATHSIG` — is the same QEMU as for dsec's own
//! guests ([`crate::qemu::Start::Disk`]).

use std::path::Path;
use std::process::Command;

use crate::disk::run_tool;
use crate::VmError;

/// The format every stored disk image has.
pub const DISK_FORMAT: &str = "qcow2";

/// QEMU's arguments for booting from `disk` (a sandbox's overlay, qcow2): the firmware
/// boots it and nothing else (`strict`: no network boot when the disk does not boot).
pub(crate) fn boot_disk_args(disk: &Path) -> [String; 6] {
    [
        "-drive".into(),
        format!(
            "file={},format={DISK_FORMAT},if=none,id=boot,discard=unmap,cache=unsafe",
            disk.to_string_lossy().replace(',', ",,")
        ),
        "-device".into(),
        "virtio-blk-pci,drive=boot,bootindex=0".into(),
        "-boot".into(),
        "strict=on".into(),
    ]
}

/// Makes `target`, a sandbox's disk: a qcow2 whose reads fall through to the stored
/// `disk` (read-only, [`DISK_FORMAT`] named, never probed) and whose writes stay in it.
pub fn create_disk_overlay(disk: &Path, target: &Path) -> Result<(), VmError> {
    run_tool(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", DISK_FORMAT, "-b"])
            .arg(disk)
            .arg(target),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_boot_disk_is_named_with_its_format_and_booted_first() {
        let args = boot_disk_args(Path::new("/state/vm/sandboxes/a,b/disk.qcow2"));
        assert_eq!(args[0], "-drive");
        assert!(args[1].starts_with("file=/state/vm/sandboxes/a,,b/disk.qcow2,format=qcow2,"));
        assert!(args[3].contains("bootindex=0"));
    }
}
