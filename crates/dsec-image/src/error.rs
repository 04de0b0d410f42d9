//! Errors of the image store.

use std::io;
use std::path::Path;

use rustix::io::Errno;

/// Why an image operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// No image of that name is stored.
    #[error("image {name:?} not found; import it first")]
    NotFound {
        /// The name that was looked up.
        name: String,
    },
    /// The source is neither a usable path nor a registry reference, or the name is invalid.
    #[error("cannot import {input:?}: {reason}")]
    InvalidSource {
        /// The source string as given.
        input: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The source is damaged: truncated or corrupt archive, bad digest, missing blob, unsafe entry.
    #[error("{input:?} is corrupt: {reason}")]
    Corrupt {
        /// The source string as given (or the image name, for damaged metadata).
        input: String,
        /// What is damaged.
        reason: String,
    },
    /// The image is a bootable disk ([`crate::Image::disk`]): its one blob is a qcow2 that
    /// only a VM's firmware boots, never a filesystem the host mounts.
    #[error("image {name:?} is a bootable disk (its own bootloader and kernel): create it with backend=\"vm\"")]
    BootableDisk {
        /// The image's name.
        name: String,
    },
    /// The registry could not be reached or refused the pull.
    #[error("cannot pull {reference:?}: {reason}")]
    Registry {
        /// The reference being pulled.
        reference: String,
        /// What the registry or the transport said.
        reason: String,
    },
    /// The image was stored here but could not be pushed to the fleet's registry.
    #[error("image {image:?} was imported on this edge but not pushed to {reference}: {reason}; other edges cannot use it until it is imported again")]
    Push {
        /// The image.
        image: String,
        /// Where it was to go.
        reference: String,
        /// What the registry or the transport said.
        reason: String,
    },
    /// The name is taken by an image of another owner, which an import or snapshot
    /// never replaces.
    #[error("image {name:?} belongs to {owner}: choose another name")]
    Owned {
        /// The name.
        name: String,
        /// Whose it is (`the admin`, or `project "NAME"`).
        owner: String,
    },
    /// A project asked for a source only the admin may import: a host path outside the
    /// import roots, or the host's Docker daemon.
    #[error("{input:?} is not a project's to import: {reason}")]
    NotAllowed {
        /// The source as given.
        input: String,
        /// Why, and what the project may import instead.
        reason: String,
    },
    /// The layer store cannot take or give a layer: it is full, read-only or unreachable.
    /// Nothing half-written is left in it.
    #[error("the layer store {store}: {reason}")]
    Store {
        /// The store's root.
        store: String,
        /// What is wrong, and what to do.
        reason: String,
    },
    /// A filesystem operation of the store itself failed.
    #[error("{context}")]
    Io {
        /// What the store was doing.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

/// Returns a mapper from an I/O error to [`ImageError::Io`] with the given context.
pub(crate) fn io_error(context: impl Into<String>) -> impl FnOnce(io::Error) -> ImageError {
    let context = context.into();
    move |source| ImageError::Io { context, source }
}

/// Says what an I/O error of the layer store at `store` means for its user: the store is
/// full, read-only or gone ([`ImageError::Store`]), or something else broke ([`ImageError::Io`]).
pub(crate) fn store_error(
    store: &Path,
    context: impl Into<String>,
) -> impl FnOnce(io::Error) -> ImageError {
    let (store, context) = (store.display().to_string(), context.into());
    move |source| {
        let reason = match Errno::from_io_error(&source) {
            Some(Errno::NOSPC | Errno::DQUOT) => "is full; free space or prune images",
            Some(Errno::ROFS) => "is read-only",
            Some(Errno::NOENT | Errno::STALE | Errno::NOTCONN | Errno::IO | Errno::NODEV) => {
                "is not reachable (unmounted, gone or failing)"
            }
            _ => return ImageError::Io { context, source },
        };
        ImageError::Store {
            store,
            reason: format!("{reason} ({context}: {source})"),
        }
    }
}

/// A failure deep inside an import, before it is known which source it concerns.
#[derive(Debug)]
pub(crate) enum Fault {
    /// The input is damaged.
    Corrupt(String),
    /// The store's own filesystem failed.
    Io(String, io::Error),
}

impl Fault {
    /// Returns a mapper from an I/O error to [`Fault::Io`] with the given context.
    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(io::Error) -> Fault {
        let context = context.into();
        move |source| Fault::Io(context, source)
    }

    /// Attaches the source string the import was given.
    pub(crate) fn into_error(self, input: &str) -> ImageError {
        match self {
            Fault::Corrupt(reason) => ImageError::Corrupt {
                input: input.to_owned(),
                reason,
            },
            Fault::Io(context, source) => ImageError::Io { context, source },
        }
    }
}
