//! The store itself, and the hub of the crate: importing, looking up, mounting and
//! removing images.
//!
//! It asks its sources for what to import — [`oci`] and [`registry`] for a [`Plan`],
//! [`docker`] for an archive, [`tree`](crate::tree) and [`unpack`](crate::unpack) for
//! layers, [`distribution`] for images a fleet shares — and carries it out; none of them
//! knows the store.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, BufReader, Read};
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use serde::{Deserialize, Serialize};

use crate::blob;
use crate::digest::{sha256, sha256_hex, HashingReader};
use crate::disk::{self, DiskFormat};
use crate::distribution::{self, Registry};
use crate::docker;
use crate::egress::{Guard, ProjectReach};
use crate::error::{io_error, store_error, Fault, ImageError};
use crate::holds::{unix_now, Held, HoldCounts, StoreLock};
use crate::image::{owned_name, DiskImage, Fork, GuestSnapshot, Image, ImageConfig};
use crate::mount::LayerMounts;
use crate::oci;
use crate::plan::{Plan, PlannedLayer};
use crate::registry::{self, ARCHIVE_SUFFIXES};
use crate::trash::Trash;
use crate::tree::{unpack_tree, unpack_upper};
use crate::unpack::{unpack_layer, Compression, Unpacked};

/// The search path a rootfs import gets, since it has no config of its own.
const DEFAULT_PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const MAX_NAME_LEN: usize = 128;
/// overlayfs stacks at most this many lower layers (`OVL_MAX_STACK`); an image with
/// more is refused at import, so that no create fails later.
pub const MAX_LAYERS: usize = 500;
/// Layers processed at once by one import.
const MAX_IMPORT_THREADS: usize = 8;

/// How far an import has got, for a progress display.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImportProgress {
    /// The image has this many layers to bring in.
    Layers(usize),
    /// One more layer is in the store (`reused`: it was there already).
    LayerDone {
        /// Its diff id.
        diff_id: String,
        /// Bytes of file content.
        size: u64,
        /// It was stored already.
        reused: bool,
    },
}

/// What the store holds, for `dsec image ls`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StoreUsage {
    /// Images recorded.
    pub images: usize,
    /// Layer blobs stored.
    pub layers: usize,
    /// Bytes those blobs take on disk.
    pub layer_bytes: u64,
    /// Layers mounted by this edge.
    pub mounted: usize,
}

/// What [`ImageStore::prune`] removed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Pruned {
    /// Layer blobs deleted.
    pub layers: usize,
    /// Bytes they took.
    pub bytes: u64,
}

/// A content-addressed store of images and their layers, as EROFS blobs.
///
/// The layer store (`root`, possibly shared by many edges over NFS or another network
/// filesystem) holds `layers/sha256/<hex>.erofs` (one blob per diff id, with a
/// `<hex>.json` sidecar; a bootable disk image's one blob, named the same way so that holds,
/// leases and pruning treat it as any layer, is its qcow2, which is never mounted), `meta/<name>.json` (one per image, written last and
/// atomically), `leases/<edge>.json` (what each edge holds) and `gc.lock`. The edge's own
/// directory (`local`) holds `staging/` (scratch space, emptied at open), `trash/`
/// (staging trees being deleted in the background) and `mnt/` (its layer mounts). Open one store per edge. Clone is cheap.
#[derive(Clone, Debug)]
pub struct ImageStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) root: PathBuf,
    staging: PathBuf,
    trash: Trash,
    pub(crate) edge: String,
    pub(crate) mounts: LayerMounts,
    pub(crate) holds: HoldCounts,
    /// Where imports are pushed and missing images pulled from (`dsec edge --registry`).
    registry: OnceLock<Registry>,
    /// The host directories beneath which a project may import by path (canonical).
    import_roots: OnceLock<Vec<PathBuf>>,
    /// Where a project's registry imports may connect besides public addresses.
    project_reach: OnceLock<Arc<ProjectReach>>,
    /// One pull at a time per image name: a batch of creates pulls a new image once.
    pulls: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// An image's layers mounted for stacking, held until dropped.
#[derive(Debug)]
pub struct MountedImage {
    /// The layers' directories in overlayfs lowerdir order (topmost FIRST).
    pub dirs: Vec<PathBuf>,
    _held: Held,
}

/// An image's layer blobs, held until dropped.
#[derive(Debug)]
pub struct HeldBlobs {
    /// The blobs, bottom layer first.
    pub blobs: Vec<PathBuf>,
    _held: Held,
}

#[derive(Serialize, Deserialize)]
struct Sidecar {
    /// Bytes of file content in the layer.
    size: u64,
}

impl ImageStore {
    /// Opens (creating if needed) the store whose layers and images live in `root` and
    /// whose edge-local scratch space and mounts live in `local` (the two may be the
    /// same directory); `edge` names this edge among those sharing `root`. Clears what a
    /// crashed run of this edge left: staging, temporary blobs, mounts. Layers stored as
    /// directories by an older dsec are converted to blobs.
    pub fn open(root: &Path, local: &Path, edge: &str) -> Result<ImageStore, ImageError> {
        let inner = Inner {
            root: root.to_owned(),
            staging: local.join("staging"),
            trash: Trash::open(&local.join("trash"))
                .map_err(io_error(format!("cannot set up {}/trash", local.display())))?,
            edge: edge.to_owned(),
            mounts: LayerMounts::open(&local.join("mnt"))
                .map_err(io_error(format!("cannot set up {}/mnt", local.display())))?,
            holds: HoldCounts::default(),
            registry: OnceLock::new(),
            import_roots: OnceLock::new(),
            project_reach: OnceLock::new(),
            pulls: Mutex::default(),
        };
        for dir in [inner.layers_dir(), inner.meta_dir(), inner.leases_dir()] {
            fs::create_dir_all(&dir)
                .map_err(inner.store_err(format!("create {}", dir.display())))?;
        }
        fs::create_dir_all(&inner.staging).map_err(io_error(format!(
            "cannot create {}",
            inner.staging.display()
        )))?;
        clear_dir(&inner.staging)?;
        inner.remove_own_temporaries()?;
        let inner = Arc::new(inner);
        inner.convert_directory_layers()?;
        inner.write_lease(true)?;
        Ok(ImageStore { inner })
    }

