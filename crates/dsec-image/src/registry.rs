//! Pulling images from OCI registries (any OCI or Docker image; `distribution` shares
//! dsec's own).
//!
//! Only the manifest, the config and the layers not already in the store are
//! downloaded, into a staging directory; the layers then go through the same
//! unpacking as any other source.

use std::net::Ipv4Addr;
use std::path::Path;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::OciDistributionError;
use oci_client::manifest::ImageIndexEntry;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use tempfile::TempDir;
use tokio::io::AsyncWriteExt;

use crate::digest::sha256;
use crate::egress::{Blocked, Guard};
use crate::error::{io_error, ImageError};
use crate::plan::{parse_config, Plan, PlannedLayer};

/// Layers downloaded at once.
const PARALLEL_DOWNLOADS: usize = 4;

/// Registries reached over plain HTTP besides loopback ones (comma separated `host[:port]`).
const INSECURE_ENV: &str = "DSEC_INSECURE_REGISTRIES";

/// How long a registry may take to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a pull waits for a registry's answer, and for each read of a body (a large
/// layer that keeps arriving is not bounded): one that accepts and never answers would
/// otherwise hold the import, and the creates waiting on its pull, forever. Not for
/// pushes: reqwest counts this from the request's start, so it would bound an upload.
pub(crate) const READ_TIMEOUT: Duration = Duration::from_secs(60);

/// File name endings that mark a source as a path, never a reference.
pub(crate) const ARCHIVE_SUFFIXES: [&str; 4] = [".tar.gz", ".tar.zst", ".tgz", ".tar"];

/// Parses `source` as a registry reference, unless it can only be meant as a path.
pub(crate) fn parse_reference(source: &str) -> Option<Reference> {
    let path_like =
        source.starts_with(['/', '.', '~']) || ARCHIVE_SUFFIXES.iter().any(|s| source.ends_with(s));
    if path_like {
        return None;
    }
    source.parse().ok()
}

/// Downloads what the store lacks of the image `reference` into a staging
/// directory and returns the plan to import it. `stored` says whether the store has a
/// layer already (and keeps it for this import); those are not downloaded. A project's
/// pull connects only through its `guard`, and fails as not allowed if the guard refused
/// a destination on the way.
pub(crate) async fn fetch(
    mut stored: impl FnMut(&str) -> Result<bool, ImageError>,
    staging: &Path,
    reference: &Reference,
    input: &str,
    guard: Option<&Guard>,
) -> Result<(Plan, TempDir), ImageError> {
    let registry_error = |e: OciDistributionError| match guard.and_then(Guard::blocked) {
        Some(Blocked::Refused(refusal)) => ImageError::NotAllowed {
            input: input.to_owned(),
            reason: refusal.to_string(),
        },
        Some(Blocked::Unreachable(why)) => ImageError::Registry {
            reference: input.to_owned(),
            reason: why,
        },
        None => ImageError::Registry {
            reference: input.to_owned(),
            reason: e.to_string(),
        },
    };
    let client = client_for(reference, guard);
    let (manifest, digest, config) = client
        .pull_manifest_and_config(reference, &RegistryAuth::Anonymous)
        .await
        .map_err(registry_error)?;
    tracing::debug!(reference = %input, manifest = %digest, "pulled manifest");
    let id = sha256(config.as_bytes());
    if id != manifest.config.digest {
        return Err(ImageError::Corrupt {
            input: input.to_owned(),
            reason: "the image config does not match its digest".into(),
        });
    }
    let (config, diff_ids) =
        parse_config(config.as_bytes(), manifest.layers.len()).map_err(|f| f.into_error(input))?;
    let downloads = tempfile::Builder::new()
        .prefix("pull-")
        .tempdir_in(staging)
        .map_err(io_error("cannot create a staging directory"))?;
    let mut layers = Vec::with_capacity(diff_ids.len());
    let mut wanted = Vec::new();
    for (index, (layer, diff_id)) in manifest.layers.iter().zip(diff_ids).enumerate() {
        let blob = downloads.path().join(format!("layer-{index}"));
        if stored(&diff_id)? {
            tracing::debug!(reference = %input, layer = %diff_id, "layer already stored");
        } else {
            wanted.push((layer.clone(), blob.clone()));
        }
        layers.push(PlannedLayer {
            diff_id,
            blob,
            // pull_blob has checked it already.
            blob_digest: None,
        });
    }
    let client = &client;
    futures::stream::iter(wanted)
        .map(|(layer, blob)| async move {
            let mut file = tokio::fs::File::create(&blob)
                .await
                .map_err(io_error("cannot create a download file"))?;
            client
                .pull_blob(reference, &layer, &mut file)
                .await
                .map_err(registry_error)?;
            file.flush()
                .await
                .map_err(io_error("cannot write a download file"))?;
            tracing::debug!(reference = %input, blob = %layer.digest, "pulled layer");
            Ok::<(), ImageError>(())
        })
        .buffer_unordered(PARALLEL_DOWNLOADS)
        .try_collect::<Vec<()>>()
        .await?;
    Ok((Plan { id, config, layers }, downloads))
}

