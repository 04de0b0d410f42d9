//! The store itself: importing, looking up and removing images.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::digest::{sha256, sha256_hex, HashingReader};
use crate::docker;
use crate::error::{io_error, Fault, ImageError};
use crate::oci::{self, Plan};
use crate::registry::{self, ARCHIVE_SUFFIXES};
use crate::rootfs::unpack_tree;
use crate::unpack::{unpack_layer, Compression, Unpacked};

/// The search path a rootfs import gets, since it has no config of its own.
const DEFAULT_PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const MAX_NAME_LEN: usize = 128;

/// An image as the store knows it: enough to stack its layers and start its process.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Image {
    /// The name it was imported under.
    pub name: String,
    /// `sha256:<hex>` of the config JSON (OCI and Docker sources) or of the
    /// JSON list of diff ids (rootfs sources).
    pub id: String,
    /// Bytes of file content in the unpacked layers.
    pub size: u64,
    /// Diff ids (`sha256:<hex>` of each uncompressed layer tar), bottom first.
    pub layers: Vec<String>,
    /// When it was imported, in unix seconds.
    pub created_at: f64,
    /// Run-time defaults from the image config.
    pub config: ImageConfig,
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

/// A content-addressed store of images and their unpacked layers.
///
/// Layout under the root: `layers/sha256/<hex>/` (one overlayfs-ready
/// directory per diff id), `meta/<name>.json` (one per image, written last
/// and atomically), `staging/` (scratch space, emptied by [`ImageStore::open`]).
/// Open one store per root. Clone is cheap.
#[derive(Clone, Debug)]
pub struct ImageStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    root: PathBuf,
    /// Layers that imports in flight rely on, with a count per import. Its lock
    /// also orders layer commits against garbage collection.
    pins: Mutex<HashMap<String, usize>>,
}

