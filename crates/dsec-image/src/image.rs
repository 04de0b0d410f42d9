//! What the store records about an image.

use serde::{Deserialize, Serialize};

/// An image as the store knows it: enough to stack its layers and start its process.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Image {
    /// The name it was imported under.
    pub name: String,
    /// `sha256:<hex>` of the config JSON (OCI and Docker sources) or of the
    /// JSON list of diff ids (rootfs sources).
    pub id: String,
    /// Bytes of file content in its layers.
    pub size: u64,
    /// Diff ids (`sha256:<hex>` of each uncompressed layer tar), bottom first.
    pub layers: Vec<String>,
    /// When it was imported, in unix seconds.
    pub created_at: f64,
    /// Run-time defaults from the image config.
    pub config: ImageConfig,
    /// Set on the image a fork makes: it belongs to the forked sandboxes and is removed
    /// once none of them is left. Images a user named have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork: Option<Fork>,
}

/// Whose an image made by a fork is.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Fork {
    /// The edge whose sandboxes use it (the only one that may remove it).
    pub edge: String,
    /// The sandbox that was forked.
    pub parent: String,
}

/// The run-time defaults an image carries.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ImageConfig {
    /// Environment, as `K=V`.
    pub env: Vec<String>,
    /// Working directory, if the image sets one.
    pub workdir: Option<String>,
    /// Default arguments (appended to the entrypoint).
    pub cmd: Vec<String>,
    /// Command prefix.
    pub entrypoint: Vec<String>,
}
