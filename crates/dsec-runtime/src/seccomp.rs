//! The default seccomp filter of sandboxed processes.
//!
//! Namespaces and capabilities decide what a sandboxed process may touch; seccomp shrinks the
//! kernel surface it can reach at all, which is where container escapes usually start. Rather
//! than invent a policy, dsec uses the one the most code has already been run against: Docker's
//! default profile (moby `profiles/seccomp/default.json`), as it applies to a process holding
//! Docker's default capability set. Concretely:
//!
//! * every syscall of the profile's unconditional allow list that exists in the native ABI,
//!   plus `arch_prctl` and `modify_ldt` on x86_64;
//! * `ptrace`, `process_vm_readv` and `process_vm_writev` (Docker allows them on kernels 4.8 and
//!   later, which re-check the syscalls a tracer rewrites) and `chroot` (`CAP_SYS_CHROOT` is a
//!   default capability);
//! * the argument-conditioned rules: `clone` only without namespace flags, `socket` for every
//!   family but `AF_ALG` and `AF_VSOCK`, `personality` for the five listed personas;
//! * `clone3` answers `ENOSYS`, so that libc falls back to `clone`, whose flags a filter can see;
//! * everything else answers `EPERM`, Docker's `defaultErrnoRet`. The rules Docker only adds for
//!   extra capabilities (`CAP_SYS_ADMIN`'s `mount`, `unshare`, `setns`, …, `CAP_SYS_PTRACE`'s
//!   `kcmp`, `CAP_SYS_BOOT`'s `reboot`, …) are left out, so those syscalls are denied.
//!
//! The policy lives in `seccomp_docker_default.json`, in seccompiler's JSON format: a `common`
//! filter holds what x86_64 and aarch64 share, an entry per architecture holds what only that
//! architecture has (seccompiler refuses names its table lacks), and the two are merged here
//! before compiling. A few instructions written here run first, for what seccompiler's format
//! cannot say: one match action per filter rules out `clone3`'s `ENOSYS`, and its syscall table
//! (Linux 6.12) lacks the `*xattrat` family (463–466) that Docker allows. Then a binary search
//! allows the syscalls the policy allows whatever their arguments, and seccompiler's program
//! of the argument-checked rules decides the rest: 256 instructions where seccompiler's
//! program of the whole policy has 1,575, which every install converts and JIT-compiles
//! again (see `seccomp/bpf.rs`).
//!
//! Where this filter differs from Docker running runc:
//!
//! * Only the native ABI is allowed. Docker also allows i386 and x32 syscalls on x86_64 (and
//!   32-bit ARM on aarch64); here a foreign-ABI syscall kills the process and an x32 syscall
//!   gets `ENOSYS`, so 32-bit binaries do not run.
//! * Integer arguments (`socket`'s family, `personality`'s persona, `clone`'s flags) are compared
//!   on the 32 bits the kernel reads. libseccomp compares all 64, so under Docker a family of
//!   `AF_VSOCK` with garbage in the upper half of the register passes the filter.
//! * As runc's `ENOSYS` stub does, syscalls numbered above the newest one the profile names
//!   answer `ENOSYS` rather than `EPERM`, so libc falls back instead of failing.

use seccompiler::{sock_filter, BpfProgram, TargetArch};
use serde_json::{Map, Value};

mod bpf;

/// The policy, in seccompiler's JSON format: see the module documentation.
const PROFILE_JSON: &str = include_str!("seccomp_docker_default.json");

/// The key of the filter holding the rules every architecture shares.
const COMMON_KEY: &str = "common";

/// The kernel accepts at most `BPF_MAXINSNS` instructions per filter.
const BPF_MAXINSNS: usize = 4096;

/// `clone3`; syscalls numbered from 424 on have the same number on every architecture.
const SYS_CLONE3: u32 = 435;
/// `setxattrat`, the first of the syscalls Docker allows that seccompiler cannot name.
const FIRST_UNNAMED_ALLOWED: u32 = 463;
/// `removexattrat`, the newest syscall the profile names; runc answers `ENOSYS` above it.
const LAST_PROFILE_SYSCALL: u32 = 466;

/// A native syscall ABI dsec has a profile for.
struct Arch {
    /// The name in `std::env::consts::ARCH` and the key of its filter in the JSON.
    name: &'static str,
    target: TargetArch,
    /// `AUDIT_ARCH_*` from `linux/audit.h`: what `seccomp_data.arch` holds for this ABI.
    audit_arch: u32,
}

