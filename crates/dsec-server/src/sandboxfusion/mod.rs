//! SandboxFusion's `POST /run_code` (and `GET /v1/ping`), answered on the fncall pool.
//!
//! RL trainers' reward code posts programs to SandboxFusion (veRL's scorer and code tool,
//! SkyRL, ROLL, MindSpeed-RL); dsec answers the same request with the same response, so a
//! trainer switches by changing a URL. Each request is one stepped fncall call (see
//! [`crate::backend::fncall::StepCall`]): the request's files and source are written into
//! a fresh root of a warm worker of the language's image, the compile step and the run
//! step run there one after the other with `bash -c` — SandboxFusion's own command lines
//! ([`languages`]) — each under its own wall-clock limit counted from its own start, each
//! ending with its whole process tree killed, and `fetch_files` are read back before the
//! root goes away. `memory_limit_MB` is the worker's memory cgroup limit.
//!
//! Differences from SandboxFusion, all deliberate: requests are isolated (SandboxFusion's
//! default runs them as bare subprocesses of its server); a program killed at its memory
//! limit gets SIGKILL (`return_code` -9) where `RLIMIT_AS` would make its allocations
//! fail; every step reads the request's stdin (compilers ignore it); each step's stdout
//! and stderr are kept up to 1 MiB (SandboxFusion reads up to 1 MiB too, but stalls a
//! program that writes more than its pipe holds); a time limit must be positive and a
//! memory limit, when given, at least [`MIN_MEMORY_MB`] and at most the edge's memory capacity
//! (what all sandboxes together may use, see [`crate::admission`]).

mod languages;
mod request;
mod runtimes;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine;
use dsec_image::{Image, ImageStore};

use crate::api::AppState;
use crate::backend::fncall::{FnCallBackend, Step, StepCall, StepOutcome};
use crate::backend::{FileWrite, SandboxRequest};
use crate::edge::{Edge, EdgeConfig};
use crate::projects::Caller;
use languages::{ImageFacts, Language, Refusal};
use request::{CommandRunResult, CommandRunStatus, RunCodeRequest, RunCodeResponse};

/// The image that serves `/run_code` unless told otherwise.
pub const DEFAULT_IMAGE: &str = "grader";
/// Memory limit of a request that asks for none (SandboxFusion's `-1`), in MiB: veRL's
/// default, enough for every grader language's compiler, and a fourth of what 4 GiB
/// workers would take from the edge's budget while they sit warm in the pool.
pub const DEFAULT_MEMORY_MB: u64 = 1024;
/// Smallest `memory_limit_MB` a request may ask for.
pub const MIN_MEMORY_MB: u64 = 16;
/// Bound on each step's stdout and on its stderr, as SandboxFusion reads at most 1 MiB.
const MAX_OUTPUT_BYTES: u64 = 1 << 20;
/// Bound on a request's fetched files together.
const MAX_FETCH_BYTES: u64 = 64 << 20;
/// How long a request may wait for a worker; not counted in its time limits.
const QUEUE_TIMEOUT: Duration = Duration::from_secs(60);
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How `/run_code` is served.
#[derive(Clone, Debug)]
pub struct SandboxFusionConfig {
    /// A listener of its own (clients address it as `http://host:port/run_code`), besides
    /// the main one.
    pub listen: Option<SocketAddr>,
    /// The image of every language without an image of its own.
    pub image: String,
    /// Images by language name.
    pub language_images: BTreeMap<String, String>,
    /// Memory limit of requests that ask for none, in MiB.
    pub default_memory_mb: u64,
}

impl Default for SandboxFusionConfig {
    fn default() -> Self {
        SandboxFusionConfig {
            listen: None,
            image: DEFAULT_IMAGE.to_owned(),
            language_images: BTreeMap::new(),
            default_memory_mb: DEFAULT_MEMORY_MB,
        }
    }
}

impl SandboxFusionConfig {
    /// Checks the language names of `language_images`.
    pub fn validate(&self) -> Result<(), String> {
        for name in self.language_images.keys() {
            if Language::parse(name).is_none() {
                let known: Vec<&str> = Language::ALL.iter().map(|l| l.as_str()).collect();
                return Err(format!(
                    "unknown SandboxFusion language {name:?}; the languages are: {}",
                    known.join(", ")
                ));
            }
        }
        Ok(())
    }
}

