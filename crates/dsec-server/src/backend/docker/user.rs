//! `user=` on docker sandboxes: the user is looked up by dsec, with the parser a native
//! sandbox's init uses, in the container's own `/etc/passwd` and `/etc/group` (read
//! through the archive API, [`crate::backend::account`]), so both backends refuse the same
//! users in the same words and set the same `HOME`, `USER`, `LOGNAME` and working
//! directory. The exec's `User` then has runc take the identity, from the same files.

use super::DockerSandbox;
use crate::backend::{RunAs, Sandbox};
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
        let account = crate::backend::account(self, &run_as.user).await?;
        account.fill_env(env);
        if run_as.home_cwd && self.stat(&account.home).await.is_ok_and(|i| i.is_dir) {
            cwd.clone_from(&account.home);
        }
        Ok(run_as.user.clone())
    }
}
