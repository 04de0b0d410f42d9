//! `backend="microvm"` and `backend="vm"`: sandboxes behind a kernel boundary, in QEMU.
//!
//! Both backends share one [`VmHost`]: the guest kernel and initramfs, the accelerator
//! (probed once: KVM when a guest actually boots under it, TCG otherwise), one read-only
//! disk per image and one boot template per image and hardware shape. A new sandbox is a
//! copy of its template's small scratch qcow2 and a QEMU restoring the template's device
//! state over a private, copy-on-write mapping of the template's memory file, so that
//! the guests of one template share the pages none of them wrote (see
//! [`dsec_vm::qemu`]); with `--vm-boot cold` each sandbox boots its kernel instead. The guest's agent speaks the
//! container backend's protocol, so exec, timeouts, output bounds and files behave alike.
//!
//! A sandbox with a network has its QEMU's network namespace plugged into the server's
//! bridge as a container's namespace is ([`dsec_net::Attachment`]): the same address
//! pool, nftables policy, resolver, name-checking proxy and refusal events, and
//! `set_network` changes the same policy (see [`dsec_vm::qemu`] for the guest's side).
//!
//! Everything a VM makes lives in `<state>/vm/sandboxes/<id>/` (scratch disk, console
//! log, a record naming its QEMU) and goes at stop; a restarted server kills the QEMUs
//! its records name (checking each one's start time, so a recycled pid is never hit)
//! and removes the directories, but for one kind: a guest paused to disk
//! ([`PauseMode::Save`]) that the edge asked to keep ([`Sandbox::keep`]) has all it needs
//! in `paused/` (memory, device state, and `kept.json`, written last), and a restarted
//! server adopts it ([`Backend::adopt`]): its next request restores it on a new channel,
//! as a snapshot's child is restored (the host drops what the guest was writing to the
//! old one), with the same identity.

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use dsec_api::{FileInfo, ImageInfo, Usage};
use dsec_image::{GuestSnapshot, HeldBlobs, Image, ImageStore};
use dsec_net::{Attachment, Networking, Policy};
use dsec_runtime::channel::{ExecEvent, ExecHandle};
use dsec_runtime::guest::MAX_IMAGE_DISKS;
use dsec_runtime::procfs::{self, Stat};
use dsec_runtime::proto::ExecSpec;
use dsec_vm::assets::{GuestAssets, KernelSource};
use dsec_vm::disk::{self, BaseFs};
use dsec_vm::qemu::{
    self, console_tail, Accel, Disks, GuestIdentity, Hardware, Machine, Start, TemplateFiles, Vm,
};
use dsec_vm::VmError;
use serde::{Deserialize, Serialize};
use tokio::sync::OnceCell;

use super::files::{list_served, read_served, watch_served, write_served, FileWatch};
use super::{file_info, MakeDir, MovePath, RemovePath};
use super::{
    Adopted, Backend, CommandSpec, Created, Failure, FileRead, ImageDefaults, Output, OutputStream,
    ProcessSpec, Sandbox, SandboxRequest, Spawned, Upload,
};
use crate::error::ApiError;

mod bootdisk;

/// The smallest guest that boots the cloud kernel and runs commands comfortably.
const MIN_VM_MEMORY_MB: u64 = 128;

/// How long the accelerator probe waits for a KVM guest's agent.
const KVM_PROBE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(8);

/// How new VM sandboxes start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BootMode {
    /// Restore a boot template's snapshot (the template boots once per image and shape).
    #[default]
    Snapshot,
    /// Boot the kernel for every sandbox.
    Cold,
}

/// What `sb.pause()` does to a VM sandbox.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PauseMode {
    /// Stop the vCPUs; the guest stays in memory (resumes at once).
    #[default]
    Stop,
    /// Stop the vCPUs, save the guest to disk and end QEMU: its memory is freed; the next
    /// request restores it.
    Save,
}

/// Which accelerator to use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AccelChoice {
    /// KVM if a probe guest boots under it, TCG otherwise.
    #[default]
    Auto,
    /// KVM only.
    Kvm,
    /// TCG only.
    Tcg,
}

/// Operator settings of the VM backends.
#[derive(Clone, Debug, Default)]
pub struct VmConfig {
    /// The static guest agent; by default looked up next to the `dsec` binary.
    pub agent: Option<PathBuf>,
    /// The guest kernel.
    pub kernel: KernelSource,
    /// Filesystem of image disks.
    pub base_fs: BaseFs,
    /// How sandboxes start.
    pub boot: BootMode,
    /// Accelerator.
    pub accel: AccelChoice,
    /// What a pause does.
    pub pause: PauseMode,
}

/// The layout of a boot template's directory and the devices of its guest (3: the NIC
/// every guest has); part of its name, so that templates an older dsec saved differently
/// are never restored (and are removed at start), and recorded with each saved guest.
const TEMPLATE_FORMAT: u32 = 3;

/// The files of a boot template directory: its scratch disk, memory and device state.
fn template_files(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    (
        dir.join("scratch.qcow2"),
        dir.join("memory"),
        dir.join("state"),
    )
}

/// What a boot template depends on.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct TemplateKey {
    image_id: String,
    hardware: Hardware,
    disk_mb: u64,
}

type Lazy<T> = Arc<OnceCell<T>>;

/// What both VM backends share on this host.
pub struct VmHost {
    dir: PathBuf,
    images: ImageStore,
    config: VmConfig,
    exe: PathBuf,
    assets: OnceCell<Result<GuestAssets, String>>,
    accel: OnceCell<Accel>,
    image_disks: Mutex<HashMap<String, Lazy<PathBuf>>>,
    scratch_bases: Mutex<HashMap<u64, Lazy<PathBuf>>>,
    templates: Mutex<HashMap<TemplateKey, Lazy<PathBuf>>>,
    /// Saved guests being written (not yet images) or restored by running sandboxes
    /// (which map their memory and read their disk), with how many: pruning leaves them.
    saving: Mutex<HashMap<String, usize>>,
}

/// A saved guest in use ([`VmHost::saving`]) while this is held.
struct SavedInUse {
    host: Arc<VmHost>,
    saved: String,
}

impl SavedInUse {
    fn new(host: &Arc<VmHost>, saved: &str) -> SavedInUse {
        *host
            .saving
            .lock()
            .expect("lock")
            .entry(saved.to_owned())
            .or_default() += 1;
        SavedInUse {
            host: Arc::clone(host),
            saved: saved.to_owned(),
        }
    }
}

impl Drop for SavedInUse {
    fn drop(&mut self) {
        let mut saving = self.host.saving.lock().expect("lock");
        if let Some(count) = saving.get_mut(&self.saved) {
            *count -= 1;
            if *count == 0 {
                saving.remove(&self.saved);
            }
        }
    }
}

/// A running guest saved as an image (`sb.snapshot()`, `sb.fork()`): a boot template's
/// files (see [`template_files`]) in `<state>/vm/snapshots/<saved>/`, and this record of
/// what a guest restored from them needs, in `guest.json`.
#[derive(Debug, Serialize, Deserialize)]
struct SavedGuest {
    /// The first channel request id the saved guest never saw.
    first_request: u32,
    /// The image disks it ran with, top first: exactly those, since its page cache holds
    /// their blocks.
    image_disks: Vec<PathBuf>,
    /// Their filesystem.
    base_fs: BaseFs,
    /// The [`TEMPLATE_FORMAT`] it was saved in (0: before the record said): a guest saved
    /// with other devices cannot be restored.
    #[serde(default)]
    format: u32,
}

/// Where the files of saved guest `saved` are.
fn saved_dir(vm_dir: &Path, saved: &str) -> PathBuf {
    vm_dir.join("snapshots").join(saved)
}

/// What `<state>/vm/sandboxes/<id>/record.json` holds, for cleanup after a crash.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    qemu_pid: i32,
    /// `/proc/<pid>/stat` start time of that QEMU: a recycled pid has another.
    start_ticks: u64,
}

