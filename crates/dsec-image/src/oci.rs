//! Reading OCI image layouts and `docker save` archives into an import plan.
//!
//! Everything read here is untrusted: digests are checked before a blob is
//! believed, and every path named by a manifest must resolve inside the
//! source directory.

use std::fs;
use std::path::{Path, PathBuf};

use oci_spec::image::{Arch, Descriptor, ImageIndex, ImageManifest, MediaType, Os};
use serde::Deserialize;

use crate::digest::{sha256, sha256_hex};
use crate::error::Fault;
use crate::plan::{parse, parse_config, Plan, PlannedLayer};

/// Image indexes nested deeper than this are refused.
const MAX_INDEX_DEPTH: usize = 4;

/// Is `dir` an OCI image layout?
pub(crate) fn is_oci_layout(dir: &Path) -> bool {
    dir.join("oci-layout").is_file() && dir.join("index.json").is_file()
}

/// Is `dir` an unpacked `docker save` archive of the legacy kind?
pub(crate) fn is_docker_archive(dir: &Path) -> bool {
    dir.join("manifest.json").is_file()
}

/// Plans the import of an OCI image layout: index (possibly nested) → manifest → config + layers.
pub(crate) fn plan_oci_layout(dir: &Path) -> Result<Plan, Fault> {
    let index: ImageIndex = parse(&read_inside(dir, "index.json")?, "index.json")?;
    let mut descriptor = pick_manifest(&index)?;
    for _ in 0..MAX_INDEX_DEPTH {
        let digest = descriptor.digest().to_string();
        let bytes = read_blob(dir, &digest)?;
        if is_index(&descriptor, &bytes) {
            let nested: ImageIndex = parse(&bytes, &digest)?;
            descriptor = pick_manifest(&nested)?;
            continue;
        }
        let manifest: ImageManifest = parse(&bytes, &digest)?;
        return plan_manifest(dir, &manifest);
    }
    Err(Fault::Corrupt("image indexes are nested too deeply".into()))
}

fn plan_manifest(dir: &Path, manifest: &ImageManifest) -> Result<Plan, Fault> {
    let config_digest = manifest.config().digest().to_string();
    let config_bytes = read_blob(dir, &config_digest)?;
    let (config, diff_ids) = parse_config(&config_bytes, manifest.layers().len())?;
    let layers = manifest
        .layers()
        .iter()
        .zip(diff_ids)
        .map(|(layer, diff_id)| {
            let blob_digest = layer.digest().to_string();
            Ok(PlannedLayer {
                diff_id,
                blob: blob_path(dir, &blob_digest)?,
                blob_digest: Some(blob_digest),
            })
        })
        .collect::<Result<_, Fault>>()?;
    Ok(Plan {
        id: config_digest,
        config,
        layers,
    })
}

/// linux/amd64 if the index offers it, else its first entry.
fn pick_manifest(index: &ImageIndex) -> Result<Descriptor, Fault> {
    let manifests = index.manifests();
    manifests
        .iter()
        .find(|m| {
            m.platform()
                .as_ref()
                .is_some_and(|p| *p.os() == Os::Linux && *p.architecture() == Arch::Amd64)
        })
        .or_else(|| manifests.first())
        .cloned()
        .ok_or_else(|| Fault::Corrupt("an image index lists no manifests".into()))
}

/// Media types lie often enough that the content decides: an index has `manifests`.
fn is_index(descriptor: &Descriptor, bytes: &[u8]) -> bool {
    #[derive(Deserialize)]
    struct Probe {
        manifests: Option<serde::de::IgnoredAny>,
    }
    *descriptor.media_type() == MediaType::ImageIndex
        || serde_json::from_slice::<Probe>(bytes).is_ok_and(|p| p.manifests.is_some())
}

/// `manifest.json` of `docker save`: one entry per saved image.
#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerManifest {
    config: String,
    layers: Vec<String>,
}

