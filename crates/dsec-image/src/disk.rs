//! Bootable disk images (a user's own qcow2 or raw disk, with its own bootloader and
//! kernel) for the `vm` backend: recognised by their first bytes, checked, and normalised
//! into one standalone qcow2 that the store keeps as the image's only blob.
//!
//! A disk is the user's input and QEMU's tools must never guess what it is: every
//! `qemu-img` call names the format (`-f`), and a qcow2 that refers to another file — a
//! backing file or an external data file — is refused before any tool opens it (such a
//! disk, opened by the host, would read the host file it names into the guest).

use std::fs::File;
use std::io::{self, Read};
use std::path::Path;
use std::process::Command;

use crate::error::{io_error, ImageError};
use crate::image::DiskImage;

/// `QFI\xfb`: the first bytes of every qcow2 file.
const QCOW2_MAGIC: &[u8] = b"QFI\xfb";

/// The qcow2 v3 incompatible feature bit of an external data file.
const QCOW2_EXTERNAL_DATA_FILE: u64 = 1 << 2;

/// How a disk's bytes are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DiskFormat {
    /// QEMU's copy-on-write format.
    Qcow2,
    /// A plain disk: a master boot record or a GUID partition table at its start.
    Raw,
}

impl DiskFormat {
    fn name(self) -> &'static str {
        match self {
            DiskFormat::Qcow2 => "qcow2",
            DiskFormat::Raw => "raw",
        }
    }
}

/// The disk format of `head` (a file's first 1024 bytes), if it is a disk.
pub(crate) fn sniff(head: &[u8]) -> Option<DiskFormat> {
    if head.starts_with(QCOW2_MAGIC) {
        return Some(DiskFormat::Qcow2);
    }
    let mbr = head.get(510..512) == Some([0x55, 0xAA].as_slice());
    let gpt = head.get(512..520) == Some(b"EFI PART".as_slice());
    (mbr || gpt).then_some(DiskFormat::Raw)
}

/// Reads up to the first 1024 bytes of `path`.
pub(crate) fn head(path: &Path) -> io::Result<Vec<u8>> {
    let mut head = Vec::with_capacity(1024);
    File::open(path)?.take(1024).read_to_end(&mut head)?;
    Ok(head)
}

/// Why a qcow2 header (its first bytes) is refused: it names a backing file or an
/// external data file, or is too short to say.
fn qcow2_refusal(head: &[u8]) -> Option<String> {
    let be32 = |at: usize| {
        head.get(at..at + 4)
            .map(|b| u32::from_be_bytes(b.try_into().expect("4 bytes")))
    };
    let be64 = |at: usize| {
        head.get(at..at + 8)
            .map(|b| u64::from_be_bytes(b.try_into().expect("8 bytes")))
    };
    let (Some(version), Some(backing_offset)) = (be32(4), be64(8)) else {
        return Some("its qcow2 header is truncated".into());
    };
    if backing_offset != 0 {
        return Some(
            "it has a backing file (a qcow2 that reads another file); flatten it first: \
             qemu-img convert -O qcow2 IN OUT"
                .into(),
        );
    }
    if version >= 3 {
        let Some(incompatible) = be64(72) else {
            return Some("its qcow2 header is truncated".into());
        };
        if incompatible & QCOW2_EXTERNAL_DATA_FILE != 0 {
            return Some(
                "it has an external data file (its data lives in another file); \
                 flatten it first: qemu-img convert -O qcow2 IN OUT"
                    .into(),
            );
        }
    }
    None
}