/// What an image offers a language: the recipe facts, or why it cannot run it.
type Check = Result<ImageFacts, String>;

/// The `/run_code` service.
pub struct SandboxFusion {
    fncall: Arc<FnCallBackend>,
    images: ImageStore,
    config: SandboxFusionConfig,
    cpus: f64,
    pids: u64,
    disk_mb: u64,
    /// The edge's memory capacity in MiB: no one sandbox may have more.
    memory_capacity_mb: u64,
    /// SandboxFusion's `executor_pod_name`: `$MY_POD_NAME`.
    pod: Option<String>,
    /// Checks by (image content id, language), made once per image content.
    checked: Mutex<HashMap<(String, Language), Check>>,
}

impl SandboxFusion {
    /// A service running requests on `fncall` workers of images from `images`, with the
    /// CPU, process and disk limits of `edge`'s defaults.
    pub fn new(
        fncall: Arc<FnCallBackend>,
        images: ImageStore,
        config: SandboxFusionConfig,
        edge: &EdgeConfig,
        memory_capacity_mb: u64,
    ) -> SandboxFusion {
        SandboxFusion {
            fncall,
            images,
            config,
            cpus: edge.cpus,
            pids: edge.pids,
            disk_mb: edge.disk_mb,
            memory_capacity_mb,
            pod: std::env::var("MY_POD_NAME").ok(),
            checked: Mutex::default(),
        }
    }

    fn image_name(&self, language: Language) -> &str {
        self.config
            .language_images
            .get(language.as_str())
            .unwrap_or(&self.config.image)
    }

    /// Runs one request for `caller`, whose project quotas hold the worker while it runs;
    /// every failure of dsec's side (a quota included) is a SandboxError saying why.
    async fn run(&self, req: RunCodeRequest, caller: &Caller, edge: &Edge) -> RunCodeResponse {
        let language = req.language;
        let started = Instant::now();
        let response = match self.try_run(req, caller, edge).await {
            Ok(response) => response,
            Err(message) => RunCodeResponse::sandbox_error(message, self.pod.clone()),
        };
        let status = format!("{:?}", response.status);
        metrics::counter!("dsec_sandboxfusion_requests_total",
            "language" => language.as_str(), "status" => status)
        .increment(1);
        metrics::histogram!("dsec_sandboxfusion_request_seconds", "language" => language.as_str())
            .record(started.elapsed().as_secs_f64());
        response
    }

