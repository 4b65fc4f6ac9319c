//! What the end-to-end tests on the real cluster share: `kubectl`, `curl`
//! and `sbmesh-sidecar status` run as a user runs them, against the cluster
//! `scripts/cluster up` starts (`scripts/test` exports its settings).
//!
//! A test gets [`Cluster::from_env`] and a [`Namespace`] of its own, deleted
//! when it drops. Without a cluster (`SBMESH_TEST_KUBECONFIG` unset) the
//! test prints SKIP and passes, unless `SBMESH_TEST_CLUSTER_REQUIRED=1`,
//! which `scripts/test` sets for the phase that runs these binaries after
//! starting the cluster: then it fails.
//!
//! Waits poll with generous deadlines, and every deadline ends within the
//! test's budget ([`budget`]: nextest's kill of a cluster test less a
//! margin), so a wait that runs out fails with its own message, never with
//! nextest's kill.
#![allow(dead_code)]

pub mod chaos;
pub mod image;
pub mod own;
#[allow(clippy::duplicate_mod)]
#[path = "../../../tests/required/mod.rs"]
mod required;

use std::io::Write;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Whether kubectl's error says the API server did not take the call:
/// the connection refused, or the server (or etcd behind it) unable to
/// serve for now.
fn api_unavailable(error: &str) -> bool {
    [
        "connection refused",
        "the server is currently unable to handle the request",
        "etcdserver: request timed out",
        "etcdserver: leader changed",
        "etcdserver: no leader",
    ]
    .iter()
    .any(|m| error.contains(m))
}

/// A listener on this machine's address on the node's link, port 80,
/// where Pebble's HTTP-01 validation of a name pointed at it arrives: one
/// test at a time holds it (a test that finds it taken waits for it, up to
/// `limit`).
pub fn host_port_80(c: &Cluster, limit: Duration) -> std::net::TcpListener {
    let start = Instant::now();
    loop {
        match std::net::TcpListener::bind((c.host_ip.as_str(), 80)) {
            Ok(listener) => {
                listener.set_nonblocking(true).expect("nonblocking");
                return listener;
            }
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && start.elapsed() < limit => {
                std::thread::sleep(Duration::from_secs(1));
            }
            Err(e) => panic!("a listener on {}:80: {e}", c.host_ip),
        }
    }
}

/// The namespace and name of the operator `cluster_install` leaves
/// installed (`install --rbac-scope cluster`, its default namespace) for
/// the other tests.
pub const OPERATOR_NAMESPACE: &str = "sbmesh-system";
pub const OPERATOR_DEPLOYMENT: &str = "sbmesh-operator";
/// The leader election Lease (docs/reference.md).
pub const LEADER_LEASE: &str = "sbproxy-operator-leader";
/// The label selector of the operator's pods.
pub const OPERATOR_SELECTOR: &str = "app.kubernetes.io/name=sbmesh-operator";

/// The running cluster's settings, from `scripts/cluster env`.
#[derive(Clone, Debug)]
pub struct Cluster {
    /// Admin kubeconfig.
    pub kubeconfig: String,
    /// The node's address: Pebble, pebble-challtestsrv and Redis listen there.
    pub node_ip: String,
    /// This machine's address on the node's link, as the node (Pebble)
    /// reaches it: where a test listens for what Pebble sends.
    pub host_ip: String,
    /// The CA that signed Pebble's listener (and the cluster's certificates).
    pub ca: String,
    /// Pebble's ACME directory, as pods reach it.
    pub acme_directory: String,
    /// Pebble's management API (its roots).
    pub acme_management: String,
    /// pebble-challtestsrv's management API (`/add-a`).
    pub challtestsrv: String,
    /// Pebble's log ("Issued certificate serial" lines).
    pub pebble_log: String,
    /// Redis, as pods reach it, without a database number.
    pub redis_url: String,
    /// This tree's sidecar image, as `scripts/cluster images` tagged it.
    pub sbmesh_image: String,
    /// The cluster's containerd socket (`ctr --address`), to kill a
    /// container through the runtime as a crash would.
    pub containerd: String,
    /// BIND, authoritative for [`Cluster::dns01_zone`] (host:port, as pods
    /// and this machine reach it), and the TSIG key that may write its TXT
    /// records: name and base64 secret.
    pub dns01_server: String,
    pub dns01_zone: String,
    pub dns01_key: String,
    pub dns01_secret: String,
}

impl Cluster {
    /// The cluster, or `None` (after printing SKIP) when none runs; with
    /// `SBMESH_TEST_CLUSTER_REQUIRED=1`, a missing cluster fails the test.
    pub fn from_env() -> Option<Cluster> {
        test_started();
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let Some(kubeconfig) = var("SBMESH_TEST_KUBECONFIG") else {
            assert!(
                !required::cluster_required(),
                "SBMESH_TEST_KUBECONFIG is not set, and the cluster is required here (CI, or \
                 SBMESH_TEST_CLUSTER_REQUIRED=1): scripts/test starts the cluster (scripts/cluster up)"
            );
            eprintln!(
                "SKIP: no cluster (run scripts/test, or scripts/cluster up and export SBMESH_TEST_KUBECONFIG)"
            );
            return None;
        };
        let need = |name: &str| var(name).unwrap_or_else(|| panic!("{name} is not set"));
        Some(Cluster {
            kubeconfig,
            node_ip: need("SBMESH_CLUSTER_NODE_IP"),
            host_ip: need("SBMESH_CLUSTER_HOST_IP"),
            ca: need("SBMESH_CLUSTER_CA"),
            acme_directory: need("SBMESH_CLUSTER_ACME_DIRECTORY"),
            acme_management: need("SBMESH_CLUSTER_ACME_MANAGEMENT_URL"),
            challtestsrv: need("SBMESH_CLUSTER_CHALLTESTSRV_URL"),
            pebble_log: need("SBMESH_CLUSTER_PEBBLE_LOG"),
            redis_url: need("SBMESH_CLUSTER_REDIS_URL"),
            sbmesh_image: need("SBMESH_CLUSTER_SBMESH_IMAGE"),
            containerd: need("SBMESH_CLUSTER_CONTAINERD_SOCK"),
            dns01_server: need("SBMESH_CLUSTER_DNS01_SERVER"),
            dns01_zone: need("SBMESH_CLUSTER_DNS01_ZONE"),
            dns01_key: need("SBMESH_CLUSTER_DNS01_KEY"),
            dns01_secret: need("SBMESH_CLUSTER_DNS01_SECRET"),
        })
    }

    /// `kubectl ARGS`: stdout, or stderr as the error.
    pub fn kubectl(&self, args: &[&str]) -> Result<String, String> {
        self.kubectl_with(args, None)
    }

    /// `kubectl ARGS` with `input` on stdin. A call the API server did not
    /// take (its connection refused, or it said it cannot serve now: the
    /// restart of kube-apiserver or etcd that a test beside this one makes)
    /// is made again for up to a minute, as a user would; any other error
    /// is the call's answer.
    pub fn kubectl_with(&self, args: &[&str], input: Option<&str>) -> Result<String, String> {
        let start = Instant::now();
        loop {
            let out = run(
                Command::new("kubectl")
                    .env("KUBECONFIG", &self.kubeconfig)
                    .args(args),
                input,
            );
            match &out {
                Err(e) if api_unavailable(e) && start.elapsed() < Duration::from_secs(60) => {
                    std::thread::sleep(Duration::from_millis(500));
                }
                _ => return out,
            }
        }
    }

