//! Images shared by a fleet through an OCI registry, in dsec's own form: the manifest's
//! layers are the store's EROFS blobs themselves and its config is the store's record of
//! the image, so an edge that pulls one stores the blobs as they come — nothing is
//! unpacked or rebuilt — and every edge mounts byte-identical layers.
//!
//! An image `NAME[:TAG]` lives at `<registry>/NAME:TAG` (`latest` when the name has no
//! tag). The registry must be trusted like the layer store itself: an edge mounts the
//! blobs it pulls (after checking each against the manifest's digest), and a blob's diff
//! id is the one the pushing edge recorded.
//!
//! A blob is sent whole from memory (the registry client takes a byte slice), so pushing
//! a layer costs its size in memory for the time of its upload; each request of a push is
//! bounded by [`upload_bound`].

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::manifest::{OciDescriptor, OciImageManifest, OCI_IMAGE_MEDIA_TYPE};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use tokio::io::AsyncWriteExt;

use crate::digest::sha256;
use crate::error::{io_error, ImageError};
use crate::image::Image;
use crate::registry::{client_config, READ_TIMEOUT};

/// The media type of the config: the store's JSON record of the image.
pub(crate) const CONFIG_MEDIA_TYPE: &str = "application/vnd.dsec.image.config.v1+json";
/// The media type of a layer: one EROFS blob of the store.
pub(crate) const LAYER_MEDIA_TYPE: &str = "application/vnd.dsec.image.layer.v1.erofs";
/// The annotation of a layer holding its diff id (what the store names the blob by).
const DIFF_ID: &str = "dev.dsec.image.diff-id";
/// The annotation of a layer holding the bytes of file content in it.
const CONTENT_SIZE: &str = "dev.dsec.image.content-size";

/// A blob's size as OCI descriptors carry it (a JSON int64).
fn descriptor_size(len: usize) -> i64 {
    i64::try_from(len).expect("a blob held in memory is smaller than 2^63 bytes")
}

/// Where a fleet's edges share images: `HOST[:PORT][/PREFIX]` (`dsec edge --registry`).
#[derive(Clone, PartialEq, Eq)]
pub struct Registry {
    base: String,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.base)
    }
}

impl fmt::Display for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.base)
    }
}

impl Registry {
    /// Parses `HOST[:PORT][/PREFIX]`; a scheme is refused (loopback registries and those
    /// in `DSEC_INSECURE_REGISTRIES` are spoken to over plain HTTP, others over HTTPS).
    pub fn parse(base: &str) -> Result<Registry, ImageError> {
        let base = base.trim_end_matches('/');
        let invalid = |reason: &str| ImageError::InvalidSource {
            input: base.to_owned(),
            reason: format!("not a registry (HOST[:PORT][/PREFIX]): {reason}"),
        };
        if base.contains("://") {
            return Err(invalid("give it without a scheme"));
        }
        // The first part must be a registry host: without a dot or a port it would be
        // read as a repository on Docker Hub.
        let host = base.split('/').next().unwrap_or_default();
        if !(host.contains(['.', ':']) || host == "localhost") {
            return Err(invalid(
                "the first part must be a host with a dot or a port, or localhost",
            ));
        }
        let registry = Registry {
            base: base.to_owned(),
        };
        registry.reference("probe")?;
        Ok(registry)
    }

    /// The registry's `host[:port]`.
    pub fn host(&self) -> &str {
        self.base.split('/').next().unwrap_or_default()
    }

    /// Where image `name` is kept.
    pub fn reference(&self, name: &str) -> Result<Reference, ImageError> {
        let (repository, tag) = match name.rsplit_once(':') {
            Some((repository, tag)) if !tag.contains('/') => (repository, tag),
            _ => (name, "latest"),
        };
        format!("{}/{repository}:{tag}", self.base)
            .parse()
            .map_err(|e| ImageError::InvalidSource {
                input: name.to_owned(),
                reason: format!(
                    "image name {name:?} cannot name a repository of registry {}: {e} (registry repositories are lowercase letters, digits and . _ - /)",
                    self.base
                ),
            })
    }

    /// A client of this registry; `read_timeout` for pulls only (see [`READ_TIMEOUT`]).
    fn client(&self, read_timeout: Option<Duration>) -> Client {
        Client::new(client_config(self.host(), read_timeout))
    }
}

/// What the registry holds of an image: enough to store it.
pub(crate) struct Pulled {
    /// The image as the pushing edge recorded it.
    pub(crate) image: Image,
    /// Its layers, in the image's order: diff id and content size.
    pub(crate) layers: Vec<(String, u64)>,
    manifest: OciImageManifest,
    reference: Reference,
    client: Client,
}

/// The slowest upload a push waits for, past its first [`READ_TIMEOUT`]: a request of a
/// push may take that long plus a second per MiB it sends. The client has no read timeout
/// for pushes (see [`READ_TIMEOUT`]), so without this bound a registry that stopped
/// answering midway would hold the push, the import waiting on it, and the layer in
/// memory, for ever.
const SLOWEST_UPLOAD_BYTES_PER_S: f64 = 1024.0 * 1024.0;

