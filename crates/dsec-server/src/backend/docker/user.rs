//! `user=` on docker sandboxes: the user is looked up by dsec, with the parser a native
//! sandbox's init uses, in the container's own `/etc/passwd` and `/etc/group` (read
//! through the archive API), so both backends refuse the same users in the same words
//! and set the same `HOME`, `USER`, `LOGNAME` and working directory. The exec's `User`
//! then has runc take the identity, from the same files.

use dsec_runtime::users::{self, GROUP, MAX_FILE_BYTES, PASSWD};

use super::DockerSandbox;
use crate::backend::{RunAs, Sandbox};
use dsec_api::ErrorKind;

use crate::error::ApiError;

impl DockerSandbox {
    /// Resolves `run_as` for a command with environment `env` and working directory
    /// `cwd`, both adjusted for the user; returns the exec's `User`.
    pub(super) async fn user(
        &self,
        run_as: &RunAs,
        env: &mut Vec<String>,
        cwd: &mut String,
    ) -> Result<String, ApiError> {
        let invalid = |e: users::UserError| ApiError::invalid(e.to_string());
        users::UserSpec::parse(&run_as.user).map_err(invalid)?;
        let passwd = self.small_file(&run_as.user, PASSWD).await?;
        let group = self.small_file(&run_as.user, GROUP).await?;
        let account =
            users::resolve(&run_as.user, passwd.as_deref(), group.as_deref()).map_err(invalid)?;
        account.fill_env(env);
        if run_as.home_cwd && self.stat(&account.home).await.is_ok_and(|i| i.is_dir) {
            cwd.clone_from(&account.home);
        }
        Ok(run_as.user.clone())
    }

    /// A passwd or group file of the container, whole; `None` when it does not exist.
    async fn small_file(&self, user: &str, path: &'static str) -> Result<Option<String>, ApiError> {
        let unreadable = |reason: String| {
            ApiError::invalid(
                users::UserError::Unreadable {
                    user: user.to_owned(),
                    file: path,
                    reason,
                }
                .to_string(),
            )
        };
        let mut read = match self.read_file(path, MAX_FILE_BYTES).await {
            Ok(read) => read,
            Err(e) if e.kind == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(unreadable(e.message)),
        };
        let mut data = Vec::new();
        while let Some(chunk) = read.next().await {
            data.extend_from_slice(&chunk.map_err(|e| unreadable(e.message))?);
        }
        String::from_utf8(data)
            .map(Some)
            .map_err(|_| unreadable("it is not UTF-8".into()))
    }
}
