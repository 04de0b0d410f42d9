//! SandboxFusion's `/run_code` request and response, field for field, and the validation
//! its server (FastAPI + pydantic) does: lax numbers (`"10"` is a float), unknown fields
//! ignored, and a 422 `{"detail": [...]}` naming each bad field the way pydantic does.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{json, Map, Value};

use super::languages::Language;

/// SandboxFusion's defaults.
const DEFAULT_TIMEOUT_S: f64 = 10.0;
/// Longest time limit dsec accepts for a step.
pub(crate) const MAX_TIMEOUT_S: f64 = 86_400.0;

/// A validated `/run_code` request.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct RunCodeRequest {
    pub code: String,
    pub language: Language,
    pub compile_timeout: f64,
    pub run_timeout: f64,
    /// `None`: no limit asked (SandboxFusion's `-1`, or any value ≤ 0).
    pub memory_limit_mb: Option<u64>,
    /// `None` and `""` both give the program an immediate end of file.
    pub stdin: Option<String>,
    /// Path (relative to the working directory, or absolute) → base64 contents; `None`
    /// values are skipped, as SandboxFusion skips them.
    pub files: BTreeMap<String, Option<String>>,
    pub fetch_files: Vec<String>,
}

/// One entry of a 422 answer, as pydantic v2 writes it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(crate) struct Invalid {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub loc: Vec<Value>,
    pub msg: String,
    pub input: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ctx: Option<Box<Value>>,
}

impl Invalid {
    fn at(field: &str, kind: &'static str, msg: impl Into<String>, input: &Value) -> Invalid {
        Invalid {
            kind,
            loc: vec![json!("body"), json!(field)],
            msg: msg.into(),
            input: input.clone(),
            ctx: None,
        }
    }

    fn inner(mut self, key: Value) -> Invalid {
        self.loc.push(key);
        self
    }

    fn ctx(mut self, ctx: Value) -> Invalid {
        self.ctx = Some(Box::new(ctx));
        self
    }
}

/// Parses and validates a request body; every problem found, pydantic-style, otherwise.
pub(crate) fn parse(body: &[u8]) -> Result<RunCodeRequest, Vec<Invalid>> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        vec![Invalid {
            kind: "json_invalid",
            loc: vec![json!("body"), json!(e.column())],
            msg: "JSON decode error".into(),
            input: json!({}),
            ctx: Some(Box::new(json!({ "error": e.to_string() }))),
        }]
    })?;
    let Some(obj) = value.as_object() else {
        return Err(vec![Invalid {
            kind: "model_attributes_type",
            loc: vec![json!("body")],
            msg: "Input should be a valid dictionary or object to extract fields from".into(),
            input: value.clone(),
            ctx: None,
        }]);
    };
    let mut errors = Vec::new();
    let code = keep(
        &mut errors,
        required(obj, "code").and_then(|v| string("code", v)),
    );
    let language = keep(&mut errors, required(obj, "language").and_then(language));
    let compile_timeout = keep(&mut errors, timeout(obj, "compile_timeout"));
    let run_timeout = keep(&mut errors, timeout(obj, "run_timeout"));
    let memory_limit_mb = keep(&mut errors, memory(obj));
    let stdin = keep(
        &mut errors,
        match obj.get("stdin") {
            None | Some(Value::Null) => Ok(None),
            Some(v) => string("stdin", v).map(Some),
        },
    );
    let files = keep(&mut errors, files(obj));
    let fetch_files = keep(&mut errors, fetch_files(obj));
    match (
        code,
        language,
        compile_timeout,
        run_timeout,
        memory_limit_mb,
        stdin,
        files,
        fetch_files,
    ) {
        (
            Some(code),
            Some(language),
            Some(ct),
            Some(rt),
            Some(mem),
            Some(stdin),
            Some(f),
            Some(ff),
        ) => Ok(RunCodeRequest {
            code,
            language,
            compile_timeout: ct,
            run_timeout: rt,
            memory_limit_mb: mem,
            stdin,
            files: f,
            fetch_files: ff,
        }),
        _ => Err(errors),
    }
}