    /// The layer store's root.
    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// Shares this store's images through `registry`: every import is pushed there, and
    /// [`resolve`](Self::resolve) pulls an image this store lacks from there. Set once.
    pub fn share_through(&self, registry: Registry) {
        if self.inner.registry.set(registry).is_err() {
            tracing::warn!("the image store shares through a registry already; keeping it");
        }
    }

    /// Lets projects import host paths beneath `roots` (`dsec serve --import-root`); set
    /// once. Without any, a project imports from registries only: a host path would let
    /// it read whatever the server can, and the host's Docker images are the admin's.
    pub fn allow_project_imports_under(&self, roots: &[PathBuf]) -> Result<(), ImageError> {
        let roots = roots
            .iter()
            .map(|r| fs::canonicalize(r).map_err(io_error(format!("import root {}", r.display()))))
            .collect::<Result<Vec<_>, _>>()?;
        if self.inner.import_roots.set(roots).is_err() {
            tracing::warn!("the image store has its import roots already; keeping them");
        }
        Ok(())
    }

    /// Lets projects' registry imports reach `reach` (`dsec serve --import-registry`, and
    /// the services they may not reach); set once. Without it a project imports from
    /// registries at public addresses only.
    pub fn set_project_reach(&self, reach: ProjectReach) {
        if self.inner.project_reach.set(Arc::new(reach)).is_err() {
            tracing::warn!("the image store has its projects' reach already; keeping it");
        }
    }

