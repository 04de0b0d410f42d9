//! What the store records about an image.

use serde::{Deserialize, Serialize};

/// An image as the store knows it: enough to stack its layers and start its process.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Image {
    /// The name it was imported under.
    pub name: String,
    /// `sha256:<hex>` of the config JSON (OCI and Docker sources) or of the
    /// JSON list of diff ids (rootfs sources).
    pub id: String,
    /// Bytes of file content in its layers.
    pub size: u64,
    /// Diff ids (`sha256:<hex>` of each uncompressed layer tar), bottom first.
    pub layers: Vec<String>,
    /// When it was imported, in unix seconds.
    pub created_at: f64,
    /// Run-time defaults from the image config.
    pub config: ImageConfig,
    /// Set on the image a fork makes: it belongs to the forked sandboxes and is removed
    /// once none of them is left. Images a user named have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork: Option<Fork>,
    /// Set on a snapshot of a running VM guest: its filesystem is not in `layers` alone
    /// but in the guest's disk, saved with its memory and devices by the VM backend.
    /// Only that backend, with the same shape, can start it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest: Option<GuestSnapshot>,
    /// Set on a bootable disk image (a user's own qcow2 or raw disk, with its bootloader
    /// and kernel): its only layer is that disk as a standalone qcow2, not a filesystem.
    /// Only the `vm` backend can start it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<DiskImage>,
    /// The project that owns it, whose token imported or snapshotted it; its name is
    /// under `<project>/` ([`owned_name`]). `None`: the admin's, shared with every project.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
}

/// The name an image of `project` is stored under: `name` itself when it is already
/// under `<project>/`, else `<project>/<name>`; the admin's (`None`) as given. A project's
/// images therefore never share a name with another project's.
pub fn owned_name(project: Option<&str>, name: &str) -> String {
    match project {
        Some(p)
            if !name
                .strip_prefix(p)
                .is_some_and(|rest| rest.starts_with('/')) =>
        {
            format!("{p}/{name}")
        }
        _ => name.to_owned(),
    }
}

/// Where and how a VM guest saved in an image ([`Image::guest`]) runs again.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct GuestSnapshot {
    /// The backend that saved it (`microvm` or `vm`).
    pub backend: String,
    /// The edge whose state directory holds the saved guest.
    pub edge: String,
    /// Its virtual CPUs.
    pub vcpus: u32,
    /// Its memory in MiB.
    pub memory_mb: u64,
    /// Its disk in MiB.
    pub disk_mb: u64,
    /// The backend's name for the saved guest's files (opaque to the store).
    pub saved: String,
}

/// A bootable disk stored as an image ([`Image::disk`]).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct DiskImage {
    /// How its blob is laid out: always `qcow2` (imports are normalised to it).
    pub format: String,
    /// The size of the disk the guest sees, in bytes.
    pub virtual_size: u64,
}

/// Whose an image made by a fork is.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Fork {
    /// The edge whose sandboxes use it (the only one that may remove it).
    pub edge: String,
    /// The sandbox that was forked.
    pub parent: String,
}

/// The run-time defaults an image carries.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ImageConfig {
    /// Environment, as `K=V`.
    pub env: Vec<String>,
    /// Working directory, if the image sets one.
    pub workdir: Option<String>,
    /// Default arguments (appended to the entrypoint).
    pub cmd: Vec<String>,
    /// Command prefix.
    pub entrypoint: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::owned_name;

    #[test]
    fn a_project_name_is_under_its_prefix_once() {
        assert_eq!(owned_name(None, "busybox"), "busybox");
        assert_eq!(owned_name(Some("team"), "tools"), "team/tools");
        assert_eq!(owned_name(Some("team"), "team/tools"), "team/tools");
        // Only the whole first segment counts as the prefix.
        assert_eq!(owned_name(Some("team"), "teamx/tools"), "team/teamx/tools");
        assert_eq!(owned_name(Some("team"), "other/tools"), "team/other/tools");
    }
}