/// The value of a field that validated; the error is collected otherwise.
fn keep<T>(errors: &mut Vec<Invalid>, field: Result<T, Invalid>) -> Option<T> {
    field.map_err(|e| errors.push(e)).ok()
}

/// pydantic reports a missing field with the whole body as its input.
fn required<'a>(obj: &'a Map<String, Value>, field: &str) -> Result<&'a Value, Invalid> {
    obj.get(field).ok_or_else(|| {
        Invalid::at(
            field,
            "missing",
            "Field required",
            &Value::Object(obj.clone()),
        )
    })
}

fn string(field: &str, v: &Value) -> Result<String, Invalid> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| Invalid::at(field, "string_type", "Input should be a valid string", v))
}

fn language(v: &Value) -> Result<Language, Invalid> {
    let expected = Language::ALL
        .iter()
        .map(|l| format!("'{}'", l.as_str()))
        .collect::<Vec<_>>();
    let (head, last) = expected.split_at(expected.len() - 1);
    let expected = format!("{} or {}", head.join(", "), last[0]);
    v.as_str().and_then(Language::parse).ok_or_else(|| {
        Invalid::at(
            "language",
            "literal_error",
            format!("Input should be {expected}"),
            v,
        )
        .ctx(json!({ "expected": expected }))
    })
}

/// A float the way pydantic's lax mode reads one: a number, or a string holding one.
fn lax_float(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse().ok(),
        Value::Bool(b) => Some(f64::from(u8::from(*b))),
        _ => None,
    }
}

fn timeout(obj: &Map<String, Value>, field: &str) -> Result<f64, Invalid> {
    let Some(v) = obj.get(field) else {
        return Ok(DEFAULT_TIMEOUT_S);
    };
    let Some(t) = lax_float(v) else {
        return Err(Invalid::at(
            field,
            "float_parsing",
            "Input should be a valid number, unable to parse string as a number",
            v,
        ));
    };
    // SandboxFusion takes any float; a limit of zero, a negative one or a week would only
    // ever time out at once or hold a worker for nothing.
    if !t.is_finite() || t <= 0.0 {
        return Err(
            Invalid::at(field, "greater_than", "Input should be greater than 0", v)
                .ctx(json!({ "gt": 0 })),
        );
    }
    if t > MAX_TIMEOUT_S {
        return Err(Invalid::at(
            field,
            "less_than_equal",
            format!("Input should be less than or equal to {MAX_TIMEOUT_S}"),
            v,
        )
        .ctx(json!({ "le": MAX_TIMEOUT_S })));
    }
    Ok(t)
}

fn memory(obj: &Map<String, Value>) -> Result<Option<u64>, Invalid> {
    const FIELD: &str = "memory_limit_MB";
    let Some(v) = obj.get(FIELD) else {
        return Ok(None);
    };
    let n = match v {
        Value::Number(n) => n.as_i64().or_else(|| {
            n.as_f64()
                .filter(|f| f.fract() == 0.0 && f.abs() < 9e15)
                // A whole number within ±9e15: exact in i64.
                .map(
                    #[allow(clippy::cast_possible_truncation)]
                    |f| f as i64,
                )
        }),
        Value::String(s) => s.trim().parse::<i64>().ok(),
        Value::Bool(b) => Some(i64::from(*b)),
        _ => None,
    };
    match n {
        None => Err(Invalid::at(
            FIELD,
            "int_parsing",
            "Input should be a valid integer",
            v,
        )),
        Some(n) if n <= 0 => Ok(None),
        Some(n) => Ok(u64::try_from(n).ok()),
    }
}

