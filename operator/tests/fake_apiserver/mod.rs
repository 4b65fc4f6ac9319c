//! A small in-process stand-in for kube-apiserver, for tests that run the
//! real `sbmesh-operator` binary (no kube-apiserver can run here).
//!
//! It stores objects as JSON under their URL path and implements just what
//! the operator uses: GET (object or list), watch (`?watch=true`: a stream
//! that stays open and carries ADDED/MODIFIED/DELETED events of its
//! collection), POST (409 AlreadyExists), PUT (409 Conflict on a stale
//! `resourceVersion`), PATCH (server-side apply and merge patches, as a
//! JSON merge; `/status` patches the status only) and DELETE. Every request
//! is logged so a test can assert what the operator called. Plain HTTP,
//! no authentication.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, header};
use axum::response::Response;
use serde_json::{Value, json};
use tokio::sync::broadcast;

/// One request as the fake saw it.
#[derive(Clone, Debug)]
pub struct Logged {
    /// HTTP method.
    pub method: String,
    /// URI path.
    pub path: String,
    /// Raw query string.
    pub query: String,
}

#[derive(Default)]
struct Store {
    objects: BTreeMap<String, Value>,
    /// Requests whose path contains the key are answered after the delay.
    delays: Vec<(String, Duration)>,
    resource_version: u64,
    uid: u64,
    log: Vec<Logged>,
}

