//! dsec's content-addressed image and layer store.
//!
//! Images come from OCI layout directories, `docker save` archives, rootfs
//! directories or tarballs, OCI registries, and the local Docker daemon
//! (`docker://REF`); bootable qcow2 or raw disks become *disk images* for the `vm`
//! backend, whose one blob is the disk itself (`disk`). Whatever the source, every layer is unpacked once (OCI whiteouts
//! turned into overlayfs ones) and kept as an EROFS blob, `layers/sha256/<hex>.erofs`,
//! in a layer store that many servers may share; each server mounts the blobs its
//! sandboxes need once and every sandbox stacks those mounts. An image is a small JSON
//! record naming its layers and run-time defaults.
//!
//! [`ImageStore`] is the hub: the sources (`oci`: layouts and `docker save` archives,
//! `registry`, `docker`: the daemon, `tree`: directories) each turn their input into a
//! `plan` or a layer (`unpack`), and only the store writes anything into itself (`blob`
//! builds and publishes, `mount` mounts, `holds` keeps layers from the collector). A
//! project's registry pull connects through an `egress` guard, which keeps it off the
//! server's own network.
//! A fleet's edges may share images through an OCI registry ([`Registry`]): imports are
//! pushed there as their blobs, and `distribution` brings missing images back.
//!
//! Invariants the rest of dsec can rely on:
//! - a blob is complete once its name exists: it is linked into place after being
//!   written and synced, never written in place, and never replaced;
//! - an image's metadata is written last, atomically, after its layers are stored,
//!   so a failed import leaves no image behind;
//! - a layer is deleted only by [`ImageStore::prune`] (which [`ImageStore::remove`]
//!   runs), and never while an image references it or anything holds it: a sandbox
//!   (through [`MountedImage`] or [`HeldBlobs`]), an import in flight, or another
//!   server sharing the store (through its lease);
//! - images have at most [`MAX_LAYERS`] layers, so every stored image can be stacked;
//! - layers keep what their source holds — setuid bits, file capabilities, device
//!   nodes — and are made inert on the host instead ([`seal`] says how and why).
#![warn(missing_docs)]

mod blob;
mod digest;
mod disk;
mod distribution;
mod docker;
mod egress;
mod error;
mod holds;
mod image;
mod mount;
mod oci;
mod plan;
mod registry;
pub mod seal;
mod store;
mod trash;
mod tree;
mod unpack;

pub use distribution::Registry;
pub use egress::ProjectReach;
pub use error::ImageError;
pub use image::{owned_name, DiskImage, Fork, GuestSnapshot, Image, ImageConfig};
pub use store::{
    HeldBlobs, ImageStore, ImportProgress, MountedImage, Pruned, StoreUsage, MAX_LAYERS,
};
