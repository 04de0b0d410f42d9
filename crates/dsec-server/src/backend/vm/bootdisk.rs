//! Sandboxes of bootable disk images (a user's own qcow2 or raw disk, [`Image::disk`]):
//! QEMU boots the disk through the firmware, its bootloader, kernel and init, and the
//! guest's `dsec-agent --service` serves the same channel as in dsec's own guests (see
//! `dsec_vm::bootdisk`).
//!
//! Each sandbox boots a qcow2 overlay of its own (`<dir>/disk.qcow2`) over the stored disk,
//! which is held (as any image's layers) while the sandbox runs and never written. Every
//! sandbox boots cold: a boot template restores dsec's own kernel and initramfs, not the
//! disk's, and a template per disk image would hold a disk whose guest has mounted it
//! read-write, which a second guest could not share. What needs dsec's initramfs — a
//! network (the guest's own init owns its interfaces), snapshots and forks, a pause
//! saved to disk — is refused or falls back (an in-memory pause).

use dsec_image::Image;
use dsec_vm::bootdisk::create_disk_overlay;
use dsec_vm::disk::BaseFs;
use dsec_vm::qemu::{Disks, GuestIdentity, Hardware, Machine, Start, Vm};

use super::{blocking_error, vm_error, write_record, Running, VmBackend};
use crate::backend::{Created, SandboxRequest};
use crate::error::ApiError;

/// Why a bootable disk's sandbox cannot have what needs dsec's own guest.
pub(super) fn unsupported(what: &str) -> ApiError {
    ApiError::invalid(format!(
        "{what} is not available for a sandbox of a bootable disk image (its guest runs its \
         own kernel and init, not dsec's)"
    ))
}

impl VmBackend {
    /// Creates a sandbox booting the disk image `image`, on `hardware`.
    pub(super) async fn create_from_disk(
        &self,
        req: SandboxRequest,
        image: Image,
        hardware: Hardware,
    ) -> Result<Created, ApiError> {
        if self.machine != Machine::Q35 {
            return Err(ApiError::invalid(format!(
                "image {} is a bootable disk, booted by a PC's firmware: create it with \
                 backend=\"vm\"",
                image.name
            )));
        }
        if !req.network.is_off() {
            return Err(unsupported("a network"));
        }
        // The guest may write every block of its disk, and each lands in the sandbox's
        // overlay on the host: the disk's size is what it may write, bounded by `disk_mb`
        // as a container's writable layer is (the importer chose the size, not the host).
        let disk_mib = image
            .disk
            .as_ref()
            .map_or(0, |d| d.virtual_size.div_ceil(1 << 20));
        if disk_mib > req.disk_mb {
            return Err(ApiError::invalid(format!(
                "image {} is a {disk_mib} MiB disk, all of which its guest may write, more \
                 than disk_mb={} allows: create it with disk_mb={disk_mib} or more",
                image.name, req.disk_mb
            )));
        }
        let host = &self.host;
        let assets = host.assets().await?;
        let held = host.images.blobs(&image)?;
        let [stored] = held.blobs.as_slice() else {
            return Err(ApiError::internal(format!(
                "the disk image {} has {} blobs, not one",
                image.name,
                held.blobs.len()
            )));
        };
        let dir = host.dir.join("sandboxes").join(&req.id);
        std::fs::create_dir_all(&dir)
            .map_err(|e| ApiError::internal(format!("creating {}: {e}", dir.display())))?;
        let overlay = dir.join("disk.qcow2");
        let started = async {
            let (stored, target) = (stored.clone(), overlay.clone());
            tokio::task::spawn_blocking(move || create_disk_overlay(&stored, &target))
                .await
                .map_err(blocking_error)?
                .map_err(vm_error)?;
            let identity = GuestIdentity {
                hostname: &req.id,
                pids_max: req.pids,
                network: None,
            };
            let started_at = std::time::Instant::now();
            let vm = Vm::start(
                &hardware,
                &assets,
                None,
                Start::Disk(identity, &overlay),
                &dir,
                None,
            )
            .await
            .map_err(vm_error)?;
            tracing::info!(sandbox = %req.id, image = %image.name, boot_s = started_at.elapsed().as_secs_f64(), "booted a disk image");
            if let Err(e) = write_record(&dir, &vm) {
                vm.kill().await;
                return Err(e);
            }
            Ok(vm)
        };
        let vm = match started.await {
            Ok(vm) => vm,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        Ok(self.running(
            req,
            Running {
                vm,
                layers: held,
                dir,
                image,
                hardware,
                disks: Disks {
                    image: Vec::new(),
                    base_fs: BaseFs::default(),
                    scratch: overlay,
                },
                restored_from: None,
                attachment: None,
            },
        ))
    }
}