fn client_for(reference: &Reference, guard: Option<&Guard>) -> Client {
    let proxy = guard.map(|g| g.url().to_owned());
    Client::new(ClientConfig {
        platform_resolver: Some(Box::new(pick_platform)),
        https_proxy: proxy.clone(),
        http_proxy: proxy,
        ..client_config(reference.resolve_registry(), Some(READ_TIMEOUT))
    })
}

/// What every client of a registry at `registry` (`host[:port]`) starts from: its
/// protocol, and bounds on a registry that does not answer (`read_timeout`: pulls only,
/// see [`READ_TIMEOUT`]).
pub(crate) fn client_config(registry: &str, read_timeout: Option<Duration>) -> ClientConfig {
    ClientConfig {
        protocol: protocol_for(registry),
        connect_timeout: Some(CONNECT_TIMEOUT),
        read_timeout,
        ..ClientConfig::default()
    }
}

/// Plain HTTP for loopback registries and those in `DSEC_INSECURE_REGISTRIES`, else HTTPS.
fn protocol_for(registry: &str) -> ClientProtocol {
    let insecure = std::env::var(INSECURE_ENV).unwrap_or_default();
    if is_insecure(registry, &insecure) {
        ClientProtocol::Http
    } else {
        ClientProtocol::Https
    }
}

/// linux/amd64 if the index offers it, else its first entry.
fn pick_platform(manifests: &[ImageIndexEntry]) -> Option<String> {
    manifests
        .iter()
        .find(|m| {
            m.platform
                .as_ref()
                .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
        })
        .or_else(|| manifests.first())
        .map(|m| m.digest.clone())
}

/// Loopback registries and those listed in `extra` speak plain HTTP.
fn is_insecure(registry: &str, extra: &str) -> bool {
    let host = host_of(registry);
    let loopback = host == "localhost"
        || host == "::1"
        || host.parse::<Ipv4Addr>().is_ok_and(|ip| ip.is_loopback());
    loopback
        || extra
            .split(',')
            .map(str::trim)
            .any(|r| !r.is_empty() && (r == registry || r == host))
}

/// The host part of `host[:port]` or `[v6]:port`.
fn host_of(registry: &str) -> &str {
    match registry.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => registry.rsplit_once(':').map_or(registry, |(host, _)| host),
    }
}

/// Runs `talk` with the `host:port` of a registry that accepts connections and never
/// answers, and checks that it came back within 10 s (its bounds, not the test's).
#[cfg(test)]
pub(crate) async fn against_a_silent_registry<T, F>(talk: impl FnOnce(String) -> F) -> T
where
    F: std::future::Future<Output = T>,
{
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let started = std::time::Instant::now();
    let out = talk(silent.local_addr().unwrap().to_string()).await;
    let took = started.elapsed();
    assert!(took < Duration::from_secs(10), "{took:?}");
    drop(silent);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_listed_registries_are_plain_http() {
        assert!(is_insecure("localhost:5000", ""));
        assert!(is_insecure("127.0.0.1:5000", ""));
        assert!(is_insecure("[::1]:5000", ""));
        assert!(!is_insecure("registry-1.docker.io", ""));
        assert!(is_insecure("reg.lan:5000", "other, reg.lan:5000"));
        assert!(is_insecure("reg.lan:5000", "reg.lan"));
        assert!(!is_insecure("reg.lan:5000", "reg.lan:6000"));
    }

    #[tokio::test]
    async fn a_registry_that_never_answers_fails_the_pull() {
        let pulled = against_a_silent_registry(|registry| async move {
            let reference: Reference = format!("{registry}/x:latest").parse().unwrap();
            let client = Client::new(client_config(&registry, Some(Duration::from_millis(300))));
            client
                .pull_manifest(&reference, &RegistryAuth::Anonymous)
                .await
        })
        .await;
        assert!(pulled.is_err(), "a silent registry answered");
    }

    #[test]
    fn paths_are_not_references() {
        assert!(parse_reference("/nonexistent/rootfs").is_none());
        assert!(parse_reference("./rootfs").is_none());
        assert!(parse_reference("image.tar.gz").is_none());
        assert!(parse_reference("not a reference").is_none());
        let reference = parse_reference("127.0.0.1:5000/test/img:v1").unwrap();
        assert_eq!(reference.registry(), "127.0.0.1:5000");
        assert!(parse_reference("busybox").is_some());
    }
}
