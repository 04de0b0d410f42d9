//! The guest's kernel and initramfs, assembled on the host.
//!
//! The kernel is Debian's `linux-image-cloud-amd64` (or one the operator brings, see
//! [`KernelSource`]); the initramfs is built here: the static `dsec-agent` as `/init`, a
//! `/dev/console` node, and the few modules the agent loads (virtio transports, block,
//! console, vsock, overlay, erofs; virtio-net only once the sandbox is given a network)
//! with their dependencies, in load order. It is cached
//! in the state directory under a digest of everything that went into it, so a new
//! agent or kernel gets a new initramfs and an unchanged one is never rebuilt.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use dsec_runtime::guest;
use sha2::{Digest, Sha256};

use crate::VmError;

/// Modules the agent needs when the kernel does not have them built in. Names as in
/// `modules.dep`, with `-` and `_` equivalent.
const WANTED_MODULES: &[&str] = &[
    "virtio_mmio",
    "virtio_pci",
    "virtio_blk",
    "virtio_console",
    "vmw_vsock_virtio_transport",
    "overlay",
    "erofs",
];

/// The network driver, loaded by the agent only when a sandbox is given a network
/// ([`guest::NET_MODULE_ORDER`]).
const NET_MODULES: &[&str] = &["virtio_net"];

/// Where the guest kernel comes from.
#[derive(Clone, Debug, Default)]
pub struct KernelSource {
    /// A kernel image (`bzImage`/`vmlinuz`) to boot; by default the newest
    /// `/boot/vmlinuz-*-cloud-amd64` (Debian's `linux-image-cloud-amd64`).
    pub kernel: Option<PathBuf>,
    /// Its modules tree; by default `/lib/modules/<version>` for a `vmlinuz-<version>`.
    /// A kernel with the virtio, vsock, overlay and erofs drivers built in needs none.
    pub modules: Option<PathBuf>,
}

/// A bootable kernel and the initramfs that starts the agent.
#[derive(Clone, Debug)]
pub struct GuestAssets {
    /// Kernel image.
    pub kernel: PathBuf,
    /// Initramfs (uncompressed newc cpio: nothing to inflate at boot under TCG).
    pub initramfs: PathBuf,
}

impl GuestAssets {
    /// Finds the kernel and builds (or reuses) the initramfs for `agent` under `cache`.
    pub fn prepare(
        source: &KernelSource,
        agent: &Path,
        cache: &Path,
    ) -> Result<GuestAssets, VmError> {
        let kernel = match &source.kernel {
            Some(k) => k.clone(),
            None => default_kernel()?,
        };
        if !kernel.is_file() {
            return Err(VmError::Unavailable(format!(
                "guest kernel {} does not exist",
                kernel.display()
            )));
        }
        let modules_dir = source.modules.clone().or_else(|| {
            let name = kernel.file_name()?.to_str()?;
            let version = name.strip_prefix("vmlinuz-")?;
            Some(PathBuf::from("/lib/modules").join(version))
        });
        let agent_bytes = std::fs::read(agent).map_err(|e| {
            VmError::Unavailable(format!(
                "the guest agent {} cannot be read ({e}); build it with scripts/build-agent.sh",
                agent.display()
            ))
        })?;
        check_static(&agent_bytes, agent)?;
        let (modules, net_modules) = match &modules_dir {
            Some(dir) if dir.join("modules.dep").is_file() => {
                let boot = resolve_modules(dir, WANTED_MODULES)?;
                let net: Vec<PathBuf> = resolve_modules(dir, NET_MODULES)?
                    .into_iter()
                    .filter(|m| !boot.contains(m))
                    .collect();
                (boot, net)
            }
            _ => (Vec::new(), Vec::new()),
        };
        let mut digest = Sha256::new();
        digest.update(&agent_bytes);
        // Each list under the name of its order file: a module moved from one list to
        // the other makes another initramfs.
        for (list, order) in [
            (&modules, guest::MODULE_ORDER),
            (&net_modules, guest::NET_MODULE_ORDER),
        ] {
            digest.update(order.as_bytes());
            for m in list {
                digest.update(m.as_os_str().as_encoded_bytes());
                digest.update(
                    std::fs::metadata(m)
                        .map(|md| md.len())
                        .unwrap_or(0)
                        .to_le_bytes(),
                );
            }
        }
        let name = format!("initramfs-{}.cpio", &hex::encode(digest.finalize())[..16]);
        std::fs::create_dir_all(cache).map_err(VmError::io("create", cache))?;
        let initramfs = cache.join(name);
        if !initramfs.exists() {
            write_initramfs(&initramfs, &agent_bytes, &modules, &net_modules)?;
        }
        Ok(GuestAssets { kernel, initramfs })
    }
}