/// Names `vm`'s QEMU in the sandbox directory `dir`, for cleanup after a crash.
fn write_record(dir: &Path, vm: &Vm) -> Result<(), ApiError> {
    let record = Record {
        qemu_pid: vm.pid(),
        start_ticks: Stat::read(vm.pid()).map_or(0, |s| s.start_ticks),
    };
    std::fs::write(
        dir.join("record.json"),
        serde_json::to_vec(&record).expect("record serializes"),
    )
    .map_err(|e| ApiError::internal(format!("writing the sandbox record: {e}")))
}

/// What `<state>/vm/sandboxes/<id>/paused/kept.json` holds: a guest paused to disk and
/// kept across a restart of the server ([`Sandbox::keep`]), with all a restarted server
/// needs to restore it. Written last, once the guest's files are on disk, and removed
/// first when it resumes: a directory without it is a guest half-saved, or one that ran
/// on, and is removed at start.
#[derive(Debug, Serialize, Deserialize)]
struct Kept {
    /// `microvm` or `vm` ([`Machine::backend`]).
    backend: String,
    /// The accelerator it was saved from ([`Accel::name`]), which it resumes on.
    accel: String,
    vcpus: u32,
    memory_mb: u64,
    disk_mb: u64,
    pids: u64,
    /// Its image: its layers are held again, and a snapshot of it stacks them.
    image: Image,
    /// The image disks it ran with, top first, and their filesystem.
    image_disks: Vec<PathBuf>,
    base_fs: BaseFs,
    /// The saved guest (a snapshot's) its scratch disk lies over, if any.
    restored_from: Option<String>,
    /// Its egress policy, and its address when it has an interface.
    network: Policy,
    address: Option<std::net::Ipv4Addr>,
    ca_bundle: bool,
    /// The first channel request id the guest never saw (see [`SavedGuest`]).
    first_request: u32,
    /// The [`TEMPLATE_FORMAT`] of its devices.
    format: u32,
    /// The edge's record of it.
    edge: serde_json::Value,
}

/// The record of the kept guest of sandbox directory `dir`, if it is kept and whole.
fn read_kept(dir: &Path) -> Option<Kept> {
    let paused = dir.join("paused");
    let (_, memory, state) = template_files(&paused);
    if !memory.exists() || !state.exists() {
        return None;
    }
    let kept: Kept = serde_json::from_slice(&std::fs::read(paused.join("kept.json")).ok()?).ok()?;
    (kept.format == TEMPLATE_FORMAT).then_some(kept)
}

