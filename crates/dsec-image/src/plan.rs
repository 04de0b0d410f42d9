//! What an import has to do, whatever the source: the image's identity, its run-time
//! defaults and its layers. OCI layouts, `docker save` archives and registries each
//! produce one; the store carries it out.

use std::path::PathBuf;

use oci_spec::image::ImageConfiguration;

use crate::digest::sha256_hex;
use crate::error::Fault;
use crate::image::ImageConfig;

/// What an import has to do: the image's identity and its layers, bottom first.
pub(crate) struct Plan {
    pub(crate) id: String,
    pub(crate) config: ImageConfig,
    pub(crate) layers: Vec<PlannedLayer>,
}

/// One layer to bring into the store.
pub(crate) struct PlannedLayer {
    /// The diff id the image config promises; checked after unpacking.
    pub(crate) diff_id: String,
    /// Where the (possibly compressed) layer tar is; unused if the layer is already stored.
    pub(crate) blob: PathBuf,
    /// The digest the blob itself must have, when known.
    pub(crate) blob_digest: Option<String>,
}

/// Parses an image config, checking it names one well-formed diff id per layer.
pub(crate) fn parse_config(
    bytes: &[u8],
    layer_count: usize,
) -> Result<(ImageConfig, Vec<String>), Fault> {
    let config: ImageConfiguration = parse(bytes, "the image config")?;
    let diff_ids = config.rootfs().diff_ids().clone();
    if diff_ids.len() != layer_count {
        return Err(Fault::Corrupt(format!(
            "the image config lists {} diff ids for {layer_count} layers",
            diff_ids.len()
        )));
    }
    if let Some(bad) = diff_ids.iter().find(|d| sha256_hex(d).is_none()) {
        return Err(Fault::Corrupt(format!(
            "diff id {bad:?} is not a sha256 digest"
        )));
    }
    Ok((image_config(&config), diff_ids))
}

/// The run-time defaults of an OCI or Docker image config.
fn image_config(config: &ImageConfiguration) -> ImageConfig {
    let Some(c) = config.config() else {
        return ImageConfig::default();
    };
    ImageConfig {
        env: c.env().clone().unwrap_or_default(),
        workdir: c.working_dir().clone().filter(|w| !w.is_empty()),
        cmd: c.cmd().clone().unwrap_or_default(),
        entrypoint: c.entrypoint().clone().unwrap_or_default(),
    }
}

pub(crate) fn parse<T: serde::de::DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T, Fault> {
    serde_json::from_slice(bytes).map_err(|e| Fault::Corrupt(format!("{what} is unreadable: {e}")))
}