impl ImageStore {
    /// Opens (creating if needed) the store at `root`, usually `<state-dir>/images`,
    /// and clears what a crashed import left in its staging area.
    pub fn open(root: &Path) -> Result<ImageStore, ImageError> {
        let inner = Inner {
            root: root.to_owned(),
            pins: Mutex::new(HashMap::new()),
        };
        for dir in [inner.layers_dir(), inner.meta_dir(), inner.staging_dir()] {
            fs::create_dir_all(&dir)
                .map_err(io_error(format!("cannot create {}", dir.display())))?;
        }
        let staging = inner.staging_dir();
        let leftovers = fs::read_dir(&staging)
            .map_err(io_error(format!("cannot list {}", staging.display())))?;
        for entry in leftovers {
            let path = entry
                .map_err(io_error(format!("cannot list {}", staging.display())))?
                .path();
            let removed = if path.is_dir() && !path.is_symlink() {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
            removed.map_err(io_error(format!("cannot remove {}", path.display())))?;
            tracing::info!(path = %path.display(), "removed leftover of an interrupted import");
        }
        Ok(ImageStore {
            inner: Arc::new(inner),
        })
    }

    /// Imports an image from an OCI layout directory, a rootfs directory, a
    /// `docker save` archive, a rootfs tarball (plain, gzip or zstd), a
    /// registry reference or `docker://REF` (exported from the Docker daemon),
    /// and stores it as `name` (default: the file's base name without archive
    /// extensions, or the reference itself), replacing any image of that name.
    pub async fn import(&self, source: &str, name: Option<&str>) -> Result<Image, ImageError> {
        if let Some(reference) = source.strip_prefix(docker::SCHEME) {
            let name = name.unwrap_or(reference).to_owned();
            validate_name(&name, source)?;
            let archive = docker::export(reference, source, &self.inner.staging_dir()).await?;
            let inner = self.inner.clone();
            let input = source.to_owned();
            return blocking(move || {
                let image = inner.import_path(archive.path(), name, &input);
                drop(archive);
                image
            })
            .await;
        }
        let path = Path::new(source);
        let exists = match tokio::fs::metadata(path).await {
            Ok(_) => true,
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(e) => return Err(io_error(format!("cannot inspect {source}"))(e)),
        };
        if exists {
            let name = match name {
                Some(name) => name.to_owned(),
                None => default_name(path),
            };
            validate_name(&name, source)?;
            let inner = self.inner.clone();
            let (path, input) = (path.to_owned(), source.to_owned());
            return blocking(move || inner.import_path(&path, name, &input)).await;
        }
        let Some(reference) = registry::parse_reference(source) else {
            return Err(ImageError::InvalidSource {
                input: source.to_owned(),
                reason: "no such file or directory, and not a registry reference".into(),
            });
        };
        let name = name.unwrap_or(source).to_owned();
        validate_name(&name, source)?;
        tracing::info!(reference = %source, image = %name, "pulling image");
        let mut pins = Pins::new(self.inner.clone());
        let staging = self.inner.staging_dir();
        let (plan, downloads) = registry::fetch(&mut pins, &staging, &reference, source).await?;
        let inner = self.inner.clone();
        let input = source.to_owned();
        blocking(move || {
            let image = inner.import_plan(&mut pins, plan, name, &input);
            drop(downloads);
            image
        })
        .await
    }

    /// Looks up an image by name.
    pub fn get(&self, name: &str) -> Result<Image, ImageError> {
        let path = self.inner.meta_path(name);
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(ImageError::NotFound {
                    name: name.to_owned(),
                })
            }
            Err(e) => return Err(io_error(format!("cannot read {}", path.display()))(e)),
        };
        serde_json::from_slice(&bytes).map_err(|e| ImageError::Corrupt {
            input: name.to_owned(),
            reason: format!("its metadata is unreadable: {e}; import it again"),
        })
    }

    /// All images, sorted by name; unreadable metadata files are skipped with a warning.
    pub fn list(&self) -> Result<Vec<Image>, ImageError> {
        let dir = self.inner.meta_dir();
        let context = || format!("cannot list {}", dir.display());
        let mut images = Vec::new();
        for entry in fs::read_dir(&dir).map_err(io_error(context()))? {
            let path = entry.map_err(io_error(context()))?.path();
            let file_name = path.file_name().unwrap_or_default().to_string_lossy();
            if file_name.starts_with('.') || !file_name.ends_with(".json") {
                continue;
            }
            let bytes =
                fs::read(&path).map_err(io_error(format!("cannot read {}", path.display())))?;
            match serde_json::from_slice::<Image>(&bytes) {
                Ok(image) => images.push(image),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "skipping unreadable image metadata")
                }
            }
        }
        images.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(images)
    }

    /// Removes the image's metadata, then deletes layers no remaining image references and that are not in `in_use` (layer digests used by live sandboxes).
    pub fn remove(&self, name: &str, in_use: &HashSet<String>) -> Result<(), ImageError> {
        let graves = {
            let pins = self.inner.lock_pins();
            // Gather the other images' references before deleting anything, so
            // an unreadable metadata directory cannot cost layers.
            let others = self.list()?;
            let path = self.inner.meta_path(name);
            match fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    return Err(ImageError::NotFound {
                        name: name.to_owned(),
                    })
                }
                Err(e) => return Err(io_error(format!("cannot remove {}", path.display()))(e)),
            }
            let referenced: HashSet<&str> = others
                .iter()
                .filter(|image| image.name != name)
                .flat_map(|image| image.layers.iter())
                .chain(in_use)
                .chain(pins.keys())
                .map(String::as_str)
                .collect();
            self.inner.bury_unreferenced(&referenced)?
        };
        // Deleting happens outside the lock: the layers are already out of the store.
        for (diff_id, grave) in graves {
            match grave.close() {
                Ok(()) => tracing::info!(layer = %diff_id, "deleted unreferenced layer"),
                Err(e) => tracing::warn!(layer = %diff_id, error = %e, "could not delete layer"),
            }
        }
        tracing::info!(image = %name, "removed image");
        Ok(())
    }

    /// Stores a sandbox's writable layer as a new image `name`: `base`'s layers plus the
    /// diff in `upper` (an overlayfs upper directory), with `base`'s config. Only the diff
    /// is copied; the base layers are shared.
    pub async fn commit_upper(
        &self,
        base: &Image,
        upper: &Path,
        name: &str,
    ) -> Result<Image, ImageError> {
        validate_name(name, name)?;
        let (inner, base, upper, name) = (
            self.inner.clone(),
            base.clone(),
            upper.to_owned(),
            name.to_owned(),
        );
        blocking(move || {
            let input = format!("the writable layer of {}", upper.display());
            let mut pins = Pins::new(inner.clone());
            for layer in &base.layers {
                if !pins.pin_if_stored(layer) {
                    return Err(ImageError::NotFound {
                        name: format!("{} (layer {layer})", base.name),
                    });
                }
            }
            let unpacked = crate::rootfs::unpack_upper(&inner.staging_dir(), &upper)
                .map_err(|f| f.into_error(&input))?;
            let diff_id = unpacked.diff_id.clone();
            let size = base.size + unpacked.size;
            let new = pins.commit(unpacked).map_err(|f| f.into_error(&input))?;
            let mut layers = base.layers.clone();
            layers.push(diff_id);
            let id = sha256(&serde_json::to_vec(&layers).unwrap_or_default());
            inner.finish(name, id, size, layers, base.config.clone(), new)
        })
        .await
    }

    /// Directories of the image's layers in overlayfs lowerdir order (topmost layer FIRST).
    pub fn layer_dirs(&self, image: &Image) -> Vec<PathBuf> {
        image
            .layers
            .iter()
            .rev()
            .map(|diff_id| self.inner.layer_path(diff_id))
            .collect()
    }
}