/// Plans the import of an unpacked legacy `docker save` archive
/// (`manifest.json`, `<hex>.json`, `<id>/layer.tar` or `blobs/sha256/<hex>`).
pub(crate) fn plan_docker_archive(dir: &Path) -> Result<Plan, Fault> {
    let manifests: Vec<DockerManifest> =
        parse(&read_inside(dir, "manifest.json")?, "manifest.json")?;
    let manifest = manifests
        .into_iter()
        .next()
        .ok_or_else(|| Fault::Corrupt("manifest.json lists no images".into()))?;
    let config_bytes = read_inside(dir, &manifest.config)?;
    let id = sha256(&config_bytes);
    if digest_in_name(&manifest.config).is_some_and(|expected| expected != id) {
        return Err(Fault::Corrupt(format!(
            "{} does not match its digest",
            manifest.config
        )));
    }
    let (config, diff_ids) = parse_config(&config_bytes, manifest.layers.len())?;
    let layers = manifest
        .layers
        .iter()
        .zip(diff_ids)
        .map(|(layer, diff_id)| {
            Ok(PlannedLayer {
                diff_id,
                blob: path_inside(dir, layer)?,
                blob_digest: digest_in_name(layer),
            })
        })
        .collect::<Result<_, Fault>>()?;
    Ok(Plan { id, config, layers })
}

/// The content digest a `docker save` file name carries, if any:
/// `blobs/sha256/<hex>` or `<hex>.json`.
fn digest_in_name(name: &str) -> Option<String> {
    let hex = name
        .strip_prefix("blobs/sha256/")
        .or_else(|| name.strip_suffix(".json"))?;
    let digest = format!("sha256:{hex}");
    sha256_hex(&digest).is_some().then_some(digest)
}

/// The path of a blob in an OCI layout; only sha256 digests are accepted.
fn blob_path(dir: &Path, digest: &str) -> Result<PathBuf, Fault> {
    let hex = sha256_hex(digest)
        .ok_or_else(|| Fault::Corrupt(format!("digest {digest:?} is not a sha256 digest")))?;
    path_inside(dir, &format!("blobs/sha256/{hex}"))
}

/// Reads a blob and checks its digest.
fn read_blob(dir: &Path, digest: &str) -> Result<Vec<u8>, Fault> {
    let path = blob_path(dir, digest)?;
    let bytes = fs::read(&path).map_err(Fault::io(format!("cannot read {}", path.display())))?;
    if sha256(&bytes) != digest {
        return Err(Fault::Corrupt(format!(
            "blob {digest} does not match its digest"
        )));
    }
    Ok(bytes)
}

fn read_inside(dir: &Path, rel: &str) -> Result<Vec<u8>, Fault> {
    let path = path_inside(dir, rel)?;
    fs::read(&path).map_err(Fault::io(format!("cannot read {}", path.display())))
}

/// Resolves `rel` under `dir`, refusing anything missing or resolving
/// (through `..` or symlinks) outside `dir`.
fn path_inside(dir: &Path, rel: &str) -> Result<PathBuf, Fault> {
    let base = dir
        .canonicalize()
        .map_err(Fault::io(format!("cannot resolve {}", dir.display())))?;
    let resolved = match base.join(rel).canonicalize() {
        Ok(path) => path,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Fault::Corrupt(format!("{rel} is missing")))
        }
        Err(e) => return Err(Fault::Io(format!("cannot resolve {rel}"), e)),
    };
    if !resolved.starts_with(&base) || !resolved.is_file() {
        return Err(Fault::Corrupt(format!(
            "{rel} is not a file inside the image"
        )));
    }
    Ok(resolved)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_in_docker_save_names() {
        let hex = "a".repeat(64);
        assert_eq!(
            digest_in_name(&format!("blobs/sha256/{hex}")),
            Some(format!("sha256:{hex}"))
        );
        assert_eq!(
            digest_in_name(&format!("{hex}.json")),
            Some(format!("sha256:{hex}"))
        );
        assert_eq!(digest_in_name(&format!("{hex}/layer.tar")), None);
        assert_eq!(digest_in_name("config.json"), None);
    }
}