/// How long a push's request sending `len` bytes may take, `grace` included.
fn upload_bound(len: usize, grace: Duration) -> Duration {
    // A blob held in memory is far below f64's 2^53 exact integers.
    #[allow(clippy::cast_precision_loss)]
    let upload = Duration::from_secs_f64(len as f64 / SLOWEST_UPLOAD_BYTES_PER_S);
    grace + upload
}

/// Runs `request` of a push (`what` it sends, `len` bytes) within its [`upload_bound`].
async fn within<T>(
    what: &str,
    len: usize,
    grace: Duration,
    request: impl Future<Output = Result<T, OciDistributionError>>,
) -> Result<T, String> {
    let bound = upload_bound(len, grace);
    match tokio::time::timeout(bound, request).await {
        Ok(done) => done.map_err(|e| e.to_string()),
        Err(_) => Err(format!(
            "the registry did not take {what} within {:.1} s (a push's request may take {} s \
             plus 1 s per MiB it sends)",
            bound.as_secs_f64(),
            grace.as_secs_f64()
        )),
    }
}

/// Pushes `image`, whose layer blobs are `blobs` (bottom first) with content sizes
/// `sizes`, to `registry`; returns the manifest's digest.
pub(crate) async fn push(
    registry: &Registry,
    image: &Image,
    blobs: &[PathBuf],
    sizes: &[u64],
) -> Result<String, ImageError> {
    push_within(registry, image, blobs, sizes, READ_TIMEOUT).await
}

/// [`push`], each request bounded by [`upload_bound`] with `grace`.
async fn push_within(
    registry: &Registry,
    image: &Image,
    blobs: &[PathBuf],
    sizes: &[u64],
    grace: Duration,
) -> Result<String, ImageError> {
    let reference = registry.reference(&image.name)?;
    let failed = |reason: String| ImageError::Push {
        image: image.name.clone(),
        reference: reference.to_string(),
        reason,
    };
    let client = registry.client(None);
    let auth = async {
        client
            .store_auth_if_needed(reference.resolve_registry(), &RegistryAuth::Anonymous)
            .await;
        Ok(())
    };
    within("the auth check", 0, grace, auth)
        .await
        .map_err(failed)?;
    let mut layers = Vec::with_capacity(blobs.len());
    for ((diff_id, blob), size) in image.layers.iter().zip(blobs).zip(sizes) {
        let data = tokio::fs::read(blob)
            .await
            .map_err(io_error(format!("cannot read layer {diff_id}")))?;
        let digest = sha256(&data);
        let what = format!("layer {diff_id} ({} bytes)", data.len());
        let layer_push = client.push_blob(&reference, &data, &digest);
        within(&what, data.len(), grace, layer_push)
            .await
            .map_err(failed)?;
        tracing::debug!(image = %image.name, layer = %diff_id, blob = %digest, "pushed layer");
        layers.push(OciDescriptor {
            media_type: LAYER_MEDIA_TYPE.to_owned(),
            digest,
            size: descriptor_size(data.len()),
            urls: None,
            annotations: Some(BTreeMap::from([
                (DIFF_ID.to_owned(), diff_id.clone()),
                (CONTENT_SIZE.to_owned(), size.to_string()),
            ])),
        });
    }
    let record = Image {
        fork: None,
        ..image.clone()
    };
    let config = serde_json::to_vec(&record).expect("an image record serializes");
    let config_digest = sha256(&config);
    let config_push = client.push_blob(&reference, &config, &config_digest);
    within("the image's record", config.len(), grace, config_push)
        .await
        .map_err(failed)?;
    let manifest = OciImageManifest {
        schema_version: 2,
        media_type: Some(OCI_IMAGE_MEDIA_TYPE.to_owned()),
        config: OciDescriptor {
            media_type: CONFIG_MEDIA_TYPE.to_owned(),
            digest: config_digest,
            size: descriptor_size(config.len()),
            urls: None,
            annotations: None,
        },
        layers,
        subject: None,
        artifact_type: None,
        annotations: None,
    };
    let manifest = manifest.into();
    let manifest_push = client.push_manifest(&reference, &manifest);
    let url = within("the manifest", 0, grace, manifest_push)
        .await
        .map_err(failed)?;
    tracing::info!(image = %image.name, reference = %reference, "pushed image");
    Ok(url)
}