/// Runs `qemu-img` with `args`, returning its stdout; a failure names the disk.
fn qemu_img(args: &[&str], input: &str) -> Result<Vec<u8>, ImageError> {
    let out = Command::new("qemu-img").args(args).output().map_err(|e| {
        io_error(format!(
            "cannot run qemu-img to import the disk {input} (install qemu-utils)"
        ))(e)
    })?;
    if !out.status.success() {
        return Err(ImageError::InvalidSource {
            input: input.to_owned(),
            reason: format!(
                "qemu-img {} refused it: {}",
                args.first().copied().unwrap_or_default(),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(out.stdout)
}

/// What `qemu-img info` says of a qcow2 (`-f qcow2`, never probed): refused if it names
/// any other file; its virtual size otherwise.
fn qcow2_info(path: &Path, input: &str) -> Result<u64, ImageError> {
    let path = path.to_string_lossy();
    let json = qemu_img(
        &["info", "-f", "qcow2", "--output=json", "--", path.as_ref()],
        input,
    )?;
    let info: serde_json::Value =
        serde_json::from_slice(&json).map_err(|e| ImageError::InvalidSource {
            input: input.to_owned(),
            reason: format!("qemu-img info's answer is unreadable: {e}"),
        })?;
    let refused = |reason: &str| ImageError::InvalidSource {
        input: input.to_owned(),
        reason: reason.to_owned(),
    };
    if info.get("backing-filename").is_some() || info.get("full-backing-filename").is_some() {
        return Err(refused("it has a backing file; flatten it first"));
    }
    if info.pointer("/format-specific/data/data-file").is_some() {
        return Err(refused("it has an external data file; flatten it first"));
    }
    info.get("virtual-size")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| refused("qemu-img info gives it no virtual size"))
}

/// Checks the disk at `path` (of `format`, from [`sniff`]) and writes it to `out` as one
/// standalone qcow2; returns what the image records of it.
pub(crate) fn normalise(
    path: &Path,
    format: DiskFormat,
    out: &Path,
    input: &str,
) -> Result<DiskImage, ImageError> {
    if format == DiskFormat::Qcow2 {
        let head = head(path).map_err(io_error(format!("cannot read {input}")))?;
        if let Some(reason) = qcow2_refusal(&head) {
            return Err(ImageError::InvalidSource {
                input: input.to_owned(),
                reason,
            });
        }
        qcow2_info(path, input)?;
    }
    let (src, dst) = (path.to_string_lossy(), out.to_string_lossy());
    qemu_img(
        &[
            "convert",
            "-f",
            format.name(),
            "-O",
            "qcow2",
            "--",
            src.as_ref(),
            dst.as_ref(),
        ],
        input,
    )?;
    let virtual_size = qcow2_info(out, input)?;
    Ok(DiskImage {
        format: DiskFormat::Qcow2.name().to_owned(),
        virtual_size,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qcow2_header(version: u32, backing: u64, incompatible: u64) -> Vec<u8> {
        let mut h = vec![0u8; 1024];
        h[..4].copy_from_slice(QCOW2_MAGIC);
        h[4..8].copy_from_slice(&version.to_be_bytes());
        h[8..16].copy_from_slice(&backing.to_be_bytes());
        h[72..80].copy_from_slice(&incompatible.to_be_bytes());
        h
    }

    #[test]
    fn disks_are_told_by_their_first_bytes() {
        assert_eq!(sniff(&qcow2_header(3, 0, 0)), Some(DiskFormat::Qcow2));
        let mut mbr = vec![0u8; 1024];
        mbr[510] = 0x55;
        mbr[511] = 0xAA;
        assert_eq!(sniff(&mbr), Some(DiskFormat::Raw));
        let mut gpt = vec![0u8; 1024];
        gpt[512..520].copy_from_slice(b"EFI PART");
        assert_eq!(sniff(&gpt), Some(DiskFormat::Raw));
        assert_eq!(sniff(b"hello"), None);
        assert_eq!(sniff(&[0u8; 1024]), None);
    }

    #[test]
    fn a_qcow2_naming_another_file_is_refused_from_its_header() {
        assert_eq!(qcow2_refusal(&qcow2_header(3, 0, 0)), None);
        assert_eq!(qcow2_refusal(&qcow2_header(2, 0, 0)), None);
        assert!(
            qcow2_refusal(&qcow2_header(3, 0x200, 0)).is_some_and(|r| r.contains("backing file"))
        );
        assert!(qcow2_refusal(&qcow2_header(3, 0, QCOW2_EXTERNAL_DATA_FILE))
            .is_some_and(|r| r.contains("external data file")));
        assert!(qcow2_refusal(QCOW2_MAGIC).is_some());
    }
}