    /// The host path an import of `source` reads, if it reads one. A `project`'s reads
    /// only an absolute path beneath an import root, and the import then reads the path
    /// as checked, its links resolved (a path elsewhere is refused whether it exists or
    /// not, so that a project learns nothing of the host's files; a link out of a root
    /// counts as outside); a project's relative source is a registry reference. The admin
    /// reads any path that exists.
    async fn host_path(
        &self,
        source: &str,
        project: Option<&str>,
    ) -> Result<Option<PathBuf>, ImageError> {
        let path = Path::new(source);
        if project.is_none() {
            return match tokio::fs::metadata(path).await {
                Ok(_) => Ok(Some(path.to_owned())),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(io_error(format!("cannot inspect {source}"))(e)),
            };
        }
        if !path.is_absolute() {
            return Ok(None);
        }
        let roots = self.inner.import_roots.get().map_or(&[][..], Vec::as_slice);
        let beneath = |p: &Path| roots.iter().any(|root| p.starts_with(root));
        let plain = path
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
        let refused = || ImageError::NotAllowed {
            input: source.to_owned(),
            reason: match roots {
                [] => "a project imports from a registry; host paths are the admin's to import \
                       (the server has no --import-root for projects)"
                    .into(),
                _ => format!(
                    "a project imports host paths only beneath the server's --import-root \
                     directories ({}), or from a registry",
                    roots
                        .iter()
                        .map(|r| r.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            },
        };
        if !plain || !beneath(path) {
            return Err(refused());
        }
        match tokio::fs::canonicalize(path).await {
            Ok(real) if beneath(&real) => Ok(Some(real)),
            Ok(_) => Err(refused()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_error(format!("cannot inspect {source}"))(e)),
        }
    }

    /// The registry images are shared through, if any.
    pub fn registry(&self) -> Option<&Registry> {
        self.inner.registry.get()
    }

    /// Imports an image from an OCI layout directory, a rootfs directory, a
    /// `docker save` archive, a rootfs tarball (plain, gzip or zstd), a
    /// registry reference or `docker://REF` (exported from the Docker daemon),
    /// and stores it as `name` (default: the file's base name without archive
    /// extensions, or the reference itself), replacing any image of that name.
    /// With a [`registry`](Self::share_through) it is pushed there too.
    pub async fn import(&self, source: &str, name: Option<&str>) -> Result<Image, ImageError> {
        self.import_with(source, name, None, Arc::new(|_| {})).await
    }

    /// [`import`](Self::import) for `project` (`None`: the admin), telling `progress`
    /// about each layer as it lands. A project's image is named under `<project>/`
    /// ([`owned_name`]); an image of another owner is never replaced.
    pub async fn import_with(
        &self,
        source: &str,
        name: Option<&str>,
        project: Option<&str>,
        progress: Arc<dyn Fn(ImportProgress) + Send + Sync>,
    ) -> Result<Image, ImageError> {
        let image = self.import_here(source, name, project, progress).await?;
        if let Some(registry) = self.registry() {
            self.push(&image, registry).await?;
        }
        Ok(image)
    }

    /// Looks up an image by name; one this store lacks is pulled from the
    /// [`registry`](Self::share_through) first, if there is one (concurrent lookups of
    /// one name pull it once).
    pub async fn resolve(&self, name: &str) -> Result<Image, ImageError> {
        let registry = match self.get(name) {
            Err(ImageError::NotFound { .. }) if self.registry().is_some() => {
                self.registry().expect("checked").clone()
            }
            found => return found,
        };
        let gate = Arc::clone(
            self.inner
                .pulls
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(name.to_owned())
                .or_default(),
        );
        let _pulling = gate.lock().await;
        let pulled = match self.get(name) {
            Err(ImageError::NotFound { .. }) => self.pull(name, &registry).await,
            found => found,
        };
        self.inner
            .pulls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(name);
        pulled
    }

    /// Sends `image` (its blobs as they are, and its record) to `registry`.
    async fn push(&self, image: &Image, registry: &Registry) -> Result<(), ImageError> {
        let blobs = self.blobs(image)?;
        let sizes = image
            .layers
            .iter()
            .map(|l| self.inner.layer_size(l))
            .collect::<Result<Vec<_>, _>>()?;
        distribution::push(registry, image, &blobs.blobs, &sizes).await?;
        Ok(())
    }

    /// Stores image `name` from `registry`: the blobs this store lacks, then its record.
    async fn pull(&self, name: &str, registry: &Registry) -> Result<Image, ImageError> {
        tracing::info!(image = %name, registry = %registry, "pulling image from the fleet's registry");
        let pulled = distribution::fetch(registry, name).await?;
        let held = Held::new(self.inner.clone());
        for (index, (diff_id, content)) in pulled.layers.iter().enumerate() {
            if self.inner.hold_if_stored(&held, diff_id)? {
                continue;
            }
            let download = self.inner.layers_dir().join(self.inner.temp_name());
            if let Err(e) = pulled.download(index, &download).await {
                let _ = fs::remove_file(&download);
                return Err(e);
            }
            let (inner, diff_id, content) = (self.inner.clone(), diff_id.clone(), *content);
            blocking(move || inner.publish(&diff_id, &download, content)).await?;
        }
        let image = pulled.image;
        let inner = self.inner.clone();
        let name = name.to_owned();
        blocking(move || {
            let naming = Naming {
                name,
                project: image.project,
            };
            let pulled = inner.finish_with_disk(
                naming,
                image.id,
                image.size,
                image.layers,
                image.config,
                image.disk,
            );
            drop(held);
            pulled
        })
        .await
    }

    /// [`import`](Self::import) into this store only.
    async fn import_here(
        &self,
        source: &str,
        name: Option<&str>,
        project: Option<&str>,
        progress: Arc<dyn Fn(ImportProgress) + Send + Sync>,
    ) -> Result<Image, ImageError> {
        if let Some(reference) = source.strip_prefix(docker::SCHEME) {
            if project.is_some() {
                return Err(ImageError::NotAllowed {
                    input: source.to_owned(),
                    reason: "the host's Docker images are the admin's to import; a project \
                             imports from a registry"
                        .into(),
                });
            }
            let name = Naming::new(name.unwrap_or(reference), project, source)?;
            let archive = docker::export(reference, source, &self.inner.staging).await?;
            let inner = self.inner.clone();
            let input = source.to_owned();
            return blocking(move || {
                let image = inner.import_path(archive.path(), name, &input, &*progress);
                drop(archive);
                image
            })
            .await;
        }
        if let Some(read) = self.host_path(source, project).await? {
            let name = match name {
                Some(name) => Naming::new(name, project, source)?,
                None => Naming::new(&default_name(Path::new(source)), project, source)?,
            };
            let inner = self.inner.clone();
            let input = source.to_owned();
            return blocking(move || inner.import_path(&read, name, &input, &*progress)).await;
        }
        let Some(reference) = registry::parse_reference(source) else {
            return Err(ImageError::InvalidSource {
                input: source.to_owned(),
                reason: "no such file or directory, and not a registry reference".into(),
            });
        };
        let name = Naming::new(name.unwrap_or(source), project, source)?;
        tracing::info!(reference = %source, image = %name.name, "pulling image");
        let held = Held::new(self.inner.clone());
        let inner = self.inner.clone();
        let stored = |diff_id: &str| inner.hold_if_stored(&held, diff_id);
        // A project's pull reaches only what its reach allows (see `egress`).
        let guard = match project {
            Some(_) => {
                let reach = self.inner.project_reach.get().cloned().unwrap_or_default();
                Some(Guard::start(reach).await.map_err(io_error(
                    "cannot start the proxy that guards a project's registry import",
                ))?)
            }
            None => None,
        };
        let (plan, downloads) = registry::fetch(
            stored,
            &self.inner.staging,
            &reference,
            source,
            guard.as_ref(),
        )
        .await?;
        drop(guard);
        let inner = self.inner.clone();
        let input = source.to_owned();
        blocking(move || {
            let image = inner.import_plan(&held, plan, name, &input, &*progress);
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
                if !self.inner.meta_dir().is_dir() {
                    return Err(self.inner.unreachable("meta"));
                }
                return Err(ImageError::NotFound {
                    name: name.to_owned(),
                });
            }
            Err(e) => return Err(self.inner.store_err(format!("read {}", path.display()))(e)),
        };
        serde_json::from_slice(&bytes).map_err(|e| ImageError::Corrupt {
            input: name.to_owned(),
            reason: format!("its metadata is unreadable: {e}; import it again"),
        })
    }

    /// All images, sorted by name; unreadable metadata files are skipped with a warning.
    pub fn list(&self) -> Result<Vec<Image>, ImageError> {
        self.inner.list(false)
    }

    /// Removes the image's metadata, then the layers that no image, no sandbox and no
    /// import (on this edge or, by their leases, on others) relies on any more.
    pub fn remove(&self, name: &str) -> Result<(), ImageError> {
        let path = self.inner.meta_path(name);
        match fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(ImageError::NotFound {
                    name: name.to_owned(),
                })
            }
            Err(e) => {
                return Err(self.inner.store_err(format!("remove {}", path.display()))(
                    e,
                ))
            }
        }
        tracing::info!(image = %name, "removed image");
        if let Err(e) = self.prune() {
            tracing::warn!(image = %name, error = %e, "its layers stay until the next prune");
        }
        Ok(())
    }

    /// Deletes every layer that no image references and nothing holds, here or on
    /// another edge of the store; unmounts this edge's layers that no image needs.
    pub fn prune(&self) -> Result<Pruned, ImageError> {
        self.inner.prune()
    }

