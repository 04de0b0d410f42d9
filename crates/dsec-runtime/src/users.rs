//! The users of a sandbox: `user=` resolved against the sandbox's own `/etc/passwd` and
//! `/etc/group`, as the sandbox sees them (never the host's), so a user the sandbox made
//! itself (`useradd`) is one too.
//!
//! The parser is small and strict: a passwd line is `name:password:uid:gid:gecos:home:shell`
//! and a group line `name:password:gid:member,member,...`; the line of the user asked for
//! must be well formed, other malformed lines are skipped (as the C library does). A uid
//! that no passwd line names is allowed, as Docker allows it: it runs with gid 0, no
//! supplementary groups and `HOME=/`. Supplementary groups come from the member lists of
//! `/etc/group`, for a user named by its name or its uid only: `uid:gid` names the one
//! group explicitly (as runc does).
//!
//! A container's init (and a VM guest's agent) looks the user up before it starts the
//! command, and the command's first process only makes system calls with the result
//! ([`Account::ids`]); the docker backend resolves with [`resolve`] too, so every backend
//! refuses the same users with the same words.

use crate::files::{FileError, SandboxRoot};

/// Where users are looked up.
pub const PASSWD: &str = "/etc/passwd";
/// Where their supplementary groups are.
pub const GROUP: &str = "/etc/group";
/// Largest passwd or group file read.
pub const MAX_FILE_BYTES: u64 = 4 << 20;
/// Longest user name accepted.
const MAX_NAME: usize = 64;

/// Why a user cannot be run as.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UserError {
    /// Not a name, a uid or `uid:gid`.
    #[error("user {user:?} is malformed: {reason}")]
    Malformed {
        /// As given.
        user: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// No passwd line has this name.
    #[error("user {user:?} not found in the sandbox's {PASSWD}: add it (useradd, or a line in {PASSWD}) or give a numeric uid")]
    Unknown {
        /// As given.
        user: String,
    },
    /// The user's own line cannot be parsed.
    #[error("user {user:?}: line {line} of the sandbox's {file} is malformed")]
    BadLine {
        /// As given.
        user: String,
        /// `/etc/passwd` or `/etc/group`.
        file: &'static str,
        /// 1-based.
        line: usize,
    },
    /// The file could not be read.
    #[error("user {user:?}: cannot read the sandbox's {file}: {reason}")]
    Unreadable {
        /// As given.
        user: String,
        /// `/etc/passwd` or `/etc/group`.
        file: &'static str,
        /// Why.
        reason: String,
    },
}

/// A `user=` as given, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UserSpec {
    /// A user name.
    Name(String),
    /// A uid.
    Uid(u32),
    /// A uid and its primary gid.
    UidGid(u32, u32),
}

impl UserSpec {
    /// Parses a name (letters, digits, `_`, `.`, `-`, not starting with `-`, a trailing
    /// `$` allowed), a uid or `uid:gid`.
    pub fn parse(user: &str) -> Result<UserSpec, UserError> {
        let bad = |reason| UserError::Malformed {
            user: user.to_owned(),
            reason,
        };
        let number = |s: &str| {
            s.parse::<u32>()
                .map_err(|_| bad("a uid or gid is a number below 2^32"))
        };
        if let Some((uid, gid)) = user.split_once(':') {
            return Ok(UserSpec::UidGid(number(uid)?, number(gid)?));
        }
        if !user.is_empty() && user.bytes().all(|b| b.is_ascii_digit()) {
            return Ok(UserSpec::Uid(number(user)?));
        }
        let name = user.strip_suffix('$').unwrap_or(user);
        if name.is_empty() || user.len() > MAX_NAME {
            return Err(bad("a user name is 1 to 64 characters"));
        }
        if name.starts_with('-')
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
        {
            return Err(bad(
                "a user name has letters, digits, '_', '.' and '-' only, and does not start with '-'",
            ));
        }
        Ok(UserSpec::Name(user.to_owned()))
    }
}

/// A user as a command runs as it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Account {
    /// Its name, when a passwd line names it.
    pub name: Option<String>,
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Every group it is in, the primary one first.
    pub groups: Vec<u32>,
    /// Its home directory (`/` for a uid without a passwd line).
    pub home: String,
}

