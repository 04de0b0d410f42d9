//! Imports from every kind of source, against real files (run as root).
//!
//! Tests that need a service `scripts/setup.sh` installs are `#[ignore]`d, so that a
//! machine without it reports them as skipped; on a set-up machine they run with
//! `--include-ignored`, and a missing service is then a failure.

use std::fs;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::{symlink, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dsec_image::{Image, ImageError, ImageStore, MountedImage};
use serde_json::json;
use sha2::{Digest, Sha256};
use tempfile::TempDir;

const MTIME: u64 = 1_700_000_000;

fn sha(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// A store of its own in a temporary directory. Bind the pair as `let (tmp, store)`:
/// the store (and its mounts) then goes before the directory.
fn new_store() -> (TempDir, ImageStore) {
    let dir = TempDir::new().unwrap();
    let store = open(&dir.path().join("images"));
    (dir, store)
}

fn open(root: &Path) -> ImageStore {
    ImageStore::open(root, root, "test").unwrap()
}

/// Hex digests of the layer blobs stored under `root/images`.
fn stored_layers(root: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(root.join("images/layers/sha256"))
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            name.strip_suffix(".erofs").map(str::to_owned)
        })
        .collect();
    names.sort();
    names
}

fn entries(dir: &Path) -> usize {
    fs::read_dir(dir).unwrap().count()
}

/// Nothing half-imported: no metadata, nothing in staging.
fn assert_clean(root: &Path, store: &ImageStore) {
    assert_eq!(entries(&root.join("images/meta")), 0);
    assert_eq!(entries(&root.join("images/staging")), 0);
    assert!(store.list().unwrap().is_empty());
}

/// A layer tar built entry by entry.
struct Layer(tar::Builder<Vec<u8>>);

impl Layer {
    fn new() -> Layer {
        Layer(tar::Builder::new(Vec::new()))
    }

    fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_size(size);
        header.set_mtime(MTIME);
        header.set_uid(0);
        header.set_gid(0);
        header
    }

    fn dir(mut self, path: &str, mode: u32) -> Layer {
        let mut header = Self::header(tar::EntryType::Directory, mode, 0);
        self.0.append_data(&mut header, path, &[][..]).unwrap();
        self
    }

    fn file(mut self, path: &str, content: &[u8], mode: u32) -> Layer {
        let mut header = Self::header(tar::EntryType::Regular, mode, content.len() as u64);
        self.0.append_data(&mut header, path, content).unwrap();
        self
    }

    fn symlink(mut self, path: &str, target: &str) -> Layer {
        let mut header = Self::header(tar::EntryType::Symlink, 0o777, 0);
        self.0.append_link(&mut header, path, target).unwrap();
        self
    }

    fn hardlink(mut self, path: &str, target: &str) -> Layer {
        let mut header = Self::header(tar::EntryType::Link, 0o644, 0);
        self.0.append_link(&mut header, path, target).unwrap();
        self
    }

    /// An entry whose name the tar crate's writer would refuse.
    fn raw_name(mut self, name: &[u8], content: &[u8]) -> Layer {
        let mut header = Self::header(tar::EntryType::Regular, 0o644, content.len() as u64);
        header.as_old_mut().name[..name.len()].copy_from_slice(name);
        header.set_cksum();
        self.0.append(&header, content).unwrap();
        self
    }

    fn build(self) -> Vec<u8> {
        self.0.into_inner().unwrap()
    }
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(bytes).unwrap();
    encoder.finish().unwrap()
}

fn zstd(bytes: &[u8]) -> Vec<u8> {
    zstd::encode_all(bytes, 3).unwrap()
}

fn write_blob(layout: &Path, bytes: &[u8]) -> String {
    let digest = sha(bytes);
    let dir = layout.join("blobs/sha256");
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join(&digest["sha256:".len()..]), bytes).unwrap();
    digest
}

fn descriptor(media_type: &str, digest: &str, bytes: &[u8]) -> serde_json::Value {
    json!({ "mediaType": media_type, "digest": digest, "size": bytes.len() })
}

fn image_config(diff_ids: &[String], config: serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": { "type": "layers", "diff_ids": diff_ids },
    }))
    .unwrap()
}

struct Built {
    config_digest: String,
    diff_ids: Vec<String>,
    manifest: serde_json::Value,
}