    async fn try_run(
        &self,
        req: RunCodeRequest,
        caller: &Caller,
        edge: &Edge,
    ) -> Result<RunCodeResponse, String> {
        let image_name = self.image_name(req.language).to_owned();
        let image = self.images.get(&image_name).map_err(|e| {
            format!(
                "{e}: /run_code runs {:?} in image {image_name:?} (build one with \
                 scripts/make-grader-image.sh DIR and import it with `dsec image import DIR \
                 --name {image_name}`, or choose another with --sandboxfusion-image)",
                req.language.as_str()
            )
        })?;
        let facts = self.check(&image, req.language).await?;
        let names: Vec<&str> = req.files.keys().map(String::as_str).collect();
        let plan = match languages::plan(req.language, &req.code, &names, facts) {
            Ok(plan) => plan,
            Err(Refusal::CompileError(text)) => {
                return Ok(RunCodeResponse::from_results(
                    Some(CommandRunResult {
                        status: CommandRunStatus::Error,
                        execution_time: None,
                        return_code: Some(1),
                        stdout: None,
                        stderr: Some(text.to_owned()),
                    }),
                    None,
                    BTreeMap::new(),
                    self.pod.clone(),
                ))
            }
            Err(Refusal::NoRunner) => {
                return Err(format!(
                    "language {:?} has no runner (SandboxFusion has none either)",
                    req.language.as_str()
                ))
            }
            Err(Refusal::NeedsGpu) => {
                return Err(format!(
                    "language {:?} needs a GPU, and dsec runs /run_code on CPU-only fncall workers",
                    req.language.as_str()
                ))
            }
        };
        let memory_mb = match req.memory_limit_mb {
            None => self.config.default_memory_mb.min(self.memory_capacity_mb),
            Some(mb) if mb < MIN_MEMORY_MB => {
                return Err(format!(
                    "memory_limit_MB={mb} is below the {MIN_MEMORY_MB} MiB a program needs to start"
                ))
            }
            Some(mb) if mb > self.memory_capacity_mb => {
                return Err(format!(
                    "memory_limit_MB={mb} is more than the {} MiB all sandboxes of this host \
                     may use together",
                    self.memory_capacity_mb
                ))
            }
            Some(mb) => mb,
        };
        let _quota = edge
            .reserve_quota(caller, self.cpus, memory_mb)
            .await
            .map_err(|e| e.message)?;
        let cwd = req.language.workdir();
        let mut files = restored_files(&cwd, &req.files)?;
        let compiled = plan.compile.is_some();
        if let Some((path, code)) = plan.source {
            files.push(FileWrite {
                path,
                data: code.into_bytes(),
                mode: 0o644,
            });
        }
        let steps = plan
            .compile
            .map(|c| (c, req.compile_timeout))
            .into_iter()
            .chain([(plan.run, req.run_timeout)])
            .map(|(cmd, timeout)| Step {
                argv: vec!["/bin/bash".into(), "-c".into(), cmd],
                timeout: Duration::from_secs_f64(timeout),
            })
            .collect();
        let call = StepCall {
            steps,
            env: self.env(&image),
            cwd,
            stdin: req.stdin.unwrap_or_default().into_bytes(),
            files,
            fetch: unique(req.fetch_files),
            max_output_bytes: MAX_OUTPUT_BYTES,
            fetch_max_bytes: MAX_FETCH_BYTES,
            queue_timeout: QUEUE_TIMEOUT,
        };
        let limits = SandboxRequest {
            id: String::new(),
            image: image_name,
            cpus: self.cpus,
            memory_mb,
            pids: self.pids,
            disk_mb: self.disk_mb,
            network: dsec_net::Policy::Off,
            ca_bundle: false,
        };
        let outcome = self
            .fncall
            .call_steps(&limits, call)
            .await
            .map_err(|e| e.message)?;
        let mut results = outcome
            .steps
            .into_iter()
            .map(|s| command_result(s, memory_mb));
        let (compile_result, run_result) = match compiled {
            true => (results.next(), results.next()),
            false => (None, results.next()),
        };
        let mut fetched = BTreeMap::new();
        for f in outcome.fetched {
            if f.truncated {
                return Err(format!(
                    "fetch_files: the files up to {:?} are more than the {} MiB dsec returns \
                     for a request",
                    f.path,
                    MAX_FETCH_BYTES >> 20
                ));
            }
            fetched.insert(
                f.path,
                base64::engine::general_purpose::STANDARD.encode(f.data),
            );
        }
        Ok(RunCodeResponse::from_results(
            compile_result,
            run_result,
            fetched,
            self.pod.clone(),
        ))
    }

    /// The environment of every step: the image's, with a `PATH`, `HOME` and a UTF-8
    /// locale unless the image sets them (Java and others print `?` for non-ASCII text
    /// in the C locale).
    fn env(&self, image: &Image) -> Vec<String> {
        let mut env = image.config.env.clone();
        for (key, default) in [
            ("PATH", DEFAULT_PATH),
            ("HOME", "/root"),
            ("LANG", "C.UTF-8"),
        ] {
            if !env.iter().any(|e| e.split('=').next() == Some(key)) {
                env.push(format!("{key}={default}"));
            }
        }
        env
    }