/// Runs blocking import work off the async runtime.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ImageError> + Send + 'static,
) -> Result<T, ImageError> {
    match tokio::task::spawn_blocking(work).await {
        Ok(result) => result,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(ImageError::Io {
            context: "the import was cancelled".into(),
            source: io::Error::other(e),
        }),
    }
}

impl Inner {
    fn layers_dir(&self) -> PathBuf {
        self.root.join("layers").join("sha256")
    }

    fn meta_dir(&self) -> PathBuf {
        self.root.join("meta")
    }

    fn staging_dir(&self) -> PathBuf {
        self.root.join("staging")
    }

    fn layer_path(&self, diff_id: &str) -> PathBuf {
        self.layers_dir()
            .join(diff_id.strip_prefix("sha256:").unwrap_or(diff_id))
    }

    fn meta_path(&self, name: &str) -> PathBuf {
        self.meta_dir().join(format!("{}.json", escape(name)))
    }

    fn lock_pins(&self) -> MutexGuard<'_, HashMap<String, usize>> {
        self.pins.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Imports a path that exists: a directory or an archive file.
    fn import_path(
        self: &Arc<Self>,
        path: &Path,
        name: String,
        input: &str,
    ) -> Result<Image, ImageError> {
        let fault = |f: Fault| f.into_error(input);
        let mut pins = Pins::new(self.clone());
        tracing::info!(source = %input, image = %name, "importing image");
        if path.is_dir() {
            if oci::is_oci_layout(path) {
                let plan = oci::plan_oci_layout(path).map_err(fault)?;
                return self.import_plan(&mut pins, plan, name, input);
            }
            let unpacked = unpack_tree(&self.staging_dir(), path, &self.root).map_err(fault)?;
            return self.import_rootfs(&mut pins, unpacked, name, input);
        }
        if !is_archive(path)? {
            return Err(ImageError::InvalidSource {
                input: input.to_owned(),
                reason: "not a directory, tar, gzip or zstd archive".into(),
            });
        }
        let file = File::open(path).map_err(io_error(format!("cannot open {input}")))?;
        // One pass serves both cases: an image archive is unpacked to be read,
        // a rootfs tarball is unpacked to become the layer.
        let unpacked = unpack_layer(&self.staging_dir(), BufReader::with_capacity(1 << 18, file))
            .map_err(fault)?;
        let dir = unpacked.dir.path();
        let plan = if oci::is_oci_layout(dir) {
            oci::plan_oci_layout(dir)
        } else if oci::is_docker_archive(dir) {
            oci::plan_docker_archive(dir)
        } else {
            return self.import_rootfs(&mut pins, unpacked, name, input);
        };
        self.import_plan(&mut pins, plan.map_err(fault)?, name, input)
    }