/// Writes the blobs of an image (layers gzip-compressed) into an OCI layout and
/// returns its manifest descriptor, without writing index.json.
fn oci_blobs(layout: &Path, layers: &[Vec<u8>], config: serde_json::Value) -> Built {
    let diff_ids: Vec<String> = layers.iter().map(|l| sha(l)).collect();
    let config_bytes = image_config(&diff_ids, config);
    let config_digest = write_blob(layout, &config_bytes);
    let layer_descriptors: Vec<_> = layers
        .iter()
        .map(|layer| {
            let blob = gzip(layer);
            let digest = write_blob(layout, &blob);
            descriptor(
                "application/vnd.oci.image.layer.v1.tar+gzip",
                &digest,
                &blob,
            )
        })
        .collect();
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": descriptor("application/vnd.oci.image.config.v1+json", &config_digest, &config_bytes),
        "layers": layer_descriptors,
    }))
    .unwrap();
    let manifest_digest = write_blob(layout, &manifest);
    let mut manifest = descriptor(
        "application/vnd.oci.image.manifest.v1+json",
        &manifest_digest,
        &manifest,
    );
    manifest["platform"] = json!({ "architecture": "amd64", "os": "linux" });
    manifest["annotations"] = json!({ "org.opencontainers.image.ref.name": "v1" });
    Built {
        config_digest,
        diff_ids,
        manifest,
    }
}