/// Writes `kept` into `paused` (a kept guest's directory, see [`Kept`]) once the guest's
/// files there and its scratch disk are on disk: a host that crashes right after must not
/// leave a record of files still only in its page cache.
fn write_kept(paused: &Path, scratch: &Path, kept: &Kept) -> Result<(), String> {
    let (_, memory, state) = template_files(paused);
    for file in [scratch, &memory, &state, paused] {
        std::fs::File::open(file)
            .and_then(|f| f.sync_all())
            .map_err(|e| format!("syncing {}: {e}", file.display()))?;
    }
    let tmp = paused.join("kept.json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(kept).expect("record serializes"))
        .and_then(|()| std::fs::File::open(&tmp)?.sync_all())
        .and_then(|()| std::fs::rename(&tmp, paused.join("kept.json")))
        .and_then(|()| std::fs::File::open(paused)?.sync_all())
        .map_err(|e| format!("writing {}: {e}", tmp.display()))
}

fn vm_error(e: VmError) -> ApiError {
    match e {
        VmError::Unavailable(_) => ApiError::unavailable(e.to_string()),
        _ => ApiError::internal(e.to_string()),
    }
}

fn blocking_error(e: tokio::task::JoinError) -> ApiError {
    ApiError::internal(e.to_string())
}

/// A scratch qcow2 over `base` at `target` (`qemu-img`, off the async threads).
async fn create_scratch(base: &Path, target: &Path) -> Result<(), ApiError> {
    let (base, target) = (base.to_owned(), target.to_owned());
    tokio::task::spawn_blocking(move || disk::create_scratch(&base, &target))
        .await
        .map_err(blocking_error)?
        .map_err(vm_error)
}

/// The value of `map[key]`, built once by `init` even when many sandboxes ask at once;
/// a failed build is retried by the next caller.
async fn once<K, T, F, Fut>(
    map: &Mutex<HashMap<K, Lazy<T>>>,
    key: K,
    init: F,
) -> Result<T, ApiError>
where
    K: Eq + Hash,
    T: Clone,
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Result<T, ApiError>>,
{
    let cell = Arc::clone(map.lock().expect("lock").entry(key).or_default());
    cell.get_or_try_init(init).await.cloned()
}

impl VmHost {
    /// The VM host under `<state>/vm`; `exe` is the running `dsec` binary (the agent is
    /// looked up beside it).
    pub fn new(state_dir: &Path, images: ImageStore, config: VmConfig, exe: PathBuf) -> VmHost {
        VmHost {
            dir: state_dir.join("vm"),
            images,
            config,
            exe,
            assets: OnceCell::new(),
            accel: OnceCell::new(),
            image_disks: Mutex::default(),
            scratch_bases: Mutex::default(),
            templates: Mutex::default(),
            saving: Mutex::default(),
        }
    }

    fn agent_path(&self) -> PathBuf {
        if let Some(agent) = &self.config.agent {
            return agent.clone();
        }
        let dir = self.exe.parent().unwrap_or(Path::new("."));
        let built = dir.join("../x86_64-unknown-linux-gnu/release/dsec-agent");
        if built.exists() {
            return built;
        }
        dir.join("dsec-agent")
    }

    async fn assets(&self) -> Result<GuestAssets, ApiError> {
        let result = self
            .assets
            .get_or_init(|| async {
                let (source, agent, cache) = (
                    self.config.kernel.clone(),
                    self.agent_path(),
                    self.dir.join("guest"),
                );
                tokio::task::spawn_blocking(move || GuestAssets::prepare(&source, &agent, &cache))
                    .await
                    .map_err(|e| e.to_string())
                    .and_then(|r| r.map_err(|e| e.to_string()))
            })
            .await;
        result.clone().map_err(|reason| {
            ApiError::unavailable(format!("VM sandboxes cannot run on this server: {reason}"))
        })
    }

    /// The accelerator, probed on first use.
    pub async fn accel(&self) -> Result<Accel, ApiError> {
        let assets = self.assets().await?;
        Ok(*self
            .accel
            .get_or_init(|| async {
                match self.config.accel {
                    AccelChoice::Kvm => Accel::Kvm,
                    AccelChoice::Tcg => Accel::Tcg,
                    AccelChoice::Auto => {
                        match qemu::probe_kvm(&assets, &self.dir.join("probe"), KVM_PROBE_DEADLINE)
                            .await
                        {
                            Ok(()) => {
                                tracing::info!("KVM boots guests; VM sandboxes use it");
                                Accel::Kvm
                            }
                            Err(reason) => {
                                tracing::info!(%reason, "VM sandboxes fall back to TCG");
                                Accel::Tcg
                            }
                        }
                    }
                }
            })
            .await)
    }

    /// The image's read-only disks, top layer first, and their filesystem. An image of up
    /// to [`MAX_IMAGE_DISKS`] layers is given its layers' EROFS blobs (`held`) as the store
    /// keeps them, no copy: the guest's overlay stacks them as the host's does. A deeper
    /// one gets one merged disk, built once from its mounted layers.
    async fn image_disks(
        &self,
        image: &Image,
        held: &HeldBlobs,
    ) -> Result<(Vec<PathBuf>, BaseFs), ApiError> {
        if (1..=MAX_IMAGE_DISKS).contains(&held.blobs.len()) {
            return Ok((held.blobs.iter().rev().cloned().collect(), BaseFs::Erofs));
        }
        let fs = self.config.base_fs;
        let target =
            self.dir
                .join("disks")
                .join(format!("{}.{}", image.id.replace(':', "-"), fs.name()));
        let images = self.images.clone();
        let disk = once(&self.image_disks, image.id.clone(), || async move {
            if !target.exists() {
                let mounted = images.mount(image).await?;
                let t = target.clone();
                tokio::task::spawn_blocking(move || disk::build_image_disk(&mounted.dirs, fs, &t))
                    .await
                    .map_err(blocking_error)?
                    .map_err(vm_error)?;
            }
            Ok(target)
        })
        .await?;
        Ok((vec![disk], fs))
    }

    /// Removes the merged disks and boot templates of images that no longer exist
    /// (`live`: the ids of those that do), and the saved guests of snapshots that no
    /// longer exist; returns the bytes freed. A disk a saved guest ran with stays.
    pub fn prune_images(&self, live: &HashSet<String>) -> u64 {
        let mut freed = 0;
        let saved: HashSet<String> = match self.images.list() {
            Ok(images) => images
                .into_iter()
                .filter_map(|i| Some(i.guest?.saved))
                .collect(),
            // Unsure which are still images: remove none.
            Err(_) => return 0,
        };
        // A kept guest restores with the disks it ran with.
        let mut kept_disks: HashSet<PathBuf> = self
            .kept()
            .into_iter()
            .flat_map(|(_, kept)| kept.image_disks)
            .collect();
        for entry in std::fs::read_dir(self.dir.join("snapshots"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            if self.saving.lock().expect("lock").contains_key(&name) {
                continue;
            }
            if saved.contains(&name) {
                if let Some(guest) = read_saved(&entry.path()) {
                    kept_disks.extend(guest.image_disks);
                }
                continue;
            }
            freed += dir_bytes(&entry.path());
            if std::fs::remove_dir_all(entry.path()).is_ok() {
                tracing::info!(saved = %name, "removed the saved guest of a deleted snapshot");
            }
        }
        let disk_id = |name: &str| {
            name.rsplit_once('.')
                .map(|(id, _)| id.replacen('-', ":", 1))
        };
        for entry in std::fs::read_dir(self.dir.join("disks"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(id) = disk_id(&name) else { continue };
            if name.contains(".tmp-") || live.contains(&id) || kept_disks.contains(&entry.path()) {
                continue;
            }
            freed += entry.metadata().map_or(0, |m| m.len());
            if std::fs::remove_file(entry.path()).is_ok() {
                tracing::info!(image = %id, "removed the VM disk of a deleted image");
            }
            self.image_disks.lock().expect("lock").remove(&id);
        }
        for entry in std::fs::read_dir(self.dir.join("templates"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let Ok(id) = std::fs::read_to_string(entry.path().join("image")) else {
                continue;
            };
            if live.contains(&id) {
                continue;
            }
            freed += dir_bytes(&entry.path());
            if std::fs::remove_dir_all(entry.path()).is_ok() {
                tracing::info!(image = %id, "removed a VM boot template of a deleted image");
            }
        }
        self.templates
            .lock()
            .expect("lock")
            .retain(|key, _| live.contains(&key.image_id));
        freed
    }

    async fn scratch_base(&self, disk_mb: u64) -> Result<PathBuf, ApiError> {
        let target = self.dir.join("scratch").join(format!("{disk_mb}M.ext4"));
        once(&self.scratch_bases, disk_mb, || async move {
            if !target.exists() {
                let t = target.clone();
                tokio::task::spawn_blocking(move || disk::build_scratch_base(disk_mb, &t))
                    .await
                    .map_err(blocking_error)?
                    .map_err(vm_error)?;
            }
            Ok(target)
        })
        .await
    }

    /// The directory of the boot template for `key` (see [`template_files`]), booting
    /// and saving the template guest the first time.
    async fn template(
        &self,
        key: TemplateKey,
        assets: &GuestAssets,
        disks: Disks,
    ) -> Result<PathBuf, ApiError> {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        (TEMPLATE_FORMAT, &key, &assets.kernel, &assets.initramfs).hash(&mut hasher);
        let dir = self
            .dir
            .join("templates")
            .join(format!("{:016x}", hasher.finish()));
        let hw = key.hardware.clone();
        let image_id = key.image_id.clone();
        once(&self.templates, key, || async move {
            if dir.join("ready").exists() {
                return Ok(dir);
            }
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir)
                .and_then(|()| std::fs::write(dir.join("image"), &image_id))
                .map_err(|e| ApiError::internal(format!("creating {}: {e}", dir.display())))?;
            let (scratch, memory, state) = template_files(&dir);
            let built = async {
                create_scratch(&disks.scratch, &scratch).await?;
                let disks = Disks { scratch, ..disks };
                let files = TemplateFiles {
                    memory: &memory,
                    state: &state,
                    first_request: 1,
                };
                let vm = Vm::start(
                    &hw,
                    assets,
                    Some(&disks),
                    Start::Template(files),
                    &dir,
                    None,
                )
                .await
                .map_err(vm_error)?;
                let saved = vm.save_template(&state).await;
                vm.kill().await;
                saved.map_err(vm_error)?;
                // On disk before `ready` says so: a host crash must not leave a template
                // whose memory is still only in the page cache.
                let dir = dir.clone();
                tokio::task::spawn_blocking(move || {
                    let (scratch, memory, state) = template_files(&dir);
                    for file in [scratch, memory, state] {
                        std::fs::File::open(&file)
                            .and_then(|f| f.sync_all())
                            .map_err(|e| format!("syncing {}: {e}", file.display()))?;
                    }
                    std::fs::write(dir.join("ready"), b"").map_err(|e| e.to_string())
                })
                .await
                .map_err(blocking_error)?
                .map_err(ApiError::internal)
            };
            match built.await {
                Ok(()) => Ok(dir),
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&dir);
                    Err(e)
                }
            }
        })
        .await
    }

    /// Removes what an earlier run left: QEMUs named by records (if still the same
    /// process), sandbox directories but those of kept guests ([`Kept`]; adopted by
    /// [`Backend::adopt`]), half-built templates and temporary files.
    pub fn clean_leftovers(&self) -> usize {
        let sandboxes = self.dir.join("sandboxes");
        let mut cleaned = 0;
        for entry in std::fs::read_dir(&sandboxes)
            .into_iter()
            .flatten()
            .flatten()
        {
            let record: Option<Record> = std::fs::read(entry.path().join("record.json"))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            if let Some(r) = record {
                // The QEMU our record names, while its start time still matches.
                let qemu = rustix::process::Pid::from_raw(r.qemu_pid);
                if let Some(qemu) = qemu.filter(|_| {
                    Stat::read(r.qemu_pid).map(|s| s.start_ticks) == Some(r.start_ticks)
                }) {
                    let _ = rustix::process::kill_process(qemu, rustix::process::Signal::KILL);
                }
            }
            if read_kept(&entry.path()).is_some() {
                continue;
            }
            let _ = std::fs::remove_dir_all(entry.path());
            cleaned += 1;
        }
        for entry in std::fs::read_dir(self.dir.join("templates"))
            .into_iter()
            .flatten()
            .flatten()
        {
            // Half-built, or saved by an older dsec in another layout (its memory inside
            // the scratch qcow2, no `state`).
            let (_, _, state) = template_files(&entry.path());
            if !entry.path().join("ready").exists() || !state.exists() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        for entry in std::fs::read_dir(self.dir.join("snapshots"))
            .into_iter()
            .flatten()
            .flatten()
        {
            // Half-saved: the record is written last.
            if read_saved(&entry.path()).is_none() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        for sub in ["disks", "scratch", "guest"] {
            for entry in std::fs::read_dir(self.dir.join(sub))
                .into_iter()
                .flatten()
                .flatten()
            {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.contains(".tmp-") || name.starts_with("merge-") {
                    let path = entry.path();
                    let _ = std::fs::remove_file(&path).or_else(|_| std::fs::remove_dir(&path));
                }
            }
        }
        let _ = std::fs::remove_dir_all(self.dir.join("probe"));
        cleaned
    }
}

impl VmHost {
    /// The kept guests ([`Kept`]) in `<state>/vm/sandboxes/`, with their directories.
    fn kept(&self) -> Vec<(PathBuf, Kept)> {
        std::fs::read_dir(self.dir.join("sandboxes"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| Some((entry.path(), read_kept(&entry.path())?)))
            .collect()
    }
}

/// The record of the saved guest in `dir`, if it is whole.
fn read_saved(dir: &Path) -> Option<SavedGuest> {
    serde_json::from_slice(&std::fs::read(dir.join("guest.json")).ok()?).ok()
}

/// Bytes of disk the files under `dir` take (a template's memory file is sparse).
fn dir_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut pending = vec![dir.to_owned()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            match entry.metadata() {
                Ok(m) if m.is_dir() => pending.push(entry.path()),
                Ok(m) => total += m.blocks() * 512,
                Err(_) => {}
            }
        }
    }
    total
}

/// `backend="microvm"` or `backend="vm"`.
pub struct VmBackend {
    host: Arc<VmHost>,
    machine: Machine,
    net: Arc<Networking>,
}

impl VmBackend {
    /// The backend running `machine`s on `host`, giving networks through `net`.
    pub fn new(host: Arc<VmHost>, machine: Machine, net: Arc<Networking>) -> VmBackend {
        VmBackend { host, machine, net }
    }
}

/// Connects a running guest to the network: its QEMU's namespace to the bridge, then the
/// guest's `/etc/resolv.conf` and CA bundle as a container's (its address and routes came
/// with its identity).
async fn plug(vm: &Vm, attachment: &Attachment, ca_bundle: bool) -> Result<(), ApiError> {
    attachment.plug(vm.netns().map_err(vm_error)?).await?;
    super::write_network_files(vm.channel(), attachment, ca_bundle).await
}

impl VmBackend {
    /// The guest an earlier run kept in sandbox directory `dir` ([`Kept`]), paused on
    /// disk: its image's layers and the saved guest under its disk held again, and its
    /// address (the same one where this server's pool has it free) and policy reserved,
    /// so that nothing made before its first request takes them.
    async fn adopt_kept(&self, dir: &Path, kept: Kept) -> Result<Adopted, ApiError> {
        let host = &self.host;
        let id = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let held = host.images.blobs(&kept.image)?;
        let restored_from = kept
            .restored_from
            .as_deref()
            .map(|saved| SavedInUse::new(host, saved));
        if let Some(saved) = &kept.restored_from {
            if read_saved(&saved_dir(&host.dir, saved)).is_none() {
                return Err(ApiError::internal(format!(
                    "the saved guest {saved} its disk lies over is gone"
                )));
            }
        }
        let attachment = match kept.address {
            Some(address) => Some(self.net.reserve_again(&kept.network, address).await?),
            None => None,
        };
        let hardware = Hardware {
            machine: self.machine,
            accel: if kept.accel == Accel::Kvm.name() {
                Accel::Kvm
            } else {
                Accel::Tcg
            },
            vcpus: kept.vcpus,
            memory_mb: kept.memory_mb,
        };
        let sandbox = VmSandbox {
            _layers: held,
            vm: std::sync::RwLock::new(None),
            on_disk: tokio::sync::Mutex::new(Some(OnDisk::Adopted {
                first_request: kept.first_request,
            })),
            saved_to_disk: AtomicBool::new(true),
            id,
            pids: kept.pids,
            guest_usage: Arc::default(),
            dir: dir.to_owned(),
            host: Arc::clone(host),
            image: kept.image,
            hardware,
            disks: Disks {
                image: kept.image_disks,
                base_fs: kept.base_fs,
                scratch: dir.join("scratch.qcow2"),
            },
            disk_mb: kept.disk_mb,
            _restored_from: restored_from,
            net: Arc::clone(&self.net),
            attachment: tokio::sync::Mutex::new(attachment),
            policy: Mutex::new(kept.network),
            ca_bundle: kept.ca_bundle,
        };
        Ok(Adopted {
            sandbox: Box::new(sandbox),
            edge: kept.edge,
        })
    }

    /// The files of the guest saved as image `name` and their record, once `hardware` and
    /// `disk_mb` are checked to be the guest's own: a running guest keeps its shape.
    fn saved_guest(
        &self,
        name: &str,
        guest: &GuestSnapshot,
        hardware: &Hardware,
        disk_mb: u64,
    ) -> Result<(PathBuf, SavedGuest), ApiError> {
        let backend = self.machine.backend();
        if guest.backend != backend {
            return Err(ApiError::invalid(format!(
                "image {name} is a snapshot of a running {} guest: create it with \
                 backend=\"{}\"",
                guest.backend, guest.backend
            )));
        }
        if guest.edge != self.host.images.edge() {
            return Err(ApiError::unavailable(format!(
                "image {name} is a snapshot of a running guest saved on edge {}: only that \
                 edge can start it",
                guest.edge
            )));
        }
        if (guest.vcpus, guest.memory_mb, guest.disk_mb)
            != (hardware.vcpus, hardware.memory_mb, disk_mb)
        {
            return Err(ApiError::invalid(format!(
                "image {name} is a snapshot of a running guest with {} CPUs, {} MiB of \
                 memory and a {} MiB disk, and a guest keeps its shape: create it with \
                 cpus={}, memory_mb={}, disk_mb={} (asked: {} CPUs, {} MiB, {} MiB)",
                guest.vcpus,
                guest.memory_mb,
                guest.disk_mb,
                guest.vcpus,
                guest.memory_mb,
                guest.disk_mb,
                hardware.vcpus,
                hardware.memory_mb,
                disk_mb
            )));
        }
        // A name this backend made (hex), never a path: the record may come from a registry.
        if guest.saved.is_empty() || !guest.saved.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ApiError::invalid(format!(
                "image {name} names no saved guest of this server ({:?})",
                guest.saved
            )));
        }
        let dir = saved_dir(&self.host.dir, &guest.saved);
        match read_saved(&dir) {
            Some(saved) if saved.format != TEMPLATE_FORMAT => Err(ApiError::invalid(format!(
                "image {name} is a snapshot of a running guest saved by an older dsec, with \
                 other devices (format {}, this server restores {TEMPLATE_FORMAT}): it cannot \
                 be restored; delete it, and snapshot the guest again from its image",
                saved.format
            ))),
            Some(saved) => Ok((dir, saved)),
            None => Err(ApiError::internal(format!(
                "the saved guest of image {name} is missing from {}",
                dir.display()
            ))),
        }
    }
}

