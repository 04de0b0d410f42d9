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
//! Everything a VM makes lives in `<state>/vm/sandboxes/<id>/` (scratch disk, console
//! log, a record naming its QEMU) and goes at stop; a restarted server kills the QEMUs
//! its records name (checking each one's start time, so a recycled pid is never hit)
//! and removes the directories.

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use dsec_api::{FileInfo, Usage};
use dsec_image::{HeldBlobs, Image, ImageStore};
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
    Backend, CommandSpec, Created, Failure, FileRead, ImageDefaults, Output, OutputStream,
    ProcessSpec, Sandbox, SandboxRequest, Spawned, Upload,
};
use crate::error::ApiError;

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
}

/// The layout of a boot template's directory; part of its name, so that templates an
/// older dsec saved differently are never restored (and are removed at start).
const TEMPLATE_FORMAT: u32 = 2;

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
}

/// What `<state>/vm/sandboxes/<id>/record.json` holds, for cleanup after a crash.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    qemu_pid: i32,
    /// `/proc/<pid>/stat` start time of that QEMU: a recycled pid has another.
    start_ticks: u64,
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
    /// (`live`: the ids of those that do); returns the bytes freed.
    pub fn prune_images(&self, live: &HashSet<String>) -> u64 {
        let mut freed = 0;
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
            if name.contains(".tmp-") || live.contains(&id) {
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
    /// process), sandbox directories, half-built templates and temporary files.
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
}

impl VmBackend {
    /// The backend running `machine`s on `host`.
    pub fn new(host: Arc<VmHost>, machine: Machine) -> VmBackend {
        VmBackend { host, machine }
    }
}

#[async_trait]
impl Backend for VmBackend {
    fn host_tasks(&self, _pids: u64) -> u64 {
        crate::admission::VM_HOST_TASKS
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
        let assets = host.assets().await?;
        // CPUs the edge checked to a small positive number; `as` from f64 saturates.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let vcpus = req.cpus.ceil().max(1.0) as u32;
        let hardware = Hardware {
            machine: self.machine,
            accel: host.accel().await?,
            vcpus,
            memory_mb: req.memory_mb,
        };
        let held = host.images.blobs(&image)?;
        let ((image_disks, base_fs), scratch_base) = tokio::try_join!(
            host.image_disks(&image, &held),
            host.scratch_base(req.disk_mb)
        )?;
        let template_disks = Disks {
            image: image_disks,
            base_fs,
            scratch: scratch_base.clone(),
        };
        let dir = host.dir.join("sandboxes").join(&req.id);
        std::fs::create_dir_all(&dir)
            .map_err(|e| ApiError::internal(format!("creating {}: {e}", dir.display())))?;
        let scratch = dir.join("scratch.qcow2");
        let identity = GuestIdentity {
            hostname: &req.id,
            pids_max: req.pids,
        };
        let started = async {
            // The template's memory and state files, which the restore borrows.
            let template_paths: (PathBuf, PathBuf);
            let start = match host.config.boot {
                BootMode::Snapshot => {
                    let key = TemplateKey {
                        image_id: image.id.clone(),
                        hardware: hardware.clone(),
                        disk_mb: req.disk_mb,
                    };
                    let template_dir = host.template(key, &assets, template_disks.clone()).await?;
                    let (template_scratch, _, _) = template_files(&template_dir);
                    let target = scratch.clone();
                    tokio::task::spawn_blocking(move || std::fs::copy(template_scratch, target))
                        .await
                        .map_err(blocking_error)?
                        .map_err(|e| {
                            ApiError::internal(format!("copying the template's scratch disk: {e}"))
                        })?;
                    let (_, memory, state) = template_files(&template_dir);
                    template_paths = (memory, state);
                    Start::Restore(
                        identity,
                        TemplateFiles {
                            memory: &template_paths.0,
                            state: &template_paths.1,
                        },
                    )
                }
                BootMode::Cold => {
                    create_scratch(&scratch_base, &scratch).await?;
                    Start::Cold(identity)
                }
            };
            let disks = Disks {
                scratch: scratch.clone(),
                ..template_disks.clone()
            };
            let vm = Vm::start(&hardware, &assets, Some(&disks), start, &dir, None)
                .await
                .map_err(vm_error)?;
            let record = Record {
                qemu_pid: vm.pid(),
                start_ticks: Stat::read(vm.pid()).map_or(0, |s| s.start_ticks),
            };
            if let Err(e) = std::fs::write(
                dir.join("record.json"),
                serde_json::to_vec(&record).expect("record serializes"),
            ) {
                vm.kill().await;
                return Err(ApiError::internal(format!(
                    "writing the sandbox record: {e}"
                )));
            }
            Ok(vm)
        };
        let vm = match started.await {
            Ok(vm) => vm,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        Ok(Created {
            sandbox: Box::new(VmSandbox {
                _layers: held,
                vm: Arc::new(vm),
                dir,
                accel: hardware.accel,
            }),
            image: ImageDefaults {
                env: image.config.env,
                workdir: image.config.workdir,
            },
        })
    }
}

struct VmSandbox {
    /// Its image's layers, held for as long as it runs (its disk may be one of them).
    _layers: HeldBlobs,
    vm: Arc<Vm>,
    dir: PathBuf,
    accel: Accel,
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
            write_served(self.vm.channel(), &f.path, f.mode, Upload::whole(f.data)).await?;
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
        let handle = self.vm.channel().exec(&spec, &cmd.stdin, &[]).await?;
        Ok(Box::new(VmOutput { handle }))
    }

    async fn read_file(&self, path: &str, max_bytes: u64) -> Result<Box<dyn FileRead>, ApiError> {
        read_served(self.vm.channel(), path, max_bytes).await
    }

    async fn spawn(&self, spec: ProcessSpec) -> Result<Spawned, ApiError> {
        super::spawn_served(self.vm.channel(), spec).await
    }

    async fn write_file(&self, path: &str, mode: u32, data: Upload) -> Result<(), ApiError> {
        write_served(self.vm.channel(), path, mode, data).await
    }

    async fn list_files(&self, path: &str, depth: u32) -> Result<Vec<FileInfo>, ApiError> {
        list_served(self.vm.channel(), path, depth).await
    }

    async fn stat(&self, path: &str) -> Result<FileInfo, ApiError> {
        Ok(file_info(self.vm.channel().stat(path).await?))
    }

    async fn make_dir(&self, req: &MakeDir) -> Result<bool, ApiError> {
        Ok(self.vm.channel().make_dir(req).await?)
    }

    async fn move_path(&self, req: &MovePath) -> Result<(), ApiError> {
        Ok(self.vm.channel().move_path(req).await?)
    }

    async fn remove_path(&self, req: &RemovePath) -> Result<(), ApiError> {
        Ok(self.vm.channel().remove_path(req).await?)
    }

    async fn watch(&self, path: &str, recursive: bool) -> Result<Box<dyn FileWatch>, ApiError> {
        watch_served(self.vm.channel(), path, recursive).await
    }

    async fn pause(&self) -> Result<(), ApiError> {
        self.vm.pause().await.map_err(vm_error)
    }

    async fn resume(&self) -> Result<(), ApiError> {
        self.vm.resume().await.map_err(vm_error)
    }

    fn usage(&self) -> Usage {
        let pid = self.vm.pid();
        let cpu_ms = Stat::read(pid).map_or(0.0, |s| s.cpu_ms());
        Usage {
            // What this guest holds alone: the pages it wrote, QEMU's heap, the
            // translator's code. The template's pages it only reads, and QEMU's binary,
            // are shared with other guests (VmRSS would count them in each).
            memory_bytes: procfs::status_bytes(pid, "RssAnon").unwrap_or(0),
            pids: 0,
            cpu_ms,
            ..Usage::default()
        }
    }

    fn is_alive(&self) -> bool {
        self.vm.is_alive()
    }

    async fn failure(&self) -> Failure {
        // The agent's channel closes as QEMU exits: give the exit a moment to be reaped.
        let mut exited = self.vm.exited();
        let _ =
            tokio::time::timeout(std::time::Duration::from_secs(1), exited.wait_for(|e| *e)).await;
        let (cause, how) = match self.vm.exit_status() {
            Some(status) => match status.signal() {
                Some(signal) => ("signal", format!("QEMU was killed by signal {signal}")),
                None => ("exit", format!("QEMU exited ({status})")),
            },
            None => ("unknown", "its guest agent's channel closed".to_owned()),
        };
        let console = console_tail(self.vm.console());
        let detail = if console.is_empty() {
            how
        } else {
            format!("{how}; the guest console ends: {console}")
        };
        Failure { cause, detail }
    }

    fn accelerator(&self) -> Option<&'static str> {
        Some(self.accel.name())
    }

    async fn stop(&self) {
        self.vm.kill().await;
        let dir = self.dir.clone();
        let _ = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(dir)).await;
    }
}