/// Reads what the registry holds of image `name`: its manifest and record.
pub(crate) async fn fetch(registry: &Registry, name: &str) -> Result<Pulled, ImageError> {
    let reference = registry.reference(name)?;
    let failed = |reason: String| ImageError::Registry {
        reference: reference.to_string(),
        reason,
    };
    let client = registry.client(Some(READ_TIMEOUT));
    let (manifest, _) = client
        .pull_image_manifest(&reference, &RegistryAuth::Anonymous)
        .await
        .map_err(|e| {
            if not_there(&e) {
                ImageError::NotFound {
                    name: name.to_owned(),
                }
            } else {
                failed(e.to_string())
            }
        })?;
    if manifest.config.media_type != CONFIG_MEDIA_TYPE {
        return Err(failed(format!(
            "it is not a dsec image (config {:?}); import it instead: dsec image import {reference}",
            manifest.config.media_type
        )));
    }
    let mut config = Vec::new();
    client
        .pull_blob(&reference, &manifest.config, &mut config)
        .await
        .map_err(|e| failed(e.to_string()))?;
    let mut image: Image = serde_json::from_slice(&config)
        .map_err(|e| failed(format!("its image record is unreadable: {e}")))?;
    image.name = name.to_owned();
    image.fork = None;
    let mut layers = Vec::with_capacity(manifest.layers.len());
    for layer in &manifest.layers {
        let annotation = |key: &str| layer.annotations.as_ref().and_then(|a| a.get(key));
        let (Some(diff_id), Some(size)) = (annotation(DIFF_ID), annotation(CONTENT_SIZE)) else {
            return Err(failed(format!(
                "layer {} lacks dsec's annotations",
                layer.digest
            )));
        };
        let size = size
            .parse()
            .map_err(|_| failed(format!("layer {} has a bad content size", layer.digest)))?;
        if layer.media_type != LAYER_MEDIA_TYPE || crate::digest::sha256_hex(diff_id).is_none() {
            return Err(failed(format!(
                "layer {} is not a dsec layer",
                layer.digest
            )));
        }
        layers.push((diff_id.clone(), size));
    }
    if layers.iter().map(|(d, _)| d).ne(image.layers.iter()) {
        return Err(failed("its layers do not match its image record".into()));
    }
    Ok(Pulled {
        image,
        layers,
        manifest,
        reference,
        client,
    })
}

/// Whether the registry answered that it has no such image.
fn not_there(e: &OciDistributionError) -> bool {
    match e {
        OciDistributionError::ImageManifestNotFoundError(_) => true,
        OciDistributionError::RegistryError { envelope, .. } => envelope.errors.iter().any(|e| {
            matches!(
                e.code,
                OciErrorCode::ManifestUnknown | OciErrorCode::NameUnknown | OciErrorCode::NotFound
            )
        }),
        _ => false,
    }
}

impl Pulled {
    /// Downloads layer `index` into `out` (checked against the manifest's digest).
    pub(crate) async fn download(&self, index: usize, out: &Path) -> Result<(), ImageError> {
        let layer = &self.manifest.layers[index];
        let mut file = tokio::fs::File::create(out)
            .await
            .map_err(io_error(format!("cannot create {}", out.display())))?;
        self.client
            .pull_blob(&self.reference, layer, &mut file)
            .await
            .map_err(|e| ImageError::Registry {
                reference: self.reference.to_string(),
                reason: e.to_string(),
            })?;
        file.flush()
            .await
            .map_err(io_error(format!("cannot write {}", out.display())))?;
        file.sync_all()
            .await
            .map_err(io_error(format!("cannot sync {}", out.display())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::against_a_silent_registry;

    #[test]
    fn names_map_to_repositories_and_tags() {
        let r = Registry::parse("127.0.0.1:5000/dsec").unwrap();
        assert_eq!(
            r.reference("busybox").unwrap().whole(),
            "127.0.0.1:5000/dsec/busybox:latest"
        );
        assert_eq!(
            r.reference("py:3.11").unwrap().whole(),
            "127.0.0.1:5000/dsec/py:3.11"
        );
        assert_eq!(
            r.reference("team/img").unwrap().whole(),
            "127.0.0.1:5000/dsec/team/img:latest"
        );
        assert!(r.reference("Upper").is_err());
    }

    #[tokio::test]
    async fn a_registry_that_never_answers_fails_the_push() {
        let dir = tempfile::tempdir().unwrap();
        let blob = dir.path().join("layer");
        std::fs::write(&blob, vec![7u8; 4096]).unwrap();
        let image = Image {
            name: "x".into(),
            id: "sha256:0".into(),
            size: 4096,
            layers: vec!["sha256:1".into()],
            created_at: 0.0,
            config: crate::image::ImageConfig::default(),
            fork: None,
            guest: None,
            disk: None,
            project: None,
        };
        let pushed = against_a_silent_registry(|host| async move {
            let registry = Registry::parse(&host).unwrap();
            let grace = Duration::from_millis(300);
            push_within(&registry, &image, &[blob], &[4096], grace).await
        })
        .await;
        let Err(ImageError::Push { reason, .. }) = pushed else {
            panic!("a silent registry took the push: {pushed:?}");
        };
        assert!(reason.contains("did not take"), "{reason}");
    }

    #[test]
    fn an_upload_may_take_a_second_per_mib_past_its_grace() {
        let grace = Duration::from_secs(60);
        assert_eq!(upload_bound(0, grace), grace);
        assert_eq!(upload_bound(10 << 20, grace), Duration::from_secs(70));
    }

    #[test]
    fn a_registry_names_its_host() {
        assert!(Registry::parse("localhost:5000").is_ok());
        assert!(Registry::parse("registry.lan/dsec").is_ok());
        assert!(Registry::parse("http://registry.lan").is_err());
        assert!(Registry::parse("dsec").is_err());
    }
}