#[async_trait]
impl Backend for VmBackend {
    fn host_tasks(&self, _pids: u64) -> u64 {
        crate::admission::VM_HOST_TASKS
    }

    fn has_networking(&self) -> bool {
        true
    }

    async fn adopt(&self) -> Vec<Adopted> {
        let mut adopted = Vec::new();
        let backend = self.machine.backend();
        for (dir, kept) in self.host.kept() {
            if kept.backend != backend {
                continue;
            }
            match self.adopt_kept(&dir, kept).await {
                Ok(a) => adopted.push(a),
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot adopt a VM guest kept by an earlier run; removing it");
                    let _ = std::fs::remove_dir_all(&dir);
                }
            }
        }
        adopted
    }

    async fn prune_images(&self, live: &HashSet<String>) -> u64 {
        let (host, live) = (Arc::clone(&self.host), live.clone());
        tokio::task::spawn_blocking(move || host.prune_images(&live))
            .await
            .unwrap_or_default()
    }

    async fn create(&self, req: SandboxRequest) -> Result<Created, ApiError> {
        if req.memory_mb < MIN_VM_MEMORY_MB {
            return Err(ApiError::invalid(format!(
                "memory_mb must be at least {MIN_VM_MEMORY_MB} for a {} sandbox (its guest \
                 runs a kernel of its own), got {}",
                self.machine.backend(),
                req.memory_mb
            )));
        }
        let host = &self.host;
        let image = host.images.resolve(&req.image).await?;
        // CPUs the edge checked to a small positive number; `as` from f64 saturates.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let vcpus = req.cpus.ceil().max(1.0) as u32;
        let hardware = Hardware {
            machine: self.machine,
            accel: host.accel().await?,
            vcpus,
            memory_mb: req.memory_mb,
        };
        if image.disk.is_some() {
            return self.create_from_disk(req, image, hardware).await;
        }
        let assets = host.assets().await?;
        let held = host.images.blobs(&image)?;
        // In use before it is read: pruning must not take it in between.
        let in_use = image
            .guest
            .as_ref()
            .map(|guest| SavedInUse::new(host, &guest.saved));
        let saved = match &image.guest {
            Some(guest) => Some(self.saved_guest(&image.name, guest, &hardware, req.disk_mb)?),
            None => None,
        };
        let ((image_disks, base_fs), scratch_base) = match &saved {
            Some((_, guest)) => (
                (guest.image_disks.clone(), guest.base_fs),
                host.scratch_base(req.disk_mb).await?,
            ),
            None => tokio::try_join!(
                host.image_disks(&image, &held),
                host.scratch_base(req.disk_mb)
            )?,
        };
        let base_disks = Disks {
            image: image_disks,
            base_fs,
            scratch: scratch_base.clone(),
        };
        let dir = host.dir.join("sandboxes").join(&req.id);
        std::fs::create_dir_all(&dir)
            .map_err(|e| ApiError::internal(format!("creating {}: {e}", dir.display())))?;
        let disks = Disks {
            scratch: dir.join("scratch.qcow2"),
            ..base_disks.clone()
        };
        // The address and the nftables rules are set up while the disk is prepared.
        let reserve = async {
            match req.network.is_off() {
                true => Ok(None),
                false => self.net.reserve(&req.network).await.map(Some),
            }
        };
        let prepare = async {
            // The saved guest's memory and state files, which the restore borrows.
            Ok::<_, ApiError>(match (&saved, host.config.boot) {
                (Some((saved_dir, guest)), _) => {
                    let (saved_scratch, _, _) = template_files(saved_dir);
                    let target = disks.scratch.clone();
                    tokio::task::spawn_blocking(move || {
                        disk::create_overlay(&saved_scratch, "qcow2", &target)
                    })
                    .await
                    .map_err(blocking_error)?
                    .map_err(vm_error)?;
                    (Some(saved_dir.clone()), guest.first_request)
                }
                (None, BootMode::Snapshot) => {
                    let key = TemplateKey {
                        image_id: image.id.clone(),
                        hardware: hardware.clone(),
                        disk_mb: req.disk_mb,
                    };
                    let template_dir = host.template(key, &assets, base_disks.clone()).await?;
                    let (template_scratch, _, _) = template_files(&template_dir);
                    let target = disks.scratch.clone();
                    tokio::task::spawn_blocking(move || std::fs::copy(template_scratch, target))
                        .await
                        .map_err(blocking_error)?
                        .map_err(|e| {
                            ApiError::internal(format!("copying the template's scratch disk: {e}"))
                        })?;
                    (Some(template_dir), 1)
                }
                (None, BootMode::Cold) => {
                    create_scratch(&scratch_base, &disks.scratch).await?;
                    (None, 0)
                }
            })
        };
        let (prepared, attachment) = tokio::join!(prepare, reserve);
        let (prepared, attachment) = match (prepared, attachment) {
            (Ok(p), Ok(a)) => (p, a),
            (p, a) => {
                let _ = std::fs::remove_dir_all(&dir);
                let net_failed = match a {
                    Ok(Some(a)) => {
                        a.release().await;
                        None
                    }
                    Ok(None) => None,
                    Err(e) => Some(ApiError::from(e)),
                };
                return Err(net_failed.or(p.err()).expect("one of the two failed"));
            }
        };
        let identity = GuestIdentity {
            hostname: &req.id,
            pids_max: req.pids,
            network: attachment.as_ref().map(Attachment::ip),
        };
        let started = async {
            let (template_dir, first_request) = prepared;
            let files = template_dir.as_deref().map(template_files);
            let start = match &files {
                Some((_, memory, state)) => Start::Restore(
                    identity,
                    TemplateFiles {
                        memory,
                        state,
                        first_request,
                    },
                ),
                None => Start::Cold(identity),
            };
            let vm = Vm::start(&hardware, &assets, Some(&disks), start, &dir, None)
                .await
                .map_err(vm_error)?;
            let plugged = match &attachment {
                Some(a) => plug(&vm, a, req.ca_bundle).await,
                None => Ok(()),
            };
            if let Err(e) = plugged.and_then(|()| write_record(&dir, &vm)) {
                vm.kill().await;
                return Err(e);
            }
            Ok(vm)
        };
        let vm = match started.await {
            Ok(vm) => vm,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                if let Some(a) = attachment {
                    a.release().await;
                }
                return Err(e);
            }
        };
        Ok(self.running(
            req,
            Running {
                vm,
                layers: held,
                dir,
                image,
                hardware,
                disks,
                restored_from: in_use,
                attachment,
            },
        ))
    }
}