    /// `kubectl ARGS`, which must succeed.
    pub fn must(&self, args: &[&str]) -> String {
        self.kubectl(args)
            .unwrap_or_else(|e| panic!("kubectl {}: {e}", args.join(" ")))
    }

    /// `kubectl apply -f -` of `yaml`, which must succeed.
    pub fn apply(&self, yaml: &str) -> String {
        self.kubectl_with(&["apply", "-f", "-"], Some(yaml))
            .unwrap_or_else(|e| panic!("kubectl apply: {e}\n--- input:\n{yaml}"))
    }

    /// `kubectl get ARGS -o json`, parsed; `None` when kubectl fails (e.g. not found).
    pub fn get(&self, args: &[&str]) -> Option<Value> {
        let mut all = vec!["get"];
        all.extend_from_slice(args);
        all.extend(["-o", "json"]);
        let out = self.kubectl(&all).ok()?;
        serde_json::from_str(&out).ok()
    }

    /// Waits until the operator `cluster_install` installs (cluster scope,
    /// [`OPERATOR_NAMESPACE`]) runs every replica: as many Ready pods, none
    /// of them terminating, as the Deployment wants (its own status lags a
    /// deleted pod).
    pub fn operator(&self) {
        wait_for(
            "the cluster-wide operator's every replica Ready",
            Duration::from_secs(180),
            || {
                let d = self.get(&["-n", OPERATOR_NAMESPACE, "deployment", OPERATOR_DEPLOYMENT])?;
                let want = d["spec"]["replicas"].as_u64()?;
                let all_namespaces = d["spec"]["template"]["spec"]["containers"][0]["args"]
                    .as_array()?
                    .iter()
                    .any(|a| a == "--all-namespaces");
                let pods = self.operator_pods(OPERATOR_NAMESPACE);
                let ready = pods
                    .iter()
                    .filter(|p| p["metadata"]["deletionTimestamp"].is_null() && pod_ready(p))
                    .count();
                (all_namespaces && pods.len() as u64 == want && ready as u64 == want).then_some(())
            },
        );
    }

    /// Stops the cluster-wide operator (its Deployment scaled to 0, its
    /// pods gone) until the guard is dropped, which scales it back and
    /// waits for it: what the cluster's objects do meanwhile is left as
    /// they are, and nothing puts back what a test changes by hand.
    pub fn operator_stopped(&self) -> OperatorStopped<'_> {
        let d = self
            .get(&["-n", OPERATOR_NAMESPACE, "deployment", OPERATOR_DEPLOYMENT])
            .expect("the operator's Deployment");
        let replicas = d["spec"]["replicas"].as_u64().unwrap_or(1);
        self.scale_operator(0)
            .unwrap_or_else(|e| panic!("scaling the operator to 0: {e}"));
        wait_for("no operator pod", Duration::from_secs(120), || {
            self.operator_pods(OPERATOR_NAMESPACE)
                .is_empty()
                .then_some(())
        });
        OperatorStopped {
            cluster: self,
            replicas,
        }
    }

    /// `kubectl scale` of the cluster-wide operator's Deployment.
    fn scale_operator(&self, replicas: u64) -> Result<String, String> {
        self.kubectl(&[
            "-n",
            OPERATOR_NAMESPACE,
            "scale",
            "deployment",
            OPERATOR_DEPLOYMENT,
            &format!("--replicas={replicas}"),
        ])
    }

    /// The operator's pods in `ns` (its Deployment's selector).
    pub fn operator_pods(&self, ns: &str) -> Vec<Value> {
        self.get(&["-n", ns, "pods", "-l", OPERATOR_SELECTOR])
            .and_then(|list| list["items"].as_array().cloned())
            .unwrap_or_default()
    }
}

/// The operator stopped by [`Cluster::operator_stopped`].
pub struct OperatorStopped<'c> {
    cluster: &'c Cluster,
    replicas: u64,
}

impl Drop for OperatorStopped<'_> {
    fn drop(&mut self) {
        let _ = self.cluster.scale_operator(self.replicas);
        if !std::thread::panicking() {
            self.cluster.operator();
        }
    }
}

/// A namespace of the test's own, deleted (without waiting) when dropped.
pub struct Namespace {
    pub name: String,
    cluster: Cluster,
}

impl Namespace {
    /// Creates `name` with these labels, deleting a leftover of an earlier run first.
    pub fn new(cluster: &Cluster, name: &str, labels: &[(&str, &str)]) -> Namespace {
        let _ = cluster.kubectl(&["delete", "namespace", name, "--wait=true", "--timeout=120s"]);
        let labels: String = labels
            .iter()
            .map(|(k, v)| format!("\n    {k}: \"{v}\""))
            .collect();
        cluster.apply(&format!(
            "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}\n  labels:\n    sbmesh.test/e2e: \"true\"{labels}\n"
        ));
        Namespace {
            name: name.to_string(),
            cluster: cluster.clone(),
        }
    }

    /// A seed manifest (`operator/tests/seed_manifests/NAME.yaml`), as
    /// written but for its namespace: this one instead of `default`.
    pub fn seed(&self, name: &str) -> String {
        let path = manifests_dir().join(format!("{name}.yaml"));
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        text.replace("namespace: default", &format!("namespace: {}", self.name))
    }

    /// Why pod creations were refused here (the messages of the
    /// `FailedCreate` Events its workloads got, one per line; empty: none).
    pub fn refused_creations(&self) -> String {
        self.kubectl(&[
            "get",
            "events",
            "--field-selector",
            "reason=FailedCreate",
            "-o",
            "custom-columns=M:.message",
            "--no-headers",
        ])
        .unwrap_or_default()
        .trim()
        .to_string()
    }

    /// The cluster it is in.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// `kubectl -n NS ARGS`.
    pub fn kubectl(&self, args: &[&str]) -> Result<String, String> {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        self.cluster.kubectl(&all)
    }

    /// `kubectl -n NS get ARGS -o json`.
    pub fn get(&self, args: &[&str]) -> Option<Value> {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        self.cluster.get(&all)
    }

    /// The pods `selector` (a label selector) selects, by name.
    pub fn pods(&self, selector: &str) -> Vec<Value> {
        let mut pods: Vec<Value> = self
            .get(&["pods", "-l", selector])
            .and_then(|l| l["items"].as_array().cloned())
            .unwrap_or_default();
        pods.sort_by_key(|p| p["metadata"]["name"].as_str().unwrap_or("").to_string());
        pods
    }

    /// The pods of SBProxy `instance`, by name.
    pub fn proxy_pods(&self, instance: &str) -> Vec<Value> {
        self.pods(&format!("app.kubernetes.io/instance={instance}"))
    }

    /// Waits until SBProxy `instance` has `n` pods, every one Ready, and
    /// returns them.
    pub fn ready_pods(&self, instance: &str, n: usize) -> Vec<Value> {
        self.ready(
            &format!("app.kubernetes.io/instance={instance}"),
            &format!("SBProxy {}/{instance}", self.name),
            n,
        )
    }

