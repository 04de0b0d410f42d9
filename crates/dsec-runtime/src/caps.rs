//! The capability set sandboxed processes keep.

use caps::{CapSet, Capability, CapsHashSet};

/// Docker's default capability set, minus `CAP_MKNOD`.
///
/// Docker can grant `CAP_MKNOD` because its device cgroup (v1) or eBPF device filter (v2)
/// stops a container from opening the block devices it creates. dsec does not install a
/// device filter, so it withholds the capability instead: `/dev` holds only the nodes init
/// made, and a process inside cannot make more. FIFOs and sockets need no capability.
///
/// `CAP_SETFCAP` stays, as in Docker and Podman: package scripts set file capabilities
/// (`setcap cap_net_raw+p /bin/ping` in iputils' postinst) and an image built or changed
/// in a sandbox must keep them. What it lets an agent make is harmless everywhere dsec
/// puts it: inside the sandbox, `no_new_privs` and the bounding set cap what an `execve`
/// can gain at this set; on the host, a snapshot's layer sits in a `0700` state directory
/// on a `nosuid,nodev` mount, where the kernel ignores file capabilities and setuid bits
/// (`dsec_image::seal`); and no other namespace honours them through `/proc/<pid>/root`
/// (the kernel treats foreign mounts as `nosuid`).
pub const KEPT: [Capability; 13] = [
    Capability::CAP_CHOWN,
    Capability::CAP_DAC_OVERRIDE,
    Capability::CAP_FSETID,
    Capability::CAP_FOWNER,
    Capability::CAP_NET_RAW,
    Capability::CAP_SETGID,
    Capability::CAP_SETUID,
    Capability::CAP_SETFCAP,
    Capability::CAP_SETPCAP,
    Capability::CAP_NET_BIND_SERVICE,
    Capability::CAP_SYS_CHROOT,
    Capability::CAP_KILL,
    Capability::CAP_AUDIT_WRITE,
];

/// Reduces the calling process to [`KEPT`]: the bounding set first (that needs
/// `CAP_SETPCAP`, still held), then effective and permitted; inheritable and ambient are
/// cleared (as Docker does since CVE-2022-24769). After this, `execve` as root can regain
/// nothing beyond [`KEPT`].
pub fn drop_to_default() -> Result<(), caps::errors::CapsError> {
    let keep: CapsHashSet = KEPT.into_iter().collect();
    for cap in caps::all().difference(&keep) {
        caps::drop(None, CapSet::Bounding, *cap)?;
    }
    caps::clear(None, CapSet::Ambient)?;
    caps::clear(None, CapSet::Inheritable)?;
    caps::set(None, CapSet::Effective, &keep)?;
    caps::set(None, CapSet::Permitted, &keep)?;
    Ok(())
}

/// Whether this process may lower OOM scores (`CAP_SYS_RESOURCE`), as a sandbox's init
/// does for itself before it drops to [`KEPT`].
pub fn can_lower_oom_scores() -> bool {
    caps::has_cap(None, CapSet::Effective, Capability::CAP_SYS_RESOURCE).unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_set_is_dockers_default_without_mknod() {
        let mask: u64 = KEPT.iter().map(|c| c.bitmask()).sum();
        assert_eq!(mask | Capability::CAP_MKNOD.bitmask(), 0xa80425fb);
        assert_eq!(mask, 0xa00425fb);
    }
}
