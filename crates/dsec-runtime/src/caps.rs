//! The capability set sandboxed processes keep.

use caps::{CapSet, Capability, CapsHashSet};

/// Docker's default capability set, minus `CAP_MKNOD`.
///
/// Docker can grant `CAP_MKNOD` because its device cgroup (v1) or eBPF device filter (v2)
/// stops a container from opening the block devices it creates. dsec does not install a
/// device filter, so it withholds the capability instead: `/dev` holds only the nodes init
/// made, and a process inside cannot make more. FIFOs and sockets need no capability.
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
