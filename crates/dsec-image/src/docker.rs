//! `docker://REF`: an image copied out of the local Docker daemon.
//!
//! The daemon exports it as a `docker save` archive, spooled into the staging area, and
//! the archive goes through the same import as any other `docker save` file: the same
//! environment then runs on the native backends, with nothing converted by hand.

use std::path::Path;
use std::time::Duration;

use bollard::Docker;
use futures::StreamExt;
use tempfile::NamedTempFile;
use tokio::io::AsyncWriteExt;

use crate::error::{io_error, ImageError};

/// The source prefix that names an image of the Docker daemon.
pub(crate) const SCHEME: &str = "docker://";

/// How long the daemon may take to answer at all.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Exports `reference` from the daemon (`DOCKER_HOST`, else the local socket) into a
/// temporary file under `staging`. `input` is the source as the caller wrote it.
pub(crate) async fn export(
    reference: &str,
    input: &str,
    staging: &Path,
) -> Result<NamedTempFile, ImageError> {
    let unreachable = |why: String| ImageError::Registry {
        reference: input.to_owned(),
        reason: format!("the Docker daemon is not reachable: {why}"),
    };
    let docker = Docker::connect_with_defaults().map_err(|e| unreachable(e.to_string()))?;
    let docker = tokio::time::timeout(CONNECT_TIMEOUT, docker.negotiate_version())
        .await
        .map_err(|_| unreachable("no answer within 5 s".into()))?
        .map_err(|e| unreachable(e.to_string()))?;
    if let Err(e) = docker.inspect_image(reference).await {
        return Err(match e {
            bollard::errors::Error::DockerResponseServerError {
                status_code: 404, ..
            } => ImageError::InvalidSource {
                input: input.to_owned(),
                reason: format!("the Docker daemon has no image {reference:?}"),
            },
            other => unreachable(other.to_string()),
        });
    }
    tracing::info!(reference = %reference, "exporting image from the Docker daemon");
    let spooled = NamedTempFile::new_in(staging).map_err(io_error(format!(
        "cannot create a file in {}",
        staging.display()
    )))?;
    let file = spooled
        .reopen()
        .map_err(io_error("cannot reopen the export file"))?;
    let mut out = tokio::fs::File::from_std(file);
    let mut stream = docker.export_image(reference);
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ImageError::Registry {
            reference: input.to_owned(),
            reason: format!("exporting from the Docker daemon: {e}"),
        })?;
        out.write_all(&chunk)
            .await
            .map_err(io_error("cannot write the exported image"))?;
    }
    out.flush()
        .await
        .map_err(io_error("cannot write the exported image"))?;
    Ok(spooled)
}
