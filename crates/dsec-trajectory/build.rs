//! Tells the tests whether PostgreSQL is installed here: its tests start a cluster of
//! their own, and where there is none to start they are ignored, with the reason, rather
//! than failed or passed.

use std::path::Path;

/// Where Debian's `postgresql` package puts each version's programs.
const PG_LIB: &str = "/usr/lib/postgresql";

fn main() {
    println!("cargo::rustc-check-cfg=cfg(postgres_installed)");
    println!("cargo::rerun-if-env-changed=DSEC_PG_BIN");
    // Installing the package changes the first; where it has never been installed, the
    // second (Debian's package database) does.
    for watched in [PG_LIB, "/var/lib/dpkg/status"] {
        if Path::new(watched).exists() {
            println!("cargo::rerun-if-changed={watched}");
            break;
        }
    }
    let installed = match std::env::var_os("DSEC_PG_BIN") {
        Some(bin) => Path::new(&bin).join("initdb").exists(),
        None => std::fs::read_dir(PG_LIB)
            .into_iter()
            .flatten()
            .flatten()
            .any(|v| v.path().join("bin/initdb").exists()),
    };
    if installed {
        println!("cargo::rustc-cfg=postgres_installed");
    }
}
