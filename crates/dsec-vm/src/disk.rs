//! Guest disks: one read-only image disk per dsec image, shared by every VM of that
//! image, and one small writable scratch disk per sandbox.
//!
//! The image disk is the image's merged tree (its layers stacked by overlayfs in a
//! throwaway mount namespace, so no mount ever outlives the build) written by
//! `mkfs.ext4 -d` or `mkfs.erofs`. The scratch disk is a qcow2 file backed by an empty
//! ext4 filesystem of the sandbox's `disk_mb`, made once per size: a new sandbox's disk
//! costs one small qcow2 header, and the image is never copied.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::VmError;

/// Filesystem of image disks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BaseFs {
    /// ext4 without a journal (read-only).
    #[default]
    Ext4,
    /// EROFS: compact, read-only by design.
    Erofs,
}

impl BaseFs {
    /// The name the kernel and `dsec.basefs=` use.
    pub fn name(self) -> &'static str {
        match self {
            BaseFs::Ext4 => "ext4",
            BaseFs::Erofs => "erofs",
        }
    }
}

/// Runs a host tool, turning a failure into an error that names it and shows its stderr.
pub(crate) fn run_tool(cmd: &mut Command) -> Result<(), VmError> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let out = cmd.output().map_err(|e| {
        VmError::Unavailable(format!("cannot run {program} ({e}); run scripts/setup.sh"))
    })?;
    if !out.status.success() {
        return Err(VmError::Tool {
            program,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(())
}

/// Bytes and inodes a tree holds (directories, files, links), to size an ext4 for it.
fn tree_size(dirs: &[PathBuf]) -> (u64, u64) {
    let (mut bytes, mut inodes) = (0u64, 0u64);
    let mut stack: Vec<PathBuf> = dirs.to_vec();
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(md) = entry.path().symlink_metadata() else {
                continue;
            };
            inodes += 1;
            // Every file takes at least one block.
            bytes += md.len().div_ceil(4096) * 4096;
            if md.is_dir() {
                stack.push(entry.path());
            }
        }
    }
    (bytes, inodes)
}

/// Writes the read-only disk of an image whose layer directories are `layers` (topmost
/// first) to `target`, atomically.
pub fn build_image_disk(layers: &[PathBuf], fs: BaseFs, target: &Path) -> Result<(), VmError> {
    let parent = target.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(parent).map_err(VmError::io("create", parent))?;
    let tmp = target.with_extension(format!("tmp-{}", std::process::id()));
    let mkfs: Vec<String> = match fs {
        BaseFs::Ext4 => {
            let (bytes, inodes) = tree_size(layers);
            let size_kib = (bytes + bytes / 4 + (32 << 20)) / 1024;
            vec![
                "mkfs.ext4".into(),
                "-q".into(),
                "-F".into(),
                "-O".into(),
                "^has_journal".into(),
                "-N".into(),
                (inodes + inodes / 4 + 1024).to_string(),
                "-E".into(),
                "root_owner=0:0".into(),
                "-L".into(),
                "dsec-image".into(),
                "-d".into(),
                "$SRC".into(),
                tmp.to_string_lossy().into_owned(),
                format!("{size_kib}k"),
            ]
        }
        BaseFs::Erofs => vec![
            "mkfs.erofs".into(),
            "--quiet".into(),
            tmp.to_string_lossy().into_owned(),
            "$SRC".into(),
        ],
    };
    let source = |src: &Path| -> Vec<String> {
        mkfs.iter()
            .map(|a| match a.as_str() {
                "$SRC" => src.to_string_lossy().into_owned(),
                _ => a.clone(),
            })
            .collect()
    };
    let result = match layers {
        [single] => {
            let args = source(single);
            run_tool(Command::new(&args[0]).args(&args[1..]))
        }
        _ => {
            // Stack the layers in a mount namespace of its own: the overlay vanishes with
            // the short-lived shell, even if this process dies midway.
            let merged = parent.join(format!("merge-{}", std::process::id()));
            std::fs::create_dir_all(&merged).map_err(VmError::io("create", &merged))?;
            let lower: Vec<String> = layers
                .iter()
                .map(|l| l.to_string_lossy().into_owned())
                .collect();
            let script =
                r#"set -e; mount -t overlay overlay -o "lowerdir=$1" "$2"; shift 2; exec "$@""#;
            let r = run_tool(
                Command::new("unshare")
                    .args([
                        "--mount",
                        "--propagation",
                        "private",
                        "sh",
                        "-c",
                        script,
                        "sh",
                    ])
                    .arg(lower.join(":"))
                    .arg(&merged)
                    .args(source(&merged)),
            );
            let _ = std::fs::remove_dir(&merged);
            r
        }
    };
    result
        .and_then(|()| std::fs::rename(&tmp, target).map_err(VmError::io("rename", &tmp)))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
}