    fn import_rootfs(
        &self,
        pins: &mut Pins,
        unpacked: Unpacked,
        name: String,
        input: &str,
    ) -> Result<Image, ImageError> {
        let diff_id = unpacked.diff_id.clone();
        let size = unpacked.size;
        let new = pins.commit(unpacked).map_err(|f| f.into_error(input))?;
        let layers = vec![diff_id];
        let id = sha256(&serde_json::to_vec(&layers).unwrap_or_default());
        let config = ImageConfig {
            env: vec![DEFAULT_PATH.to_owned()],
            ..ImageConfig::default()
        };
        self.finish(name, id, size, layers, config, new)
    }

    /// Brings every layer of `plan` into the store, then records the image.
    fn import_plan(
        &self,
        pins: &mut Pins,
        plan: Plan,
        name: String,
        input: &str,
    ) -> Result<Image, ImageError> {
        let fault = |f: Fault| f.into_error(input);
        let mut size = 0;
        let mut any_new = false;
        for layer in &plan.layers {
            if pins.pin_if_stored(&layer.diff_id) {
                tracing::debug!(layer = %layer.diff_id, "layer already stored");
                let path = self.layer_path(&layer.diff_id);
                size += tree_size(&path)
                    .map_err(io_error(format!("cannot measure {}", path.display())))?;
                continue;
            }
            let file = File::open(&layer.blob).map_err(|e| match e.kind() {
                io::ErrorKind::NotFound => ImageError::Corrupt {
                    input: input.to_owned(),
                    reason: format!("the blob of layer {} is missing", layer.diff_id),
                },
                _ => io_error(format!("cannot open {}", layer.blob.display()))(e),
            })?;
            let mut blob = HashingReader::new(BufReader::with_capacity(1 << 18, file));
            let unpacked = unpack_layer(&self.staging_dir(), &mut blob).map_err(fault)?;
            blob.drain().map_err(|e| ImageError::Corrupt {
                input: input.to_owned(),
                reason: format!("the blob of layer {} is unreadable: {e}", layer.diff_id),
            })?;
            if let Some(expected) = &layer.blob_digest {
                if blob.digest() != *expected {
                    return Err(fault(Fault::Corrupt(format!(
                        "blob {expected} does not match its digest"
                    ))));
                }
            }
            if unpacked.diff_id != layer.diff_id {
                return Err(fault(Fault::Corrupt(format!(
                    "layer {} unpacks to {}",
                    layer.diff_id, unpacked.diff_id
                ))));
            }
            size += unpacked.size;
            any_new |= pins.commit(unpacked).map_err(fault)?;
        }
        let layers = plan.layers.into_iter().map(|l| l.diff_id).collect();
        self.finish(name, plan.id, size, layers, plan.config, any_new)
    }

    /// Records the image; its layers are all stored (and pinned) by now.
    fn finish(
        &self,
        name: String,
        id: String,
        size: u64,
        layers: Vec<String>,
        config: ImageConfig,
        new_layers: bool,
    ) -> Result<Image, ImageError> {
        if new_layers {
            // The metadata must not outlive a crash that loses layer content.
            let root = File::open(&self.root)
                .map_err(io_error(format!("cannot open {}", self.root.display())))?;
            rustix::fs::syncfs(&root).map_err(|e| ImageError::Io {
                context: "cannot flush the new layers to disk".into(),
                source: e.into(),
            })?;
        }
        let image = Image {
            name,
            id,
            size,
            layers,
            created_at: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            config,
        };
        self.write_meta(&image)?;
        tracing::info!(image = %image.name, id = %image.id, layers = image.layers.len(), size = image.size, "imported image");
        Ok(image)
    }