    /// What `image` offers `language`: the facts its recipe depends on, or `Err` naming
    /// the first program the language needs (or `bash`) that the image lacks. Read from
    /// the image's layers once per image content.
    async fn check(&self, image: &Image, language: Language) -> Check {
        let key = (image.id.clone(), language);
        if let Some(check) = self.checked.lock().expect("lock").get(&key) {
            return check.clone();
        }
        // Held mounted while it is read (the pool's workers mount it too, once per edge).
        let mounted = match self.images.mount(image).await {
            Ok(mounted) => mounted,
            Err(e) => return Err(format!("image {:?} cannot be read: {e}", image.name)),
        };
        let path = self
            .env(image)
            .iter()
            .find_map(|e| e.strip_prefix("PATH=").map(str::to_owned))
            .unwrap_or_else(|| DEFAULT_PATH.to_owned());
        let name = image.name.clone();
        let check = tokio::task::spawn_blocking(move || {
            let layers = runtimes::Layers(&mounted.dirs);
            let needs = std::iter::once(&"bash").chain(language.needs());
            if let Some(missing) = needs.into_iter().find(|p| !layers.has_program(&path, p)) {
                return Err(format!(
                    "image {name:?} has no {missing} (on its PATH {path}), which language \
                     {:?} needs: rebuild it with scripts/make-grader-image.sh, or give the \
                     language an image that has it with --sandboxfusion-language-image {}=IMAGE",
                    language.as_str(),
                    language.as_str()
                ));
            }
            let lib_dirs = [
                "/usr/lib/x86_64-linux-gnu",
                "/usr/lib64",
                "/usr/lib",
                "/lib",
            ];
            Ok(ImageFacts {
                openssl: ["libssl.so", "libcrypto.so"].iter().all(|lib| {
                    lib_dirs
                        .iter()
                        .any(|dir| layers.has_file(&format!("{dir}/{lib}")))
                }),
            })
        })
        .await
        .map_err(|e| e.to_string())?;
        self.checked
            .lock()
            .expect("lock")
            .insert(key, check.clone());
        check
    }
}

/// The request's `files` as writes: paths relative to `cwd` or absolute, `null` contents
/// and names containing `IGNORE_THIS_FILE` skipped, as SandboxFusion's `restore_files`.
fn restored_files(
    cwd: &str,
    files: &BTreeMap<String, Option<String>>,
) -> Result<Vec<FileWrite>, String> {
    let mut writes = Vec::new();
    for (name, content) in files {
        let Some(content) = content else { continue };
        if name.contains("IGNORE_THIS_FILE") {
            continue;
        }
        if name.is_empty() || name.contains('\0') || name.ends_with('/') {
            return Err(format!("files: {name:?} is not a file name"));
        }
        // Python's b64decode skips characters outside the alphabet, newlines included.
        let clean: Vec<u8> = content
            .bytes()
            .filter(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'='))
            .collect();
        let data = base64::engine::general_purpose::STANDARD
            .decode(&clean)
            .map_err(|e| format!("files: the contents of {name:?} are not base64: {e}"))?;
        let path = match name.starts_with('/') {
            true => name.clone(),
            false => format!("{cwd}/{name}"),
        };
        writes.push(FileWrite {
            path,
            data,
            mode: 0o644,
        });
    }
    Ok(writes)
}

/// `paths` without repeats, in order: each file is read back once.
fn unique(paths: Vec<String>) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    paths
        .into_iter()
        .filter(|p| seen.insert(p.clone()))
        .collect()
}

/// A step's outcome as SandboxFusion reports a command: the return code of a program
/// killed by a signal is minus the signal, as Python's `returncode` says it.
fn command_result(step: StepOutcome, memory_mb: u64) -> CommandRunResult {
    let exit = step.exit;
    let mut stderr = decode(step.stderr);
    if exit.oom_killed {
        stderr.push_str(&format!(
            "\n[dsec] killed: the program reached its memory limit of {memory_mb} MiB\n"
        ));
    }
    let return_code = match step.signal {
        Some(signal) => Some(-signal),
        None => exit.exit_code,
    };
    CommandRunResult {
        status: match exit.timed_out {
            true => CommandRunStatus::TimeLimitExceeded,
            false => CommandRunStatus::Finished,
        },
        execution_time: Some(exit.duration_ms / 1000.0),
        return_code: if exit.timed_out { None } else { return_code },
        stdout: Some(decode(step.stdout)),
        stderr: Some(stderr),
    }
}

/// Output as text, or SandboxFusion's `[DecodeError] ...` when it is not UTF-8.
fn decode(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| {
        let err = e.utf8_error();
        let at = err.valid_up_to();
        let byte = e.as_bytes()[at];
        let reason = match err.error_len() {
            None => "unexpected end of data",
            Some(_) if (0x80..0xc0).contains(&byte) => "invalid start byte",
            Some(_) => "invalid continuation byte",
        };
        format!(
            "[DecodeError] 'utf-8' codec can't decode byte 0x{byte:02x} in position {at}: {reason}"
        )
    })
}

