//! A ConfigMap mount as the kubelet maintains it, for the reload tests and
//! the reload benchmark: `sb.yml -> ..data/sb.yml`, `..data -> ..<timestamp>`,
//! and an update renames a fresh `..data_tmp` symlink over `..data`.

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
        let mut k = Self {
            dir: dir.to_path_buf(),
            generation: 0,
            current: None,
        };
        k.publish(text);
        std::os::unix::fs::symlink("..data/sb.yml", dir.join("sb.yml")).expect("symlink sb.yml");
        k
    }

    /// Swaps in `text` the way the kubelet does, then removes the old data.
    pub fn publish(&mut self, text: &str) {
        self.generation += 1;
        let name = format!("..2026_01_01_00_00_00.{:09}", self.generation);
        let data = self.dir.join(&name);
        std::fs::create_dir(&data).expect("data dir");
        std::fs::write(data.join("sb.yml"), text).expect("write sb.yml");
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