impl VmBackend {
    /// The sandbox a create has just started, as the edge takes it.
    fn running(&self, req: SandboxRequest, started: Running) -> Created {
        let defaults = ImageDefaults {
            env: started.image.config.env.clone(),
            workdir: started.image.config.workdir.clone(),
        };
        Created {
            sandbox: Box::new(VmSandbox {
                _layers: started.layers,
                vm: std::sync::RwLock::new(Some(Arc::new(started.vm))),
                on_disk: tokio::sync::Mutex::new(None),
                saved_to_disk: AtomicBool::new(false),
                id: req.id,
                pids: req.pids,
                guest_usage: Arc::default(),
                dir: started.dir,
                host: Arc::clone(&self.host),
                image: started.image,
                hardware: started.hardware,
                disks: started.disks,
                disk_mb: req.disk_mb,
                _restored_from: started.restored_from,
                net: Arc::clone(&self.net),
                attachment: tokio::sync::Mutex::new(started.attachment),
                policy: Mutex::new(req.network),
                ca_bundle: req.ca_bundle,
            }),
            image: defaults,
        }
    }
}

/// What a create started: [`VmBackend::running`] makes a sandbox of it.
struct Running {
    vm: Vm,
    layers: HeldBlobs,
    dir: PathBuf,
    image: Image,
    hardware: Hardware,
    disks: Disks,
    restored_from: Option<SavedInUse>,
    attachment: Option<Attachment>,
}

struct VmSandbox {
    /// Its image's layers, held for as long as it runs (its disk may be one of them).
    _layers: HeldBlobs,
    /// Its QEMU: none while it is saved to disk (or could not be restored from it), a
    /// new one after.
    vm: std::sync::RwLock<Option<Arc<Vm>>>,
    /// The paused guest saved to disk, with no QEMU ([`PauseMode::Save`]); the lock
    /// orders pauses and resumes.
    on_disk: tokio::sync::Mutex<Option<OnDisk>>,
    /// The same, for the synchronous checks ([`Sandbox::is_alive`]).
    saved_to_disk: AtomicBool,
    id: String,
    pids: u64,
    /// What the guest's agent last said its commands use.
    guest_usage: Arc<GuestUsageCache>,
    dir: PathBuf,
    host: Arc<VmHost>,
    /// What it was started from (a snapshot of it stacks the same layers).
    image: Image,
    hardware: Hardware,
    disks: Disks,
    disk_mb: u64,
    /// The saved guest it was restored from, if any.
    _restored_from: Option<SavedInUse>,
    net: Arc<Networking>,
    /// Its place on the network; `None` while it has never had one. Locked after
    /// `on_disk` where both are.
    attachment: tokio::sync::Mutex<Option<Attachment>>,
    /// Its egress policy, as last set (kept with it, [`Kept`]).
    policy: Mutex<Policy>,
    /// Whether a network given later brings the host's CA bundle.
    ca_bundle: bool,
}

