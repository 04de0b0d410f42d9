//! E2B's API on a fleet apiserver (`--e2b-listen`, `--e2b-envd-listen`), so that the
//! unmodified e2b SDK drives a whole fleet: each edge serves E2B's API itself
//! (`dsec edge --e2b-listen --e2b-envd-listen`, published in its etcd record), and this
//! apiserver fronts them as it fronts `/v1`.
//!
//! - Control plane: the API key is checked here as dsec's tokens are (this apiserver's
//!   token is the admin's, the fleet's project tokens act for their project, sent to the
//!   edge as its admin's key with [`ACTING_FOR`](dsec_server::projects::ACTING_FOR)).
//!   Creates are placed like dsec's; a request about one sandbox goes to the edge its id
//!   names; lists are merged over the edges and paged as one list; any other route is the
//!   edges' to answer (what E2B has and dsec does not: 501 in E2B's shape).
//! - envd: routed by the `E2b-Sandbox-Id` header (or the host) to the edge's envd
//!   endpoint, request and answer streamed through (Connect streams stay streams); the
//!   sandbox's access token is checked by its edge.
//!
//! Errors are E2B's: an id that names no edge of the fleet is not found (404 here, envd's
//! 502 "not found" there); an edge that left or cannot be reached answers at once, naming
//! it.

use std::collections::BTreeMap;

use axum::body::{Body, Bytes};
use axum::extract::{RawQuery, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use dsec_server::e2b::control::{
    api_key, key_caller, list_response, listed_key, refused_key, E2bError, ListQuery, TOTAL_RUNNING,
};
use dsec_server::e2b::envd::{drained, http_error, requested_sandbox};
use dsec_server::e2b::{Template, DEBUG_SANDBOX_ID};
use dsec_server::error::ApiError;

use super::{
    about_sandbox, act_for, passed_on, path_and_query, placed, sandbox_in, Fleet, Listener, Lists,
    Wanted,
};
use crate::membership::Member;

type Result<T> = std::result::Result<T, E2bError>;

/// Largest control-plane request body (E2B's are small JSON documents).
const MAX_CONTROL_BODY: usize = 1 << 20;

/// The control plane's routes.
pub(super) fn control_router(fleet: Fleet) -> Router {
    Router::new()
        .route("/sandboxes", post(create).get(list))
        .route("/v2/sandboxes", post(create).get(list))
        .route("/sandboxes/metrics", get(metrics_of_many))
        .route("/sandboxes/{id}", any(by_id))
        .route("/sandboxes/{id}/{*rest}", any(by_id))
        .route("/v2/sandboxes/{id}/{*rest}", any(by_id))
        .fallback(from_any)
        .layer(middleware::from_fn_with_state(fleet.clone(), authenticate))
        .route("/health", get(|| async { StatusCode::NO_CONTENT }))
        .with_state(fleet)
}

/// The envd endpoint: every route, to the edge of the sandbox named.
pub(super) fn envd_router(fleet: Fleet) -> Router {
    Router::new().fallback(envd).with_state(fleet)
}

/// Checks the API key as `dsec serve --e2b-listen` does, against this apiserver's token and
/// the fleet's projects, and names a project to the edges.
async fn authenticate(State(fleet): State<Fleet>, mut request: Request, next: Next) -> Response {
    let caller = key_caller(fleet.token.as_deref(), api_key(request.headers()), |key| {
        fleet.projects.as_ref()?.authenticate(key)
    });
    let Some(caller) = caller else {
        let refused = refused_key(fleet.token.is_some()).into_response();
        return drained(request.into_body(), refused).await;
    };
    if let Err(e) = act_for(request.headers_mut(), &caller) {
        return E2bError::from(e).into_response();
    }
    next.run(request).await
}

async fn read_body(body: Body) -> Result<Bytes> {
    axum::body::to_bytes(body, MAX_CONTROL_BODY)
        .await
        .map_err(|e| E2bError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("request body: {e}")))
}