async fn run_code(
    State(state): State<AppState>,
    caller: Caller,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(body) => body,
        Err(rejection) => {
            let detail = serde_json::json!({ "detail": rejection.body_text() });
            return (rejection.status(), Json(detail)).into_response();
        }
    };
    match request::parse(&body) {
        Ok(req) => Json(state.sandboxfusion.run(req, &caller, &state.edge).await).into_response(),
        Err(detail) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            Json(serde_json::json!({ "detail": detail })),
        )
            .into_response(),
    }
}

/// SandboxFusion's health check: the JSON string `"pong"`.
async fn ping() -> Json<&'static str> {
    Json("pong")
}

/// `POST /run_code` and `GET /v1/ping`, behind the caller's authentication.
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/run_code", post(run_code))
        .route("/v1/ping", get(ping))
}

/// Serves `/run_code` on a listener of its own until `stop` turns true. It takes the
/// tokens the main listener takes (see [`crate::api::presented_token`]: a client given
/// only a URL authenticates with `http://dsec:TOKEN@host:port/run_code`), and asks for
/// none when the server has no `--token-file` (as SandboxFusion).
pub fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    max_upload_bytes: usize,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<std::io::Result<()>> {
    let app = routes()
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            crate::api::authenticate,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(max_upload_bytes))
        .with_state(state);
    tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop.wait_for(|stopped| *stopped).await;
            })
            .await
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::ExitStatus;

    fn step(exit: ExitStatus, stdout: &[u8]) -> StepOutcome {
        StepOutcome {
            signal: (exit.exit_code == Some(137)).then_some(9),
            exit,
            stdout: stdout.to_vec(),
            stderr: Vec::new(),
        }
    }

    #[test]
    fn results_read_like_sandboxfusions() {
        let ok = command_result(
            step(
                ExitStatus {
                    exit_code: Some(0),
                    duration_ms: 250.0,
                    ..ExitStatus::default()
                },
                b"1\n",
            ),
            1024,
        );
        assert_eq!(ok.status, CommandRunStatus::Finished);
        assert_eq!((ok.return_code, ok.execution_time), (Some(0), Some(0.25)));
        assert_eq!(ok.stdout.as_deref(), Some("1\n"));
        let tle = command_result(
            step(
                ExitStatus {
                    timed_out: true,
                    ..ExitStatus::default()
                },
                b"",
            ),
            1024,
        );
        assert_eq!(
            (tle.status, tle.return_code),
            (CommandRunStatus::TimeLimitExceeded, None)
        );
        let oom = command_result(
            step(
                ExitStatus {
                    exit_code: Some(137),
                    oom_killed: true,
                    ..ExitStatus::default()
                },
                b"",
            ),
            64,
        );
        assert_eq!(oom.return_code, Some(-9));
        assert!(oom.stderr.unwrap().contains("memory limit of 64 MiB"));
        // A shell reporting its child's signal exits 128+n itself: not a signal of its own.
        let segv = command_result(
            step(
                ExitStatus {
                    exit_code: Some(139),
                    ..ExitStatus::default()
                },
                b"",
            ),
            64,
        );
        assert_eq!(segv.return_code, Some(139));
    }

    #[test]
    fn undecodable_output_is_reported_as_sandboxfusion_does() {
        assert_eq!(
            decode(b"ok\xff".to_vec()),
            "[DecodeError] 'utf-8' codec can't decode byte 0xff in position 2: invalid continuation byte"
        );
        assert!(decode("é".as_bytes()[..1].to_vec()).contains("unexpected end"));
    }

    #[test]
    fn files_are_restored_relative_to_the_working_directory() {
        let mut files = BTreeMap::new();
        files.insert("a/b.txt".to_owned(), Some("aGk=\n".to_owned()));
        files.insert("/mnt/c".to_owned(), Some("a Gk=".to_owned()));
        files.insert("skipped".to_owned(), None);
        files.insert("x_IGNORE_THIS_FILE".to_owned(), Some("aGk=".to_owned()));
        let writes = restored_files("/tmp/sandbox/python", &files).unwrap();
        let paths: Vec<&str> = writes.iter().map(|w| w.path.as_str()).collect();
        assert_eq!(paths, ["/mnt/c", "/tmp/sandbox/python/a/b.txt"]);
        assert!(writes.iter().all(|w| w.data == b"hi"));
        files.insert("bad".to_owned(), Some("a".to_owned()));
        assert!(restored_files("/", &files).unwrap_err().contains("\"bad\""));
    }
}