/// How a guest saved to disk goes on when it is restored.
enum OnDisk {
    /// Saved by this server: on the channel it had, exactly where it stopped.
    Held(qemu::Resumed),
    /// Kept by an earlier run of the server, whose channel is gone: on a new one, whose
    /// requests start at `first_request` (past any the guest saw).
    Adopted { first_request: u32 },
}

/// How old the guest's usage may be before a read asks the guest again.
const GUEST_USAGE_AGE: std::time::Duration = std::time::Duration::from_secs(1);

/// The guest's last usage report, refreshed in the background: usage is read without
/// waiting (the sampler and `info()` ask often), and a guest is asked at most once per
/// [`GUEST_USAGE_AGE`], only while someone reads it.
#[derive(Default)]
struct GuestUsageCache {
    last: Mutex<Option<(std::time::Instant, dsec_runtime::proto::GuestUsage)>>,
    asking: AtomicBool,
}

impl GuestUsageCache {
    /// The last report (none yet: `None`), asking `channel` for a new one if it is old.
    fn latest(
        self: &Arc<Self>,
        channel: &dsec_runtime::channel::Channel,
    ) -> Option<dsec_runtime::proto::GuestUsage> {
        let last = self.last.lock().expect("lock").clone();
        let stale = last
            .as_ref()
            .is_none_or(|(at, _)| at.elapsed() >= GUEST_USAGE_AGE);
        if stale && !self.asking.swap(true, Ordering::AcqRel) {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let (cache, channel) = (Arc::clone(self), channel.clone());
                runtime.spawn(async move {
                    if let Ok(usage) = channel.guest_usage().await {
                        *cache.last.lock().expect("lock") =
                            Some((std::time::Instant::now(), usage));
                    }
                    cache.asking.store(false, Ordering::Release);
                });
            } else {
                self.asking.store(false, Ordering::Release);
            }
        }
        last.map(|(_, usage)| usage)
    }
}

impl VmSandbox {
    /// Its QEMU; none while the guest is on disk (requests resume it first) or after it
    /// could not be restored (the sandbox has failed).
    fn vm(&self) -> Result<Arc<Vm>, ApiError> {
        self.vm.read().expect("lock").clone().ok_or_else(|| {
            ApiError::sandbox_failed(format!(
                "sandbox {} has no running guest (it could not be restored from disk)",
                self.id
            ))
        })
    }

    /// The record that makes the paused guest outlive the server.
    fn kept_file(&self) -> PathBuf {
        self.dir.join("paused").join("kept.json")
    }

    /// What its guest is told: its name, limits and address on `attachment`.
    fn identity(&self, attachment: Option<&Attachment>) -> GuestIdentity<'_> {
        GuestIdentity {
            hostname: &self.id,
            pids_max: self.pids,
            network: attachment.map(Attachment::ip),
        }
    }

    /// Where a guest paused to disk is kept: its memory and device state (its disk stays
    /// the sandbox's own scratch disk).
    fn paused_files(&self) -> (PathBuf, PathBuf) {
        let (_, memory, state) = template_files(&self.dir.join("paused"));
        (memory, state)
    }

    /// Saves the paused guest `vm` to disk and ends its QEMU: a receiving QEMU takes its
    /// RAM into a file and saves its devices, as for a snapshot, over the same scratch
    /// disk (which QEMU hands over between the two as a migration's shared storage).
    async fn save_to_disk(&self, vm: &Vm) -> Result<OnDisk, ApiError> {
        let dir = self.dir.join("paused");
        std::fs::create_dir_all(&dir)
            .map_err(|e| ApiError::internal(format!("creating {}: {e}", dir.display())))?;
        let (memory, state) = self.paused_files();
        for file in [&memory, &state] {
            let _ = std::fs::remove_file(file);
        }
        self.save_through_receiver(vm, &self.disks, &dir, &memory, &state, false)
            .await?;
        let hold = vm
            .take_hold()
            .await
            .ok_or_else(|| ApiError::internal("a guest saved to disk without its channel held"))?;
        // Its channel outlives it: the guest goes on over the next QEMU's.
        vm.channel().suspend();
        self.saved_to_disk.store(true, Ordering::SeqCst);
        // Its veth goes with this QEMU's namespace: the next QEMU's is plugged anew.
        if let Some(a) = self.attachment.lock().await.as_ref() {
            a.unplug().await;
        }
        vm.kill().await;
        Ok(OnDisk::Held(qemu::Resumed {
            channel: vm.channel().clone(),
            hold,
        }))
    }

    /// Moves the paused guest `vm` into a receiving QEMU over `disks` that keeps its RAM
    /// in `memory` (mapped shared), then has it save the devices to `state` as a boot
    /// template is saved; the receiver's logs go in `dir`. `vm` stays paused. A `durable`
    /// save (to be synced after) has `memory` written to disk as it comes in.
    async fn save_through_receiver(
        &self,
        vm: &Vm,
        disks: &Disks,
        dir: &Path,
        memory: &Path,
        state: &Path,
        durable: bool,
    ) -> Result<(), ApiError> {
        let assets = self.host.assets().await?;
        let files = TemplateFiles {
            memory,
            state,
            first_request: 0,
        };
        let receiver = Vm::start(
            &self.hardware,
            &assets,
            Some(disks),
            Start::Receive(files),
            dir,
            None,
        )
        .await
        .map_err(vm_error)?;
        let moved = async {
            tokio::select! {
                sent = vm.send_state(&receiver) => sent?,
                () = write_back(memory), if durable => unreachable!("write_back never ends"),
            }
            receiver.save_template(state).await
        }
        .await;
        receiver.kill().await;
        moved.map_err(vm_error)
    }

    /// Starts a QEMU for the guest saved by [`VmSandbox::save_to_disk`]: on the channel
    /// it had, or on a new one if an earlier run of the server kept it.
    async fn restore_from_disk(&self, saved: OnDisk) -> Result<Vm, ApiError> {
        // Running on from here, the guest's files no longer describe it: a server that
        // restarts from now on must not restore them.
        match std::fs::remove_file(self.kept_file()) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(ApiError::internal(format!(
                    "removing {}: {e}",
                    self.kept_file().display()
                )))
            }
        }
        let assets = self.host.assets().await?;
        let (memory, state) = self.paused_files();
        let attachment = self.attachment.lock().await;
        let identity = self.identity(attachment.as_ref());
        let files = |first_request| TemplateFiles {
            memory: &memory,
            state: &state,
            first_request,
        };
        let (start, adopted) = match saved {
            OnDisk::Held(resumed) => (Start::Resume(identity, files(0), resumed), false),
            OnDisk::Adopted { first_request } => {
                (Start::Restore(identity, files(first_request)), true)
            }
        };
        let vm = Vm::start(
            &self.hardware,
            &assets,
            Some(&self.disks),
            start,
            &self.dir,
            None,
        )
        .await
        .map_err(vm_error)?;
        match attachment.as_ref() {
            // This server's bridge and resolver may not be the earlier run's.
            Some(a) if adopted => plug(&vm, a, self.ca_bundle).await?,
            Some(a) => a.plug(vm.netns().map_err(vm_error)?).await?,
            None => {}
        }
        write_record(&self.dir, &vm)?;
        // The new QEMU maps them: unlinked, they stay its until it exits, and the next
        // pause writes new ones.
        for file in [&memory, &state] {
            let _ = std::fs::remove_file(file);
        }
        Ok(vm)
    }

    /// Saves the paused guest as image `name`: its disk, then its memory and devices,
    /// moved into a receiving QEMU that keeps the RAM in a file and saves the rest as a
    /// boot template is saved (see [`dsec_vm::qemu`]). Guests restored from it map that
    /// file copy-on-write, as they map a template's.
    async fn save_guest(
        &self,
        saved: &str,
        name: &str,
        project: Option<&str>,
    ) -> Result<ImageInfo, ApiError> {
        let host = &self.host;
        let dir = saved_dir(&host.dir, saved);
        std::fs::create_dir_all(&dir)
            .map_err(|e| ApiError::internal(format!("creating {}: {e}", dir.display())))?;
        let (scratch, memory, state) = template_files(&dir);
        // Paused: its disk is flushed and stays as it is.
        let (disk, base, target) = (
            self.disks.scratch.clone(),
            host.scratch_base(self.disk_mb).await?,
            scratch.clone(),
        );
        tokio::task::spawn_blocking(move || disk::copy_onto_base(&disk, &base, &target))
            .await
            .map_err(blocking_error)?
            .map_err(vm_error)?;
        let disks = Disks {
            scratch: scratch.clone(),
            ..self.disks.clone()
        };
        let vm = self.vm()?;
        self.save_through_receiver(&vm, &disks, &dir, &memory, &state, true)
            .await?;
        let record = SavedGuest {
            first_request: first_unseen(vm.channel()),
            image_disks: self.disks.image.clone(),
            base_fs: self.disks.base_fs,
            format: TEMPLATE_FORMAT,
        };
        let written = dir.clone();
        tokio::task::spawn_blocking(move || {
            let dir = written;
            for log in ["console.log", "qemu.log"] {
                let _ = std::fs::remove_file(dir.join(log));
            }
            let (scratch, memory, state) = template_files(&dir);
            for file in [scratch, memory, state] {
                std::fs::File::open(&file)
                    .and_then(|f| f.sync_all())
                    .map_err(|e| format!("syncing {}: {e}", file.display()))?;
            }
            let tmp = dir.join("guest.json.tmp");
            std::fs::write(
                &tmp,
                serde_json::to_vec(&record).expect("record serializes"),
            )
            .and_then(|()| std::fs::File::open(&tmp)?.sync_all())
            .and_then(|()| std::fs::rename(&tmp, dir.join("guest.json")))
            .map_err(|e| format!("writing {}: {e}", tmp.display()))
        })
        .await
        .map_err(blocking_error)?
        .map_err(ApiError::internal)?;
        let guest = GuestSnapshot {
            backend: self.hardware.machine.backend().to_owned(),
            edge: host.images.edge().to_owned(),
            vcpus: self.hardware.vcpus,
            memory_mb: self.hardware.memory_mb,
            disk_mb: self.disk_mb,
            saved: saved.to_owned(),
        };
        let image = host
            .images
            .record_guest(&self.image, name, project, guest)?;
        Ok(super::image_info(&host.images, image))
    }
}