    /// Rewrites this edge's lease so that other edges keep seeing it as alive.
    pub fn refresh_lease(&self) -> Result<(), ImageError> {
        self.inner.write_lease(true)
    }

    /// Stores a sandbox's writable layer as a new image `name`: `base`'s layers plus the
    /// diff in `upper` (an overlayfs upper directory), with `base`'s config. Only the diff
    /// is stored; the base layers are shared.
    pub async fn commit_upper(
        &self,
        base: &Image,
        upper: &Path,
        name: &str,
        project: Option<&str>,
    ) -> Result<Image, ImageError> {
        let naming = Naming::new(name, project, name)?;
        if base.layers.len() >= MAX_LAYERS {
            return Err(ImageError::InvalidSource {
                input: name.to_owned(),
                reason: format!(
                    "{} already has {} layers: a snapshot would exceed the {MAX_LAYERS} that can be stacked",
                    base.name,
                    base.layers.len()
                ),
            });
        }
        let (inner, base, upper) = (self.inner.clone(), base.clone(), upper.to_owned());
        blocking(move || {
            let input = format!("the writable layer of {}", upper.display());
            let held = Held::new(inner.clone());
            for layer in &base.layers {
                if !inner.hold_if_stored(&held, layer)? {
                    return Err(ImageError::NotFound {
                        name: format!("{} (layer {layer})", base.name),
                    });
                }
            }
            let unpacked =
                unpack_upper(&inner.staging, &upper).map_err(|f| f.into_error(&input))?;
            let diff_id = unpacked.diff_id.clone();
            let size = base.size + unpacked.size;
            inner.store_unpacked(&held, unpacked, &input)?;
            let mut layers = base.layers.clone();
            layers.push(diff_id);
            let id = sha256(&serde_json::to_vec(&layers).unwrap_or_default());
            inner.finish(naming, id, size, layers, base.config.clone())
        })
        .await
    }

    /// Records a VM guest saved by its backend as image `name` (see [`Image::guest`]):
    /// `base`'s layers, held like any image's, and its config; the id is new (the guest
    /// is one point in time, not content).
    pub fn record_guest(
        &self,
        base: &Image,
        name: &str,
        project: Option<&str>,
        guest: GuestSnapshot,
    ) -> Result<Image, ImageError> {
        let naming = Naming::new(name, project, name)?;
        self.inner.check_owner(&naming)?;
        let held = Held::new(self.inner.clone());
        for layer in &base.layers {
            if !self.inner.hold_if_stored(&held, layer)? {
                return Err(ImageError::NotFound {
                    name: format!("{} (layer {layer})", base.name),
                });
            }
        }
        let unique = format!(
            "{}\n{}\n{:032x}",
            base.id,
            naming.name,
            rand::random::<u128>()
        );
        let image = Image {
            name: naming.name,
            id: sha256(unique.as_bytes()),
            size: base.size,
            layers: base.layers.clone(),
            created_at: unix_now(),
            config: base.config.clone(),
            fork: None,
            guest: Some(guest),
            disk: None,
            project: naming.project,
        };
        self.inner.write_meta(&image)?;
        Ok(image)
    }

    /// Marks `name` as the image of a fork (see [`Image::fork`]).
    pub fn mark_fork(&self, name: &str, fork: Fork) -> Result<Image, ImageError> {
        let mut image = self.get(name)?;
        image.fork = Some(fork);
        self.inner.write_meta(&image)?;
        Ok(image)
    }

    /// This edge's name among those sharing the store.
    pub fn edge(&self) -> &str {
        &self.inner.edge
    }

    /// Mounts the image's layers (once per edge; later calls reuse the mounts) for a
    /// sandbox to stack, and holds them until the result is dropped. A layer whose blob
    /// is gone or unreadable fails only this call, with the reason.
    pub async fn mount(&self, image: &Image) -> Result<MountedImage, ImageError> {
        // A disk image's blob holds the user's bytes as they imported them: mounting it
        // would hand the host kernel's EROFS parser a file its user crafted.
        if image.disk.is_some() {
            return Err(ImageError::BootableDisk {
                name: image.name.clone(),
            });
        }
        let (inner, image) = (self.inner.clone(), image.clone());
        blocking(move || {
            let blobs = inner.held_blobs(&image)?;
            let mut dirs = Vec::with_capacity(blobs.blobs.len());
            for (layer, blob) in image.layers.iter().zip(&blobs.blobs).rev() {
                let dir = inner.mounts.mount(layer, blob).map_err(|e| {
                    match rustix::io::Errno::from_io_error(&e) {
                        // EROFS refuses what is not a whole image of its own.
                        Some(rustix::io::Errno::INVAL | rustix::io::Errno::UCLEAN) => {
                            ImageError::Corrupt {
                                input: image.name.clone(),
                                reason: format!(
                                    "its layer {layer} in the store is damaged ({e}); delete the image and import it again"
                                ),
                            }
                        }
                        _ => inner.store_err(format!("mount layer {layer} of {}", image.name))(e),
                    }
                })?;
                dirs.push(dir);
            }
            Ok(MountedImage {
                dirs,
                _held: blobs._held,
            })
        })
        .await
    }

    /// The image's layer blobs, held until the result is dropped (VM image disks use
    /// them as they are).
    pub fn blobs(&self, image: &Image) -> Result<HeldBlobs, ImageError> {
        self.inner.held_blobs(image)
    }

    /// Bytes the image's layer blobs take on disk (a layer shared with other images
    /// counts in each).
    pub fn disk_bytes(&self, image: &Image) -> u64 {
        image
            .layers
            .iter()
            .filter_map(|l| fs::metadata(self.inner.blob_path(l)).ok())
            .map(|m| m.blocks() * 512)
            .sum()
    }