/// The architectures the JSON has a filter for.
static ARCHES: [Arch; 2] = [
    Arch {
        name: "x86_64",
        target: TargetArch::x86_64,
        audit_arch: 0xC000_003E,
    },
    Arch {
        name: "aarch64",
        target: TargetArch::aarch64,
        audit_arch: 0xC000_00B7,
    },
];

/// Why the default filter could not be built or installed.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// Sandboxes must not run unfiltered, and there is no profile for this CPU.
    #[error("no seccomp profile for architecture {0}")]
    UnsupportedArch(&'static str),
    /// The embedded JSON does not have the shape this module expects: a bug in dsec.
    #[error("embedded seccomp profile is malformed: {0}")]
    Malformed(&'static str),
    /// The embedded JSON does not parse: a bug in dsec.
    #[error("embedded seccomp profile is not valid JSON")]
    Json(#[from] serde_json::Error),
    /// seccompiler rejected the profile, e.g. a syscall name it does not know: a bug in dsec.
    #[error("compiling the seccomp profile for {arch}")]
    Compile {
        /// The architecture compiled for.
        arch: &'static str,
        /// seccompiler's reason.
        #[source]
        source: seccompiler::Error,
    },
    /// The kernel would refuse the program.
    #[error("seccomp program has {0} instructions, more than the kernel's {BPF_MAXINSNS}")]
    TooLarge(usize),
    /// `prctl(PR_SET_NO_NEW_PRIVS)` or `seccomp(SECCOMP_SET_MODE_FILTER)` failed.
    #[error("installing the seccomp filter")]
    Install(#[source] seccompiler::Error),
}

/// Docker's default seccomp policy, compiled for this CPU.
///
/// Compiling parses JSON and allocates, which a forked child must not do, so the runtime
/// compiles once at start and every sandboxed process only installs the ready program.
#[derive(Debug, Clone)]
pub struct SeccompProfile {
    program: BpfProgram,
}

impl SeccompProfile {
    /// Builds the filter equivalent to Docker's default profile for the native ABI.
    ///
    /// Fails only on an architecture without a profile or on a bug in the embedded profile, so
    /// the runtime should refuse to start rather than run sandboxes unfiltered.
    pub fn docker_default() -> Result<SeccompProfile, SeccompError> {
        let arch = ARCHES
            .iter()
            .find(|arch| arch.name == std::env::consts::ARCH)
            .ok_or(SeccompError::UnsupportedArch(std::env::consts::ARCH))?;
        Ok(SeccompProfile {
            program: compile(arch)?,
        })
    }

    /// Confines the calling thread, and every process it then forks or executes, to the profile.
    ///
    /// Meant for a sandboxed process between fork and exec, so it allocates nothing:
    /// seccompiler's `apply_filter` makes the two syscalls and builds its errors from `errno`.
    /// It sets `no_new_privs` first, which an unprivileged caller needs and which also keeps a
    /// setuid binary from gaining privileges the filter was not written for.
    pub fn apply(&self) -> Result<(), SeccompError> {
        seccompiler::apply_filter(&self.program).map_err(SeccompError::Install)
    }
}

/// Compiles the merged profile of `arch`: [`prologue`], then the binary search over the
/// syscalls it allows whatever their arguments ([`bpf::dispatch`]), then seccompiler's program
/// of the argument-checked rules alone, which denies everything else.
fn compile(arch: &Arch) -> Result<BpfProgram, SeccompError> {
    let policy = merged_json(arch)?;
    let whole = seccompiler_program(arch, &policy)?;
    let mut allowed = Vec::new();
    for nr in 0..FIRST_UNNAMED_ALLOWED {
        let verdict =
            bpf::constant_verdict(&whole, arch.audit_arch, nr).map_err(SeccompError::Malformed)?;
        if verdict == Some(libc::SECCOMP_RET_ALLOW) {
            allowed.push(nr);
        }
    }
    let conditional = seccompiler_program(arch, &only_conditional(policy, arch)?)?;
    let dispatch = bpf::dispatch(&bpf::ranges(allowed), libc::SECCOMP_RET_ALLOW, 0);
    let mut program = prologue(arch.audit_arch, dispatch.len())?.to_vec();
    program.extend(dispatch);
    program.extend(conditional);
    if program.len() > BPF_MAXINSNS {
        return Err(SeccompError::TooLarge(program.len()));
    }
    Ok(program)
}

/// seccompiler's program of `policy`, one of [`merged_json`]'s documents.
fn seccompiler_program(arch: &Arch, policy: &Value) -> Result<BpfProgram, SeccompError> {
    let json = serde_json::to_vec(policy)?;
    let mut compiled =
        seccompiler::compile_from_json(json.as_slice(), arch.target).map_err(|source| {
            SeccompError::Compile {
                arch: arch.name,
                source,
            }
        })?;
    compiled
        .remove(arch.name)
        .ok_or(SeccompError::Malformed("compiled filter went missing"))
}

/// `policy` without its unconditional rules.
fn only_conditional(mut policy: Value, arch: &Arch) -> Result<Value, SeccompError> {
    let Some(Value::Array(rules)) = policy
        .get_mut(arch.name)
        .and_then(|filter| filter.get_mut("filter"))
    else {
        return Err(SeccompError::Malformed(
            "the merged filter has no rule list",
        ));
    };
    rules.retain(|rule| rule.get("args").is_some());
    Ok(policy)
}

/// One seccompiler JSON document whose only filter, named after `arch`, holds the `common`
/// rules followed by the architecture's own.
fn merged_json(arch: &Arch) -> Result<Value, SeccompError> {
    let mut filters: Map<String, Value> = serde_json::from_str(PROFILE_JSON)?;
    let mut merged = filters
        .remove(COMMON_KEY)
        .ok_or(SeccompError::Malformed("no `common` filter"))?;
    let own = filters
        .remove(arch.name)
        .ok_or(SeccompError::Malformed("no filter for the architecture"))?;
    for action in ["mismatch_action", "match_action"] {
        if merged.get(action) != own.get(action) {
            return Err(SeccompError::Malformed(
                "an architecture's actions differ from `common`'s",
            ));
        }
    }
    let Some(Value::Array(own_rules)) = own.get("filter") else {
        return Err(SeccompError::Malformed("an architecture has no rule list"));
    };
    let Some(Value::Array(rules)) = merged.get_mut("filter") else {
        return Err(SeccompError::Malformed("`common` has no rule list"));
    };
    rules.extend(own_rules.iter().cloned());
    let mut document = Map::new();
    document.insert(arch.name.to_owned(), merged);
    Ok(Value::Object(document))
}

/// Instructions that run before seccompiler's program, for native-ABI syscalls only (the
/// program kills any other ABI):
///
/// ```text
/// 0: A = arch                  5: if A < 463 goto 9
/// 1: if A != native goto 8     6: return ALLOW
/// 2: A = nr                    7: return ERRNO(ENOSYS)
/// 3: if A == clone3 goto 7     8: goto past the dispatch, to seccompiler's program
/// 4: if A > 466 goto 7         9: (the dispatch over allowed syscalls, A = nr)
/// ```
///
/// It reads the architecture and syscall number only, so the kernel can still cache the
/// verdict of every unconditionally allowed syscall.
fn prologue(audit_arch: u32, dispatch_len: usize) -> Result<[sock_filter; 9], SeccompError> {
    use bpf::{insn, op};
    const ENOSYS: u32 = libc::SECCOMP_RET_ERRNO | libc::ENOSYS.unsigned_abs();
    let past_dispatch =
        u32::try_from(dispatch_len).map_err(|_| SeccompError::TooLarge(dispatch_len))?;
    Ok([
        insn(op::LD_ABS, op::ARCH_OFFSET, 0, 0),
        insn(op::JEQ, audit_arch, 0, 6),
        insn(op::LD_ABS, op::NR_OFFSET, 0, 0),
        insn(op::JEQ, SYS_CLONE3, 3, 0),
        insn(op::JGT, LAST_PROFILE_SYSCALL, 2, 0),
        insn(op::JGE, FIRST_UNNAMED_ALLOWED, 0, 3),
        insn(op::RET, libc::SECCOMP_RET_ALLOW, 0, 0),
        insn(op::RET, ENOSYS, 0, 0),
        insn(op::JA, past_dispatch, 0, 0),
    ])
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn compiles_for_every_architecture() {
        for arch in &ARCHES {
            let program = compile(arch).unwrap_or_else(|e| panic!("{}: {e:?}", arch.name));
            assert!(program.len() <= BPF_MAXINSNS, "{}", arch.name);
        }
        SeccompProfile::docker_default().unwrap();
    }

    /// The dispatch changes how fast the filter decides, never what: for every syscall the
    /// profile names and many arguments, the installed program answers what seccompiler's
    /// program of the whole policy answers.
    #[test]
    fn the_installed_program_decides_as_seccompilers_program_of_the_whole_policy() {
        let mut args = vec![
            [0; 6],
            [u64::MAX; 6],
            [40, 1, 0, 0, 0, 0],               // AF_VSOCK
            [38, 5, 0, 0, 0, 0],               // AF_ALG
            [0x1000_0000 | 17, 0, 0, 0, 0, 0], // CLONE_NEWUSER | SIGCHLD
            [0x0002_0000 | 17, 0, 0, 0, 0, 0], // CLONE_NEWNS | SIGCHLD
            [0x0040_0000, 0, 0, 0, 0, 0],      // PER_LINUX32-ish personas
            [0xFFFF_FFFF, 0, 0, 0, 0, 0],
        ];
        let mut seed: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..64 {
            let mut a = [0; 6];
            for word in &mut a {
                seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                *word = seed >> (seed % 48);
            }
            args.push(a);
        }
        for arch in &ARCHES {
            let whole = seccompiler_program(arch, &merged_json(arch).unwrap()).unwrap();
            let installed = compile(arch).unwrap();
            assert!(
                installed.len() < whole.len() / 4,
                "{}: {}",
                arch.name,
                installed.len()
            );
            for nr in (0..FIRST_UNNAMED_ALLOWED).filter(|nr| *nr != SYS_CLONE3) {
                for a in &args {
                    let call = |arch| bpf::Call {
                        arch,
                        nr,
                        args: Some(a),
                    };
                    for audit_arch in [arch.audit_arch, 0x4000_0003] {
                        assert_eq!(
                            bpf::run(&installed, call(audit_arch)),
                            bpf::run(&whole, call(audit_arch)),
                            "{}: syscall {nr}, arch {audit_arch:#x}, args {a:x?}",
                            arch.name
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn prologue_numbers_match_libc() {
        assert_eq!(libc::SYS_clone3, libc::c_long::from(SYS_CLONE3));
    }

    /// seccompiler turns a syscall listed both with and without arguments into a conditional
    /// one, silently; the policy must never rely on that.
    #[test]
    fn no_syscall_is_both_unconditional_and_conditional() {
        for arch in &ARCHES {
            let json = merged_json(arch).unwrap();
            let (mut plain, mut conditional) = (BTreeSet::new(), BTreeSet::new());
            for rule in json[arch.name]["filter"].as_array().unwrap() {
                let name = rule["syscall"].as_str().unwrap();
                if rule.get("args").is_some() {
                    conditional.insert(name);
                } else {
                    assert!(plain.insert(name), "{}: {name} listed twice", arch.name);
                }
            }
            let both: Vec<_> = plain.intersection(&conditional).collect();
            assert!(both.is_empty(), "{}: {both:?}", arch.name);
        }
    }

    /// A syscall made by the filtered child, its missing arguments zero: its result or `errno`.
    fn sys(nr: libc::c_long, args: &[libc::c_long]) -> Result<libc::c_long, i32> {
        let mut a = [0; 6];
        a[..args.len()].copy_from_slice(args);
        // SAFETY: the checks pass integers and pointers to static C strings only, and none of
        // the syscalls they make writes to this process's memory.
        let ret = unsafe { libc::syscall(nr, a[0], a[1], a[2], a[3], a[4], a[5]) };
        if ret == -1 {
            Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
        } else {
            Ok(ret)
        }
    }

    fn fork_works() -> bool {
        match sys(libc::SYS_clone, &[libc::SIGCHLD.into()]) {
            // SAFETY: `_exit` ends the copy of the child without touching its state.
            Ok(0) => unsafe { libc::_exit(0) },
            Ok(pid) => {
                let mut status = 0;
                let pid = libc::pid_t::try_from(pid).unwrap();
                // SAFETY: `status` is a live local the kernel writes the exit status to.
                let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
                waited == pid && libc::WIFEXITED(status)
            }
            Err(_) => false,
        }
    }

    const AF_UNIX: libc::c_long = libc::AF_UNIX as libc::c_long;
    const AF_VSOCK: libc::c_long = 40;
    const SOCK_STREAM: libc::c_long = libc::SOCK_STREAM as libc::c_long;
    const KEYCTL_GET_KEYRING_ID: libc::c_long = 0;
    const KEY_SPEC_SESSION_KEYRING: libc::c_long = -3;

    /// A named check the filtered child makes; `false` means it failed.
    type Check = (&'static str, fn() -> bool);

    /// What the filtered child checks, in order. The denied calls are built so that without
    /// the filter the kernel would answer something other than `EPERM`.
    const CHECKS: &[Check] = &[
        ("getpid is allowed", || sys(libc::SYS_getpid, &[]).is_ok()),
        ("socket(AF_UNIX) is allowed", || {
            sys(libc::SYS_socket, &[AF_UNIX, SOCK_STREAM])
                .is_ok_and(|fd| sys(libc::SYS_close, &[fd]).is_ok())
        }),
        ("socket(AF_VSOCK) is EPERM", || {
            sys(libc::SYS_socket, &[AF_VSOCK, SOCK_STREAM]) == Err(libc::EPERM)
        }),
        (
            "socket(AF_VSOCK with garbage above bit 32) is EPERM",
            || sys(libc::SYS_socket, &[AF_VSOCK | 1 << 32, SOCK_STREAM]) == Err(libc::EPERM),
        ),
        ("personality query is allowed", || {
            sys(libc::SYS_personality, &[0xFFFF_FFFF]).is_ok()
        }),
        ("personality(ADDR_NO_RANDOMIZE) is EPERM", || {
            let persona = libc::ADDR_NO_RANDOMIZE.into();
            sys(libc::SYS_personality, &[persona]) == Err(libc::EPERM)
        }),
        (
            "unshare(CLONE_NEWNS) is EPERM (kernel: EINVAL for CLONE_VFORK)",
            || {
                let flags = (libc::CLONE_NEWNS | libc::CLONE_VFORK).into();
                sys(libc::SYS_unshare, &[flags]) == Err(libc::EPERM)
            },
        ),
        ("mount is EPERM (kernel: ENOENT)", || {
            let target = c"/nonexistent-dsec-seccomp-test";
            let args = [c"none".as_ptr(), target.as_ptr(), c"tmpfs".as_ptr()];
            sys(libc::SYS_mount, &args.map(|p| p as libc::c_long)) == Err(libc::EPERM)
        }),
        (
            "clone(CLONE_NEWUSER) is EPERM (kernel: EINVAL with CLONE_FS)",
            || {
                let flags = (libc::CLONE_NEWUSER | libc::CLONE_FS | libc::SIGCHLD).into();
                sys(libc::SYS_clone, &[flags]) == Err(libc::EPERM)
            },
        ),
        ("clone without namespace flags (fork) works", fork_works),
        ("clone3 is ENOSYS", || {
            sys(libc::SYS_clone3, &[]) == Err(libc::ENOSYS)
        }),
        ("keyctl is EPERM", || {
            let args = [KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING];
            sys(libc::SYS_keyctl, &args) == Err(libc::EPERM)
        }),
        ("getxattrat (464) is not EPERM", || {
            sys(464, &[-1]) != Err(libc::EPERM)
        }),
        ("a syscall newer than the profile (467) is ENOSYS", || {
            sys(467, &[-1]) == Err(libc::ENOSYS)
        }),
    ];

    #[test]
    fn forked_child_is_confined_like_docker() {
        let profile = SeccompProfile::docker_default().unwrap();
        // SAFETY: the child only installs the compiled filter, makes raw syscalls and `_exit`s,
        // none of which allocates or takes a lock another thread may have held at the fork.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            let code = match profile.apply() {
                Err(_) => 100,
                Ok(()) => CHECKS
                    .iter()
                    .position(|(_, check)| !check())
                    .map_or(0, |index| i32::try_from(index + 1).unwrap()),
            };
            // SAFETY: ends the child without running the test harness's exit handlers.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: `status` is a live local the kernel writes the exit status to.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "child died: status {status:#x}");
        match libc::WEXITSTATUS(status) {
            0 => {}
            100 => panic!("installing the filter failed"),
            code => panic!(
                "check failed: {}",
                CHECKS[usize::try_from(code - 1).unwrap()].0
            ),
        }
    }
}