/// How often a snapshot's memory file is pushed towards the disk while it comes in.
const WRITE_BACK_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// Starts writing `memory`'s dirty pages to disk every [`WRITE_BACK_EVERY`], until
/// dropped: the sync once the snapshot is whole then finds most of the file written,
/// where it would write all of it after the copy (0.3–1.1 s of a snapshot, measured here).
async fn write_back(memory: &Path) {
    let Ok(file) = std::fs::File::open(memory) else {
        return std::future::pending().await;
    };
    let file = Arc::new(file);
    loop {
        tokio::time::sleep(WRITE_BACK_EVERY).await;
        let file = Arc::clone(&file);
        let _ = tokio::task::spawn_blocking(move || {
            // SAFETY: sync_file_range(2) on a descriptor `file` holds open, integer
            // arguments only; it starts writes and waits for none.
            unsafe {
                libc::sync_file_range(
                    std::os::fd::AsRawFd::as_raw_fd(&*file),
                    0,
                    0,
                    libc::SYNC_FILE_RANGE_WRITE,
                )
            }
        })
        .await;
    }
}

/// A request id past every one `channel`'s guest has seen, far enough that none of the
/// output it may still be writing holds it by chance: where a guest restored from a save
/// on a new channel starts (see [`qemu::Start::Restore`]).
fn first_unseen(channel: &dsec_runtime::channel::Channel) -> u32 {
    channel
        .next_id()
        .wrapping_add(rand::random_range(1 << 16..1 << 24))
}

/// The output of a command in a guest.
struct VmOutput {
    handle: ExecHandle,
}

#[async_trait]
impl OutputStream for VmOutput {
    async fn next(&mut self) -> Option<Result<Output, ApiError>> {
        let event = self.handle.next().await?;
        Some(match event {
            Ok(ExecEvent::Stdout(data)) => Ok(Output::Stdout(data)),
            Ok(ExecEvent::Stderr(data)) => Ok(Output::Stderr(data)),
            Ok(ExecEvent::Exit(exit)) => Ok(Output::Exit(super::exec_exit_status(
                &exit,
                exit.oom_killed,
            ))),
            Ok(ExecEvent::StepExit(_) | ExecEvent::Fetched { .. } | ExecEvent::Started(_)) => {
                Err(super::not_plain())
            }
            Err(e) => Err(e.into()),
        })
    }
}

#[async_trait]
impl Sandbox for VmSandbox {
    async fn exec(&self, cmd: CommandSpec) -> Result<Box<dyn OutputStream>, ApiError> {
        for f in cmd.files {
            write_served(self.vm()?.channel(), &f.path, f.mode, Upload::whole(f.data)).await?;
        }
        let spec = ExecSpec {
            argv: cmd.argv,
            env: cmd.env,
            cwd: cmd.cwd,
            timeout_ms: Some(cmd.timeout_ms),
            max_output_bytes: cmd.max_output_bytes,
            run_as: cmd.run_as,
            ..ExecSpec::default()
        };
        let handle = self.vm()?.channel().exec(&spec, &cmd.stdin, &[]).await?;
        Ok(Box::new(VmOutput { handle }))
    }

    async fn read_file(&self, path: &str, max_bytes: u64) -> Result<Box<dyn FileRead>, ApiError> {
        read_served(self.vm()?.channel(), path, max_bytes).await
    }

    async fn spawn(&self, spec: ProcessSpec) -> Result<Spawned, ApiError> {
        super::spawn_served(self.vm()?.channel(), spec).await
    }

    async fn write_file(&self, path: &str, mode: u32, data: Upload) -> Result<(), ApiError> {
        write_served(self.vm()?.channel(), path, mode, data).await
    }

    async fn list_files(&self, path: &str, depth: u32) -> Result<Vec<FileInfo>, ApiError> {
        list_served(self.vm()?.channel(), path, depth).await
    }

    async fn stat(&self, path: &str) -> Result<FileInfo, ApiError> {
        Ok(file_info(self.vm()?.channel().stat(path).await?))
    }

    async fn make_dir(&self, req: &MakeDir) -> Result<bool, ApiError> {
        Ok(self.vm()?.channel().make_dir(req).await?)
    }

    async fn move_path(&self, req: &MovePath) -> Result<(), ApiError> {
        Ok(self.vm()?.channel().move_path(req).await?)
    }

    async fn remove_path(&self, req: &RemovePath) -> Result<(), ApiError> {
        Ok(self.vm()?.channel().remove_path(req).await?)
    }

    async fn watch(&self, path: &str, recursive: bool) -> Result<Box<dyn FileWatch>, ApiError> {
        watch_served(self.vm()?.channel(), path, recursive).await
    }

    async fn pause(&self) -> Result<(), ApiError> {
        let mut on_disk = self.on_disk.lock().await;
        if on_disk.is_some() {
            return Ok(());
        }
        let vm = self.vm()?;
        vm.pause().await.map_err(vm_error)?;
        // A bootable disk's guest is paused in memory only (see `bootdisk`).
        if self.host.config.pause == PauseMode::Save && self.image.disk.is_none() {
            // Paused in memory if it cannot be saved: still a pause.
            match self.save_to_disk(&vm).await {
                Ok(saved) => {
                    *on_disk = Some(saved);
                    *self.vm.write().expect("lock") = None;
                }
                Err(e) => {
                    tracing::warn!(sandbox = %self.id, error = %e, "cannot save a paused guest to disk; it stays paused in memory")
                }
            }
        }
        Ok(())
    }

