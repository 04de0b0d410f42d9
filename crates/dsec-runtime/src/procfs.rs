//! What dsec reads of `/proc/<pid>`, parsed in one place.
//!
//! `stat`'s fields are numbered after the command name, which may itself hold spaces and
//! parentheses: every field is read after the *last* `)`. Nothing here holds the process:
//! a pid read from `/proc` may be reused at once, so a caller that acts on it takes a
//! pidfd first and checks what it read afterwards (see [`crate::pidfd::open_if`]).

use std::os::unix::fs::MetadataExt;

/// The fields of `/proc/<pid>/stat` dsec uses (proc(5) numbers them from 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stat {
    /// Field 3: the state (`R`, `S`, `Z` for a zombie, …).
    pub state: char,
    /// Field 4: the parent's pid.
    pub ppid: i32,
    /// Field 5: the process group id.
    pub pgrp: i32,
    /// Field 6: the session id.
    pub session: i32,
    /// Field 14: user CPU time, in clock ticks.
    pub utime_ticks: u64,
    /// Field 15: system CPU time, in clock ticks.
    pub stime_ticks: u64,
    /// Field 22: when the process started, in clock ticks since boot; with the pid, it
    /// names one process across pid reuse.
    pub start_ticks: u64,
    /// Field 52: the exit status in `waitpid(2)`'s form, once the process has exited (a
    /// zombie); shown to those who may `ptrace`-read the process, 0 to others.
    pub exit_code: i32,
}

impl Stat {
    /// `/proc/<pid>/stat`, or `None` once the process is gone.
    pub fn read(pid: i32) -> Option<Stat> {
        Stat::parse(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
    }

    /// Parses the text of a `stat` file.
    pub fn parse(text: &str) -> Option<Stat> {
        // After the name, field 3 (the state) comes first: field N is at index N - 3.
        let fields: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
        let at = |field: usize| fields.get(field - 3).copied();
        Some(Stat {
            state: at(3)?.chars().next()?,
            ppid: at(4)?.parse().ok()?,
            pgrp: at(5)?.parse().ok()?,
            session: at(6)?.parse().ok()?,
            utime_ticks: at(14)?.parse().ok()?,
            stime_ticks: at(15)?.parse().ok()?,
            start_ticks: at(22)?.parse().ok()?,
            exit_code: at(52)?.parse().ok()?,
        })
    }

    /// Whether the process has exited and waits to be reaped by its parent.
    pub fn is_zombie(&self) -> bool {
        self.state == 'Z'
    }

    /// User and system CPU time together, in milliseconds.
    pub fn cpu_ms(&self) -> f64 {
        (self.utime_ticks + self.stime_ticks) as f64 * 1000.0 / clock_ticks_per_second()
    }
}

/// The kernel's clock tick (`_SC_CLK_TCK`), the unit of `stat`'s times.
pub fn clock_ticks_per_second() -> f64 {
    rustix::param::clock_ticks_per_second() as f64
}

/// Every pid in `/proc` now (processes, not threads).
pub fn pids() -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

/// The inode of the process's pid namespace: equal for two processes in the same one.
pub fn pid_namespace(pid: i32) -> Option<u64> {
    std::fs::metadata(format!("/proc/{pid}/ns/pid"))
        .ok()
        .map(|m| m.ino())
}

/// A `Key:   N kB` line of `/proc/<pid>/status` (e.g. `VmRSS`), in bytes.
pub fn status_bytes(pid: i32, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines().find_map(|line| {
        let value = line.strip_prefix(key)?.strip_prefix(':')?;
        let kib: u64 = value.split_whitespace().next()?.parse().ok()?;
        Some(kib * 1024)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_after_the_last_parenthesis() {
        // A command name with spaces and a ')' of its own, as an agent may choose.
        let text = "4242 (a) b (c) Z 17 4242 4242 0 -1 4194560 100 0 0 0 \
                    7 3 0 0 20 0 1 0 987654 0 0 18446744073709551615 0 0 0 0 0 0 0 0 0 0 \
                    0 0 17 1 0 0 0 0 0 0 0 0 0 0 0 0 9";
        let stat = Stat::parse(text).unwrap();
        assert_eq!(
            stat,
            Stat {
                state: 'Z',
                ppid: 17,
                pgrp: 4242,
                session: 4242,
                utime_ticks: 7,
                stime_ticks: 3,
                start_ticks: 987654,
                exit_code: libc::SIGKILL,
            }
        );
        assert!(stat.is_zombie());
        assert!(Stat::parse("4242 (short) S 1 2").is_none());
    }

    #[test]
    fn an_unreaped_child_shows_how_it_ended() {
        for (script, ended) in [
            ("kill -KILL $$", (true, libc::SIGKILL)),
            ("exit 7", (false, 7)),
        ] {
            let mut child = std::process::Command::new("sh")
                .args(["-c", script])
                .spawn()
                .unwrap();
            let pid = i32::try_from(child.id()).unwrap();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            // Unreaped, it stays listed until the wait below.
            let status = loop {
                let stat = Stat::read(pid).unwrap();
                if stat.is_zombie() {
                    break stat.exit_code;
                }
                assert!(std::time::Instant::now() < deadline, "{script}: no exit");
                std::thread::sleep(std::time::Duration::from_millis(10));
            };
            let seen = match libc::WIFSIGNALED(status) {
                true => (true, libc::WTERMSIG(status)),
                false => (false, libc::WEXITSTATUS(status)),
            };
            assert_eq!(seen, ended, "{script}");
            child.wait().unwrap();
        }
    }

    #[test]
    fn this_process_reads_as_itself() {
        let me = i32::try_from(std::process::id()).unwrap();
        let stat = Stat::read(me).unwrap();
        assert_eq!(
            stat.ppid,
            rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get())
        );
        assert!(pids().contains(&me));
        assert_eq!(pid_namespace(me), pid_namespace(me));
        assert!(status_bytes(me, "VmRSS").unwrap() > 0);
        assert!(status_bytes(me, "VmNoSuchKey").is_none());
    }
}