/// `POST /sandboxes`, `POST /v2/sandboxes`: placed over the edges serving E2B that run the
/// template's backend (a `templateID` naming none: each edge's own `--e2b-backend`).
async fn create(State(fleet): State<Fleet>, request: Request) -> Result<Response> {
    #[derive(serde::Deserialize)]
    struct NewSandbox {
        #[serde(rename = "templateID")]
        template_id: String,
    }
    let path = path_and_query(&request);
    let (parts, body) = request.into_parts();
    let body = read_body(body).await?;
    let new: NewSandbox = serde_json::from_slice(&body)
        .map_err(|e| E2bError::new(StatusCode::BAD_REQUEST, format!("request body: {e}")))?;
    // Only a backend the template names is checked here; the edge checks the rest.
    let backend = match new.template_id.contains('+') {
        true => Some(Template::parse(&new.template_id, "")?.backend),
        false => None,
    };
    let label = backend.clone().unwrap_or_else(|| "e2b-default".to_owned());
    metrics::counter!("dsec_fleet_creates_total", "backend" => label).increment(1);
    Ok(placed(
        &fleet,
        Wanted::E2b(backend.as_deref()),
        &path,
        &parts.headers,
        body,
        None,
    )
    .await?)
}

/// The live edge of sandbox `id`: an id naming no edge of the fleet is not found (E2B's
/// answer for an unknown sandbox); one whose edge left the fleet is unavailable, saying so.
fn edge_of(fleet: &Fleet, id: &str) -> std::result::Result<std::sync::Arc<Member>, ApiError> {
    fleet
        .edge_of_sandbox(id)
        .map_err(|e| match crate::edge_of(id) {
            Some(edge) if fleet.table.departed(edge) => e,
            _ => ApiError::not_found(e.message),
        })
}

/// A sandbox's edge that left or cannot be reached is a gateway's failure, 502, as E2B's
/// proxy answers: the SDK raises it, with the message naming the edge (its 503 would say
/// "busy, retry", which a lost sandbox is not).
fn bad_gateway(e: ApiError) -> E2bError {
    if e.kind == dsec_api::ErrorKind::Unavailable {
        E2bError::new(StatusCode::BAD_GATEWAY, e.message)
    } else {
        e.into()
    }
}

/// Every request about one sandbox: to the edge its id names, streamed both ways.
async fn by_id(State(fleet): State<Fleet>, request: Request) -> Result<Response> {
    let id = sandbox_in(
        request.uri().path().trim_start_matches("/v2"),
        "/sandboxes/",
    );
    match edge_of(&fleet, &id) {
        Ok(member) => about_sandbox(&fleet, &member, Listener::E2b, &id, request)
            .await
            .map_err(bad_gateway),
        Err(e) => Ok(drained(request.into_body(), bad_gateway(e).into_response()).await),
    }
}

/// The edges serving E2B a list or a read of sandboxes asks (see
/// [`Fleet::listed_members`]).
fn e2b_members(fleet: &Fleet) -> Vec<std::sync::Arc<Member>> {
    let mut members = fleet.listed_members();
    members.retain(|m| m.record.e2b.is_some());
    members
}

/// `GET /v2/sandboxes` (filters, pages) and the old `GET /sandboxes`: every edge asked for
/// the same page, the answers merged and paged again as one list (a page token names a
/// place in the list's order, which every edge shares), the running counted over all.
async fn list(State(fleet): State<Fleet>, request: Request) -> Result<Response> {
    let query = request.uri().query().unwrap_or_default();
    let q = if request.uri().path() == "/sandboxes" {
        ListQuery::parse_v1(query)?
    } else {
        ListQuery::parse(query)?
    };
    let path = path_and_query(&request);
    let lists = fleet
        .lists(
            &e2b_members(&fleet),
            Listener::E2b,
            &path,
            request.headers(),
        )
        .await?;
    let (all, heads) = match lists {
        Lists::Merged { items, heads } => (items, heads),
        Lists::Refused(answer) => return Ok(answer),
    };
    let running = heads
        .iter()
        .filter_map(|h| h.get(TOTAL_RUNNING)?.to_str().ok()?.parse::<usize>().ok())
        .sum();
    let (page, next) = q.page(all, |v| listed_key(v).unwrap_or((0, "")));
    Ok(list_response(
        &page,
        next,
        q.counts_running().then_some(running),
    ))
}