fn files(obj: &Map<String, Value>) -> Result<BTreeMap<String, Option<String>>, Invalid> {
    const FIELD: &str = "files";
    let Some(v) = obj.get(FIELD) else {
        return Ok(BTreeMap::new());
    };
    let Some(map) = v.as_object() else {
        return Err(Invalid::at(
            FIELD,
            "dict_type",
            "Input should be a valid dictionary",
            v,
        ));
    };
    map.iter()
        .map(|(k, v)| match v {
            Value::Null => Ok((k.clone(), None)),
            Value::String(s) => Ok((k.clone(), Some(s.clone()))),
            other => Err(Invalid::at(
                FIELD,
                "string_type",
                "Input should be a valid string",
                other,
            )
            .inner(json!(k))),
        })
        .collect()
}

fn fetch_files(obj: &Map<String, Value>) -> Result<Vec<String>, Invalid> {
    const FIELD: &str = "fetch_files";
    let Some(v) = obj.get(FIELD) else {
        return Ok(Vec::new());
    };
    let Some(list) = v.as_array() else {
        return Err(Invalid::at(
            FIELD,
            "list_type",
            "Input should be a valid list",
            v,
        ));
    };
    list.iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_str().map(str::to_owned).ok_or_else(|| {
                Invalid::at(FIELD, "string_type", "Input should be a valid string", v)
                    .inner(json!(i))
            })
        })
        .collect()
}

/// How one command ended, as SandboxFusion reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub(crate) enum CommandRunStatus {
    Finished,
    Error,
    TimeLimitExceeded,
}

/// `CommandRunResult`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(crate) struct CommandRunResult {
    pub status: CommandRunStatus,
    /// Wall seconds from the command's start to its end (or its time limit).
    pub execution_time: Option<f64>,
    /// `None` after a time-out or a sandbox error; `-n` after signal `n`, as Python's
    /// `returncode` says it.
    pub return_code: Option<i32>,
    pub stdout: Option<String>,
    pub stderr: Option<String>,
}

/// The request's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub(crate) enum RunStatus {
    Success,
    Failed,
    SandboxError,
}

/// `RunCodeResponse`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub(crate) struct RunCodeResponse {
    pub status: RunStatus,
    pub message: String,
    pub compile_result: Option<CommandRunResult>,
    pub run_result: Option<CommandRunResult>,
    pub executor_pod_name: Option<String>,
    pub files: BTreeMap<String, String>,
}

impl RunCodeResponse {
    /// A response for the results of the steps that ran, status derived as SandboxFusion's
    /// `parse_run_status` does: any `Error` is a SandboxError (its stderr the message),
    /// else any time-out or non-zero exit is Failed, else Success.
    pub(crate) fn from_results(
        compile_result: Option<CommandRunResult>,
        run_result: Option<CommandRunResult>,
        files: BTreeMap<String, String>,
        pod: Option<String>,
    ) -> RunCodeResponse {
        let results: Vec<&CommandRunResult> =
            compile_result.iter().chain(run_result.iter()).collect();
        let (status, message) = if let Some(e) =
            results.iter().find(|r| r.status == CommandRunStatus::Error)
        {
            (
                RunStatus::SandboxError,
                e.stderr.clone().unwrap_or_default(),
            )
        } else if results.iter().any(|r| {
            r.status == CommandRunStatus::TimeLimitExceeded || r.return_code.is_some_and(|c| c != 0)
        }) {
            (RunStatus::Failed, String::new())
        } else {
            (RunStatus::Success, String::new())
        };
        RunCodeResponse {
            status,
            message,
            compile_result,
            run_result,
            executor_pod_name: pod,
            files,
        }
    }