    /// Waits until `selector` selects `n` pods, every one Ready (`what`
    /// names them in the time-out's message), and returns them.
    pub fn ready(&self, selector: &str, what: &str, n: usize) -> Vec<Value> {
        wait_for(
            &format!("{n} Ready pods of {what}"),
            Duration::from_secs(240),
            || {
                let pods = self.pods(selector);
                (pods.len() == n && pods.iter().all(pod_ready)).then_some(pods)
            },
        )
    }

    /// Waits until SBProxy `name`'s condition `type_` has `status` (and
    /// `reason`, when given); returns the SBProxy.
    pub fn condition(&self, name: &str, type_: &str, status: &str, reason: Option<&str>) -> Value {
        wait_for(
            &format!("SBProxy {}/{name} {type_}={status} {reason:?}", self.name),
            Duration::from_secs(180),
            || {
                let p = self.get(&["sbproxy", name])?;
                let c = p["status"]["conditions"]
                    .as_array()?
                    .iter()
                    .find(|c| c["type"] == type_)?
                    .clone();
                (c["status"] == status && reason.is_none_or(|r| c["reason"] == r)).then_some(p)
            },
        )
    }

    /// The ClusterIP of Service `name`, once the operator made it.
    pub fn wait_cluster_ip(&self, name: &str) -> String {
        wait_for(
            &format!("the Service {name}"),
            Duration::from_secs(60),
            || {
                self.get(&["service", name])?["spec"]["clusterIP"]
                    .as_str()
                    .map(str::to_string)
            },
        )
    }

    /// The ClusterIP of Service `name`.
    pub fn cluster_ip(&self, name: &str) -> String {
        let svc = self
            .get(&["service", name])
            .unwrap_or_else(|| panic!("no Service {}/{name}", self.name));
        svc["spec"]["clusterIP"]
            .as_str()
            .unwrap_or_else(|| panic!("Service {name} has no clusterIP: {svc}"))
            .to_string()
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = self
            .cluster
            .kubectl(&["delete", "namespace", &self.name, "--wait=false"]);
    }
}

/// An SBProxy `demo` in `ns` whose sidecars order one certificate for
/// `names` (`san`) from the cluster's Pebble, on its Redis, and restart the
/// proxy with it (sbproxy reads its certificate once): 3 replicas, the
/// proxy's TLS port 8443, each name a mock origin answering `<name>\n`.
/// The ConfigMap `acme-ca` carries the CA Pebble's listener is signed by.
///
/// Its store is Redis database `db`, emptied first: records another run
/// sealed under another cluster key cannot be opened, and the sidecar
/// rightly refuses to overwrite them.
pub fn acme_manifest(c: &Cluster, ns: &str, names: &[&str], db: u8) -> String {
    let redis = format!("{}/{db}", c.redis_url);
    run(
        Command::new("redis-cli").args(["-u", &redis, "FLUSHDB"]),
        None,
    )
    .unwrap_or_else(|e| panic!("redis-cli -u {redis} FLUSHDB: {e}"));
    let ca = std::fs::read_to_string(&c.ca).expect("the cluster CA");
    let ca: String = ca.lines().map(|l| format!("    {l}\n")).collect();
    let origins: String = names
        .iter()
        .map(|n| {
            format!(
                "      \"{n}\":\n        action: {{ type: static, status_code: 200, body: \"{n}\\n\" }}\n"
            )
        })
        .collect();
    format!(
        r#"apiVersion: v1
kind: ConfigMap
metadata: {{name: acme-ca, namespace: {ns}}}
data:
  ca.crt: |
{ca}---
apiVersion: sbproxy.dev/v1alpha1
kind: SBProxyConfig
metadata: {{name: demo-config, namespace: {ns}}}
spec:
  config: |
    proxy:
      admin: {{ enabled: true, port: 9090, username: admin, password: secret }}
      https_bind_port: 8443
      tls_cert_file: /var/lib/sbproxy/certs/tls.crt
      tls_key_file: /var/lib/sbproxy/certs/tls.key
      extensions:
        sbmesh:
          acme:
            enabled: true
            email: ops@e2e.test
            directory_url: {dir}
            ca_root: /etc/sbmesh-acme/ca.crt
            storage_backend: redis
            storage_path: {redis}
            certificates: san
            apply: restart
    origins:
{origins}---
apiVersion: sbproxy.dev/v1alpha1
kind: SBProxy
metadata: {{name: demo, namespace: {ns}}}
spec:
  image: soapbucket/sbproxy:1.13.0
  configRef: demo-config
  replicas: 3
  port: 8080
  adminPort: 9090
  clustering: {{ enabled: true }}
  podTemplate:
    volumes:
    - name: acme-ca
      configMap: {{ name: acme-ca }}
    sidecarVolumeMounts:
    - {{ name: acme-ca, mountPath: /etc/sbmesh-acme, readOnly: true }}
"#,
        dir = c.acme_directory,
    )
}

/// [`acme_manifest`] ordering over DNS-01 from the cluster's BIND
/// (`rfc2136`), its TSIG secret in a Secret `dns01-tsig` handed to the
/// sidecar as `SBMESH_TSIG_SECRET` through `spec.podTemplate.sidecarEnv`,
/// as a user keeps a credential out of the config.
pub fn dns01_manifest(c: &Cluster, ns: &str, names: &[&str], db: u8) -> String {
    let acme = format!(
        "            apply: restart\n            challenge: dns-01\n            dns01:\n\
         \x20             provider: rfc2136\n\
         \x20             nameserver: \"{server}\"\n\
         \x20             tsig_key_name: {key}\n\
         \x20             tsig_secret: \"env:SBMESH_TSIG_SECRET\"\n",
        server = c.dns01_server,
        key = c.dns01_key,
    );
    let env = "    sidecarEnv:\n    - name: SBMESH_TSIG_SECRET\n      \
               valueFrom: { secretKeyRef: { name: dns01-tsig, key: secret } }\n    \
               sidecarVolumeMounts:\n";
    let manifest = acme_manifest(c, ns, names, db);
    let edited = manifest
        .replacen("            apply: restart\n", &acme, 1)
        .replacen("    sidecarVolumeMounts:\n", env, 1);
    assert_eq!(
        edited.matches("SBMESH_TSIG_SECRET").count(),
        2,
        "acme_manifest changed shape: {manifest}"
    );
    format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{name: dns01-tsig, namespace: {ns}}}\n\
         stringData: {{secret: \"{secret}\"}}\n---\n{edited}",
        secret = c.dns01_secret
    )
}

/// The TXT values the cluster's BIND serves at `name` (`dig +short`).
pub fn dns01_txt(c: &Cluster, name: &str) -> Vec<String> {
    let (host, port) = c.dns01_server.rsplit_once(':').expect("host:port");
    run(
        Command::new("dig").args([&format!("@{host}"), "-p", port, "+short", "TXT", name]),
        None,
    )
    .unwrap_or_else(|e| panic!("dig TXT {name} at {}: {e}", c.dns01_server))
    .lines()
    .map(|l| l.trim().trim_matches('"').to_string())
    .filter(|l| !l.is_empty())
    .collect()
}

