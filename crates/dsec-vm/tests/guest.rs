//! Boots real guests under QEMU: a cold boot, a boot template and a restore, for both
//! machines. Needs root, QEMU, the cloud kernel and the static agent
//! (`scripts/build-agent.sh`); without them each test says why and returns.

use std::path::{Path, PathBuf};
use std::time::Instant;

use dsec_runtime::channel::ExecEvent;
use dsec_runtime::proto::ExecSpec;
use dsec_vm::assets::{GuestAssets, KernelSource};
use dsec_vm::disk::{self, BaseFs};
use dsec_vm::qemu::{Accel, Disks, GuestIdentity, Hardware, Machine, Start, TemplateFiles, Vm};

fn agent() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/x86_64-unknown-linux-gnu/release/dsec-agent")
}

/// A busybox root filesystem in `dir`.
fn busybox_root(dir: &Path) {
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    std::fs::copy("/bin/busybox", dir.join("bin/busybox")).unwrap();
    for applet in ["sh", "echo", "cat", "hostname", "ls", "sleep", "head", "od"] {
        std::os::unix::fs::symlink("busybox", dir.join("bin").join(applet)).unwrap();
    }
    for d in ["tmp", "etc", "root"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
    }
}

struct Fixture {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    assets: GuestAssets,
    disks: Disks,
}

/// Image disks of both filesystems get booted: microvm's tests use EROFS, q35's ext4.
fn fixture(base_fs: BaseFs) -> Option<Fixture> {
    if !agent().exists()
        || std::process::Command::new("qemu-system-x86_64")
            .arg("--version")
            .output()
            .is_err()
    {
        eprintln!(
            "skipped: needs qemu-system-x86_64 and the static agent (scripts/build-agent.sh)"
        );
        return None;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_owned();
    let assets = match GuestAssets::prepare(&KernelSource::default(), &agent(), &dir.join("assets"))
    {
        Ok(a) => a,
        Err(e) => {
            eprintln!("skipped: {e}");
            return None;
        }
    };
    busybox_root(&dir.join("rootfs"));
    let base = dir.join(format!("image.{}", base_fs.name()));
    disk::build_image_disk(&[dir.join("rootfs")], base_fs, &base).unwrap();
    let scratch_base = dir.join("scratch-64.ext4");
    disk::build_scratch_base(64, &scratch_base).unwrap();
    Some(Fixture {
        disks: Disks {
            image: vec![base],
            base_fs,
            scratch: scratch_base,
        },
        _tmp: tmp,
        dir,
        assets,
    })
}

async fn run(vm: &Vm, script: &str) -> (String, i32) {
    let spec = ExecSpec {
        argv: vec!["sh".into(), "-c".into(), script.into()],
        env: vec!["PATH=/bin".into()],
        cwd: "/".into(),
        timeout_ms: Some(20_000),
        max_output_bytes: 1 << 20,
        ..ExecSpec::default()
    };
    let mut handle = vm.channel().exec(&spec, b"", &[]).await.unwrap();
    let mut out = String::new();
    loop {
        match handle.next().await.unwrap().unwrap() {
            ExecEvent::Stdout(d) | ExecEvent::Stderr(d) => {
                out.push_str(&String::from_utf8_lossy(&d))
            }
            ExecEvent::Exit(e) => return (out, e.exit_code.unwrap_or(-1)),
            other => panic!("a one-step command sent {other:?}"),
        }
    }
}

async fn cold_then_restore(machine: Machine) {
    let base_fs = match machine {
        Machine::Microvm => BaseFs::Erofs,
        Machine::Q35 => BaseFs::Ext4,
    };
    let Some(f) = fixture(base_fs) else { return };
    let hw = Hardware {
        machine,
        accel: Accel::Tcg,
        vcpus: 1,
        memory_mb: 256,
    };
    let template = f.dir.join("template");
    std::fs::create_dir_all(&template).unwrap();
    let scratch = template.join("scratch.qcow2");
    disk::create_scratch(&f.disks.scratch, &scratch).unwrap();
    let disks = Disks {
        scratch: scratch.clone(),
        ..f.disks.clone()
    };
    // A cold boot, as `--vm-boot cold` does it.
    let cold_dir = f.dir.join("cold");
    std::fs::create_dir_all(&cold_dir).unwrap();
    disk::create_scratch(&f.disks.scratch, &cold_dir.join("scratch.qcow2")).unwrap();
    let cold_disks = Disks {
        scratch: cold_dir.join("scratch.qcow2"),
        ..f.disks.clone()
    };
    let t = Instant::now();
    let vm = Vm::start(
        &hw,
        &f.assets,
        Some(&cold_disks),
        Start::Cold(GuestIdentity {
            hostname: "cold",
            pids_max: 64,
            network: None,
        }),
        &cold_dir,
        None,
    )
    .await
    .unwrap();
    let (out, code) = run(&vm, "echo hello; hostname").await;
    eprintln!("{machine:?} cold boot → first exec {:?}", t.elapsed());
    assert_eq!((out.as_str(), code), ("hello\ncold\n", 0));
    vm.kill().await;

    // The boot template: saved while its agent waits for an identity.
    let files = TemplateFiles {
        memory: &template.join("memory"),
        state: &template.join("state"),
        first_request: 1,
    };
    let vm = Vm::start(
        &hw,
        &f.assets,
        Some(&disks),
        Start::Template(files),
        &template,
        None,
    )
    .await
    .unwrap();
    vm.save_template(files.state).await.unwrap();
    vm.kill().await;
    let saved_memory = file_hash(files.memory);

    for name in ["sb-a", "sb-b"] {
        let dir = f.dir.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(&scratch, dir.join("scratch.qcow2")).unwrap();
        let disks = Disks {
            scratch: dir.join("scratch.qcow2"),
            ..f.disks.clone()
        };
        let t = Instant::now();
        let vm = Vm::start(
            &hw,
            &f.assets,
            Some(&disks),
            Start::Restore(
                GuestIdentity {
                    hostname: name,
                    pids_max: 64,
                    network: None,
                },
                files,
            ),
            &dir,
            None,
        )
        .await
        .unwrap();
        let restored = t.elapsed();
        let (out, code) = run(&vm, "hostname; echo data > /root/f; cat /root/f").await;
        eprintln!(
            "{machine:?} restore → identity {restored:?}; first exec {:?}",
            t.elapsed()
        );
        assert_eq!(code, 0, "{out}");
        assert_eq!(out, format!("{name}\ndata\n"));
        let t = Instant::now();
        for _ in 0..20 {
            run(&vm, "true").await;
        }
        eprintln!("{machine:?} exec round trip {:?}", t.elapsed() / 20);
        let listing = vm.channel().list_dir("/root", 100, 1).await.unwrap();
        assert!(listing.iter().any(|e| e.name == "f"), "{listing:?}");
        vm.pause().await.unwrap();
        vm.resume().await.unwrap();
        vm.kill().await;
        assert!(!vm.is_alive());
    }
    // The guests mapped the template's memory privately: what they wrote is their own.
    assert_eq!(file_hash(files.memory), saved_memory);
}

/// A hash of a file's bytes.
fn file_hash(path: &Path) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    std::fs::read(path).unwrap().hash(&mut hasher);
    hasher.finish()
}

#[tokio::test(flavor = "multi_thread")]
async fn microvm_boots_snapshots_and_restores() {
    cold_then_restore(Machine::Microvm).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn q35_boots_snapshots_and_restores() {
    cold_then_restore(Machine::Q35).await;
}