    async fn keep(&self, edge: &serde_json::Value) -> Result<bool, ApiError> {
        let on_disk = self.on_disk.lock().await;
        let first_request = match on_disk.as_ref() {
            None => return Ok(false),
            Some(OnDisk::Held(resumed)) => first_unseen(&resumed.channel),
            Some(OnDisk::Adopted { first_request }) => *first_request,
        };
        let address = self.attachment.lock().await.as_ref().map(Attachment::ip);
        let kept = Kept {
            backend: self.hardware.machine.backend().to_owned(),
            accel: self.hardware.accel.name().to_owned(),
            vcpus: self.hardware.vcpus,
            memory_mb: self.hardware.memory_mb,
            disk_mb: self.disk_mb,
            pids: self.pids,
            image: self.image.clone(),
            image_disks: self.disks.image.clone(),
            base_fs: self.disks.base_fs,
            restored_from: self._restored_from.as_ref().map(|r| r.saved.clone()),
            network: self.policy.lock().expect("lock").clone(),
            address,
            ca_bundle: self.ca_bundle,
            first_request,
            format: TEMPLATE_FORMAT,
            edge: edge.clone(),
        };
        let (dir, scratch) = (self.dir.join("paused"), self.disks.scratch.clone());
        tokio::task::spawn_blocking(move || write_kept(&dir, &scratch, &kept))
            .await
            .map_err(blocking_error)?
            .map_err(ApiError::internal)?;
        Ok(true)
    }

    async fn resume(&self) -> Result<(), ApiError> {
        let mut on_disk = self.on_disk.lock().await;
        let Some(saved) = on_disk.take() else {
            return self.vm()?.resume().await.map_err(vm_error);
        };
        let vm = self.restore_from_disk(saved).await;
        // Restored or not, it is no longer a saved guest: one that cannot come back has
        // failed (its old QEMU is gone), and the reaper says so.
        self.saved_to_disk.store(false, Ordering::SeqCst);
        *self.vm.write().expect("lock") = Some(Arc::new(vm?));
        Ok(())
    }

    async fn snapshot(&self, name: &str, project: Option<&str>) -> Result<ImageInfo, ApiError> {
        if self.image.disk.is_some() {
            return Err(bootdisk::unsupported("a snapshot or fork"));
        }
        let mut on_disk = self.on_disk.lock().await;
        if let Some(saved) = on_disk.take() {
            // Saved from memory, not from its pause files: back in a QEMU, paused again.
            let vm = self.restore_from_disk(saved).await;
            self.saved_to_disk.store(false, Ordering::SeqCst);
            let vm = Arc::new(vm?);
            *self.vm.write().expect("lock") = Some(Arc::clone(&vm));
            vm.pause().await.map_err(vm_error)?;
        }
        let saved = format!("{:016x}", rand::random::<u64>());
        let _saving = SavedInUse::new(&self.host, &saved);
        let result = self.save_guest(&saved, name, project).await;
        if result.is_err() {
            let _ = std::fs::remove_dir_all(saved_dir(&self.host.dir, &saved));
        }
        result
    }

    fn usage(&self) -> Usage {
        // Saved to disk: it holds no memory and runs nothing.
        let Ok(vm) = self.vm() else {
            return Usage::default();
        };
        let pid = vm.pid();
        let cpu_ms = Stat::read(pid).map_or(0.0, |s| s.cpu_ms());
        let guest = self.guest_usage.latest(vm.channel());
        let g = guest.clone().unwrap_or_default();
        // Unknown for this sample while a network change holds the attachment.
        let traffic = self
            .attachment
            .try_lock()
            .ok()
            .and_then(|a| a.as_ref()?.traffic());
        Usage {
            // What this guest holds alone: the pages it wrote, QEMU's heap, the
            // translator's code. The template's pages it only reads, and QEMU's binary,
            // are shared with other guests (VmRSS would count them in each).
            memory_bytes: procfs::status_bytes(pid, "RssAnon").unwrap_or(0),
            cpu_ms,
            // The rest as the guest counts it.
            pids: g.pids,
            memory_peak_bytes: g.memory_peak_bytes,
            pids_limit_hits: g.pids_limit_hits,
            oom_kills: g.oom_kills,
            disk_bytes: guest.as_ref().map(|g| g.disk_bytes),
            disk_inodes: guest.as_ref().map(|g| g.disk_inodes),
            network_rx_bytes: traffic.map(|t| t.rx_bytes),
            network_tx_bytes: traffic.map(|t| t.tx_bytes),
            ..Usage::default()
        }
    }

    fn replaced_image_files(&self, dirs: &[&str]) -> Vec<String> {
        // The guest's agent reads its own overlay (the host cannot read the guest's
        // disk), with each usage report.
        let last = self.guest_usage.last.lock().expect("lock").clone();
        last.map(|(_, usage)| usage.replaced)
            .unwrap_or_default()
            .into_iter()
            .filter(|path| {
                // The guest names these: at most a path's length each.
                path.len() <= 4096
                    && dirs.iter().any(|d| {
                        path.strip_prefix(d.trim_end_matches('/'))
                            .is_some_and(|rest| rest.starts_with('/'))
                    })
            })
            .collect()
    }

    fn is_alive(&self) -> bool {
        match self.vm() {
            Ok(vm) => vm.is_alive(),
            Err(_) => self.saved_to_disk.load(Ordering::SeqCst),
        }
    }

    async fn failure(&self) -> Failure {
        let Ok(vm) = self.vm() else {
            return Failure {
                cause: "restore",
                detail: "its guest could not be restored from disk".to_owned(),
            };
        };
        // The agent's channel closes as QEMU exits: give the exit a moment to be reaped.
        let mut exited = vm.exited();
        let _ =
            tokio::time::timeout(std::time::Duration::from_secs(1), exited.wait_for(|e| *e)).await;
        let (cause, how) = match vm.exit_status() {
            Some(status) => match status.signal() {
                Some(signal) => ("signal", format!("QEMU was killed by signal {signal}")),
                None => ("exit", format!("QEMU exited ({status})")),
            },
            None => ("unknown", "its guest agent's channel closed".to_owned()),
        };
        let console = console_tail(vm.console());
        let detail = if console.is_empty() {
            how
        } else {
            format!("{how}; the guest console ends: {console}")
        };
        Failure { cause, detail }
    }

    fn accelerator(&self) -> Option<&'static str> {
        Some(self.hardware.accel.name())
    }

    async fn set_network(&self, policy: Policy) -> Result<(), ApiError> {
        let on_disk = self.on_disk.lock().await;
        let mut attachment = self.attachment.lock().await;
        match &*attachment {
            Some(a) => a.set_policy(&policy).await?,
            None if policy.is_off() => {}
            None if self.image.disk.is_some() => return Err(bootdisk::unsupported("a network")),
            None if on_disk.is_some() => {
                return Err(ApiError::unavailable(
                    "this sandbox is paused and saved to disk: resume it before giving it a \
                 network",
                ))
            }
            None => {
                let a = self.net.reserve(&policy).await?;
                let given = async {
                    let vm = self.vm()?;
                    plug(&vm, &a, self.ca_bundle).await?;
                    vm.identify(self.identity(Some(&a))).await.map_err(vm_error)
                };
                if let Err(e) = given.await {
                    a.release().await;
                    return Err(e);
                }
                *attachment = Some(a);
            }
        }
        *self.policy.lock().expect("lock") = policy;
        Ok(())
    }

    async fn network_refused(&self) -> Vec<dsec_net::Refused> {
        self.attachment
            .lock()
            .await
            .as_ref()
            .map(Attachment::refused)
            .unwrap_or_default()
    }

    async fn stop(&self) {
        if let Ok(vm) = self.vm() {
            vm.kill().await;
        }
        if let Some(a) = self.attachment.lock().await.take() {
            a.release().await;
        }
        let dir = self.dir.clone();
        let _ = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(dir)).await;
    }
}
