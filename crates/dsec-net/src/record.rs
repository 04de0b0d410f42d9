//! The host's record of which dsec servers have networking, kept outside every state
//! directory (in `/run`, which lives exactly as long as the kernel objects it describes:
//! both are gone after a reboot), so that any dsec server can tell the networking of a
//! live server from what a dead one left, whatever state directory either used.
//!
//! Each server with networking holds `/run/dsec/net/<tag>` open with an exclusive `flock`
//! for as long as its bridge and tables exist. The kernel drops that lock when the process
//! dies, however it dies (SIGKILL, OOM, a panic): a record nobody holds is a dead server's,
//! and its objects (all named by the tag in the file's name) may be removed. A record held
//! is a live server's, and nothing of it is ever touched. Every claim, removal and pool
//! choice happens under the directory's own lock (`.lock`), so two servers starting at
//! once neither remove each other's objects nor pick the same pool.
//!
//! The record also says which network namespace the objects are in: a server removes a
//! dead server's objects only in its own namespace (fleet edges on one machine each have
//! their own, with their own bridges), and leaves the records of other namespaces to the
//! servers that start there.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::net::Ipv4Addr;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Where the records live.
pub(crate) const DIR: &str = "/run/dsec/net";

/// The network namespace of this process, as `device:inode` of its `ns/net` file.
pub(crate) fn netns_id() -> String {
    std::fs::metadata("/proc/self/ns/net")
        .map(|m| format!("{}:{}", m.dev(), m.ino()))
        .unwrap_or_default()
}

/// Whether `name` can be a server tag (eight lower-case hex digits): only such names
/// are ever turned into interface and table names.
pub(crate) fn is_tag(name: &str) -> bool {
    name.len() == 8 && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// What a record says about its server.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Owner {
    /// The server's pid (in its own pid namespace; for people, not for liveness).
    pub pid: u32,
    /// Its network namespace ([`netns_id`]).
    pub netns: String,
    /// Its state directory.
    pub state_dir: String,
    /// Its address pool, once chosen.
    pub pool: Option<(Ipv4Addr, u8)>,
}

impl Owner {
    fn to_json(&self) -> String {
        serde_json::json!({
            "pid": self.pid,
            "netns": self.netns,
            "state_dir": self.state_dir,
            "pool": self.pool.map(|(net, prefix)| format!("{net}/{prefix}")),
        })
        .to_string()
    }

    fn from_json(text: &str) -> Option<Owner> {
        let v: serde_json::Value = serde_json::from_str(text).ok()?;
        Some(Owner {
            pid: u32::try_from(v["pid"].as_u64()?).ok()?,
            netns: v["netns"].as_str()?.to_owned(),
            state_dir: v["state_dir"].as_str().unwrap_or_default().to_owned(),
            pool: v["pool"].as_str().and_then(|p| crate::parse_pool(p).ok()),
        })
    }
}

/// The records directory, locked: held while claiming, removing and choosing a pool.
pub(crate) struct Registry {
    dir: PathBuf,
    _lock: File,
}

/// This server's record, locked for as long as it lives.
pub(crate) struct Record {
    path: PathBuf,
    file: File,
}

/// A record some other server holds now.
#[derive(Debug)]
pub(crate) struct Live {
    pub tag: String,
    pub owner: Option<Owner>,
}

fn open_rw(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
}

fn read_owner(file: &mut File) -> Option<Owner> {
    let mut text = String::new();
    file.rewind().ok()?;
    file.take(64 * 1024).read_to_string(&mut text).ok()?;
    Owner::from_json(&text)
}

