//! dsec's content-addressed image and layer store.
//!
//! Images come from OCI layout directories, `docker save` archives, rootfs
//! directories or tarballs, OCI registries, and the local Docker daemon
//! (`docker://REF`). Whatever the source, every
//! layer ends up unpacked once under `layers/sha256/<diff id>/`, with OCI
//! whiteouts already turned into overlayfs ones, ready to be a lowerdir; an
//! image is a small JSON record naming its layers and run-time defaults.
//!
//! Invariants the rest of dsec can rely on:
//! - a layer directory is complete once it exists: it appears by `rename`
//!   from the staging area, never by being written in place;
//! - an image's metadata is written last, atomically, after its layers are on
//!   disk, so a failed import leaves no image behind;
//! - layers are deleted only by [`ImageStore::remove`], and never while an
//!   image, a live sandbox (`in_use`) or an import in flight relies on them.
#![warn(missing_docs)]

mod digest;
mod docker;
mod error;
mod oci;
mod registry;
mod rootfs;
mod store;
mod unpack;

pub use error::ImageError;
pub use store::{Image, ImageConfig, ImageStore};
