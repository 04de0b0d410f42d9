//! The contract between the host's VM driver and the agent inside every guest: where
//! the agent finds its kernel modules and disks, how it is told who it is, and where it
//! listens. Both sides compile this one module, so they cannot drift apart.

/// Name of the virtio-serial port the agent serves (`virtserialport,name=...`).
pub const PORT_NAME: &str = "dsec.agent";

/// vsock port the agent listens on when the VMM offers no virtio-serial port (as
/// Firecracker does not); only the host (CID 2) may connect.
pub const VSOCK_PORT: u32 = 1024;

/// Initramfs directory holding the kernel modules the agent loads.
pub const MODULE_DIR: &str = "/lib/modules/dsec";

/// File in [`MODULE_DIR`] naming the modules, one per line, dependencies first.
pub const MODULE_ORDER: &str = "order";

/// File in [`MODULE_DIR`] naming the network driver's modules (virtio-net and what it
/// needs beyond [`MODULE_ORDER`]'s), dependencies first. The agent loads them only when
/// the sandbox is given a network: until then the guest has no interface but loopback,
/// as a container without a network has none.
pub const NET_MODULE_ORDER: &str = "net-order";

/// The guest's network interface, once its driver is loaded (the VM's only NIC).
pub const NET_INTERFACE: &str = "eth0";

/// The gateway of every guest's interface: the host side of QEMU's user-mode network
/// (`-netdev user`, its default `10.0.2.2`), which makes each of the guest's
/// connections from the sandbox's own network namespace (see `dsec_vm::qemu`).
pub const NET_GATEWAY: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 0, 2, 2);

/// Serial number of the read-only disk holding the image (`virtio-blk,serial=...`), or
/// its top layer when each layer is a disk of its own (see [`image_disk_serial`]).
pub const BASE_DISK_SERIAL: &str = "dsec-base";

/// Most image disks a guest is given: an image of more layers gets one merged disk.
/// (microvm has 24 virtio-mmio transports, and the agent's port and the scratch disk take
/// two.)
pub const MAX_IMAGE_DISKS: usize = 16;

/// Serial number of image disk `i`, top layer first: each layer's EROFS blob is a disk of
/// its own, stacked by the guest's overlay as the host's would.
pub fn image_disk_serial(i: usize) -> String {
    match i {
        0 => BASE_DISK_SERIAL.to_owned(),
        _ => format!("{BASE_DISK_SERIAL}-{i}"),
    }
}

/// Serial number of the sandbox's own writable disk (ext4, the overlay's upper layer).
pub const SCRATCH_DISK_SERIAL: &str = "dsec-scratch";

/// What the host says on the kernel command line, as `dsec.<key>=<value>` words.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BootArgs {
    /// Hostname until the edge assigns an identity.
    pub hostname: String,
    /// Filesystem of the image disks: `ext4` or `erofs`.
    pub base_fs: String,
    /// How many image disks there are (see [`image_disk_serial`]).
    pub image_disks: usize,
    /// An accelerator probe: the agent reports ready as soon as its channel is open and
    /// builds nothing.
    pub probe: bool,
}

impl BootArgs {
    /// The kernel command line words for these arguments.
    pub fn to_cmdline(&self) -> String {
        let probe = if self.probe { " dsec.probe=1" } else { "" };
        format!(
            "dsec.hostname={} dsec.basefs={} dsec.disks={}{probe}",
            self.hostname, self.base_fs, self.image_disks
        )
    }

    /// Reads the arguments back from `/proc/cmdline`; missing ones get defaults.
    pub fn parse(cmdline: &str) -> BootArgs {
        let mut args = BootArgs {
            hostname: "dsec".to_owned(),
            base_fs: "ext4".to_owned(),
            image_disks: 1,
            probe: false,
        };
        for word in cmdline.split_whitespace() {
            match word.split_once('=') {
                Some(("dsec.hostname", v)) => args.hostname = v.to_owned(),
                Some(("dsec.basefs", v)) => args.base_fs = v.to_owned(),
                Some(("dsec.disks", v)) => {
                    args.image_disks = v.parse().map_or(1, |n: usize| n.clamp(1, MAX_IMAGE_DISKS));
                }
                Some(("dsec.probe", v)) => args.probe = v == "1",
                _ => {}
            }
        }
        args
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_args_round_trip_through_a_command_line() {
        let args = BootArgs {
            hostname: "sb-1".into(),
            base_fs: "erofs".into(),
            image_disks: 3,
            probe: true,
        };
        let cmdline = format!("console=ttyS0 quiet {} panic=-1", args.to_cmdline());
        assert_eq!(BootArgs::parse(&cmdline), args);
        assert_eq!(BootArgs::parse("quiet").base_fs, "ext4");
        assert_eq!(BootArgs::parse("quiet").image_disks, 1);
        assert_eq!(
            BootArgs::parse("dsec.disks=99").image_disks,
            MAX_IMAGE_DISKS
        );
        assert_eq!(image_disk_serial(0), BASE_DISK_SERIAL);
        assert_eq!(image_disk_serial(2), "dsec-base-2");
    }
}
