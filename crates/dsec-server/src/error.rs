//! The one place where failures become HTTP responses.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use dsec_api::{ErrorBody, ErrorDetail, ErrorKind};
use dsec_image::ImageError;
use dsec_runtime::container::RuntimeError;
use dsec_runtime::files::{FileError, FileOp};
use dsec_runtime::proto::InitStage;
use dsec_trajectory::LogError;

/// An error as the API reports it: a kind (the SDK's exception) and a message a user can
/// act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// Class of the error.
    pub kind: ErrorKind,
    /// What went wrong, for humans.
    pub message: String,
}

impl ApiError {
    /// An error of `kind`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> ApiError {
        ApiError {
            kind,
            message: message.into(),
        }
    }

    /// Bad input.
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorKind::InvalidArgument, message)
    }

    /// No such thing.
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorKind::NotFound, message)
    }

    /// Cannot be done on this host.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorKind::Unavailable, message)
    }

    /// Wrong state.
    pub fn conflict(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorKind::Conflict, message)
    }

    /// This edge's budget is promised: another edge, or this one later, may take it.
    pub fn capacity(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorKind::Capacity, message)
    }

    /// The sandbox's init is gone.
    pub fn sandbox_failed(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorKind::SandboxFailed, message)
    }

    /// A host failure or a bug.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorKind::Internal, message)
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.kind.as_str(), self.message)
    }
}

impl From<ApiError> for ErrorDetail {
    fn from(e: ApiError) -> ErrorDetail {
        ErrorDetail {
            kind: e.kind,
            message: e.message,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        metrics::counter!("dsec_errors_total", "kind" => self.kind.as_str()).increment(1);
        if self.kind == ErrorKind::Internal {
            tracing::error!(message = %self.message, "internal error");
        }
        let status =
            StatusCode::from_u16(self.kind.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let close = self.kind == ErrorKind::PayloadTooLarge;
        let body = ErrorBody { error: self.into() };
        let mut response = (status, Json(body)).into_response();
        if close {
            // The rest of the refused body is never read: the connection cannot carry
            // another request, and a client must not pool it.
            response.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        response
    }
}

impl From<ImageError> for ApiError {
    fn from(e: ImageError) -> ApiError {
        let kind = match &e {
            ImageError::NotFound { .. } => ErrorKind::NotFound,
            ImageError::InvalidSource { .. }
            | ImageError::Corrupt { .. }
            | ImageError::BootableDisk { .. } => ErrorKind::InvalidArgument,
            ImageError::Registry { .. } | ImageError::Push { .. } | ImageError::Store { .. } => {
                ErrorKind::Unavailable
            }
            ImageError::Owned { .. } => ErrorKind::Conflict,
            ImageError::NotAllowed { .. } => ErrorKind::PermissionDenied,
            ImageError::Io { .. } => ErrorKind::Internal,
        };
        let mut message = e.to_string();
        if let ImageError::Io { source, .. } = &e {
            message = format!("{message}: {source}");
        }
        ApiError::new(kind, message)
    }
}

impl From<FileError> for ApiError {
    /// Every file failure of every backend becomes an API error here, so this is where a
    /// refusal or a limit hit is counted (`dsec_file_refused_total{reason}`) and logged —
    /// inside the request's span, which names the sandbox.
    fn from(e: FileError) -> ApiError {
        let kind = match &e {
            FileError::NotFound { .. } => ErrorKind::NotFound,
            FileError::Exists { .. } | FileError::TooManyWatches { .. } => ErrorKind::Conflict,
            FileError::Io { .. } => ErrorKind::Internal,
            FileError::PermissionDenied { .. } => ErrorKind::PermissionDenied,
            FileError::Busy { .. } => ErrorKind::Unavailable,
            FileError::TooLarge {
                op: FileOp::Write, ..
            } => ErrorKind::PayloadTooLarge,
            _ => ErrorKind::InvalidArgument,
        };
        if let Some(reason) = e.refusal_label() {
            metrics::counter!("dsec_file_refused_total", "reason" => reason).increment(1);
            tracing::warn!(path = %e.path(), reason, error = %e, "file request refused");
        }
        ApiError::new(kind, e.to_string())
    }
}

impl From<LogError> for ApiError {
    fn from(e: LogError) -> ApiError {
        let kind = match &e {
            LogError::TrajectoryTaken { .. } => ErrorKind::Conflict,
            _ => ErrorKind::Internal,
        };
        ApiError::new(kind, e.to_string())
    }
}

impl From<RuntimeError> for ApiError {
    fn from(e: RuntimeError) -> ApiError {
        if let RuntimeError::File(file) = e {
            return file.into();
        }
        match &e {
            RuntimeError::Exec(err)
                if matches!(
                    err.stage,
                    InitStage::Chdir | InitStage::Spec | InitStage::User
                ) =>
            {
                ApiError::invalid(err.message.clone())
            }
            RuntimeError::Gone => {
                ApiError::sandbox_failed("the sandbox's init exited; the sandbox has failed")
            }
            _ => ApiError::internal(e.to_string()),
        }
    }
}
