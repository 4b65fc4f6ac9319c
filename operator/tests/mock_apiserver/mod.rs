//! A scripted API server for reconcile tests (the tower-test scenario
//! pattern of kube-rs/controller-rs): the reconciler's `kube::Client` talks
//! to a `tower_test` mock, and a scenario task checks every request against
//! the next expected one, answers it, and fails on any request the script
//! does not list, including one arriving after the script has ended.

#![allow(dead_code)]

use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use serde_json::{Value, json};

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

/// A client wired to a fresh scripted server.
pub fn pair() -> (kube::Client, Verifier) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    (kube::Client::new(service, "default"), Verifier(handle))
}

/// A request as the server saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    /// HTTP method.
    pub method: Method,
    /// URI path.
    pub path: String,
    /// Decoded query pairs.
    pub query: Vec<(String, String)>,
    /// `Content-Type`, when sent.
    pub content_type: Option<String>,
    /// The JSON body (`Null` when empty).
    pub body: Value,
}

impl Seen {
    /// The value of query parameter `key`.
    pub fn query(&self, key: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// How the server answers an expected request.
#[derive(Clone, Debug)]
pub enum Answer {
    /// This JSON with this status.
    Json(StatusCode, Value),
    /// The request body back (as a create or an apply would), with these
    /// top-level members merged in (e.g. a StatefulSet's `status`).
    Echo(StatusCode, Value),
    /// A `Status` failure with this code and reason.
    Failure(StatusCode, &'static str),
    /// The body of `object` with `status` replaced by the request's.
    StatusOf(Value),
    /// A plain-text body with this status: what a real apiserver answers
    /// for a kind it does not serve (`404 page not found`, no `Status`).
    Text(StatusCode, &'static str),
}

/// One expected request.
#[derive(Clone, Debug)]
pub struct Expect {
    /// Method it must have.
    pub method: Method,
    /// Path it must have.
    pub path: String,
    /// How to answer.
    pub answer: Answer,
}

impl Expect {
    /// GET `path`, answered with `object` or 404.
    pub fn get(path: impl Into<String>, object: Option<Value>) -> Self {
        let answer = match object {
            Some(o) => Answer::Json(StatusCode::OK, o),
            None => Answer::Failure(StatusCode::NOT_FOUND, "NotFound"),
        };
        Self {
            method: Method::GET,
            path: path.into(),
            answer,
        }
    }

    /// POST to the collection `path`, answered with the body (201).
    pub fn create(path: impl Into<String>) -> Self {
        Self {
            method: Method::POST,
            path: path.into(),
            answer: Answer::Echo(StatusCode::CREATED, json!({})),
        }
    }

    /// PATCH of `path`, answered with the body plus `extra` members.
    pub fn patch(path: impl Into<String>, extra: Value) -> Self {
        Self {
            method: Method::PATCH,
            path: path.into(),
            answer: Answer::Echo(StatusCode::OK, extra),
        }
    }

    /// PATCH of a status subresource, answered with `object` carrying the
    /// patched status.
    pub fn patch_status(path: impl Into<String>, object: Value) -> Self {
        Self {
            method: Method::PATCH,
            path: path.into(),
            answer: Answer::StatusOf(object),
        }
    }

    /// DELETE of `path`, answered with a success Status.
    pub fn delete(path: impl Into<String>) -> Self {
        Self {
            method: Method::DELETE,
            path: path.into(),
            answer: Answer::Json(
                StatusCode::OK,
                json!({"apiVersion": "v1", "kind": "Status", "status": "Success", "code": 200}),
            ),
        }
    }

    /// This request answered with `answer` instead.
    pub fn answer(mut self, answer: Answer) -> Self {
        self.answer = answer;
        self
    }
}

/// The server side of [`pair`].
pub struct Verifier(Handle);

impl Verifier {
    /// Plays `script` in a task; the task's result is every request seen,
    /// in order. It ends only once every client clone is dropped (drop the
    /// reconcile context), and panics on any request beyond the script.
    pub fn run(self, script: Vec<Expect>) -> tokio::task::JoinHandle<Vec<Seen>> {
        let mut handle = self.0;
        tokio::spawn(async move {
            let mut seen = Vec::new();
            for (i, expect) in script.into_iter().enumerate() {
                let Some((request, reply)) = handle.next_request().await else {
                    panic!(
                        "step {i}: expected {} {}, but the client was dropped (seen so far: {:#?})",
                        expect.method,
                        expect.path,
                        summary(&seen)
                    );
                };
                let got = read(request).await;
                assert_eq!(
                    (&got.method, got.path.as_str()),
                    (&expect.method, expect.path.as_str()),
                    "step {i}: unexpected request (seen before: {:#?})",
                    summary(&seen)
                );
                reply.send_response(respond(&expect.answer, &got.body));
                seen.push(got);
            }
            if let Some((request, _)) = handle.next_request().await {
                let got = read(request).await;
                panic!(
                    "unexpected request after the script: {} {} {}\n(seen: {:#?})",
                    got.method,
                    got.path,
                    got.body,
                    summary(&seen)
                );
            }
            seen
        })
    }
}

/// Waits for a scenario with a deadline; re-raises its panic.
pub async fn finish(task: tokio::task::JoinHandle<Vec<Seen>>) -> Vec<Seen> {
    match tokio::time::timeout(Duration::from_secs(10), task).await {
        Ok(Ok(seen)) => seen,
        Ok(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Ok(Err(e)) => panic!("scenario task failed: {e}"),
        Err(_) => panic!(
            "scenario did not finish: a request it expects never came, or a client was not dropped"
        ),
    }
}

fn summary(seen: &[Seen]) -> Vec<String> {
    seen.iter()
        .map(|s| format!("{} {}", s.method, s.path))
        .collect()
}

async fn read(request: Request<Body>) -> Seen {
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let query = request
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (decode(k), decode(v)),
            None => (decode(p), String::new()),
        })
        .collect();
    let content_type = request
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let bytes = match request.into_body().collect_bytes().await {
        Ok(b) => b,
        Err(e) => panic!("reading a request body: {e}"),
    };
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        match serde_json::from_slice(&bytes) {
            Ok(v) => v,
            Err(e) => panic!(
                "request body is not JSON ({e}): {}",
                String::from_utf8_lossy(&bytes)
            ),
        }
    };
    Seen {
        method,
        path,
        query,
        content_type,
        body,
    }
}

fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                    }
                    Err(_) => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn respond(answer: &Answer, request_body: &Value) -> Response<Body> {
    if let Answer::Text(code, text) = answer {
        let mut response = Response::new(Body::from(text.as_bytes().to_vec()));
        *response.status_mut() = *code;
        return response;
    }
    let (code, body) = match answer {
        Answer::Text(..) => unreachable!("answered above"),
        Answer::Json(code, v) => (*code, v.clone()),
        Answer::Echo(code, extra) => {
            let mut v = request_body.clone();
            if let (Some(obj), Some(extra)) = (v.as_object_mut(), extra.as_object()) {
                for (k, x) in extra {
                    obj.insert(k.clone(), x.clone());
                }
            }
            (*code, v)
        }
        Answer::Failure(code, reason) => (
            *code,
            json!({
                "apiVersion": "v1", "kind": "Status", "status": "Failure",
                "reason": reason, "code": code.as_u16(),
                "message": format!("scripted {reason}"),
            }),
        ),
        Answer::StatusOf(object) => {
            let mut v = object.clone();
            if let (Some(obj), Some(status)) = (v.as_object_mut(), request_body.get("status")) {
                obj.insert("status".into(), status.clone());
            }
            (StatusCode::OK, v)
        }
    };
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    let mut response = Response::new(Body::from(bytes));
    *response.status_mut() = code;
    response
}