fn default_kernel() -> Result<PathBuf, VmError> {
    let mut cloud: Vec<PathBuf> = std::fs::read_dir("/boot")
        .map_err(VmError::io("read", Path::new("/boot")))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("vmlinuz-") && n.ends_with("-cloud-amd64"))
        })
        .collect();
    cloud.sort();
    cloud.pop().ok_or_else(|| {
        VmError::Unavailable(
            "no guest kernel: install linux-image-cloud-amd64 (scripts/setup.sh does) or pass \
             --vm-kernel"
                .into(),
        )
    })
}

/// A dynamically linked agent would find no loader in the initramfs: refuse it here
/// rather than let the guest panic.
fn check_static(elf: &[u8], path: &Path) -> Result<(), VmError> {
    const PT_INTERP: u32 = 3;
    let bad = |why: &str| {
        VmError::Unavailable(format!(
            "the guest agent {} {why}; build it with scripts/build-agent.sh",
            path.display()
        ))
    };
    if elf.len() < 64 || &elf[..4] != b"\x7fELF" || elf[4] != 2 {
        return Err(bad("is not a 64-bit ELF executable"));
    }
    let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
    let phoff = usize::try_from(u64::from_le_bytes(elf[32..40].try_into().expect("8 bytes")))
        .map_err(|_| bad("has its program headers out of range"))?;
    let (phentsize, phnum) = (u16_at(54), u16_at(56));
    for i in 0..phnum {
        let at = phoff + i * phentsize;
        let Some(kind) = elf.get(at..at + 4) else {
            return Err(bad("has a truncated program header table"));
        };
        if u32::from_le_bytes(kind.try_into().expect("4 bytes")) == PT_INTERP {
            return Err(bad("is dynamically linked (the guest has no libc)"));
        }
    }
    Ok(())
}

fn module_name(path: &str) -> String {
    Path::new(path)
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.split(".ko").next())
        .unwrap_or_default()
        .replace('-', "_")
}

/// The files of `wanted` and of everything they depend on, dependencies first, per
/// `modules.dep`. Modules the kernel has built in (`modules.builtin`) need no file.
pub fn resolve_modules(dir: &Path, wanted: &[&str]) -> Result<Vec<PathBuf>, VmError> {
    let dep_path = dir.join("modules.dep");
    let deps_text = std::fs::read_to_string(&dep_path).map_err(VmError::io("read", &dep_path))?;
    let mut deps: HashMap<String, (String, Vec<String>)> = HashMap::new();
    for line in deps_text.lines() {
        let Some((module, rest)) = line.split_once(':') else {
            continue;
        };
        let needs = rest.split_whitespace().map(module_name).collect();
        deps.insert(module_name(module), (module.to_owned(), needs));
    }
    let builtin: HashSet<String> = std::fs::read_to_string(dir.join("modules.builtin"))
        .unwrap_or_default()
        .lines()
        .map(module_name)
        .collect();
    let mut order = Vec::new();
    let mut seen = HashSet::new();
    fn visit(
        name: &str,
        deps: &HashMap<String, (String, Vec<String>)>,
        seen: &mut HashSet<String>,
        order: &mut Vec<String>,
    ) -> bool {
        if !seen.insert(name.to_owned()) {
            return true;
        }
        let Some((_, needs)) = deps.get(name) else {
            return false;
        };
        for need in needs {
            visit(need, deps, seen, order);
        }
        order.push(name.to_owned());
        true
    }
    for name in wanted {
        let name = name.replace('-', "_");
        if !visit(&name, &deps, &mut seen, &mut order) && !builtin.contains(&name) {
            return Err(VmError::Unavailable(format!(
                "kernel module {name} is neither in {} nor built into the kernel",
                dep_path.display()
            )));
        }
    }
    Ok(order.iter().map(|n| dir.join(&deps[n].0)).collect())
}