fn write_index(layout: &Path, manifests: Vec<serde_json::Value>) {
    fs::write(
        layout.join("index.json"),
        serde_json::to_vec(&json!({ "schemaVersion": 2, "manifests": manifests })).unwrap(),
    )
    .unwrap();
    fs::write(
        layout.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
}

/// A whole OCI layout with the given layers (uncompressed tars, bottom first).
fn oci_layout(layout: &Path, layers: &[Vec<u8>], config: serde_json::Value) -> Built {
    let built = oci_blobs(layout, layers, config);
    write_index(layout, vec![built.manifest.clone()]);
    built
}

/// Two layers: the upper deletes `etc/old` and makes `opt` opaque.
fn whiteout_layers() -> Vec<Vec<u8>> {
    let lower = Layer::new()
        .dir("etc", 0o755)
        .file("etc/passwd", b"root:x:0:0::/root:/bin/sh\n", 0o644)
        .file("etc/old", b"old", 0o644)
        .dir("opt", 0o755)
        .file("opt/a", b"a", 0o644)
        .build();
    let upper = Layer::new()
        .dir("etc", 0o755)
        .file("etc/.wh.old", b"", 0o644)
        .dir("opt", 0o755)
        .file("opt/.wh..wh..opq", b"", 0o644)
        .file("opt/b", b"b", 0o600)
        .build();
    vec![lower, upper]
}

/// The image's layers, mounted from their blobs, topmost first.
async fn mounted(store: &ImageStore, image: &Image) -> MountedImage {
    store.mount(image).await.unwrap()
}

#[tokio::test]
async fn rootfs_directory_keeps_modes_links_owners_and_special_files() {
    let (tmp, store) = new_store();
    let rootfs = tmp.path().join("myroot");
    fs::create_dir_all(rootfs.join("bin")).unwrap();
    fs::create_dir_all(rootfs.join("etc")).unwrap();
    fs::set_permissions(rootfs.join("etc"), fs::Permissions::from_mode(0o700)).unwrap();
    let tool = rootfs.join("bin/tool");
    fs::write(&tool, b"#!/bin/sh\necho hi\n").unwrap();
    std::os::unix::fs::chown(&tool, Some(1234), Some(5678)).unwrap();
    fs::set_permissions(&tool, fs::Permissions::from_mode(0o4755)).unwrap();
    fs::write(rootfs.join("etc/conf"), b"x=1\n").unwrap();
    fs::set_permissions(rootfs.join("etc/conf"), fs::Permissions::from_mode(0o640)).unwrap();
    let has_xattr = xattr::set(rootfs.join("etc/conf"), "user.dsec", b"yes").is_ok();
    symlink("bin/tool", rootfs.join("link")).unwrap();
    symlink("/nowhere/absolute", rootfs.join("dangling")).unwrap();
    fs::hard_link(&tool, rootfs.join("hard")).unwrap();
    let dir_fd = rustix::fs::open(
        &rootfs,
        rustix::fs::OFlags::DIRECTORY,
        rustix::fs::Mode::empty(),
    )
    .unwrap();
    rustix::fs::mknodat(
        &dir_fd,
        "fifo",
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    rustix::fs::mknodat(
        &dir_fd,
        "null",
        rustix::fs::FileType::CharacterDevice,
        rustix::fs::Mode::from_raw_mode(0o666),
        rustix::fs::makedev(1, 3),
    )
    .unwrap();

    let image = store.import(rootfs.to_str().unwrap(), None).await.unwrap();
    assert_eq!(image.name, "myroot");
    assert_eq!(image.layers.len(), 1);
    assert_eq!(
        image.config.env,
        ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    );
    assert_eq!(image.size, 18 + 4);
    assert_eq!(store.get("myroot").unwrap(), image);

    let mounted = mounted(&store, &image).await;
    let layer = &mounted.dirs[0];
    assert!(layer.starts_with(tmp.path().join("images/mnt")));
    assert_eq!(
        stored_layers(tmp.path()),
        [image.layers[0]["sha256:".len()..].to_owned()]
    );
    let tool_meta = fs::symlink_metadata(layer.join("bin/tool")).unwrap();
    assert_eq!(tool_meta.mode() & 0o7777, 0o4755);
    assert_eq!((tool_meta.uid(), tool_meta.gid()), (1234, 5678));
    assert_eq!(
        fs::read(layer.join("bin/tool")).unwrap(),
        b"#!/bin/sh\necho hi\n"
    );
    assert_eq!(
        fs::symlink_metadata(layer.join("etc")).unwrap().mode() & 0o7777,
        0o700
    );
    assert_eq!(
        fs::symlink_metadata(layer.join("etc/conf")).unwrap().mode() & 0o7777,
        0o640
    );
    assert_eq!(
        fs::read_link(layer.join("link")).unwrap(),
        Path::new("bin/tool")
    );
    assert_eq!(
        fs::read_link(layer.join("dangling")).unwrap(),
        Path::new("/nowhere/absolute")
    );
    assert_eq!(
        fs::symlink_metadata(layer.join("hard")).unwrap().ino(),
        tool_meta.ino()
    );
    assert!(fs::symlink_metadata(layer.join("fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
    let null = fs::symlink_metadata(layer.join("null")).unwrap();
    assert!(null.file_type().is_char_device());
    assert_eq!(null.rdev(), rustix::fs::makedev(1, 3));
    if has_xattr {
        assert_eq!(
            xattr::get(layer.join("etc/conf"), "user.dsec").unwrap(),
            Some(b"yes".to_vec())
        );
    }
    assert_eq!(entries(&tmp.path().join("images/staging")), 0);
}

#[tokio::test]
async fn same_directory_twice_is_stored_once() {
    let (tmp, store) = new_store();
    let rootfs = tmp.path().join("rootfs");
    fs::create_dir_all(rootfs.join("usr/bin")).unwrap();
    fs::write(rootfs.join("usr/bin/app"), b"app").unwrap();
    let source = rootfs.to_str().unwrap();
    let first = store.import(source, Some("one")).await.unwrap();
    let second = store.import(source, Some("two")).await.unwrap();
    assert_eq!(first.layers, second.layers);
    assert_eq!(first.id, second.id);
    assert_eq!(stored_layers(tmp.path()).len(), 1);
    let names: Vec<_> = store.list().unwrap().into_iter().map(|i| i.name).collect();
    assert_eq!(names, ["one", "two"]);
    // Both staging trees (the stored one and the duplicate) are deleted off the path.
    assert_eq!(entries(&tmp.path().join("images/staging")), 0);
    wait_empty(&tmp.path().join("images/trash"));
}

/// Waits (up to 10 s) for the background deletion of what lies in `dir`.
fn wait_empty(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while entries(dir) > 0 {
        assert!(
            Instant::now() < deadline,
            "{} still holds {} entries",
            dir.display(),
            entries(dir)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test]
async fn rootfs_directory_holding_the_store_leaves_it_out() {
    let tmp = TempDir::new().unwrap();
    let rootfs = tmp.path().join("host");
    let store = open(&rootfs.join("var/lib/dsec/images"));
    fs::write(rootfs.join("hello"), b"hi").unwrap();
    let image = store.import(rootfs.to_str().unwrap(), None).await.unwrap();
    let mounted = mounted(&store, &image).await;
    let layer = &mounted.dirs[0];
    assert_eq!(fs::read(layer.join("hello")).unwrap(), b"hi");
    assert!(layer.join("var/lib/dsec").is_dir());
    assert!(!layer.join("var/lib/dsec/images").exists());
}

#[tokio::test]
async fn rootfs_tarballs_plain_gzip_and_zstd() {
    let (tmp, store) = new_store();
    let tar = Layer::new()
        .dir("bin", 0o755)
        .file("bin/sh", b"shell", 0o755)
        .symlink("bin/ash", "sh")
        .hardlink("bin/ash2", "bin/sh")
        .build();
    let diff_id = sha(&tar);
    for (file, bytes, name) in [
        ("a.tar", tar.clone(), "a"),
        ("b.tar.gz", gzip(&tar), "b"),
        ("c.tar.zst", zstd(&tar), "c"),
        ("d.tgz", gzip(&tar), "d"),
    ] {
        let path = tmp.path().join(file);
        fs::write(&path, bytes).unwrap();
        let image = store.import(path.to_str().unwrap(), None).await.unwrap();
        assert_eq!(image.name, name);
        assert_eq!(image.layers, std::slice::from_ref(&diff_id));
        let mounted = mounted(&store, &image).await;
        let layer = &mounted.dirs[0];
        assert_eq!(fs::read(layer.join("bin/sh")).unwrap(), b"shell");
        assert_eq!(
            fs::read_link(layer.join("bin/ash")).unwrap(),
            Path::new("sh")
        );
        assert_eq!(
            fs::metadata(layer.join("bin/ash2")).unwrap().ino(),
            fs::metadata(layer.join("bin/sh")).unwrap().ino()
        );
    }
    assert_eq!(
        stored_layers(tmp.path()),
        [diff_id["sha256:".len()..].to_owned()]
    );
    assert_eq!(entries(&tmp.path().join("images/staging")), 0);
}

#[tokio::test]
async fn oci_layout_with_whiteouts_and_opaque_directory() {
    let (tmp, store) = new_store();
    let layout = tmp.path().join("app");
    let built = oci_layout(
        &layout,
        &whiteout_layers(),
        json!({
            "Env": ["PATH=/bin", "FOO=bar"],
            "WorkingDir": "/work",
            "Cmd": ["sh", "-c", "true"],
            "Entrypoint": ["/entry"],
        }),
    );
    let image = store.import(layout.to_str().unwrap(), None).await.unwrap();
    assert_eq!(image.name, "app");
    assert_eq!(image.id, built.config_digest);
    assert_eq!(image.layers, built.diff_ids);
    assert_eq!(image.config.env, ["PATH=/bin", "FOO=bar"]);
    assert_eq!(image.config.workdir.as_deref(), Some("/work"));
    assert_eq!(image.config.cmd, ["sh", "-c", "true"]);
    assert_eq!(image.config.entrypoint, ["/entry"]);

    let mounted = mounted(&store, &image).await;
    let dirs = &mounted.dirs;
    assert_eq!(dirs.len(), 2);
    let (upper, lower) = (&dirs[0], &dirs[1]);
    assert_eq!(fs::read(lower.join("etc/old")).unwrap(), b"old");
    let whiteout = fs::symlink_metadata(upper.join("etc/old")).unwrap();
    assert!(whiteout.file_type().is_char_device());
    assert_eq!(whiteout.rdev(), 0);
    assert!(!upper.join("etc/.wh.old").exists());
    assert!(!upper.join("opt/.wh..wh..opq").exists());
    assert_eq!(
        xattr::get(upper.join("opt"), "trusted.overlay.opaque").unwrap(),
        Some(b"y".to_vec())
    );
    assert_eq!(
        xattr::get(lower.join("opt"), "trusted.overlay.opaque").unwrap(),
        None
    );
    assert_eq!(fs::read(upper.join("opt/b")).unwrap(), b"b");
    assert_eq!(
        fs::metadata(upper.join("opt/b")).unwrap().mode() & 0o7777,
        0o600
    );
}

#[tokio::test]
async fn oci_layers_stack_under_overlayfs() {
    let (tmp, store) = new_store();
    let layout = tmp.path().join("stacked");
    oci_layout(&layout, &whiteout_layers(), json!({}));
    let image = store.import(layout.to_str().unwrap(), None).await.unwrap();
    let mounted = mounted(&store, &image).await;
    let lower = mounted
        .dirs
        .iter()
        .map(|d| d.to_str().unwrap().to_owned())
        .collect::<Vec<_>>()
        .join(":");
    let (upper, work, merged) = (
        tmp.path().join("upper"),
        tmp.path().join("work"),
        tmp.path().join("merged"),
    );
    for dir in [&upper, &work, &merged] {
        fs::create_dir(dir).unwrap();
    }
    let options = std::ffi::CString::new(format!(
        "lowerdir={lower},upperdir={},workdir={}",
        upper.display(),
        work.display()
    ))
    .unwrap();
    rustix::mount::mount(
        "overlay",
        &merged,
        "overlay",
        rustix::mount::MountFlags::empty(),
        options.as_c_str(),
    )
    .expect("mount overlayfs (these tests run as root, with the overlay module loaded)");
    let seen = (
        merged.join("etc/passwd").exists(),
        merged.join("etc/old").exists(),
        merged.join("opt/a").exists(),
        fs::read(merged.join("opt/b")).ok(),
    );
    rustix::mount::unmount(&merged, rustix::mount::UnmountFlags::DETACH).unwrap();
    assert_eq!(seen, (true, false, false, Some(b"b".to_vec())));
}

#[tokio::test]
async fn nested_index_picks_linux_amd64() {
    let (tmp, store) = new_store();
    let layout = tmp.path().join("multi");
    let built = oci_blobs(
        &layout,
        &[Layer::new().file("amd64", b"yes", 0o644).build()],
        json!({}),
    );
    let nested = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": sha(b"an arm64 manifest that is not in the layout"),
                "size": 1,
                "platform": { "architecture": "arm64", "os": "linux" },
            },
            built.manifest,
        ],
    }))
    .unwrap();
    let nested_digest = write_blob(&layout, &nested);
    write_index(
        &layout,
        vec![descriptor(
            "application/vnd.oci.image.index.v1+json",
            &nested_digest,
            &nested,
        )],
    );
    let image = store.import(layout.to_str().unwrap(), None).await.unwrap();
    assert_eq!(image.layers, built.diff_ids);
    assert!(mounted(&store, &image).await.dirs[0]
        .join("amd64")
        .is_file());
}

/// Writes `files` (path, bytes) as a tar file.
fn write_tar(path: &Path, files: &[(String, Vec<u8>)]) {
    let mut outer = Layer::new();
    for (name, bytes) in files {
        outer = outer.file(name, bytes, 0o644);
    }
    fs::write(path, outer.build()).unwrap();
}

#[tokio::test]
async fn docker_save_archive_legacy_format() {
    let (tmp, store) = new_store();
    let layer = Layer::new()
        .dir("srv", 0o755)
        .file("srv/index.html", b"hello", 0o644)
        .build();
    let diff_id = sha(&layer);
    let config = image_config(
        std::slice::from_ref(&diff_id),
        json!({ "Cmd": ["httpd"], "WorkingDir": "/srv" }),
    );
    let config_hex = sha(&config)["sha256:".len()..].to_owned();
    let layer_id = "f".repeat(64);
    let manifest = serde_json::to_vec(&json!([{
        "Config": format!("{config_hex}.json"),
        "RepoTags": ["web:latest"],
        "Layers": [format!("{layer_id}/layer.tar")],
    }]))
    .unwrap();
    let archive = tmp.path().join("web.tar");
    write_tar(
        &archive,
        &[
            (format!("{config_hex}.json"), config.clone()),
            (format!("{layer_id}/layer.tar"), layer),
            ("manifest.json".into(), manifest),
        ],
    );
    let image = store.import(archive.to_str().unwrap(), None).await.unwrap();
    assert_eq!(image.name, "web");
    assert_eq!(image.id, sha(&config));
    assert_eq!(image.layers, [diff_id]);
    assert_eq!(image.config.cmd, ["httpd"]);
    assert_eq!(image.config.workdir.as_deref(), Some("/srv"));
    assert_eq!(
        fs::read(mounted(&store, &image).await.dirs[0].join("srv/index.html")).unwrap(),
        b"hello"
    );
    assert_eq!(entries(&tmp.path().join("images/staging")), 0);
}

#[tokio::test]
async fn docker_save_archive_oci_format_compressed() {
    let (tmp, store) = new_store();
    let layout = tmp.path().join("layout");
    let built = oci_layout(&layout, &whiteout_layers(), json!({ "Cmd": ["sh"] }));
    // docker save ≥ 25: an OCI layout plus a manifest.json, here gzip-compressed as a whole.
    let mut files = Vec::new();
    for name in ["oci-layout", "index.json"] {
        files.push((name.to_owned(), fs::read(layout.join(name)).unwrap()));
    }
    for blob in fs::read_dir(layout.join("blobs/sha256")).unwrap() {
        let blob = blob.unwrap();
        files.push((
            format!("blobs/sha256/{}", blob.file_name().to_string_lossy()),
            fs::read(blob.path()).unwrap(),
        ));
    }
    files.push(("manifest.json".into(), b"[]".to_vec()));
    let plain = tmp.path().join("saved.tar");
    write_tar(&plain, &files);
    let compressed = tmp.path().join("saved2.tar.gz");
    fs::write(&compressed, gzip(&fs::read(&plain).unwrap())).unwrap();

    for (path, name) in [(plain, "saved"), (compressed, "saved2")] {
        let image = store.import(path.to_str().unwrap(), None).await.unwrap();
        assert_eq!(image.name, name);
        assert_eq!(image.id, built.config_digest);
        assert_eq!(image.layers, built.diff_ids);
    }
    assert_eq!(stored_layers(tmp.path()).len(), 2);
    assert_eq!(entries(&tmp.path().join("images/staging")), 0);
}

#[tokio::test]
async fn truncated_gzip_is_corrupt_and_leaves_nothing() {
    let (tmp, store) = new_store();
    let noise: Vec<u8> = (0..400_000u32)
        .flat_map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes())
        .collect();
    let tar = Layer::new()
        .file("big", &noise, 0o644)
        .file("after", b"x", 0o644)
        .build();
    let compressed = gzip(&tar);
    let path = tmp.path().join("cut.tar.gz");
    fs::write(&path, &compressed[..compressed.len() / 2]).unwrap();
    let err = store
        .import(path.to_str().unwrap(), None)
        .await
        .unwrap_err();
    assert!(matches!(err, ImageError::Corrupt { .. }), "{err:?}");
    assert_clean(tmp.path(), &store);
    assert!(stored_layers(tmp.path()).is_empty());
}

#[tokio::test]
async fn escaping_entry_is_corrupt_and_leaves_nothing() {
    let (tmp, store) = new_store();
    let tar = Layer::new()
        .file("ok", b"fine", 0o644)
        .raw_name(b"../escape", b"evil")
        .build();
    let path = tmp.path().join("evil.tar");
    fs::write(&path, tar).unwrap();
    let err = store
        .import(path.to_str().unwrap(), None)
        .await
        .unwrap_err();
    assert!(matches!(err, ImageError::Corrupt { .. }), "{err:?}");
    assert_clean(tmp.path(), &store);
    assert!(stored_layers(tmp.path()).is_empty());
    assert!(!tmp.path().join("images/escape").exists());
    assert!(!tmp.path().join("images/staging/escape").exists());
}

#[tokio::test]
async fn symlink_escape_is_corrupt() {
    let (tmp, store) = new_store();
    let outside = tmp.path().join("outside");
    fs::create_dir(&outside).unwrap();
    let tar = Layer::new()
        .symlink("sneaky", outside.to_str().unwrap())
        .file("sneaky/planted", b"evil", 0o644)
        .build();
    let path = tmp.path().join("sneaky.tar");
    fs::write(&path, tar).unwrap();
    let err = store
        .import(path.to_str().unwrap(), None)
        .await
        .unwrap_err();
    assert!(matches!(err, ImageError::Corrupt { .. }), "{err:?}");
    assert!(!outside.join("planted").exists());
    assert_clean(tmp.path(), &store);
}

#[tokio::test]
async fn bad_blob_digest_is_corrupt() {
    let (tmp, store) = new_store();
    let layout = tmp.path().join("tampered");
    oci_layout(&layout, &whiteout_layers(), json!({}));
    // Swap the upper layer's blob for other valid content under the same name.
    let manifest_digest: serde_json::Value =
        serde_json::from_slice(&fs::read(layout.join("index.json")).unwrap()).unwrap();
    let manifest_hex =
        manifest_digest["manifests"][0]["digest"].as_str().unwrap()["sha256:".len()..].to_owned();
    let manifest: serde_json::Value =
        serde_json::from_slice(&fs::read(layout.join("blobs/sha256").join(manifest_hex)).unwrap())
            .unwrap();
    let upper_hex = &manifest["layers"][1]["digest"].as_str().unwrap()["sha256:".len()..];
    fs::write(
        layout.join("blobs/sha256").join(upper_hex),
        gzip(&Layer::new().file("other", b"other", 0o644).build()),
    )
    .unwrap();
    let err = store
        .import(layout.to_str().unwrap(), None)
        .await
        .unwrap_err();
    assert!(matches!(err, ImageError::Corrupt { .. }), "{err:?}");
    assert_eq!(entries(&tmp.path().join("images/meta")), 0);
    assert_eq!(entries(&tmp.path().join("images/staging")), 0);
    // The complete lower layer may stay; the tampered one must not.
    assert_eq!(stored_layers(tmp.path()).len(), 1);
}

#[tokio::test]
async fn unknown_sources_and_bad_names_are_invalid() {
    let (tmp, store) = new_store();
    let junk = tmp.path().join("junk.bin");
    fs::write(&junk, b"definitely not an archive").unwrap();
    let rootfs = tmp.path().join("rootfs");
    fs::create_dir(&rootfs).unwrap();
    let cases = [
        ("/nonexistent/path/rootfs", None),
        ("./missing.tar.gz", None),
        ("not a reference!", None),
        (junk.to_str().unwrap(), None),
        (rootfs.to_str().unwrap(), Some("bad name")),
        (rootfs.to_str().unwrap(), Some(".hidden")),
    ];
    for (source, name) in cases {
        let err = store.import(source, name).await.unwrap_err();
        assert!(
            matches!(err, ImageError::InvalidSource { .. }),
            "{source}: {err:?}"
        );
    }
    assert!(matches!(
        store.get("nope"),
        Err(ImageError::NotFound { .. })
    ));
    assert_clean(tmp.path(), &store);
}

#[tokio::test]
async fn remove_keeps_shared_and_in_use_layers() {
    let (tmp, store) = new_store();
    let base = Layer::new().file("base", b"base", 0o644).build();
    let only_a = Layer::new().file("a", b"a", 0o644).build();
    let only_b = Layer::new().file("b", b"b", 0o644).build();
    let only_c = Layer::new().file("c", b"c", 0o644).build();
    let hex = |tar: &[u8]| sha(tar)["sha256:".len()..].to_owned();
    for (name, layers) in [
        ("a", vec![base.clone(), only_a.clone()]),
        ("b", vec![base.clone(), only_b.clone()]),
    ] {
        let layout = tmp.path().join(format!("layout-{name}"));
        oci_layout(&layout, &layers, json!({}));
        store
            .import(layout.to_str().unwrap(), Some(name))
            .await
            .unwrap();
    }
    let c_path = tmp.path().join("c.tar");
    fs::write(&c_path, &only_c).unwrap();
    store.import(c_path.to_str().unwrap(), None).await.unwrap();
    let names: Vec<_> = store.list().unwrap().into_iter().map(|i| i.name).collect();
    assert_eq!(names, ["a", "b", "c"]);
    assert_eq!(stored_layers(tmp.path()).len(), 4);

    store.remove("a").unwrap();
    let left = stored_layers(tmp.path());
    assert!(left.contains(&hex(&base)), "shared with b");
    assert!(!left.contains(&hex(&only_a)));
    assert!(matches!(store.get("a"), Err(ImageError::NotFound { .. })));

    // A sandbox built on c holds its layer.
    let in_use = mounted(&store, &store.get("c").unwrap()).await;
    store.remove("c").unwrap();
    assert!(
        stored_layers(tmp.path()).contains(&hex(&only_c)),
        "used by a sandbox"
    );
    assert_eq!(fs::read(in_use.dirs[0].join("c")).unwrap(), b"c");

    store.remove("b").unwrap();
    assert_eq!(stored_layers(tmp.path()), [hex(&only_c)]);
    assert!(matches!(
        store.remove("b"),
        Err(ImageError::NotFound { .. })
    ));
    drop(in_use);
    let pruned = store.prune().unwrap();
    assert_eq!(pruned.layers, 1);
    assert!(stored_layers(tmp.path()).is_empty());
    assert!(store.list().unwrap().is_empty());
    assert_eq!(entries(&tmp.path().join("images/staging")), 0);
    assert_eq!(
        entries(&tmp.path().join("images/mnt")),
        0,
        "unused layers are unmounted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_imports_of_one_layer_store_it_once() {
    let (tmp, store) = new_store();
    let tar = Layer::new()
        .file("data", &vec![7u8; 1 << 20], 0o644)
        .build();
    let path = tmp.path().join("data.tar");
    fs::write(&path, &tar).unwrap();
    let source = path.to_str().unwrap().to_owned();
    let imports = (0..4).map(|i| {
        let (store, source) = (store.clone(), source.clone());
        tokio::spawn(async move { store.import(&source, Some(&format!("copy{i}"))).await })
    });
    for import in imports.collect::<Vec<_>>() {
        import.await.unwrap().unwrap();
    }
    assert_eq!(store.list().unwrap().len(), 4);
    assert_eq!(
        stored_layers(tmp.path()),
        [sha(&tar)["sha256:".len()..].to_owned()]
    );
    assert_eq!(entries(&tmp.path().join("images/staging")), 0);
}

#[tokio::test]
async fn open_clears_leftover_staging() {
    let tmp = TempDir::new().unwrap();
    let root = tmp.path().join("images");
    drop(open(&root));
    fs::create_dir_all(root.join("staging/layer-crashed/usr")).unwrap();
    fs::write(root.join("staging/layer-crashed/usr/x"), b"x").unwrap();
    fs::write(root.join("layers/sha256/.tmp-test-0123"), b"half a blob").unwrap();
    fs::create_dir_all(root.join("trash/layer-half-deleted/etc")).unwrap();
    fs::write(root.join("trash/layer-half-deleted/etc/y"), b"y").unwrap();
    let store = open(&root);
    assert_eq!(entries(&root.join("staging")), 0);
    assert!(!root.join("layers/sha256/.tmp-test-0123").exists());
    wait_empty(&root.join("trash"));
    drop(store);
}

/// A registry process, stopped (by its pid) when dropped.
struct Registry(Child);

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
#[ignore = "needs docker-registry and skopeo from scripts/setup.sh; run with --include-ignored"]
async fn pull_from_a_local_registry() {
    const REGISTRY: &str = "/usr/bin/docker-registry";
    const SKOPEO: &str = "/usr/bin/skopeo";
    for program in [REGISTRY, SKOPEO] {
        assert!(
            Path::new(program).exists(),
            "{program} is missing: scripts/setup.sh installs docker-registry and skopeo"
        );
    }
    let (tmp, store) = new_store();
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = tmp.path().join("registry.yml");
    fs::write(
        &config,
        format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n",
            tmp.path().join("registry-data").display()
        ),
    )
    .unwrap();
    let _registry = Registry(
        Command::new(REGISTRY)
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "registry did not start");
        std::thread::sleep(Duration::from_millis(50));
    }

    let layout = tmp.path().join("layout");
    let built = oci_layout(
        &layout,
        &whiteout_layers(),
        json!({ "Cmd": ["sh"], "Env": ["A=1"] }),
    );
    let reference = format!("127.0.0.1:{port}/test/img:v1");
    let pushed = Command::new(SKOPEO)
        .args(["--insecure-policy", "copy", "--dest-tls-verify=false"])
        .arg(format!("oci:{}:v1", layout.display()))
        .arg(format!("docker://{reference}"))
        .output()
        .unwrap();
    assert!(
        pushed.status.success(),
        "skopeo: {}",
        String::from_utf8_lossy(&pushed.stderr)
    );

    let image = store.import(&reference, None).await.unwrap();
    assert_eq!(image.name, reference);
    assert_eq!(image.id, built.config_digest);
    assert_eq!(image.layers, built.diff_ids);
    assert_eq!(image.config.cmd, ["sh"]);
    assert_eq!(image.config.env, ["A=1"]);
    let mounted = mounted(&store, &image).await;
    let upper = &mounted.dirs[0];
    assert!(fs::symlink_metadata(upper.join("etc/old"))
        .unwrap()
        .file_type()
        .is_char_device());
    // Pulling again reuses the stored layers.
    let again = store.import(&reference, Some("again")).await.unwrap();
    assert_eq!(again.layers, image.layers);
    assert_eq!(again.size, image.size);
    assert_eq!(stored_layers(tmp.path()).len(), 2);
    assert_eq!(entries(&tmp.path().join("images/staging")), 0);
}

/// A disk image's blob is the user's own bytes: the store never mounts it, whichever path
/// asks (a create that pulled it from a registry skips the edge's own check).
#[tokio::test]
#[ignore = "needs qemu-img (qemu-utils) from scripts/setup.sh; run with --include-ignored"]
async fn a_bootable_disk_is_never_mounted_as_layers() {
    let (tmp, store) = new_store();
    let raw = tmp.path().join("disk.raw");
    let mut bytes = vec![0u8; 1 << 20];
    bytes[510..512].copy_from_slice(&[0x55, 0xAA]); // a master boot record's signature
    fs::write(&raw, &bytes).unwrap();
    let image = store
        .import(raw.to_str().unwrap(), Some("disk"))
        .await
        .unwrap();
    assert!(image.disk.is_some(), "{image:?}");
    match store.mount(&image).await {
        Err(ImageError::BootableDisk { name }) => assert_eq!(name, "disk"),
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("a disk image's qcow2 was mounted as EROFS layers"),
    }
}