    fn write_meta(&self, image: &Image) -> Result<(), ImageError> {
        let dir = self.meta_dir();
        let path = self.meta_path(&image.name);
        let context = || format!("cannot write {}", path.display());
        let mut tmp = tempfile::Builder::new()
            .prefix(".tmp-")
            .tempfile_in(&dir)
            .map_err(io_error(context()))?;
        serde_json::to_writer_pretty(&mut tmp, image).map_err(|e| io_error(context())(e.into()))?;
        tmp.as_file().sync_all().map_err(io_error(context()))?;
        tmp.persist(&path)
            .map_err(|e| io_error(context())(e.error))?;
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(io_error(context()))
    }

    /// Moves every stored layer not in `referenced` into a staging grave,
    /// to be deleted by the caller. Call with the pins lock held.
    fn bury_unreferenced(
        &self,
        referenced: &HashSet<&str>,
    ) -> Result<Vec<(String, tempfile::TempDir)>, ImageError> {
        let layers = self.layers_dir();
        let context = || format!("cannot list {}", layers.display());
        let mut graves = Vec::new();
        for entry in fs::read_dir(&layers).map_err(io_error(context()))? {
            let entry = entry.map_err(io_error(context()))?;
            let diff_id = format!("sha256:{}", entry.file_name().to_string_lossy());
            if sha256_hex(&diff_id).is_none() || referenced.contains(diff_id.as_str()) {
                continue;
            }
            let grave = tempfile::Builder::new()
                .prefix("gc-")
                .tempdir_in(self.staging_dir())
                .map_err(io_error("cannot create a staging directory"))?;
            fs::rename(entry.path(), grave.path().join("layer"))
                .map_err(io_error(format!("cannot remove layer {diff_id}")))?;
            graves.push((diff_id, grave));
        }
        Ok(graves)
    }
}

/// Layers an import relies on; garbage collection leaves them alone until
/// this is dropped, after the image's metadata is written.
pub(crate) struct Pins {
    inner: Arc<Inner>,
    held: Vec<String>,
}

impl Pins {
    pub(crate) fn new(inner: Arc<Inner>) -> Pins {
        Pins {
            inner,
            held: Vec::new(),
        }
    }

    /// Pins `diff_id` if it is stored; says whether it is.
    pub(crate) fn pin_if_stored(&mut self, diff_id: &str) -> bool {
        let mut pins = self.inner.lock_pins();
        if !self.inner.layer_path(diff_id).is_dir() {
            return false;
        }
        *pins.entry(diff_id.to_owned()).or_default() += 1;
        self.held.push(diff_id.to_owned());
        true
    }

    /// Moves an unpacked layer into the store and pins it; if another import
    /// stored it meanwhile, the copy is discarded. Says whether it was new.
    fn commit(&mut self, mut unpacked: Unpacked) -> Result<bool, Fault> {
        let target = self.inner.layer_path(&unpacked.diff_id);
        let mut pins = self.inner.lock_pins();
        let new = match fs::rename(unpacked.dir.path(), &target) {
            Ok(()) => true,
            Err(e)
                if matches!(
                    rustix::io::Errno::from_io_error(&e),
                    Some(rustix::io::Errno::EXIST | rustix::io::Errno::NOTEMPTY)
                ) =>
            {
                false
            }
            Err(e) => {
                return Err(Fault::Io(
                    format!("cannot store layer {}", unpacked.diff_id),
                    e,
                ))
            }
        };
        *pins.entry(unpacked.diff_id.clone()).or_default() += 1;
        self.held.push(unpacked.diff_id.clone());
        drop(pins);
        if new {
            unpacked.dir.disable_cleanup(true);
            tracing::debug!(layer = %unpacked.diff_id, size = unpacked.size, "stored layer");
        } else {
            tracing::debug!(layer = %unpacked.diff_id, "layer stored meanwhile; discarding copy");
        }
        Ok(new)
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        let mut pins = self.inner.lock_pins();
        for diff_id in self.held.drain(..) {
            if let Some(count) = pins.get_mut(&diff_id) {
                *count -= 1;
                if *count == 0 {
                    pins.remove(&diff_id);
                }
            }
        }
    }
}

