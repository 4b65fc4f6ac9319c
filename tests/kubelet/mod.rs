//! A ConfigMap or Secret mount as the kubelet maintains it, for the reload
//! tests, the reload benchmark and the `--watch-tls` tests: `<key> ->
//! ..data/<key>`, `..data -> ..<timestamp>`, and an update renames a fresh
//! `..data_tmp` symlink over `..data`.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub struct Kubelet {
    dir: PathBuf,
    generation: usize,
    current: Option<PathBuf>,
}

impl Kubelet {
    /// Mounts `text` as `<dir>/sb.yml`.
    pub fn new(dir: &Path, text: &str) -> Self {
        Self::with_files(dir, &[("sb.yml", text)])
    }

    /// Mounts every `(key, text)` as `<dir>/<key>` (a Secret such as
    /// `tls.crt` + `tls.key`).
    pub fn with_files(dir: &Path, files: &[(&str, &str)]) -> Self {
        let mut k = Self {
            dir: dir.to_path_buf(),
            generation: 0,
            current: None,
        };
        k.publish_files(files);
        for (key, _) in files {
            std::os::unix::fs::symlink(format!("..data/{key}"), dir.join(key))
                .expect("symlink the key");
        }
        k
    }

    /// Swaps in `text` the way the kubelet does, then removes the old data.
    pub fn publish(&mut self, text: &str) {
        self.publish_files(&[("sb.yml", text)]);
    }

    /// Swaps in new contents of every key at once, as the kubelet does.
    pub fn publish_files(&mut self, files: &[(&str, &str)]) {
        self.generation += 1;
        let name = format!("..2026_01_01_00_00_00.{:09}", self.generation);
        let data = self.dir.join(&name);
        std::fs::create_dir(&data).expect("data dir");
        for (key, text) in files {
            std::fs::write(data.join(key), text).expect("write the key");
        }
        let tmp = self.dir.join("..data_tmp");
        std::os::unix::fs::symlink(&name, &tmp).expect("symlink ..data_tmp");
        std::fs::rename(&tmp, self.dir.join("..data")).expect("swap ..data");
        if let Some(old) = self.current.replace(data) {
            std::fs::remove_dir_all(old).expect("remove old data");
        }
    }

    /// The path the proxy and the sidecar read.
    pub fn path(&self) -> PathBuf {
        self.dir.join("sb.yml")
    }
}