impl Registry {
    /// Locks the records directory `dir` (created, mode 0700), waiting for another
    /// server's start-up or shutdown to finish with it.
    pub(crate) fn lock(dir: &Path) -> std::io::Result<Registry> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        let lock = open_rw(&dir.join(".lock"))?;
        lock.lock()?;
        Ok(Registry {
            dir: dir.to_owned(),
            _lock: lock,
        })
    }

    /// Claims `tag` for this process, writing `owner` into its record; `Err` names the
    /// live server that holds it.
    pub(crate) fn claim(&self, tag: &str, owner: &Owner) -> Result<Record, String> {
        let path = self.dir.join(tag);
        let mut file = open_rw(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let holder = describe(read_owner(&mut file).as_ref());
                return Err(format!(
                    "networking tag {tag} is held by another live dsec server ({holder})"
                ));
            }
            Err(TryLockError::Error(e)) => return Err(format!("{}: {e}", path.display())),
        }
        let record = Record { path, file };
        record.write(owner).map_err(|e| e.to_string())?;
        Ok(record)
    }

    /// The records nobody holds whose objects are in network namespace `netns` (or
    /// that never said where theirs are), each locked now: (tag, what it says, record).
    pub(crate) fn dead(&self, netns: &str) -> Vec<(String, Option<Owner>, Record)> {
        let mut out = Vec::new();
        for tag in self.tags() {
            let path = self.dir.join(&tag);
            let Ok(mut file) = open_rw(&path) else {
                continue;
            };
            if file.try_lock().is_err() {
                continue; // live, or unreadable: never touched
            }
            let owner = read_owner(&mut file);
            if owner.as_ref().is_some_and(|o| o.netns != netns) {
                continue;
            }
            out.push((tag, owner, Record { path, file }));
        }
        out
    }

    /// The records some live server holds now.
    pub(crate) fn live(&self) -> Vec<Live> {
        let mut out = Vec::new();
        for tag in self.tags() {
            let Ok(mut file) = File::open(self.dir.join(&tag)) else {
                continue;
            };
            if matches!(file.try_lock(), Err(TryLockError::WouldBlock)) {
                out.push(Live {
                    owner: read_owner(&mut file),
                    tag,
                });
            }
        }
        out
    }

    fn tags(&self) -> Vec<String> {
        std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|name| is_tag(name))
            .collect()
    }
}

/// A live server as a person would want it named in a message.
pub(crate) fn describe(owner: Option<&Owner>) -> String {
    match owner {
        Some(o) => format!("pid {}, state directory {}", o.pid, o.state_dir),
        None => "details unknown".into(),
    }
}

impl Record {
    /// Replaces what the record says.
    pub(crate) fn write(&self, owner: &Owner) -> std::io::Result<()> {
        let mut file = &self.file;
        file.set_len(0)?;
        file.rewind()?;
        file.write_all(owner.to_json().as_bytes())
    }

    /// Deletes the record (its objects are gone); `_registry` proves the directory lock
    /// is held, so no other server is claiming the same name meanwhile.
    pub(crate) fn remove(self, _registry: &Registry) {
        if let Err(e) = std::fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), error = %e, "removing a networking record");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(netns: &str) -> Owner {
        Owner {
            pid: std::process::id(),
            netns: netns.into(),
            state_dir: "/var/lib/dsec".into(),
            pool: Some((Ipv4Addr::new(10, 209, 0, 0), 16)),
        }
    }

    #[test]
    fn records_round_trip() {
        let o = owner("4:1234");
        assert_eq!(Owner::from_json(&o.to_json()), Some(o));
        assert_eq!(Owner::from_json("{"), None);
    }

    #[test]
    fn only_tags_name_objects() {
        assert!(is_tag("0123abcd"));
        for bad in ["0123abc", "0123ABCD", "../../et", "0123abcd0", ".lock"] {
            assert!(!is_tag(bad), "{bad}");
        }
    }

    /// A held record is live; the same file left by a dropped holder is dead; records of
    /// another network namespace are not offered for removal.
    #[test]
    fn a_held_record_is_live_and_a_released_one_dead() {
        let dir = std::env::temp_dir().join(format!("dsec-net-records-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let registry = Registry::lock(&dir).unwrap();
        let held = registry.claim("0000aaaa", &owner("1:1")).unwrap();
        let released = registry.claim("0000bbbb", &owner("1:1")).unwrap();
        let elsewhere = registry.claim("0000cccc", &owner("1:2")).unwrap();
        // A second claim of a held tag fails, naming the holder (flock is per open file,
        // so this holds within one process too).
        let e = registry.claim("0000aaaa", &owner("1:1")).err().unwrap();
        assert!(e.contains("0000aaaa") && e.contains("/var/lib/dsec"), "{e}");
        drop(released);
        drop(elsewhere);
        let dead: Vec<String> = registry.dead("1:1").into_iter().map(|d| d.0).collect();
        assert_eq!(dead, vec!["0000bbbb".to_owned()]);
        let live: Vec<String> = registry.live().into_iter().map(|l| l.tag).collect();
        assert_eq!(live, vec!["0000aaaa".to_owned()]);
        held.remove(&registry);
        assert!(!dir.join("0000aaaa").exists());
        drop(registry);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