    /// What the store holds.
    pub fn usage(&self) -> Result<StoreUsage, ImageError> {
        let mut usage = StoreUsage {
            images: self.list()?.len(),
            mounted: self.inner.mounts.layers().len(),
            ..StoreUsage::default()
        };
        for (_, meta) in self.inner.stored_blobs()? {
            usage.layers += 1;
            usage.layer_bytes += meta.blocks() * 512;
        }
        Ok(usage)
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

    pub(crate) fn leases_dir(&self) -> PathBuf {
        self.root.join("leases")
    }

    pub(crate) fn lease_path(&self, edge: &str) -> PathBuf {
        self.leases_dir().join(format!("{}.json", escape(edge)))
    }

    fn hex(diff_id: &str) -> &str {
        diff_id.strip_prefix("sha256:").unwrap_or(diff_id)
    }

    pub(crate) fn blob_path(&self, diff_id: &str) -> PathBuf {
        self.layers_dir()
            .join(format!("{}.erofs", Self::hex(diff_id)))
    }

    fn sidecar_path(&self, diff_id: &str) -> PathBuf {
        self.layers_dir()
            .join(format!("{}.json", Self::hex(diff_id)))
    }

    fn meta_path(&self, name: &str) -> PathBuf {
        self.meta_dir().join(format!("{}.json", escape(name)))
    }

    /// A name for a temporary file in the layer store, marked as this edge's.
    fn temp_name(&self) -> String {
        format!(".tmp-{}-{:016x}", escape(&self.edge), rand::random::<u64>())
    }

    /// Maps an I/O error of the layer store (see [`store_error`]).
    pub(crate) fn store_err(
        &self,
        context: impl Into<String>,
    ) -> impl FnOnce(io::Error) -> ImageError {
        store_error(&self.root, context)
    }

    /// The store's `dir` directory is gone: the store was unmounted or removed.
    fn unreachable(&self, dir: &str) -> ImageError {
        ImageError::Store {
            store: self.root.display().to_string(),
            reason: format!("is not reachable: its {dir} directory is gone (unmounted?)"),
        }
    }

    /// Holds `diff_id` (lease first), then says whether its blob is stored.
    fn hold_if_stored(&self, held: &Held, diff_id: &str) -> Result<bool, ImageError> {
        held.hold(diff_id);
        Ok(self.blob_path(diff_id).is_file())
    }

    fn held_blobs(self: &Arc<Self>, image: &Image) -> Result<HeldBlobs, ImageError> {
        let held = Held::new(self.clone());
        held.hold_all(&image.layers);
        if !self.layers_dir().is_dir() {
            return Err(self.unreachable("layers"));
        }
        let mut blobs = Vec::with_capacity(image.layers.len());
        for layer in &image.layers {
            let blob = self.blob_path(layer);
            match fs::metadata(&blob) {
                Ok(_) => blobs.push(blob),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    return Err(ImageError::Store {
                        store: self.root.display().to_string(),
                        reason: format!(
                            "has no layer {layer} of image {:?} any more (removed by hand?); import the image again",
                            image.name
                        ),
                    })
                }
                Err(e) => return Err(self.store_err(format!("read layer {layer}"))(e)),
            }
        }
        Ok(HeldBlobs { blobs, _held: held })
    }