    /// A request dsec could not run: `message` says why.
    pub(crate) fn sandbox_error(message: impl Into<String>, pod: Option<String>) -> Self {
        RunCodeResponse {
            status: RunStatus::SandboxError,
            message: message.into(),
            compile_result: None,
            run_result: None,
            executor_pod_name: pod,
            files: BTreeMap::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors(body: &str) -> Vec<Invalid> {
        parse(body.as_bytes()).expect_err("invalid")
    }

    #[test]
    fn defaults_and_lax_numbers() {
        let r = parse(br#"{"code": "print(1)", "language": "python"}"#).unwrap();
        assert_eq!(r.compile_timeout, 10.0);
        assert_eq!(r.run_timeout, 10.0);
        assert_eq!(r.memory_limit_mb, None);
        assert_eq!(r.stdin, None);
        let r = parse(
            br#"{"code": "", "language": "cpp", "run_timeout": "2.5", "compile_timeout": 3,
                 "memory_limit_MB": "512", "stdin": "x", "expected_stdout": "ignored"}"#,
        )
        .unwrap();
        assert_eq!((r.run_timeout, r.compile_timeout), (2.5, 3.0));
        assert_eq!(r.memory_limit_mb, Some(512));
        assert_eq!(r.stdin.as_deref(), Some("x"));
        let r = parse(br#"{"code": "", "language": "R", "memory_limit_MB": -1}"#).unwrap();
        assert_eq!(r.memory_limit_mb, None);
        assert_eq!(r.language, Language::R);
    }

    #[test]
    fn unknown_language_is_a_literal_error_listing_the_valid_ones() {
        let e = errors(r#"{"code": "x", "language": "cobol"}"#);
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].kind, "literal_error");
        assert_eq!(e[0].loc, vec![json!("body"), json!("language")]);
        assert!(e[0].msg.contains("'python'") && e[0].msg.contains("or 'racket'"));
    }

    #[test]
    fn every_bad_field_is_named() {
        let e = errors(
            r#"{"language": "python", "run_timeout": "soon", "stdin": 5,
                "files": {"a": 1}, "fetch_files": ["ok", 2], "memory_limit_MB": 1.5}"#,
        );
        let locs: Vec<Vec<Value>> = e.iter().map(|i| i.loc.clone()).collect();
        assert!(locs.contains(&vec![json!("body"), json!("code")]));
        assert!(locs.contains(&vec![json!("body"), json!("run_timeout")]));
        assert!(locs.contains(&vec![json!("body"), json!("stdin")]));
        assert!(locs.contains(&vec![json!("body"), json!("files"), json!("a")]));
        assert!(locs.contains(&vec![json!("body"), json!("fetch_files"), json!(1)]));
        assert!(locs.contains(&vec![json!("body"), json!("memory_limit_MB")]));
        assert_eq!(errors("[1]")[0].kind, "model_attributes_type");
        assert_eq!(errors("{nope")[0].kind, "json_invalid");
        assert_eq!(
            errors(r#"{"code": "", "language": "bash", "run_timeout": 0}"#)[0].kind,
            "greater_than"
        );
    }

    fn result(status: CommandRunStatus, rc: Option<i32>) -> CommandRunResult {
        CommandRunResult {
            status,
            execution_time: Some(0.1),
            return_code: rc,
            stdout: Some(String::new()),
            stderr: Some("why".into()),
        }
    }

    #[test]
    fn status_follows_sandboxfusion_rules() {
        let status = |c, r| RunCodeResponse::from_results(c, r, BTreeMap::new(), None).status;
        use CommandRunStatus::*;
        assert_eq!(
            status(None, Some(result(Finished, Some(0)))),
            RunStatus::Success
        );
        assert_eq!(
            status(None, Some(result(Finished, Some(1)))),
            RunStatus::Failed
        );
        assert_eq!(
            status(None, Some(result(TimeLimitExceeded, None))),
            RunStatus::Failed
        );
        assert_eq!(
            status(Some(result(Finished, Some(1))), None),
            RunStatus::Failed
        );
        let error = RunCodeResponse::from_results(
            Some(result(Error, Some(1))),
            None,
            BTreeMap::new(),
            None,
        );
        assert_eq!(
            (error.status, error.message.as_str()),
            (RunStatus::SandboxError, "why")
        );
        let json = serde_json::to_value(&error).unwrap();
        assert_eq!(json["run_result"], Value::Null);
        assert_eq!(json["compile_result"]["status"], "Error");
    }
}