#[derive(Clone)]
struct Shared {
    store: Arc<Mutex<Store>>,
    /// Held by each write from its checks (exists, resourceVersion) to its
    /// store: as in kube-apiserver, two creates of one name cannot both
    /// succeed, nor two updates from one resourceVersion.
    writes: Arc<Mutex<()>>,
    events: broadcast::Sender<(String, Value)>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn one_write(&self) -> std::sync::MutexGuard<'_, ()> {
        self.writes.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The running fake.
pub struct FakeApiServer {
    /// Where it listens.
    pub addr: SocketAddr,
    shared: Shared,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeApiServer {
    /// Starts on 127.0.0.1, on a port the OS picks.
    pub async fn start() -> Self {
        let (events, _) = broadcast::channel(1024);
        let shared = Shared {
            store: Arc::default(),
            writes: Arc::default(),
            events,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the fake API server");
        let addr = listener.local_addr().expect("local addr");
        let app = Router::new().fallback(handle).with_state(shared.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { addr, shared, task }
    }

    /// Writes a kubeconfig pointing at this server (http, no user
    /// credentials, default namespace `namespace`) into `dir`.
    pub fn write_kubeconfig(&self, dir: &Path, namespace: &str) -> PathBuf {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: {namespace}\n\
             current-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            self.addr
        );
        std::fs::write(&path, text).expect("write kubeconfig");
        path
    }

    /// The object stored at `path`.
    pub fn get(&self, path: &str) -> Option<Value> {
        self.shared.lock().objects.get(path).cloned()
    }

    /// Stores `object` at `path` as a client write would (fresh
    /// `resourceVersion`, watchers notified).
    pub fn put(&self, path: &str, object: Value) -> Value {
        store(&self.shared, path, object)
    }

    /// Answers requests whose path contains `fragment` only after `delay`
    /// (a stuck API server, for drain tests).
    pub fn delay(&self, fragment: &str, delay: Duration) {
        self.shared.lock().delays.push((fragment.to_owned(), delay));
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Logged> {
        self.shared.lock().log.clone()
    }
}

/// `(collection, name, subresource)` of a namespaced path:
/// `/api/v1/namespaces/ns/plural[/name[/sub]]` or
/// `/apis/group/version/namespaces/ns/plural[/name[/sub]]`.
fn split(path: &str) -> Option<(String, Option<String>, Option<String>)> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let prefix = match segs.first() {
        Some(&"api") => 2,
        Some(&"apis") => 3,
        _ => return None,
    };
    if segs.get(prefix) != Some(&"namespaces") || segs.len() < prefix + 3 {
        return None;
    }
    let collection = format!("/{}", segs[..prefix + 3].join("/"));
    let name = segs.get(prefix + 3).map(|s| (*s).to_owned());
    let sub = segs.get(prefix + 4).map(|s| (*s).to_owned());
    Some((collection, name, sub))
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response {
    json_response(
        code,
        &json!({
            "apiVersion": "v1", "kind": "Status", "status": "Failure",
            "reason": reason, "message": message, "code": code.as_u16(),
        }),
    )
}

fn json_response(code: StatusCode, body: &Value) -> Response {
    let mut r = Response::new(Body::from(serde_json::to_vec(body).unwrap_or_default()));
    *r.status_mut() = code;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

fn merge(target: &mut Value, patch: &Value) {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        (t, p) => *t = p.clone(),
    }
}

/// Writes `object` at `path` with the next resourceVersion and tells the
/// collection's watchers.
fn store(shared: &Shared, path: &str, mut object: Value) -> Value {
    let (collection, kind_of_event) = {
        let mut s = shared.lock();
        // As kube-apiserver: a write that changes nothing keeps the
        // resourceVersion and wakes no watcher (else every no-op apply
        // would re-trigger the controller that made it).
        if let Some(current) = s.objects.get(path) {
            let mut same = object.clone();
            same["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"].clone();
            same["metadata"]["uid"] = current["metadata"]["uid"].clone();
            same["metadata"]["namespace"] = current["metadata"]["namespace"].clone();
            if same == *current {
                return current.clone();
            }
        }
        s.resource_version += 1;
        let rv = s.resource_version.to_string();
        let existed = s.objects.contains_key(path);
        if let Some(uid) = s.objects.get(path).map(|c| c["metadata"]["uid"].clone()) {
            object["metadata"]["uid"] = uid;
        } else if object["metadata"]["uid"].is_null() {
            s.uid += 1;
            object["metadata"]["uid"] = json!(format!("uid-{}", s.uid));
        }
        object["metadata"]["resourceVersion"] = json!(rv);
        if let Some(ns) = path
            .trim_matches('/')
            .split('/')
            .skip_while(|s| *s != "namespaces")
            .nth(1)
        {
            object["metadata"]["namespace"] = json!(ns);
        }
        s.objects.insert(path.to_owned(), object.clone());
        let collection = split(path).map(|(c, _, _)| c).unwrap_or_default();
        (collection, if existed { "MODIFIED" } else { "ADDED" })
    };
    let _ = shared.events.send((
        collection,
        json!({"type": kind_of_event, "object": object.clone()}),
    ));
    object
}

async fn handle(State(shared): State<Shared>, request: Request) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let query = request.uri().query().unwrap_or("").to_owned();
    let content_type = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let delay = {
        let mut s = shared.lock();
        s.log.push(Logged {
            method: method.to_string(),
            path: path.clone(),
            query: query.clone(),
        });
        s.delays
            .iter()
            .find(|(f, _)| path.contains(f.as_str()))
            .map(|(_, d)| *d)
    };
    if let Some(d) = delay {
        tokio::time::sleep(d).await;
    }
    let body = match axum::body::to_bytes(request.into_body(), 16 << 20).await {
        Ok(b) => b,
        Err(_) => return status(StatusCode::BAD_REQUEST, "BadRequest", "unreadable body"),
    };
    let body: Value = if body.is_empty() {
        Value::Null
    } else {
        match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
        }
    };
    let Some((collection, name, sub)) = split(&path) else {
        return status(StatusCode::NOT_FOUND, "NotFound", "not served by the fake");
    };
    let object_path = name.as_ref().map(|n| format!("{collection}/{n}"));
    match (method, object_path) {
        (Method::GET, Some(p)) => match shared.lock().objects.get(&p) {
            Some(o) => json_response(StatusCode::OK, o),
            None => status(StatusCode::NOT_FOUND, "NotFound", &format!("{p} not found")),
        },
        (Method::GET, None)
            if query
                .split('&')
                .any(|q| q == "watch=true" || q == "watch=1") =>
        {
            watch(&shared, collection)
        }
        (Method::GET, None) => {
            let s = shared.lock();
            let prefix = format!("{collection}/");
            let items: Vec<Value> = s
                .objects
                .iter()
                .filter(|(k, _)| k.starts_with(&prefix) && !k[prefix.len()..].contains('/'))
                .map(|(_, v)| v.clone())
                .collect();
            json_response(
                StatusCode::OK,
                &json!({
                    "apiVersion": "v1", "kind": "List",
                    "metadata": { "resourceVersion": s.resource_version.to_string() },
                    "items": items,
                }),
            )
        }
        (Method::POST, None) => {
            let _write = shared.one_write();
            let Some(name) = body["metadata"]["name"].as_str().map(str::to_owned) else {
                return status(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "Invalid",
                    "metadata.name is required",
                );
            };
            let p = format!("{collection}/{name}");
            if shared.lock().objects.contains_key(&p) {
                return status(
                    StatusCode::CONFLICT,
                    "AlreadyExists",
                    &format!("{p} already exists"),
                );
            }
            let stored = store(&shared, &p, body);
            json_response(StatusCode::CREATED, &stored)
        }
        (Method::PUT, Some(p)) => {
            let _write = shared.one_write();
            let current = shared.lock().objects.get(&p).cloned();
            let Some(current) = current else {
                return status(StatusCode::NOT_FOUND, "NotFound", &format!("{p} not found"));
            };
            let sent = &body["metadata"]["resourceVersion"];
            if !sent.is_null() && *sent != current["metadata"]["resourceVersion"] {
                return status(
                    StatusCode::CONFLICT,
                    "Conflict",
                    "Operation cannot be fulfilled: the object has been modified; please apply your changes to the latest version and try again",
                );
            }
            let stored = store(&shared, &p, body);
            json_response(StatusCode::OK, &stored)
        }
        (Method::PATCH, Some(p)) => {
            let _write = shared.one_write();
            let current = shared.lock().objects.get(&p).cloned();
            let is_apply = content_type.starts_with("application/apply-patch");
            let mut object = match current {
                Some(c) => c,
                None if is_apply && sub.is_none() => json!({}),
                None => {
                    return status(StatusCode::NOT_FOUND, "NotFound", &format!("{p} not found"));
                }
            };
            if sub.as_deref() == Some("status") {
                merge(&mut object["status"], &body["status"]);
            } else {
                merge(&mut object, &body);
            }
            let stored = store(&shared, &p, object);
            json_response(StatusCode::OK, &stored)
        }
        (Method::DELETE, Some(p)) => {
            let _write = shared.one_write();
            let removed = shared.lock().objects.remove(&p);
            match removed {
                Some(o) => {
                    let _ = shared
                        .events
                        .send((collection, json!({"type": "DELETED", "object": o})));
                    json_response(
                        StatusCode::OK,
                        &json!({"apiVersion": "v1", "kind": "Status", "status": "Success", "code": 200}),
                    )
                }
                None => status(StatusCode::NOT_FOUND, "NotFound", &format!("{p} not found")),
            }
        }
        _ => status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "not served by the fake",
        ),
    }
}

/// A watch that stays open: one JSON event per line for `collection`.
fn watch(shared: &Shared, collection: String) -> Response {
    let rx = shared.events.subscribe();
    let stream = futures::stream::unfold((rx, collection), |(mut rx, collection)| async move {
        loop {
            match rx.recv().await {
                Ok((c, event)) if c == collection => {
                    let mut line = serde_json::to_vec(&event).unwrap_or_default();
                    line.push(b'\n');
                    return Some((Ok::<_, Infallible>(Bytes::from(line)), (rx, collection)));
                }
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    });
    let mut r = Response::new(Body::from_stream(stream));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}