/// Makes the empty ext4 of `disk_mb` that scratch disks of that size are backed by.
pub fn build_scratch_base(disk_mb: u64, target: &Path) -> Result<(), VmError> {
    let parent = target.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(parent).map_err(VmError::io("create", parent))?;
    let tmp = target.with_extension(format!("tmp-{}", std::process::id()));
    run_tool(
        Command::new("mkfs.ext4")
            .args([
                "-q",
                "-F",
                "-O",
                "^has_journal",
                "-E",
                "root_owner=0:0",
                "-L",
                "dsec-scratch",
            ])
            .arg(&tmp)
            .arg(format!("{disk_mb}M")),
    )
    .and_then(|()| std::fs::rename(&tmp, target).map_err(VmError::io("rename", &tmp)))
    .inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// Creates a sandbox's scratch disk: a qcow2 over `base` that only ever holds the
/// sandbox's own writes.
pub fn create_scratch(base: &Path, target: &Path) -> Result<(), VmError> {
    create_overlay(base, "raw", target)
}

/// Copies the qcow2 `disk` (of a paused guest) to `target` as a qcow2 over the raw
/// `base` holding every cluster `disk` or the qcow2s under it changed: a copy that
/// depends on none of them, only on the base every scratch disk shares.
pub fn copy_onto_base(disk: &Path, base: &Path, target: &Path) -> Result<(), VmError> {
    run_tool(
        Command::new("qemu-img")
            // `-U`: the paused guest's QEMU holds the disk open (and locked).
            .args([
                "convert", "-q", "-U", "-f", "qcow2", "-O", "qcow2", "-F", "raw", "-B",
            ])
            .arg(base)
            .arg(disk)
            .arg(target),
    )
}

/// A qcow2 at `target` whose reads fall through to `base` (of `base_format`), which is
/// never written: how a fork's children share their parent's saved disk.
pub fn create_overlay(base: &Path, base_format: &str, target: &Path) -> Result<(), VmError> {
    run_tool(
        Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-F", base_format, "-b"])
            .arg(base)
            .arg(target),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names in the root directory of an ext4 image, read with `debugfs`.
    fn root_names(image: &Path) -> Vec<String> {
        let out = Command::new("debugfs")
            .args(["-R", "ls -p /"])
            .arg(image)
            .output()
            .expect("debugfs runs");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split('/').nth(5).map(str::to_owned))
            .filter(|n| !n.is_empty() && n != "." && n != ".." && n != "lost+found")
            .collect()
    }

    #[test]
    fn an_image_disk_holds_the_merged_layers() {
        let tmp = tempfile::tempdir().unwrap();
        let (lower, upper) = (tmp.path().join("lower"), tmp.path().join("upper"));
        std::fs::create_dir_all(&lower).unwrap();
        std::fs::create_dir_all(&upper).unwrap();
        std::fs::write(lower.join("kept"), b"1").unwrap();
        std::fs::write(lower.join("deleted"), b"2").unwrap();
        std::fs::write(upper.join("added"), b"3").unwrap();
        // An overlayfs whiteout: the upper layer deletes `deleted`.
        rustix::fs::mknodat(
            rustix::fs::CWD,
            upper.join("deleted"),
            rustix::fs::FileType::CharacterDevice,
            rustix::fs::Mode::from_bits_truncate(0o644),
            0,
        )
        .unwrap();
        let image = tmp.path().join("image.ext4");
        build_image_disk(&[upper, lower], BaseFs::Ext4, &image).unwrap();
        let mut names = root_names(&image);
        names.sort();
        assert_eq!(names, ["added", "kept"]);
    }
}