    fn list(&self, strict: bool) -> Result<Vec<Image>, ImageError> {
        let dir = self.meta_dir();
        let context = || format!("list {}", dir.display());
        let mut images = Vec::new();
        for entry in fs::read_dir(&dir).map_err(self.store_err(context()))? {
            let path = entry.map_err(self.store_err(context()))?.path();
            let file_name = path.file_name().unwrap_or_default().to_string_lossy();
            if file_name.starts_with('.') || !file_name.ends_with(".json") {
                continue;
            }
            let bytes =
                fs::read(&path).map_err(self.store_err(format!("read {}", path.display())))?;
            match serde_json::from_slice::<Image>(&bytes) {
                Ok(image) => images.push(image),
                Err(e) if strict => {
                    return Err(ImageError::Corrupt {
                        input: path.display().to_string(),
                        reason: format!("{e}; nothing is pruned until it is fixed or removed"),
                    })
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "skipping unreadable image metadata")
                }
            }
        }
        images.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(images)
    }

    /// Imports a path that exists: a directory or an archive file.
    fn import_path(
        self: &Arc<Self>,
        path: &Path,
        name: Naming,
        input: &str,
        progress: &(dyn Fn(ImportProgress) + Sync),
    ) -> Result<Image, ImageError> {
        let fault = |f: Fault| f.into_error(input);
        let held = Held::new(self.clone());
        tracing::info!(source = %input, image = %name.name, "importing image");
        if path.is_dir() {
            if oci::is_oci_layout(path) {
                let plan = oci::plan_oci_layout(path).map_err(fault)?;
                return self.import_plan(&held, plan, name, input, progress);
            }
            progress(ImportProgress::Layers(1));
            let skip = [self.root.as_path(), self.staging.as_path()];
            let unpacked = unpack_tree(&self.staging, path, &skip).map_err(fault)?;
            return self.import_rootfs(&held, unpacked, name, input, progress);
        }
        if !is_archive(path)? {
            let head = disk::head(path).map_err(io_error(format!("cannot read {input}")))?;
            let Some(format) = disk::sniff(&head) else {
                return Err(ImageError::InvalidSource {
                    input: input.to_owned(),
                    reason: "not a directory, tar, gzip or zstd archive, qcow2 or raw disk".into(),
                });
            };
            return self.import_disk(&held, path, format, name, input, progress);
        }
        let file = File::open(path).map_err(io_error(format!("cannot open {input}")))?;
        // One pass serves both cases: an image archive is unpacked to be read,
        // a rootfs tarball is unpacked to become the layer.
        let unpacked =
            unpack_layer(&self.staging, BufReader::with_capacity(1 << 18, file)).map_err(fault)?;
        let dir = unpacked.dir.path();
        let plan = if oci::is_oci_layout(dir) {
            oci::plan_oci_layout(dir)
        } else if oci::is_docker_archive(dir) {
            oci::plan_docker_archive(dir)
        } else {
            progress(ImportProgress::Layers(1));
            return self.import_rootfs(&held, unpacked, name, input, progress);
        };
        self.import_plan(&held, plan.map_err(fault)?, name, input, progress)
    }

    /// Imports a bootable disk (see [`disk`]): normalised to a standalone qcow2, which is
    /// stored, content-addressed, as the image's only blob.
    fn import_disk(
        &self,
        held: &Held,
        path: &Path,
        format: DiskFormat,
        name: Naming,
        input: &str,
        progress: &(dyn Fn(ImportProgress) + Sync),
    ) -> Result<Image, ImageError> {
        progress(ImportProgress::Layers(1));
        let built = self
            .staging
            .join(format!("disk-{:016x}.qcow2", rand::random::<u64>()));
        let normalised = disk::normalise(path, format, &built, input).and_then(|disk| {
            let file =
                File::open(&built).map_err(io_error(format!("cannot read {}", built.display())))?;
            let size = file
                .metadata()
                .map_err(io_error(format!("cannot read {}", built.display())))?
                .len();
            let mut reader = HashingReader::new(BufReader::with_capacity(1 << 20, file));
            reader
                .drain()
                .map_err(io_error(format!("cannot read {}", built.display())))?;
            Ok((disk, size, reader.digest()))
        });
        let (disk, size, diff_id) = match normalised {
            Ok(done) => done,
            Err(e) => {
                let _ = fs::remove_file(&built);
                return Err(e);
            }
        };
        held.hold(&diff_id);
        let new = self.publish(&diff_id, &built, size)?;
        progress(ImportProgress::LayerDone {
            diff_id: diff_id.clone(),
            size,
            reused: !new,
        });
        let layers = vec![diff_id];
        let id = sha256(&serde_json::to_vec(&layers).unwrap_or_default());
        tracing::info!(source = %input, virtual_size = disk.virtual_size, "imported a bootable disk");
        self.finish_with_disk(name, id, size, layers, ImageConfig::default(), Some(disk))
    }

    fn import_rootfs(
        &self,
        held: &Held,
        unpacked: Unpacked,
        name: Naming,
        input: &str,
        progress: &(dyn Fn(ImportProgress) + Sync),
    ) -> Result<Image, ImageError> {
        let diff_id = unpacked.diff_id.clone();
        let size = unpacked.size;
        let new = self.store_unpacked(held, unpacked, input)?;
        progress(ImportProgress::LayerDone {
            diff_id: diff_id.clone(),
            size,
            reused: !new,
        });
        let layers = vec![diff_id];
        let id = sha256(&serde_json::to_vec(&layers).unwrap_or_default());
        let config = ImageConfig {
            env: vec![DEFAULT_PATH.to_owned()],
            ..ImageConfig::default()
        };
        self.finish(name, id, size, layers, config)
    }

    /// Brings every layer of `plan` into the store, several at once, then records the
    /// image. The first failure stops the others; layers already stored stay (each is
    /// whole), the image is not recorded.
    fn import_plan(
        &self,
        held: &Held,
        plan: Plan,
        name: Naming,
        input: &str,
        progress: &(dyn Fn(ImportProgress) + Sync),
    ) -> Result<Image, ImageError> {
        if plan.layers.len() > MAX_LAYERS {
            return Err(ImageError::InvalidSource {
                input: input.to_owned(),
                reason: format!(
                    "the image has {} layers; at most {MAX_LAYERS} can be stacked (flatten it, e.g. `docker export | docker import`)",
                    plan.layers.len()
                ),
            });
        }
        progress(ImportProgress::Layers(plan.layers.len()));
        let next = AtomicUsize::new(0);
        let failed = AtomicBool::new(false);
        let sizes: Mutex<Vec<Option<u64>>> = Mutex::new(vec![None; plan.layers.len()]);
        let first_error: Mutex<Option<ImageError>> = Mutex::new(None);
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(MAX_IMPORT_THREADS)
            .min(plan.layers.len().max(1));
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(|| {
                    while !failed.load(Ordering::Relaxed) {
                        let index = next.fetch_add(1, Ordering::Relaxed);
                        let Some(layer) = plan.layers.get(index) else {
                            return;
                        };
                        match self.bring_layer(held, layer, input) {
                            Ok((size, reused)) => {
                                sizes.lock().unwrap_or_else(PoisonError::into_inner)[index] =
                                    Some(size);
                                progress(ImportProgress::LayerDone {
                                    diff_id: layer.diff_id.clone(),
                                    size,
                                    reused,
                                });
                            }
                            Err(e) => {
                                failed.store(true, Ordering::Relaxed);
                                first_error
                                    .lock()
                                    .unwrap_or_else(PoisonError::into_inner)
                                    .get_or_insert(e);
                                return;
                            }
                        }
                    }
                });
            }
        });
        if let Some(e) = first_error
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
        {
            return Err(e);
        }
        let size = sizes
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
            .into_iter()
            .map(Option::unwrap_or_default)
            .sum();
        let layers = plan.layers.into_iter().map(|l| l.diff_id).collect();
        self.finish(name, plan.id, size, layers, plan.config)
    }

    /// Stores one planned layer unless it is stored already; returns its content size
    /// and whether it was reused.
    fn bring_layer(
        &self,
        held: &Held,
        layer: &PlannedLayer,
        input: &str,
    ) -> Result<(u64, bool), ImageError> {
        let fault = |f: Fault| f.into_error(input);
        if self.hold_if_stored(held, &layer.diff_id)? {
            tracing::debug!(layer = %layer.diff_id, "layer already stored");
            return Ok((self.layer_size(&layer.diff_id)?, true));
        }
        let file = File::open(&layer.blob).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => ImageError::Corrupt {
                input: input.to_owned(),
                reason: format!("the blob of layer {} is missing", layer.diff_id),
            },
            _ => io_error(format!("cannot open {}", layer.blob.display()))(e),
        })?;
        let mut blob = HashingReader::new(BufReader::with_capacity(1 << 18, file));
        let unpacked = unpack_layer(&self.staging, &mut blob).map_err(fault)?;
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
        let size = unpacked.size;
        let new = self.store_unpacked(held, unpacked, input)?;
        Ok((size, !new))
    }

    /// Builds the blob of an unpacked layer and publishes it (and its sidecar), holding
    /// it first. Says whether it was new: a layer another import stored meanwhile is
    /// kept as it is and this copy dropped.
    fn store_unpacked(
        &self,
        held: &Held,
        unpacked: Unpacked,
        input: &str,
    ) -> Result<bool, ImageError> {
        let diff_id = unpacked.diff_id.clone();
        held.hold(&diff_id);
        if self.blob_path(&diff_id).is_file() {
            self.trash.discard(unpacked.dir);
            return Ok(false);
        }
        let size = unpacked.size;
        let built = self.build(&diff_id, unpacked.dir.path(), input)?;
        self.trash.discard(unpacked.dir);
        self.publish(&diff_id, &built, size)
    }

    /// Builds the blob of the tree `tree` as a temporary file of the layer store.
    fn build(&self, diff_id: &str, tree: &Path, input: &str) -> Result<PathBuf, ImageError> {
        let built = self.layers_dir().join(self.temp_name());
        blob::build(tree, &built, diff_id).map_err(|e| {
            let _ = fs::remove_file(&built);
            self.store_err(format!("write layer {diff_id} of {input}"))(e)
        })?;
        Ok(built)
    }

    /// Publishes a built blob of `diff_id` (sidecar first, so a blob always has one).
    fn publish(&self, diff_id: &str, built: &Path, size: u64) -> Result<bool, ImageError> {
        let dir = self.layers_dir();
        let hex = Self::hex(diff_id);
        let context = format!("store layer {diff_id}");
        let sidecar = serde_json::to_vec(&Sidecar { size }).unwrap_or_default();
        match blob::publish_bytes(&sidecar, &dir, &format!("{hex}.json"), &self.temp_name()) {
            Err(e) if e.kind() != io::ErrorKind::AlreadyExists => {
                let _ = fs::remove_file(built);
                return Err(self.store_err(context)(e));
            }
            _ => {}
        }
        let new = blob::publish(built, &dir, &format!("{hex}.erofs"), &self.temp_name())
            .map_err(self.store_err(context))?;
        if new {
            tracing::debug!(layer = %diff_id, size, "stored layer");
        } else {
            tracing::debug!(layer = %diff_id, "layer stored meanwhile; discarding copy");
        }
        Ok(new)
    }

    /// Bytes of file content in a stored layer.
    fn layer_size(&self, diff_id: &str) -> Result<u64, ImageError> {
        let path = self.sidecar_path(diff_id);
        let bytes = fs::read(&path).map_err(self.store_err(format!("read {}", path.display())))?;
        serde_json::from_slice::<Sidecar>(&bytes)
            .map(|s| s.size)
            .map_err(|e| ImageError::Corrupt {
                input: path.display().to_string(),
                reason: format!("unreadable: {e}"),
            })
    }

    /// Records the image; its layers are all stored (and held) by now.
    fn finish(
        &self,
        naming: Naming,
        id: String,
        size: u64,
        layers: Vec<String>,
        config: ImageConfig,
    ) -> Result<Image, ImageError> {
        self.finish_with_disk(naming, id, size, layers, config, None)
    }

    /// [`finish`](Self::finish), recording the image as the bootable `disk` if it is one.
    fn finish_with_disk(
        &self,
        naming: Naming,
        id: String,
        size: u64,
        layers: Vec<String>,
        config: ImageConfig,
        disk: Option<DiskImage>,
    ) -> Result<Image, ImageError> {
        self.check_owner(&naming)?;
        let image = Image {
            name: naming.name,
            id,
            size,
            layers,
            created_at: unix_now(),
            config,
            fork: None,
            guest: None,
            disk,
            project: naming.project,
        };
        self.write_meta(&image)?;
        tracing::info!(image = %image.name, id = %image.id, layers = image.layers.len(), size = image.size, "imported image");
        Ok(image)
    }

    /// Refuses to record `naming` over an image of another owner: a project never
    /// replaces the admin's image, nor the admin a project's.
    fn check_owner(&self, naming: &Naming) -> Result<(), ImageError> {
        let path = self.meta_path(&naming.name);
        let Ok(bytes) = fs::read(&path) else {
            return Ok(());
        };
        let owner = serde_json::from_slice::<Image>(&bytes).map(|i| i.project);
        match owner {
            Ok(owner) if owner != naming.project => Err(ImageError::Owned {
                name: naming.name.clone(),
                owner: owner.map_or_else(|| "the admin".to_owned(), |p| format!("project {p:?}")),
            }),
            _ => Ok(()),
        }
    }

    fn write_meta(&self, image: &Image) -> Result<(), ImageError> {
        let dir = self.meta_dir();
        let path = self.meta_path(&image.name);
        let context = || format!("write {}", path.display());
        let mut tmp = tempfile::Builder::new()
            .prefix(".tmp-")
            .tempfile_in(&dir)
            .map_err(self.store_err(context()))?;
        serde_json::to_writer_pretty(&mut tmp, image)
            .map_err(|e| self.store_err(context())(e.into()))?;
        tmp.as_file()
            .sync_all()
            .map_err(self.store_err(context()))?;
        tmp.persist(&path)
            .map_err(|e| self.store_err(context())(e.error))?;
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(self.store_err(context()))
    }

    /// Every `<hex>.erofs` in the store, with its metadata.
    fn stored_blobs(&self) -> Result<Vec<(String, fs::Metadata)>, ImageError> {
        let dir = self.layers_dir();
        let context = || format!("list {}", dir.display());
        let mut blobs = Vec::new();
        for entry in fs::read_dir(&dir).map_err(self.store_err(context()))? {
            let entry = entry.map_err(self.store_err(context()))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(hex) = name.strip_suffix(".erofs") else {
                continue;
            };
            let diff_id = format!("sha256:{hex}");
            if sha256_hex(&diff_id).is_none() {
                continue;
            }
            if let Ok(meta) = entry.metadata() {
                blobs.push((diff_id, meta));
            }
        }
        Ok(blobs)
    }

    fn prune(&self) -> Result<Pruned, ImageError> {
        let lock = StoreLock::take(&self.root, true).map_err(self.store_err("lock the store"))?;
        let images = self.list(true)?;
        let mut referenced: BTreeSet<String> = images
            .iter()
            .flat_map(|i| i.layers.iter().cloned())
            .collect();
        let counts = self.holds.lock();
        referenced.extend(counts.keys().cloned());
        // This edge's mounts depend on its own needs; other edges' leases only keep
        // their layers in the store.
        for layer in self.mounts.layers() {
            if !referenced.contains(&layer) {
                self.mounts.unmount(&layer);
                tracing::debug!(layer = %layer, "unmounted layer no image needs");
            }
        }
        referenced.extend(self.leased_by_others()?);
        let mut pruned = Pruned::default();
        let mut kept = HashSet::new();
        for (diff_id, meta) in self.stored_blobs()? {
            if referenced.contains(&diff_id) {
                kept.insert(diff_id);
                continue;
            }
            match fs::remove_file(self.blob_path(&diff_id)) {
                Ok(()) => {
                    let _ = fs::remove_file(self.sidecar_path(&diff_id));
                    pruned.layers += 1;
                    pruned.bytes += meta.blocks() * 512;
                    tracing::info!(layer = %diff_id, "deleted unreferenced layer");
                }
                Err(e) => tracing::warn!(layer = %diff_id, error = %e, "could not delete layer"),
            }
        }
        drop(counts);
        // Sidecars whose blob never made it (a publish cut short); one being published
        // now is held, so referenced.
        for entry in fs::read_dir(self.layers_dir())
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(hex) = name.strip_suffix(".json") {
                let diff_id = format!("sha256:{hex}");
                if !kept.contains(&diff_id) && !referenced.contains(&diff_id) {
                    let _ = fs::remove_file(entry.path());
                }
            }
        }
        drop(lock);
        // Other edges may now prune what this one no longer holds or mounts.
        self.write_lease(true)?;
        Ok(pruned)
    }

    /// Removes the temporary files a crashed run of this edge left in the layer store.
    fn remove_own_temporaries(&self) -> Result<(), ImageError> {
        let prefix = format!(".tmp-{}-", escape(&self.edge));
        let dir = self.layers_dir();
        for entry in
            fs::read_dir(&dir).map_err(self.store_err(format!("list {}", dir.display())))?
        {
            let entry = entry.map_err(self.store_err(format!("list {}", dir.display())))?;
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = fs::remove_file(entry.path());
                tracing::info!(path = %entry.path().display(), "removed leftover of an interrupted import");
            }
        }
        Ok(())
    }

    /// Converts layers an older dsec stored as unpacked directories into blobs.
    fn convert_directory_layers(self: &Arc<Self>) -> Result<(), ImageError> {
        let dir = self.layers_dir();
        for entry in
            fs::read_dir(&dir).map_err(self.store_err(format!("list {}", dir.display())))?
        {
            let entry = entry.map_err(self.store_err(format!("list {}", dir.display())))?;
            let diff_id = format!("sha256:{}", entry.file_name().to_string_lossy());
            let path = entry.path();
            if sha256_hex(&diff_id).is_none() || !path.is_dir() || path.is_symlink() {
                continue;
            }
            tracing::info!(layer = %diff_id, "converting a layer directory to an EROFS blob");
            let held = Held::new(self.clone());
            held.hold(&diff_id);
            if !self.blob_path(&diff_id).is_file() {
                let built = self.build(&diff_id, &path, "a layer directory")?;
                let size = tree_size(&path)
                    .map_err(io_error(format!("cannot measure {}", path.display())))?;
                self.publish(&diff_id, &built, size)?;
            }
            fs::remove_dir_all(&path)
                .map_err(io_error(format!("cannot remove {}", path.display())))?;
        }
        Ok(())
    }
}

/// Empties `dir` (a staging area no one else uses).
fn clear_dir(dir: &Path) -> Result<(), ImageError> {
    let context = || format!("cannot list {}", dir.display());
    for entry in fs::read_dir(dir).map_err(io_error(context()))? {
        let path = entry.map_err(io_error(context()))?.path();
        let removed = if path.is_dir() && !path.is_symlink() {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        removed.map_err(io_error(format!("cannot remove {}", path.display())))?;
        tracing::info!(path = %path.display(), "removed leftover of an interrupted import");
    }
    Ok(())
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

/// The name an image is recorded under, and whose it is.
#[derive(Debug)]
struct Naming {
    name: String,
    project: Option<String>,
}

impl Naming {
    /// `name` as `project` asked for it (see [`owned_name`]), checked.
    fn new(name: &str, project: Option<&str>, input: &str) -> Result<Naming, ImageError> {
        let name = owned_name(project, name);
        validate_name(&name, input)?;
        Ok(Naming {
            name,
            project: project.map(str::to_owned),
        })
    }
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