/// Writes the initramfs atomically: a temporary file renamed into place.
fn write_initramfs(
    target: &Path,
    agent: &[u8],
    modules: &[PathBuf],
    net_modules: &[PathBuf],
) -> Result<(), VmError> {
    let tmp = target.with_extension(format!("tmp-{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut out = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        let dir = |out: &mut dyn Write, name: &str| -> std::io::Result<()> {
            cpio::NewcBuilder::new(name)
                .mode(0o040755)
                .nlink(2)
                .write(out, 0)
                .finish()?;
            Ok(())
        };
        let file =
            |out: &mut dyn Write, name: &str, mode: u32, data: &[u8]| -> std::io::Result<()> {
                // A newc entry's size is 32 bits: a larger file cannot be archived.
                let size = u32::try_from(data.len()).map_err(|_| {
                    std::io::Error::other(format!("{name}: over 4 GiB, too large for a cpio entry"))
                })?;
                let mut w = cpio::NewcBuilder::new(name)
                    .mode(0o100000 | mode)
                    .nlink(1)
                    .write(out, size);
                w.write_all(data)?;
                w.finish()?;
                Ok(())
            };
        for d in [
            "dev",
            "proc",
            "sys",
            "mnt",
            "lib",
            "lib/modules",
            &guest::MODULE_DIR[1..],
        ] {
            dir(&mut out, d)?;
        }
        cpio::NewcBuilder::new("dev/console")
            .mode(0o020600)
            .nlink(1)
            .rdev_major(5)
            .rdev_minor(1)
            .write(&mut out as &mut dyn Write, 0)
            .finish()?;
        for (list, order_file) in [
            (modules, guest::MODULE_ORDER),
            (net_modules, guest::NET_MODULE_ORDER),
        ] {
            let mut order = String::new();
            for m in list {
                let name = m.file_name().and_then(|n| n.to_str()).unwrap_or_default();
                let data = std::fs::read(m)?;
                file(
                    &mut out,
                    &format!("{}/{name}", &guest::MODULE_DIR[1..]),
                    0o644,
                    &data,
                )?;
                order.push_str(name);
                order.push('\n');
            }
            file(
                &mut out,
                &format!("{}/{order_file}", &guest::MODULE_DIR[1..]),
                0o644,
                order.as_bytes(),
            )?;
        }
        file(&mut out, "init", 0o755, agent)?;
        cpio::newc::trailer(&mut out as &mut dyn Write)?;
        out.into_inner().map_err(|e| e.into_error())?.sync_all()
    };
    write()
        .and_then(|()| std::fs::rename(&tmp, target))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            VmError::Io {
                action: "write initramfs",
                path: target.to_owned(),
                source: e,
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_come_after_their_dependencies() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(
            tmp.path().join("modules.dep"),
            "kernel/virtio_blk.ko: kernel/virtio_ring.ko kernel/virtio.ko\n\
             kernel/virtio_ring.ko: kernel/virtio.ko\n\
             kernel/virtio.ko:\n\
             kernel/overlay.ko:\n",
        )
        .unwrap();
        std::fs::write(
            tmp.path().join("modules.builtin"),
            "kernel/fs/ext4/ext4.ko\n",
        )
        .unwrap();
        let order = resolve_modules(tmp.path(), &["virtio-blk", "overlay", "ext4"]).unwrap();
        let names: Vec<String> = order
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            ["virtio.ko", "virtio_ring.ko", "virtio_blk.ko", "overlay.ko"]
        );
        assert!(resolve_modules(tmp.path(), &["nope"]).is_err());
    }

    #[test]
    fn a_dynamic_executable_is_refused_as_agent() {
        let exe = std::fs::read("/proc/self/exe").unwrap();
        let err = check_static(&exe, Path::new("/proc/self/exe")).unwrap_err();
        assert!(err.to_string().contains("dynamically linked"), "{err}");
        assert!(check_static(b"#!/bin/sh\n", Path::new("x")).is_err());
    }
}