/// `GET /sandboxes/metrics?sandbox_ids=a,b`: each edge asked for its own, the answers
/// merged.
async fn metrics_of_many(
    State(fleet): State<Fleet>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Result<Json<serde_json::Value>> {
    let mut by_edge = BTreeMap::<String, Vec<String>>::new();
    let query = query.unwrap_or_default();
    for (key, value) in form_urlencoded::parse(query.as_bytes()) {
        if key != "sandbox_ids" {
            continue;
        }
        for id in value.split(',') {
            if let Some(edge) = crate::edge_of(id) {
                by_edge
                    .entry(edge.to_owned())
                    .or_default()
                    .push(id.to_owned());
            }
        }
    }
    let members: Vec<_> = e2b_members(&fleet)
        .into_iter()
        .filter(|m| by_edge.contains_key(&m.record.name))
        .collect();
    let path = |m: &Member| {
        let ids = by_edge[&m.record.name].join(",");
        let query: String = form_urlencoded::Serializer::new(String::new())
            .append_pair("sandbox_ids", &ids)
            .finish();
        format!("/sandboxes/metrics?{query}")
    };
    let answers = fleet
        .ask_all(
            &members,
            Listener::E2b,
            &Method::GET,
            path,
            &headers,
            &Bytes::new(),
        )
        .await;
    let mut sandboxes = serde_json::Map::new();
    for (member, answer) in members.iter().zip(answers) {
        let found = answer.ok().filter(|a| a.status.is_success()).and_then(|a| {
            let mut v: serde_json::Value = serde_json::from_slice(&a.body).ok()?;
            match v.get_mut("sandboxes")?.take() {
                serde_json::Value::Object(m) => Some(m),
                _ => None,
            }
        });
        match found {
            Some(m) => sandboxes.extend(m),
            None => {
                tracing::warn!(edge = %member.record.name, "E2B metrics: leaving out an edge that does not answer")
            }
        }
    }
    Ok(Json(serde_json::json!({ "sandboxes": sandboxes })))
}

/// Any other route: the same on every edge (what dsec's E2B API does not have answers
/// 501 there, an unknown route 404), so the first live edge serving E2B answers it.
async fn from_any(State(fleet): State<Fleet>, request: Request) -> Result<Response> {
    let Some(member) = e2b_members(&fleet).into_iter().next() else {
        let none = E2bError::from(no_e2b_edges(&fleet)).into_response();
        return Ok(drained(request.into_body(), none).await);
    };
    let path = path_and_query(&request);
    let (parts, body) = request.into_parts();
    let body = passed_on(body);
    Ok(fleet
        .forward(
            &member,
            Listener::E2b,
            parts.method,
            &path,
            &parts.headers,
            body,
        )
        .await?)
}

fn no_e2b_edges(fleet: &Fleet) -> ApiError {
    if fleet.ready_members().is_empty() {
        return fleet.no_edges();
    }
    ApiError::unavailable(
        "no live edge serves E2B: start edges with --e2b-listen and --e2b-envd-listen",
    )
}

/// envd: to the envd endpoint of the edge the sandbox's id names, streamed both ways; a
/// sandbox that cannot be reached answers envd's 502, as E2B's proxy does (the SDK's
/// `is_running()` reads it as not running).
async fn envd(State(fleet): State<Fleet>, mut request: Request) -> Response {
    let id = match requested_sandbox(request.headers()) {
        Ok(id) => id,
        Err(refused) => return drained(request.into_body(), refused).await,
    };
    let member = if id == DEBUG_SANDBOX_ID {
        Err(ApiError::not_found(
            "the e2b SDK's debug mode is served by `dsec serve --e2b-debug-template`, not by a \
             fleet apiserver",
        ))
    } else {
        edge_of(&fleet, &id)
    };
    let unreachable = |e: ApiError| http_error(StatusCode::BAD_GATEWAY, e.message);
    let member = match member {
        Ok(member) => member,
        Err(e) => return drained(request.into_body(), unreachable(e)).await,
    };
    // The edge reads the id from the header (a client may have named it in the host).
    let Ok(named) = HeaderValue::from_str(&id) else {
        let refused = ApiError::not_found(format!("sandbox {id:?} not found: not a sandbox id"));
        return drained(request.into_body(), unreachable(refused)).await;
    };
    request.headers_mut().insert("e2b-sandbox-id", named);
    about_sandbox(&fleet, &member, Listener::Envd, &id, request)
        .await
        .unwrap_or_else(unreachable)
}