impl Account {
    /// Adds `HOME`, `USER` and `LOGNAME` to `env` (`K=V` entries), each unless `env`
    /// already sets it; `USER` and `LOGNAME` only for a named user.
    pub fn fill_env(&self, env: &mut Vec<String>) {
        let mut add = |key: &str, value: &str| {
            if !env
                .iter()
                .any(|e| e.strip_prefix(key).is_some_and(|r| r.starts_with('=')))
            {
                env.push(format!("{key}={value}"));
            }
        };
        add("HOME", &self.home);
        if let Some(name) = &self.name {
            add("USER", name);
            add("LOGNAME", name);
        }
    }
}

/// One passwd line, split.
struct PasswdLine<'a> {
    name: &'a str,
    uid: u32,
    gid: u32,
    home: &'a str,
}

fn passwd_line(line: &str) -> Option<PasswdLine<'_>> {
    let f: Vec<&str> = line.split(':').collect();
    let [name, _, uid, gid, _, home, _] = f.as_slice() else {
        return None;
    };
    Some(PasswdLine {
        name,
        uid: uid.parse().ok()?,
        gid: gid.parse().ok()?,
        home,
    })
}

/// The numbered lines of a file that hold an entry (not blank, not a comment).
fn entries(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l))
        .filter(|(_, l)| !l.trim().is_empty() && !l.starts_with('#'))
}

/// Resolves `user` against the contents of the sandbox's passwd and group files (`None`:
/// the file does not exist).
pub fn resolve(
    user: &str,
    passwd: Option<&str>,
    group: Option<&str>,
) -> Result<Account, UserError> {
    let spec = UserSpec::parse(user)?;
    let passwd = passwd.unwrap_or("");
    let bad_line = |file, line| UserError::BadLine {
        user: user.to_owned(),
        file,
        line,
    };
    let found = match &spec {
        UserSpec::Name(name) => {
            let (n, line) = entries(passwd)
                .find(|(_, l)| l.split(':').next() == Some(name.as_str()))
                .ok_or_else(|| UserError::Unknown {
                    user: user.to_owned(),
                })?;
            Some(passwd_line(line).ok_or_else(|| bad_line(PASSWD, n))?)
        }
        UserSpec::Uid(uid) | UserSpec::UidGid(uid, _) => entries(passwd)
            .filter_map(|(_, l)| passwd_line(l))
            .find(|p| p.uid == *uid),
    };
    let uid = match spec {
        UserSpec::Name(_) => found.as_ref().map_or(0, |p| p.uid),
        UserSpec::Uid(uid) | UserSpec::UidGid(uid, _) => uid,
    };
    let gid = match spec {
        UserSpec::UidGid(_, gid) => gid,
        _ => found.as_ref().map_or(0, |p| p.gid),
    };
    let mut groups = vec![gid];
    if let (Some(p), false) = (&found, matches!(spec, UserSpec::UidGid(..))) {
        for (n, line) in entries(group.unwrap_or("")) {
            let f: Vec<&str> = line.split(':').collect();
            let [_, _, g, members] = f.as_slice() else {
                continue;
            };
            if !members.split(',').any(|m| m == p.name) {
                continue;
            }
            let g: u32 = g.parse().map_err(|_| bad_line(GROUP, n))?;
            if !groups.contains(&g) {
                groups.push(g);
            }
        }
    }
    Ok(Account {
        name: found.as_ref().map(|p| p.name.to_owned()),
        uid,
        gid,
        groups,
        home: found
            .as_ref()
            .map(|p| p.home)
            .filter(|h| h.starts_with('/'))
            .unwrap_or("/")
            .to_owned(),
    })
}

/// Reads a passwd or group file beneath `root`; `None` when it does not exist.
fn read(root: &SandboxRoot, user: &str, file: &'static str) -> Result<Option<String>, UserError> {
    let unreadable = |reason: String| UserError::Unreadable {
        user: user.to_owned(),
        file,
        reason,
    };
    let (mut f, _) = match root.open_read(file, MAX_FILE_BYTES) {
        Ok(opened) => opened,
        Err(FileError::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(unreadable(e.to_string())),
    };
    // Bounded while read too: a command may be appending to the file as init reads it.
    let mut text = String::new();
    std::io::Read::read_to_string(
        &mut std::io::Read::take(&mut f, MAX_FILE_BYTES + 1),
        &mut text,
    )
    .map_err(|e| unreadable(e.to_string()))?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(unreadable(format!(
            "it grew past {MAX_FILE_BYTES} bytes while read"
        )));
    }
    Ok(Some(text))
}