/// Makes Pebble resolve `name` to `ip` (pebble-challtestsrv's `/add-a`), as
/// a public DNS record points a name at the LoadBalancer before a Service.
/// Records of an earlier run are cleared first: a name that still resolved
/// to the ClusterIP of a deleted Service would time Pebble's validation out.
pub fn add_a(c: &Cluster, name: &str, ip: &str) {
    let (code, body) = curl(&[
        "-X",
        "POST",
        &format!("{}/clear-a", c.challtestsrv),
        "-d",
        &format!(r#"{{"host":"{name}."}}"#),
    ])
    .expect("pebble-challtestsrv");
    assert_eq!(code, 200, "clear-a {name}: {body}");
    let (code, body) = curl(&[
        "-X",
        "POST",
        &format!("{}/add-a", c.challtestsrv),
        "-d",
        &format!(r#"{{"host":"{name}.","addresses":["{ip}"]}}"#),
    ])
    .expect("pebble-challtestsrv");
    assert_eq!(code, 200, "add-a {name}: {body}");
}

/// How many certificates Pebble has issued (its log's lines).
pub fn issued(c: &Cluster) -> usize {
    pebble_log_lines(c, "Issued certificate serial")
}

/// Lines of Pebble's log so far that contain `text`.
fn pebble_log_lines(c: &Cluster, text: &str) -> usize {
    std::fs::read_to_string(&c.pebble_log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(text))
        .count()
}

/// Authorizations Pebble's validation failed so far (its log): each one
/// a failed validation Let's Encrypt would count against the account.
pub fn invalid_authorizations(c: &Cluster) -> usize {
    pebble_log_lines(c, " set INVALID by completed challenge")
}

/// Pebble's root (what its certificates chain to), in a file for curl,
/// removed when dropped.
pub fn pebble_root(c: &Cluster) -> PebbleRoot {
    let (code, pem) = curl(&["--cacert", &c.ca, &format!("{}/roots/0", c.acme_management)])
        .expect("Pebble's management API");
    assert_eq!(code, 200, "{pem}");
    let mut file = tempfile::Builder::new()
        .prefix("pebble-root-")
        .suffix(".pem")
        .tempfile()
        .expect("a file for the root");
    file.write_all(pem.as_bytes()).expect("write the root");
    let path = file.into_temp_path();
    PebbleRoot {
        text: path.display().to_string(),
        _path: path,
    }
}

/// The file [`pebble_root`] wrote: its path as text for curl's
/// `--cacert`, removed when dropped.
pub struct PebbleRoot {
    text: String,
    _path: tempfile::TempPath,
}

impl std::ops::Deref for PebbleRoot {
    type Target = str;
    fn deref(&self) -> &str {
        &self.text
    }
}

/// Whether `https://NAME:PORT/` at `ip` completes a TLS handshake verified
/// against `root` and answers 200.
pub fn serves_tls(root: &str, name: &str, ip: &str, port: u16) -> bool {
    https_status(root, name, ip, port) == Some(200)
}

/// Whether a TLS handshake with `ip:port` for SNI `name` presents a
/// certificate for `name` that `root` vouches for (whatever the proxy then
/// answers over HTTP).
pub fn tls_verified(root: &str, name: &str, ip: &str, port: u16) -> bool {
    https_status(root, name, ip, port).is_some_and(|code| code != 0)
}

/// The HTTP status of `https://NAME:PORT/` at `ip`, verified against
/// `root`; `None` when no verified exchange completes within 2 s (not
/// curl()'s 10: a connection a restarting proxy accepted and never answers
/// must not hold a timed wait up).
fn https_status(root: &str, name: &str, ip: &str, port: u16) -> Option<u16> {
    let resolve = format!("{name}:{port}:{ip}");
    curl(&[
        "--max-time",
        "2",
        "--cacert",
        root,
        "--resolve",
        &resolve,
        &format!("https://{name}:{port}/"),
    ])
    .ok()
    .map(|(code, _)| code)
}

/// The serial (lowercase hex, no leading zeros) of the certificate served
/// for SNI `name` at `ip:port`; `None` when no handshake completes within 2 s.
pub fn served_serial(name: &str, ip: &str, port: u16) -> Option<String> {
    served_certificate(name, ip, port).map(|(serial, _)| serial)
}

/// The certificate served for SNI `name` at `ip:port`: its serial (as
/// [`served_serial`] says it) and whether it is past its notAfter now; `None` when
/// no handshake completes within 2 s.
pub fn served_certificate(name: &str, ip: &str, port: u16) -> Option<(String, bool)> {
    let connect = format!("{ip}:{port}");
    let pem = run(
        Command::new("timeout").args([
            "2",
            "openssl",
            "s_client",
            "-connect",
            &connect,
            "-servername",
            name,
        ]),
        Some(""),
    )
    .ok()?;
    // `-checkend 0` exits 1 for a certificate that has expired.
    let (out, expired) = match run(
        Command::new("openssl").args(["x509", "-noout", "-serial", "-checkend", "0"]),
        Some(&pem),
    ) {
        Ok(out) => (out, false),
        Err(out) if out.contains("will expire") => (out, true),
        Err(_) => return None,
    };
    let hex = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("serial="))?
        .to_ascii_lowercase();
    Some((hex.trim_start_matches('0').to_string(), expired))
}

/// A pod's `Ready` condition is `True`.
pub fn pod_ready(pod: &Value) -> bool {
    pod["status"]["conditions"].as_array().is_some_and(|cs| {
        cs.iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

/// Every container's status of a pod, init containers (the sidecar) first.
pub fn container_statuses(pod: &Value) -> impl Iterator<Item = &Value> {
    ["initContainerStatuses", "containerStatuses"]
        .into_iter()
        .filter_map(|k| pod["status"][k].as_array())
        .flatten()
}

/// Every container's `restartCount` of a pod, init containers (the sidecar) included.
pub fn restarts(pod: &Value) -> Vec<(String, i64)> {
    container_statuses(pod)
        .map(|s| {
            (
                s["name"].as_str().unwrap_or("").to_string(),
                s["restartCount"].as_i64().unwrap_or(-1),
            )
        })
        .collect()
}

/// The pod's IP.
pub fn pod_ip(pod: &Value) -> String {
    pod["status"]["podIP"].as_str().unwrap_or("").to_string()
}

/// `curl -sS ARGS`, answering `(status, body)`; `Err` when curl fails
/// (no connection, TLS failure).
pub fn curl(args: &[&str]) -> Result<(u16, String), String> {
    let out = run(
        Command::new("curl")
            .args(["-sS", "--max-time", "10", "-o", "-", "-w", "\n%{http_code}"])
            .args(args),
        None,
    )?;
    let (body, code) = out.rsplit_once('\n').unwrap_or(("", out.as_str()));
    Ok((code.trim().parse().unwrap_or(0), body.to_string()))
}

/// What sbproxy answers for an origin `action: { type: mock, body: TEXT }`
/// (as the seed's manifests have it): a mock's body is a JSON value, so a
/// string is sent JSON-encoded, quotes and escapes included
/// (`Content-Type: application/json`). A `static` action sends its text as
/// it is.
pub fn mock_answer(text: &str) -> String {
    serde_json::to_string(text).expect("a string is JSON")
}

/// Waits until `url` answers 200 with exactly `body` to a request for Host
/// `host`.
pub fn wait_for_answer(url: &str, host: &str, body: &str, limit: Duration) {
    let header = format!("Host: {host}");
    wait_for(&format!("{body:?} from {url} (Host {host})"), limit, || {
        let (code, got) = curl(&["-H", &header, url]).ok()?;
        (code == 200 && got == body).then_some(())
    });
}

/// A sidecar's `/admin/cluster/status` (admin port 9091 of the pod).
pub fn sidecar_status(ip: &str, user: Option<(&str, &str)>) -> Option<Value> {
    let url = format!("http://{ip}:9091/admin/cluster/status");
    let auth = user.map(|(u, p)| format!("{u}:{p}"));
    let mut args = vec![url.as_str()];
    if let Some(a) = &auth {
        args.extend(["-u", a.as_str()]);
    }
    let (code, body) = curl(&args).ok()?;
    (code == 200).then(|| serde_json::from_str(&body).ok())?
}

/// A sidecar's `/metrics` sample `name{labels}` (the text before the value), as a number.
pub fn metric(ip: &str, sample: &str) -> Option<f64> {
    let (code, body) = curl(&[&format!("http://{ip}:9091/metrics")]).ok()?;
    if code != 200 {
        return None;
    }
    body.lines().find_map(|l| {
        l.strip_prefix(sample)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// Polls `f` every 500 ms until it answers `Some`, for at most `limit`,
/// and never past the test's [`budget`].
pub fn wait_for<T>(what: &str, limit: Duration, f: impl FnMut() -> Option<T>) -> T {
    wait_every(what, limit, Duration::from_millis(500), f)
}

/// [`wait_for`], polling every `period`.
pub fn wait_every<T>(
    what: &str,
    limit: Duration,
    period: Duration,
    mut f: impl FnMut() -> Option<T>,
) -> T {
    let start = Instant::now();
    let (limit, why) = match budget() {
        Some(budget) if budget.saturating_sub(test_started().elapsed()) < limit => (
            budget.saturating_sub(test_started().elapsed()),
            format!(
                " (what was left of the test's budget of {budget:?}: nextest kills a cluster \
                 test at {:?}, .config/nextest.toml)",
                nextest_kill()
            ),
        ),
        _ => (limit, String::new()),
    };
    loop {
        if let Some(v) = f() {
            eprintln!("{what}: after {:.1} s", start.elapsed().as_secs_f64());
            return v;
        }
        assert!(start.elapsed() < limit, "no {what} within {limit:?}{why}");
        std::thread::sleep(period);
    }
}

/// When this test started: its first [`Cluster::from_env`] (nextest runs
/// each test in a process of its own).
fn test_started() -> Instant {
    static STARTED: OnceLock<Instant> = OnceLock::new();
    *STARTED.get_or_init(Instant::now)
}

/// How long a cluster test may wait in all under nextest (which sets
/// `NEXTEST_RUN_ID`): its kill less a minute, for the failure's message
/// and the clean-up. `None` elsewhere (the timeline bench, `cargo test`).
pub fn budget() -> Option<Duration> {
    std::env::var_os("NEXTEST_RUN_ID")
        .map(|_| nextest_kill().saturating_sub(Duration::from_secs(60)))
}

/// When nextest kills a cluster test: `period` times `terminate-after` of
/// the `slow-timeout` in `.config/nextest.toml`'s override for
/// `binary(cluster_e2e)`, the one place that says it.
pub fn nextest_kill() -> Duration {
    static KILL: OnceLock<Duration> = OnceLock::new();
    *KILL.get_or_init(|| {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.config/nextest.toml");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        slow_timeout_of(&text, "binary(cluster_e2e)").unwrap_or_else(|| {
            panic!(
                "{}: no override for binary(cluster_e2e) with \
                 slow-timeout = {{ period = \"<N>s\", terminate-after = <M> }}",
                path.display()
            )
        })
    })
}

/// The kill time of the first override whose `filter` names `target`.
fn slow_timeout_of(config: &str, target: &str) -> Option<Duration> {
    let mut in_block = false;
    for line in config.lines().map(str::trim) {
        if line.starts_with('[') {
            in_block = false;
        } else if line.starts_with("filter") {
            in_block = line.contains(target);
        } else if in_block && line.starts_with("slow-timeout") {
            // `name = N` or `name = "Ns"`: a period in another unit is not read.
            let field = |name: &str, unit: &str| -> Option<u64> {
                let rest = line.split(name).nth(1)?.trim_start_matches([' ', '=', '"']);
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                rest[digits.len()..]
                    .starts_with(unit)
                    .then(|| digits.parse().ok())?
            };
            return Some(Duration::from_secs(
                field("period", "s\"")? * field("terminate-after", "")?,
            ));
        }
    }
    None
}

/// The operator binary this build made.
pub fn operator_bin() -> &'static str {
    env!("CARGO_BIN_EXE_sbmesh-operator")
}

/// `sbmesh-operator ARGS`: stdout.
pub fn operator(args: &[&str]) -> String {
    run(Command::new(operator_bin()).args(args), None)
        .unwrap_or_else(|e| panic!("sbmesh-operator {}: {e}", args.join(" ")))
}

fn manifests_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/seed_manifests")
}

fn run(cmd: &mut Command, input: Option<&str>) -> Result<String, String> {
    let mut child = cmd
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        stdin
            .write_all(text.as_bytes())
            .map_err(|e| format!("writing to {cmd:?}: {e}"))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("waiting for {cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        ))
    }
}

/// Each pod by name: its UID and every container's restart count. Two
/// equal maps mean the same pods, none replaced and none restarted (a
/// replaced pod also starts at zero restarts, but under a new UID).
pub type Identities = std::collections::BTreeMap<String, (String, Vec<(String, i64)>)>;

/// The [`Identities`] of `pods`.
pub fn identities(pods: &[Value]) -> Identities {
    pods.iter()
        .map(|p| {
            (
                p["metadata"]["name"].as_str().unwrap_or("").to_string(),
                (
                    p["metadata"]["uid"].as_str().unwrap_or("").to_string(),
                    restarts(p),
                ),
            )
        })
        .collect()
}

/// `kubectl port-forward` of a pod's port to a free port of 127.0.0.1, as a
/// user with kubectl reaches a pod's loopback-only endpoints (the
/// connection arrives on the pod's loopback). Stopped when dropped.
pub struct PortForward {
    child: Child,
    /// The local port.
    pub port: u16,
}

impl PortForward {
    /// Starts `kubectl -n NS port-forward pod/POD :PORT` and waits for its
    /// "Forwarding from 127.0.0.1:N" line.
    pub fn new(c: &Cluster, ns: &str, pod: &str, port: u16) -> PortForward {
        let mut child = Command::new("kubectl")
            .env("KUBECONFIG", &c.kubeconfig)
            .args([
                "-n",
                ns,
                "port-forward",
                "--address",
                "127.0.0.1",
                &format!("pod/{pod}"),
                &format!(":{port}"),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kubectl port-forward");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // "Forwarding from 127.0.0.1:40123 -> 9091"
                let local = line
                    .strip_prefix("Forwarding from 127.0.0.1:")
                    .and_then(|rest| rest.split(' ').next())
                    .and_then(|p| p.parse::<u16>().ok());
                if let Some(local) = local {
                    let _ = tx.send(local);
                }
            }
        });
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(local) => PortForward { child, port: local },
            Err(_) => {
                let _ = child.kill();
                let out = child.wait_with_output().expect("kubectl port-forward");
                panic!(
                    "kubectl -n {ns} port-forward pod/{pod} :{port} did not forward within 30 s: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
    }
}

impl Drop for PortForward {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A sidecar's `/admin/cluster/status`, read as a user with kubectl reads
/// it when no admin credentials are set: through `kubectl port-forward`,
/// which the sidecar sees as a loopback client.
pub fn sidecar_status_forwarded(c: &Cluster, ns: &str, pod: &str) -> Value {
    let forward = PortForward::new(c, ns, pod, 9091);
    let url = format!("http://127.0.0.1:{}/admin/cluster/status", forward.port);
    let (code, body) = curl(&[&url]).unwrap_or_else(|e| panic!("{url} ({pod}): {e}"));
    assert_eq!(code, 200, "{url} ({pod}): {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{url} ({pod}): {e}: {body}"))
}

/// A running container's ID in the runtime (`containerStatuses[].containerID`,
/// or `initContainerStatuses[]` for the sidecar, without its `containerd://`).
pub fn running_container_id(pod: &Value, container: &str) -> Option<String> {
    container_statuses(pod)
        .find(|s| s["name"] == container && s["state"]["running"].is_object())
        .and_then(|s| s["containerID"].as_str())
        .and_then(|id| id.strip_prefix("containerd://"))
        .map(String::from)
}

/// [`running_container_id`], which must be there.
pub fn container_id(pod: &Value, container: &str) -> String {
    running_container_id(pod, container)
        .unwrap_or_else(|| panic!("no running container {container} in {pod}"))
}

/// SIGKILL to a container's process through containerd, as a crash or an
/// OOM kill ends it: no SIGTERM, nothing released.
pub fn kill_container(c: &Cluster, id: &str) {
    ctr(c, &["tasks", "kill", "--signal", "SIGKILL", id]);
}

/// [`kill_container`], or why not (the task already gone, say).
pub fn try_kill_container(c: &Cluster, id: &str) -> Result<(), String> {
    try_ctr(c, &["tasks", "kill", "--signal", "SIGKILL", id]).map(|_| ())
}

/// Freezes a container's processes through containerd (the freezer
/// cgroup): a hung process that neither works, renews nor releases.
pub fn pause_container(c: &Cluster, id: &str) {
    ctr(c, &["tasks", "pause", id]);
}

/// Thaws a container [`pause_container`] froze, if it still runs (a
/// SIGKILL to a frozen container ends it at once: then there is nothing
/// to thaw).
pub fn resume_container(c: &Cluster, id: &str) {
    if let Err(e) = try_ctr(c, &["tasks", "resume", id]) {
        eprintln!("ctr tasks resume {id}: {e} (the task is gone)");
    }
}

/// The resident memory (VmRSS, bytes) of a running container's process,
/// found through the runtime (`ctr tasks ls`): the node's processes are
/// this machine's.
pub fn container_rss(c: &Cluster, id: &str) -> Option<u64> {
    let pid = container_pid(c, id)?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// A running container's process id on this machine (`ctr tasks ls`).
fn container_pid(c: &Cluster, id: &str) -> Option<String> {
    let tasks = try_ctr(c, &["tasks", "ls"]).ok()?;
    tasks.lines().find_map(|line| {
        let mut cols = line.split_whitespace();
        (cols.next()? == id).then(|| cols.next().map(String::from))?
    })
}

/// A running container's CPU quota (µs per 100 ms period; `None`:
/// unlimited) and how many periods the kernel throttled it so far, from its
/// cgroup (v2's `cpu.max` and `cpu.stat`, or v1's `cpu.cfs_quota_us` and
/// `cpu.stat`): what the kubelet set, and what the kernel did with it.
pub fn container_cpu(c: &Cluster, id: &str) -> Option<(Option<u64>, u64)> {
    let pid = container_pid(c, id)?;
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let v2 = std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    let (dir, quota) = if v2 {
        let path = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
        let dir = format!("/sys/fs/cgroup{path}");
        let max = std::fs::read_to_string(format!("{dir}/cpu.max")).ok()?;
        (dir, max.split_whitespace().next()?.parse().ok())
    } else {
        let (controllers, path) = cgroup.lines().find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            controllers
                .split(',')
                .any(|c| c == "cpu")
                .then_some((controllers, path))
        })?;
        let dir = format!("/sys/fs/cgroup/{controllers}{path}");
        let quota = std::fs::read_to_string(format!("{dir}/cpu.cfs_quota_us")).ok()?;
        (dir, quota.trim().parse().ok().filter(|q: &u64| *q > 0))
    };
    let stat = std::fs::read_to_string(format!("{dir}/cpu.stat")).ok()?;
    let throttled = stat
        .lines()
        .find_map(|l| l.strip_prefix("nr_throttled "))?
        .trim()
        .parse()
        .ok()?;
    Some((quota, throttled))
}

fn ctr(c: &Cluster, args: &[&str]) {
    try_ctr(c, args).unwrap_or_else(|e| panic!("ctr {}: {e}", args.join(" ")));
}

pub fn try_ctr(c: &Cluster, args: &[&str]) -> Result<String, String> {
    let mut all = vec!["--address", c.containerd.as_str(), "--namespace", "k8s.io"];
    all.extend_from_slice(args);
    run(Command::new("ctr").args(&all), None)
}

/// The A records of `name` at the cluster's DNS (CoreDNS on the node), as
/// a pod resolves it; the first address.
pub fn resolve(c: &Cluster, name: &str) -> Result<String, String> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/cluster.d/dns.py");
    let out = run(
        Command::new("python3")
            .arg(&script)
            .args([&c.node_ip, name]),
        None,
    )?;
    out.split_whitespace()
        .next()
        .map(str::to_string)
        .ok_or_else(|| format!("no A record of {name}"))
}

/// `redis-cli -h HOST -p PORT PING`'s answer.
pub fn redis_ping(host: &str, port: &str) -> Result<String, String> {
    run(
        Command::new("redis-cli").args(["-h", host, "-p", port, "PING"]),
        None,
    )
    .map(|out| out.trim().to_string())
}

/// `manifest` with one more origin, `name`, in its config: a new name for
/// the fleet's certificate (in `san` mode), ordered once.
pub fn with_origin(manifest: &str, name: &str) -> String {
    let origin = format!(
        "    origins:\n      \"{name}\":\n        action: {{ type: static, status_code: 200, body: \"{name}\\n\" }}\n"
    );
    let next = manifest.replacen("    origins:\n", &origin, 1);
    assert_ne!(next, manifest, "no origins to add {name} to");
    next
}

/// How many validations Pebble ran for `name` so far (its log's "Pulled a
/// task" lines): with authorization reuse off, one per order that names it,
/// so a count that does not move means no new order for `name`.
pub fn validations_for(c: &Cluster, name: &str) -> usize {
    pebble_log_lines(c, &format!("Value:\"{name}\"}}"))
}

/// The admin credentials of the seed's manifests and of [`acme_manifest`]'s
/// config (`proxy.admin`): the sidecar's admin API takes the proxy's.
pub const ADMIN: Option<(&str, &str)> = Some(("admin", "secret"));

/// A fleet of [`acme_manifest`]: SBProxy `demo`, 3 replicas, clustered, the
/// sidecar's ACME on Redis database `db` with two names of its own
/// (`a.NS.test`, `b.NS.test`), deployed and whole: the certificate issued
/// once and served by every proxy. What a fleet-life scenario compares
/// against afterwards: the serial, and Pebble's validations of the names.
pub struct Fleet {
    pub ns: Namespace,
    pub names: Vec<String>,
    pub root: PebbleRoot,
    /// The ClusterIP of `demo-svc`, where Pebble validates.
    pub service_ip: String,
    /// The serial of the certificate every proxy serves.
    pub serial: String,
    /// The manifest applied.
    pub manifest: String,
    validations: usize,
}

impl Fleet {
    /// Deploys the fleet in a new namespace `ns`, `edit` applied to the
    /// manifest first (e.g. a clustering knob), and waits until it is whole.
    pub fn deploy(c: &Cluster, ns: &str, db: u8, edit: impl FnOnce(String) -> String) -> Fleet {
        let namespace = Namespace::new(c, ns, &[]);
        let names: Vec<String> = ["a", "b"]
            .iter()
            .map(|p| format!("{p}.{ns}.test"))
            .collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let manifest = edit(acme_manifest(c, ns, &refs, db));
        // Pebble's log is the cluster's: an earlier run's orders for the
        // same names are in it.
        let earlier: usize = names.iter().map(|n| validations_for(c, n)).sum();
        c.apply(&manifest);
        let service_ip = namespace.wait_cluster_ip("demo-svc");
        for name in &names {
            add_a(c, name, &service_ip);
        }
        let root = pebble_root(c);
        let mut fleet = Fleet {
            ns: namespace,
            names,
            root,
            service_ip,
            serial: String::new(),
            manifest,
            validations: 0,
        };
        fleet.serial = wait_for(
            "the fleet's first certificate served by a proxy",
            Duration::from_secs(240),
            || {
                let pod = fleet.ns.proxy_pods("demo").into_iter().find(pod_ready)?;
                let ip = pod_ip(&pod);
                serves_tls(&fleet.root, &fleet.names[0], &ip, 8443)
                    .then(|| served_serial(&fleet.names[0], &ip, 8443))?
            },
        );
        fleet.whole(3);
        fleet.validations = fleet.validations_now(c);
        assert_eq!(
            fleet.validations - earlier,
            fleet.names.len(),
            "one validation per name for the first certificate: more means a second order"
        );
        fleet
    }

    /// Waits until the fleet is whole with `n` replicas: `n` pods, every one
    /// Ready; every sidecar sees `n` members alive and healthy (its
    /// `total_nodes` and `healthy_nodes`), none of them listed twice; every
    /// proxy serves the fleet's certificate (its serial) for every name,
    /// through a TLS handshake that verifies against Pebble's root. Returns
    /// the pods and how long it took.
    pub fn whole(&self, n: usize) -> (Vec<Value>, Duration) {
        let (pods, took, _) = self.whole_serving(n, Some(&self.serial));
        (pods, took)
    }

    /// [`Fleet::whole`], every proxy serving one certificate for every name
    /// of the fleet: `serial`, or any one that Pebble's root verifies (in
    /// date, for every name) when `None`. Returns the pods, how long it
    /// took, and the serial served.
    pub fn whole_serving(&self, n: usize, serial: Option<&str>) -> (Vec<Value>, Duration, String) {
        let start = Instant::now();
        let mut served = String::new();
        let pods = wait_every(
            &format!("the fleet whole with {n} replicas"),
            Duration::from_secs(300),
            Duration::from_millis(250),
            || {
                let pods = self.ns.proxy_pods("demo");
                if pods.len() != n || !pods.iter().all(pod_ready) {
                    return None;
                }
                for pod in &pods {
                    let ip = pod_ip(pod);
                    let s = sidecar_status(&ip, ADMIN)?;
                    if s["summary"]["total_nodes"] != n || s["summary"]["healthy_nodes"] != n {
                        return None;
                    }
                    let live: Vec<&str> = s["nodes"]
                        .as_array()?
                        .iter()
                        .filter(|m| m["membership_state"] != "down")
                        .filter_map(|m| m["node_id"].as_str())
                        .collect();
                    let distinct: std::collections::BTreeSet<&str> = live.iter().copied().collect();
                    if distinct.len() != live.len() {
                        return None;
                    }
                    for name in &self.names {
                        let now = served_serial(name, &ip, 8443)?;
                        let want = match serial {
                            Some(s) => s.to_string(),
                            None if served.is_empty() => now.clone(),
                            None => served.clone(),
                        };
                        if now != want
                            || (serial.is_none() && !serves_tls(&self.root, name, &ip, 8443))
                        {
                            served.clear();
                            return None;
                        }
                        served = now;
                    }
                }
                Some(pods)
            },
        );
        let serial = serial.map_or(served, str::to_string);
        for pod in &pods {
            for name in &self.names {
                assert!(
                    serves_tls(&self.root, name, &pod_ip(pod), 8443),
                    "{} serves {name} with the serial {serial} but not verified by Pebble's root",
                    pod["metadata"]["name"],
                );
            }
        }
        (pods, start.elapsed(), serial)
    }

    /// Pebble's validations of the fleet's names so far.
    fn validations_now(&self, c: &Cluster) -> usize {
        self.names.iter().map(|n| validations_for(c, n)).sum()
    }

    /// Orders the CA saw for the fleet's names since it was deployed (0:
    /// every pod got the certificate from the store).
    pub fn new_validations(&self, c: &Cluster) -> usize {
        self.validations_now(c) - self.validations
    }

    /// `kubectl patch sbproxy demo --type=merge -p PATCH`.
    pub fn patch(&self, patch: &str) {
        self.ns
            .kubectl(&["patch", "sbproxy", "demo", "--type=merge", "-p", patch])
            .unwrap_or_else(|e| panic!("patching SBProxy demo with {patch}: {e}"));
    }

    /// The IPs of the fleet's pods, by pod name.
    pub fn ips(&self) -> Vec<String> {
        self.ns.proxy_pods("demo").iter().map(pod_ip).collect()
    }

    /// The fleet's pods by name, with their UIDs and restart counts.
    pub fn identities(&self) -> Identities {
        identities(&self.ns.proxy_pods("demo"))
    }
}

/// A thread that calls a function every `period` until [`Sampler::finish`],
/// keeping each answer with when it came: what a scenario asserts held at
/// every moment (never two pods down, the mesh never split).
pub struct Sampler<T: Send + 'static> {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: Option<std::thread::JoinHandle<Vec<(Duration, T)>>>,
}

impl<T: Send + 'static> Sampler<T> {
    pub fn start(period: Duration, mut f: impl FnMut() -> T + Send + 'static) -> Sampler<T> {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let handle = std::thread::spawn(move || {
            let start = Instant::now();
            let mut samples = Vec::new();
            while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
                samples.push((start.elapsed(), f()));
                std::thread::sleep(period);
            }
            samples
        });
        Sampler {
            stop,
            handle: Some(handle),
        }
    }

    /// Stops the thread and returns every sample.
    pub fn finish(mut self) -> Vec<(Duration, T)> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.handle
            .take()
            .expect("finished once")
            .join()
            .expect("the sampler panicked")
    }
}

