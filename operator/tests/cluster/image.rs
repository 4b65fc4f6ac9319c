//! The images the cluster runs against what the Dockerfile states: read
//! back from the cluster's containerd (`ctr images export`), so the check
//! is of what the pods run, not of how it was made.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

use super::{Cluster, try_ctr};

/// What an image holds that a user's pod depends on: its config (user,
/// entrypoint, command, exposed ports) and, for each path named, its kind,
/// owner and mode as `tar -tv` prints them (`-rwxr-xr-x 0/0`).
#[derive(Debug, PartialEq, Eq)]
pub struct Shape {
    pub user: String,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub exposed: Vec<String>,
    pub files: BTreeMap<String, String>,
}

/// The last stage of a Dockerfile: its USER, ENTRYPOINT, CMD and EXPOSE,
/// and for each `COPY [--chown=U:G] SRC DST` the destination with the owner
/// it gets (`U/G`, else `0/0`), and for a directory copied, each directory
/// under it that the builder's `install -d` made.
pub fn stated(dockerfile: &Path) -> Shape {
    let text = std::fs::read_to_string(dockerfile)
        .unwrap_or_else(|e| panic!("{}: {e}", dockerfile.display()));
    let joined = text.replace("\\\n", " ");
    let lines: Vec<&str> = joined
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let last = lines
        .iter()
        .rposition(|l| l.starts_with("FROM "))
        .expect("a FROM");
    // The builder's directories under /out (its `install -d` steps).
    let made: Vec<String> = lines[..last]
        .iter()
        .flat_map(|l| l.split("&&"))
        .map(str::trim)
        .filter(|step| step.starts_with("install -d"))
        .flat_map(|step| step.split_whitespace().filter(|w| w.starts_with("/out/")))
        .map(|w| w.trim_start_matches("/out").to_string())
        .collect();
    let json = |rest: &str| -> Vec<String> {
        serde_json::from_str(rest).unwrap_or_else(|e| panic!("{rest}: {e}"))
    };
    let mut shape = Shape {
        user: String::new(),
        entrypoint: Vec::new(),
        cmd: Vec::new(),
        exposed: Vec::new(),
        files: BTreeMap::new(),
    };
    for line in &lines[last + 1..] {
        let (keyword, rest) = line.split_once(' ').unwrap_or((line, ""));
        let rest = rest.trim();
        match keyword {
            "USER" => shape.user = rest.to_string(),
            "ENTRYPOINT" => shape.entrypoint = json(rest),
            "CMD" => shape.cmd = json(rest),
            "EXPOSE" => shape
                .exposed
                .extend(rest.split_whitespace().map(String::from)),
            "COPY" => {
                let words: Vec<&str> = rest.split_whitespace().collect();
                let owner = words
                    .iter()
                    .find_map(|w| w.strip_prefix("--chown="))
                    .map_or("0/0".to_string(), |o| o.replace(':', "/"));
                let paths: Vec<&str> = words
                    .iter()
                    .copied()
                    .filter(|w| !w.starts_with("--"))
                    .collect();
                let [src, dst] = paths[..] else {
                    panic!("COPY {rest}: expected SRC DST")
                };
                let src = src.trim_start_matches("/out");
                let under: Vec<&String> = made.iter().filter(|d| d.starts_with(src)).collect();
                if under.is_empty() {
                    shape.files.insert(dst.to_string(), format!("- {owner}"));
                } else {
                    shape.files.insert(dst.to_string(), format!("d {owner}"));
                    for d in under {
                        let path = format!("{dst}{}", &d[src.len()..]);
                        shape.files.insert(path, format!("d {owner}"));
                    }
                }
            }
            _ => {}
        }
    }
    shape.exposed.sort();
    shape
}

/// The image `tag` as the cluster's containerd holds it: the paths of
/// `like` (another [`Shape`]'s files) with their kind and owner, and its
/// config.
pub fn imported(c: &Cluster, tag: &str, like: &Shape) -> Shape {
    let dir = tempfile::tempdir().expect("a folder for the export");
    let tar = dir.path().join("image.tar");
    try_ctr(c, &["images", "export", &tar.display().to_string(), tag])
        .unwrap_or_else(|e| panic!("ctr images export {tag}: {e}"));
    untar(&tar, dir.path());
    let blob = |digest: &str| -> Vec<u8> {
        let path = dir.path().join("blobs").join(digest.replacen(':', "/", 1));
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    let parse = |bytes: Vec<u8>| -> Value { serde_json::from_slice(&bytes).expect("JSON") };
    let index = parse(std::fs::read(dir.path().join("index.json")).expect("index.json"));
    let mut manifest = parse(blob(
        index["manifests"][0]["digest"]
            .as_str()
            .expect("a manifest"),
    ));
    if manifest["manifests"].is_array() {
        manifest = parse(blob(
            manifest["manifests"][0]["digest"].as_str().expect("one"),
        ));
    }
    let config = parse(blob(
        manifest["config"]["digest"].as_str().expect("a config"),
    ));
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(String::from))
            .collect()
    };
    let cfg = &config["config"];
    let mut exposed: Vec<String> = cfg["ExposedPorts"]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default();
    exposed.sort();
    let mut listing = String::new();
    for layer in manifest["layers"].as_array().expect("layers") {
        let digest = layer["digest"].as_str().expect("a layer digest");
        let path = dir.path().join("blobs").join(digest.replacen(':', "/", 1));
        let out = Command::new("tar")
            .args(["--numeric-owner", "-tvf"])
            .arg(&path)
            .output()
            .expect("tar");
        assert!(out.status.success(), "tar -tvf {digest}: {out:?}");
        listing.push_str(&String::from_utf8_lossy(&out.stdout));
    }
    let files = like
        .files
        .keys()
        .filter_map(|want| {
            listing.lines().find_map(|l| {
                let words: Vec<&str> = l.split_whitespace().collect();
                let path = format!("/{}", words.last()?.trim_end_matches('/'));
                (path == *want).then(|| {
                    let kind = if words[0].starts_with('d') { "d" } else { "-" };
                    (want.clone(), format!("{kind} {}", words[1]))
                })
            })
        })
        .collect();
    Shape {
        user: cfg["User"].as_str().unwrap_or_default().to_string(),
        entrypoint: strings(&cfg["Entrypoint"]),
        cmd: strings(&cfg["Cmd"]),
        exposed,
        files,
    }
}

fn untar(tar: &Path, into: &Path) {
    let out = Command::new("tar")
        .arg("-xf")
        .arg(tar)
        .arg("-C")
        .arg(into)
        .output()
        .expect("tar");
    assert!(out.status.success(), "tar -xf {}: {out:?}", tar.display());
}