/// Looks `user` up in the passwd and group files beneath `root` (the sandbox's `/`).
/// Returns the account and whether its home is a directory.
pub fn lookup(root: &SandboxRoot, user: &str) -> Result<(Account, bool), UserError> {
    UserSpec::parse(user)?;
    let passwd = read(root, user, PASSWD)?;
    let group = read(root, user, GROUP)?;
    let account = resolve(user, passwd.as_deref(), group.as_deref())?;
    let home_is_dir = root.stat(&account.home).is_ok_and(|e| e.is_dir);
    Ok((account, home_is_dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD_TEXT: &str = "root:x:0:0:root:/root:/bin/sh\n\
        # a comment\n\
        alice:x:1000:1000:Alice:/home/alice:/bin/sh\n\
        broken:x:notanumber:1\n\
        nohome:x:1001:1001::relative:/bin/sh\n";
    const GROUP_TEXT: &str =
        "root:x:0:\nalice:x:1000:\nwheel:x:10:root,alice\naudio:x:29:bob,alice\n";

    #[test]
    fn names_uids_and_uid_gid_pairs_resolve() {
        let alice = resolve("alice", Some(PASSWD_TEXT), Some(GROUP_TEXT)).unwrap();
        assert_eq!(
            alice,
            Account {
                name: Some("alice".into()),
                uid: 1000,
                gid: 1000,
                groups: vec![1000, 10, 29],
                home: "/home/alice".into(),
            }
        );
        assert_eq!(
            resolve("1000", Some(PASSWD_TEXT), Some(GROUP_TEXT)).unwrap(),
            alice
        );
        let pair = resolve("1000:29", Some(PASSWD_TEXT), Some(GROUP_TEXT)).unwrap();
        assert_eq!(
            (pair.gid, pair.groups, pair.home.as_str()),
            (29, vec![29], "/home/alice")
        );
    }

    #[test]
    fn a_uid_without_a_line_runs_with_gid_0_and_home_slash() {
        let nobody = resolve("4242", Some(PASSWD_TEXT), None).unwrap();
        assert_eq!((nobody.name, nobody.uid, nobody.gid), (None, 4242, 0));
        assert_eq!((nobody.groups, nobody.home.as_str()), (vec![0], "/"));
        assert_eq!(
            resolve("nohome", Some(PASSWD_TEXT), None).unwrap().home,
            "/"
        );
    }

    #[test]
    fn unknown_malformed_and_broken_users_are_refused() {
        let err = resolve("bob", Some(PASSWD_TEXT), None).unwrap_err();
        assert!(
            err.to_string()
                .contains("\"bob\" not found in the sandbox's /etc/passwd"),
            "{err}"
        );
        assert!(matches!(
            resolve("bob", None, None),
            Err(UserError::Unknown { .. })
        ));
        assert!(matches!(
            resolve("broken", Some(PASSWD_TEXT), None),
            Err(UserError::BadLine { line: 4, .. })
        ));
        for bad in [
            "",
            "-x",
            "a b",
            "x:y",
            "1:",
            "99999999999",
            "a/b",
            &"a".repeat(65),
        ] {
            assert!(
                matches!(UserSpec::parse(bad), Err(UserError::Malformed { .. })),
                "{bad:?}"
            );
        }
        assert_eq!(
            UserSpec::parse("svc$").unwrap(),
            UserSpec::Name("svc$".into())
        );
    }

    #[test]
    fn the_environment_given_wins() {
        let alice = resolve("alice", Some(PASSWD_TEXT), None).unwrap();
        let mut env = vec!["HOME=/elsewhere".to_owned(), "HOMEX=1".to_owned()];
        alice.fill_env(&mut env);
        assert_eq!(
            env,
            ["HOME=/elsewhere", "HOMEX=1", "USER=alice", "LOGNAME=alice"]
        );
    }
}
