//! dsec's native container runtime.
//!
//! The pieces, in the order a sandbox meets them:
//! - [`zygote`]: a single-threaded helper process that `clone(2)`s each sandbox into new
//!   mount, pid, uts, ipc and network namespaces — no `execve` on the create path;
//! - [`init`]: the sandbox's PID 1 (a fork of the zygote): joins its [`cgroup`]s, builds
//!   the [`rootfs`], drops [`caps`] and installs the [`seccomp`] filter on itself, then
//!   runs commands (which inherit both) for the edge over the [`proto`] channel;
//! - `launch`: what runs between a `clone` and an `execve` — the zygote's start, each
//!   command's first process, a stepped call's steps (`steps`) — in one file to audit;
//! - [`container`]: the edge's async handle on a sandbox, talking to init through a
//!   [`channel`]; [`files`]: the sandbox's files, served by init over that channel;
//! - [`fds`]: what every process dsec starts may inherit (its standard descriptors only);
//!   [`pidfd`]: host processes read and signalled by pid, held by pidfd; [`procfs`]: what
//!   is read of them in `/proc`; [`tree`]: a command's whole process tree, killed;
//!   [`users`]: the sandbox's users, whom commands may run as.
//!
//! A VM guest's agent reuses [`init`]'s command loop, [`proto`], [`files`], [`caps`] and
//! [`seccomp`] inside the guest (see `dsec-agent`).
#![warn(missing_docs)]

pub mod caps;
pub mod cgroup;
pub mod channel;
pub mod container;
pub mod fds;
pub mod files;
pub mod guest;
pub mod init;
mod launch;
pub mod layers;
pub mod pidfd;
pub mod procfs;
pub mod proto;
pub mod rootfs;
pub mod seccomp;
pub mod spec;
mod steps;
pub mod tree;
pub mod users;
pub mod zygote;