impl<T: Send + 'static> Drop for Sampler<T> {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The IPs of [`ready_fleet_pods`].
pub fn ready_ips(c: &Cluster, ns: &str) -> Vec<String> {
    ready_fleet_pods(c, ns).iter().map(pod_ip).collect()
}

/// SBProxy `demo`'s pods in `ns` that are Ready and not being deleted.
pub fn ready_fleet_pods(c: &Cluster, ns: &str) -> Vec<Value> {
    c.get(&["-n", ns, "pods", "-l", "app.kubernetes.io/instance=demo"])
        .and_then(|l| l["items"].as_array().cloned())
        .unwrap_or_default()
        .into_iter()
        .filter(|p| pod_ready(p) && p["metadata"]["deletionTimestamp"].is_null())
        .collect()
}

/// Gives the node's image `from` a second name `to` (`ctr images tag`), as
/// a new tag of the same build would arrive: nothing is pulled.
pub fn tag_image(c: &Cluster, from: &str, to: &str) {
    ctr(c, &["images", "tag", "--force", from, to]);
}

/// Removes a name [`tag_image`] gave (the image stays under its own).
pub fn untag_image(c: &Cluster, name: &str) {
    if let Err(e) = try_ctr(c, &["images", "rm", name]) {
        eprintln!("ctr images rm {name}: {e}");
    }
}