/// Is `path` a tar, gzip or zstd file, judged by its first block?
fn is_archive(path: &Path) -> Result<bool, ImageError> {
    let mut head = Vec::with_capacity(512);
    File::open(path)
        .and_then(|f| f.take(512).read_to_end(&mut head))
        .map_err(io_error(format!("cannot read {}", path.display())))?;
    let ustar = head.get(257..262) == Some(b"ustar".as_slice());
    let empty_tar = head.len() == 512 && head.iter().all(|b| *b == 0);
    Ok(Compression::sniff(&head) != Compression::None || ustar || empty_tar)
}

/// The base name of a path without archive extensions.
fn default_name(path: &Path) -> String {
    let base = path
        .file_name()
        .map(|n| n.to_owned())
        .or_else(|| path.canonicalize().ok()?.file_name().map(|n| n.to_owned()))
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    ARCHIVE_SUFFIXES
        .iter()
        .find_map(|s| base.strip_suffix(s))
        .unwrap_or(&base)
        .to_owned()
}

/// Names are `[a-zA-Z0-9][a-zA-Z0-9._:/@-]*`, at most 128 characters
/// (`@` so that a digest reference can name its own image).
fn validate_name(name: &str, input: &str) -> Result<(), ImageError> {
    let mut chars = name.chars();
    let valid = name.len() <= MAX_NAME_LEN
        && chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || "._:/@-".contains(c));
    if valid {
        return Ok(());
    }
    Err(ImageError::InvalidSource {
        input: input.to_owned(),
        reason: format!(
            "image name {name:?} is invalid: use up to {MAX_NAME_LEN} letters, digits and . _ : / @ -, starting with a letter or digit"
        ),
    })
}

/// A file name for an image name: `/`, `:` and `@` are percent-encoded.
fn escape(name: &str) -> String {
    let mut escaped = String::with_capacity(name.len());
    for byte in name.bytes() {
        if byte.is_ascii_alphanumeric() || b"._-".contains(&byte) {
            escaped.push(char::from(byte));
        } else {
            escaped.push_str(&format!("%{byte:02X}"));
        }
    }
    escaped
}

/// Bytes of file content under `dir`, each hard-linked file counted once.
fn tree_size(dir: &Path) -> io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut seen = HashSet::new();
    let mut pending = vec![dir.to_owned()];
    let mut total = 0;
    while let Some(dir) = pending.pop() {
        for entry in fs::read_dir(&dir)? {
            let entry = entry?;
            let meta = entry.metadata()?;
            if meta.is_dir() {
                pending.push(entry.path());
            } else if meta.is_file() && (meta.nlink() == 1 || seen.insert((meta.dev(), meta.ino())))
            {
                total += meta.len();
            }
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(validate_name("busybox", "x").is_ok());
        assert!(validate_name("127.0.0.1:5000/test/img:v1", "x").is_ok());
        assert!(validate_name("reg/img@sha256:abc", "x").is_ok());
        for bad in ["", ".hidden", "-x", "a b", "a\nb", &"a".repeat(129)] {
            assert!(
                matches!(
                    validate_name(bad, "x"),
                    Err(ImageError::InvalidSource { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn escaped_names_are_flat_file_names() {
        assert_eq!(escape("reg:5000/a/b:v1"), "reg%3A5000%2Fa%2Fb%3Av1");
        assert_eq!(escape("a.b_c-d"), "a.b_c-d");
    }

    #[test]
    fn default_names_drop_archive_extensions() {
        for (path, name) in [
            ("/x/alpine.tar.gz", "alpine"),
            ("/x/alpine.tgz", "alpine"),
            ("/x/alpine.tar.zst", "alpine"),
            ("/x/alpine.tar", "alpine"),
            ("/x/rootfs/", "rootfs"),
            ("/x/app.img", "app.img"),
        ] {
            assert_eq!(default_name(Path::new(path)), name);
        }
    }
}
