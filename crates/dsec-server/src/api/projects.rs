//! `/v1/projects`: the admin makes and removes projects; a project's token lists its own.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use dsec_api::{CreateProjectRequest, ErrorBody, ProjectInfo, ProjectToken, Quotas};

use super::{ApiJson, AppState};
use crate::error::ApiError;
use crate::projects::Caller;

/// Project routes need a token to tell the admin from a project.
fn require_tokens(state: &AppState) -> Result<(), ApiError> {
    match state.token {
        Some(_) => Ok(()),
        None => Err(ApiError::conflict(
            "projects need the server to require a token: restart dsec serve with \
             --token-file (that token becomes the admin's)",
        )),
    }
}

#[utoipa::path(post, path = "/v1/projects", request_body = CreateProjectRequest,
    responses((status = 201, body = ProjectToken, description = "the project and its token, shown once"),
              (status = 400, body = ErrorBody), (status = 401, body = ErrorBody),
              (status = 409, body = ErrorBody)))]
pub(super) async fn create_project(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateProjectRequest>,
) -> Result<(StatusCode, Json<ProjectToken>), ApiError> {
    caller.require_admin("creating a project")?;
    require_tokens(&state)?;
    let quotas = Quotas {
        max_sandboxes: req.max_sandboxes,
        max_cpus: req.max_cpus,
        max_memory_mb: req.max_memory_mb,
    };
    let token = state.projects.create(&req.name, quotas)?;
    Ok((
        StatusCode::CREATED,
        Json(ProjectToken {
            name: req.name,
            token,
            quotas,
        }),
    ))
}

#[utoipa::path(get, path = "/v1/projects",
    responses((status = 200, body = [ProjectInfo], description = "the admin: every project; a project's token: its own")))]
pub(super) async fn list_projects(
    State(state): State<AppState>,
    caller: Caller,
) -> Json<Vec<ProjectInfo>> {
    Json(
        state
            .projects
            .list()
            .into_iter()
            .filter(|(name, _, _)| caller.sees(Some(name)))
            .map(|(name, quotas, tokens)| ProjectInfo {
                usage: state.edge.project_usage(&name),
                name,
                quotas,
                tokens,
            })
            .collect(),
    )
}

#[utoipa::path(delete, path = "/v1/projects/{name}",
    responses((status = 204), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody, description = "it still has sandboxes")))]
pub(super) async fn delete_project(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    caller.require_admin("deleting a project")?;
    let n = state.edge.project_sandboxes(&name);
    if n > 0 {
        return Err(ApiError::conflict(format!(
            "project {name:?} still has {n} sandbox(es): stop them first (its token can \
             list them), then delete it"
        )));
    }
    state.projects.delete(&name)?;
    // Its images go with it: no token could reach them any more.
    if let Err(e) = state.edge.delete_project_images(&name).await {
        tracing::warn!(project = %name, error = %e.message, "its images stay: delete them with the admin token");
    }
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/projects/{name}/tokens",
    responses((status = 201, body = ProjectToken, description = "a new token for the project, shown once"),
              (status = 401, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn add_token(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<(StatusCode, Json<ProjectToken>), ApiError> {
    caller.require_admin("adding a project token")?;
    let (token, quotas) = state.projects.add_token(&name)?;
    Ok((
        StatusCode::CREATED,
        Json(ProjectToken {
            name,
            token,
            quotas,
        }),
    ))
}