/// `scripts/cluster restart PART...`: each part of the cluster (`etcd`,
/// `kube-apiserver`, `redis`, …) stopped and started again with its state
/// kept, one after the other; returns once the last answers.
pub fn restart_parts(parts: &[&str]) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/cluster");
    run(
        Command::new("bash").arg(&script).arg("restart").args(parts),
        None,
    )
    .unwrap_or_else(|e| panic!("scripts/cluster restart {}: {e}", parts.join(" ")));
}

/// Evicts each of `pods` through the eviction API, as `kubectl drain`
/// does, trying again every 500 ms while the PodDisruptionBudget refuses:
/// how many were evicted and how many refusals it took.
pub fn evict_all(
    c: &Cluster,
    ns: &str,
    mut left: std::collections::BTreeSet<String>,
) -> (usize, usize) {
    let (mut evicted, mut refused) = (0, 0);
    let start = std::time::Instant::now();
    while !left.is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(400),
            "evictions still refused after 400 s: {left:?} ({evicted} evicted, {refused} refused)"
        );
        for name in left.clone() {
            let body = format!(
                r#"{{"apiVersion":"policy/v1","kind":"Eviction","metadata":{{"name":"{name}","namespace":"{ns}"}}}}"#
            );
            let path = format!("/api/v1/namespaces/{ns}/pods/{name}/eviction");
            match c.kubectl_with(&["create", "--raw", &path, "-f", "-"], Some(&body)) {
                Ok(_) => {
                    evicted += 1;
                    left.remove(&name);
                }
                Err(e) if e.contains("disruption budget") || e.contains("TooManyRequests") => {
                    refused += 1
                }
                // Being deleted already (evicted a moment ago).
                Err(e) if e.contains("NotFound") || e.contains("not found") => {}
                Err(e) => panic!("evicting {name}: {e}"),
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    (evicted, refused)
}

/// `scripts/cluster power-cut`: SIGKILL to every part of the node at once,
/// what a reboot loses dropped, every part started again from its disk;
/// returns once the node is Ready again.
pub fn power_cut() {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/cluster");
    run(Command::new("bash").arg(&script).arg("power-cut"), None)
        .unwrap_or_else(|e| panic!("scripts/cluster power-cut: {e}"));
}

/// The certificates the CA issued that a pod's sidecar (at `ip`) reports
/// for its own node, as its status lists them (no placeholder).
pub fn local_certificates(ip: &str) -> Vec<Value> {
    let Some(status) = sidecar_status(ip, ADMIN) else {
        return Vec::new();
    };
    status["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|n| n["local"] == true)
        .flat_map(|n| n["certificates"].as_array().cloned().unwrap_or_default())
        .filter(|c| c["placeholder"] != true)
        .collect()
}

/// A certificate's serial as status shows it, without leading zeros.
pub fn serial_of(cert: &Value) -> String {
    cert["serial"]
        .as_str()
        .unwrap_or("")
        .trim_start_matches('0')
        .to_ascii_lowercase()
}

/// The pod's containers named `sbmesh-sidecar` (init or regular).
pub fn sidecars(pod: &Value) -> usize {
    ["containers", "initContainers"]
        .iter()
        .flat_map(|k| pod["spec"][k].as_array().cloned().unwrap_or_default())
        .filter(|c| c["name"] == "sbmesh-sidecar")
        .count()
}

/// A proxy pod as a user creates one, run through admission only
/// (`kubectl create --dry-run=server`: the webhooks run, nothing is
/// stored): the object the API server would store, and how long the
/// creation took.
pub fn dry_run_pod(ns: &Namespace) -> (Value, Duration) {
    let pod = format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{ generateName: edge-, namespace: {ns}, annotations: {{ sbproxy.dev/mesh-service: edge-mesh }} }}
spec:
  containers:
  - name: proxy
    image: soapbucket/sbproxy:1.13.0
    imagePullPolicy: Never
    volumeMounts:
    - {{ name: config, mountPath: /etc/sbproxy, readOnly: true }}
  volumes:
  - name: config
    configMap: {{ name: edge-config }}
"#,
        ns = ns.name
    );
    let start = std::time::Instant::now();
    let out = ns
        .cluster()
        .kubectl_with(
            &["create", "--dry-run=server", "-o", "json", "-f", "-"],
            Some(&pod),
        )
        .unwrap_or_else(|e| panic!("a dry-run pod creation in {}: {e}", ns.name));
    let took = start.elapsed();
    (serde_json::from_str(&out).expect("kubectl's JSON"), took)
}

/// The p-th percentile of `samples` (sorted here).
pub fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    let i = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[i]
}

/// The ConfigMap `edge-config` of a user's own proxy workload: `sb.yml`
/// with the admin credentials of [`ADMIN`] and `edge.example.com`
/// answering `body`.
pub fn edge_config(ns: &str, body: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: ConfigMap
metadata: {{ name: edge-config, namespace: {ns} }}
data:
  sb.yml: |
    proxy:
      admin: {{ enabled: true, port: 9090, username: admin, password: secret }}
    origins:
      "edge.example.com":
        action: {{ type: static, status_code: 200, body: "{body}\n" }}
"#
    )
}

/// Waits until every sidecar of `pods` sees `n` alive nodes; answers each
/// pod's `config_hashes` by pod name.
pub fn mesh_of(pods: &[Value], n: usize) -> std::collections::BTreeMap<String, Value> {
    wait_for(
        &format!("every sidecar's status showing {n} alive nodes"),
        Duration::from_secs(120),
        || {
            let mut hashes = std::collections::BTreeMap::new();
            for pod in pods {
                let s = sidecar_status(&pod_ip(pod), ADMIN)?;
                let alive = s["nodes"]
                    .as_array()?
                    .iter()
                    .filter(|n| n["membership_state"] == "alive")
                    .count();
                if s["summary"]["total_nodes"] != n || alive != n {
                    return None;
                }
                hashes.insert(
                    pod["metadata"]["name"].as_str()?.to_string(),
                    s["summary"]["config_hashes"].clone(),
                );
            }
            Some(hashes)
        },
    )
}
