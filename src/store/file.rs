//! `file`: a store in a directory, safe between processes and pods that
//! share it (an RWX volume).
//!
//! # Layout
//!
//! A key's segments are directories; its last segment names the files. `~`
//! is outside the key alphabet, so the store's own names can never collide
//! with a key's (and a key may be both a record and a prefix, `a/b` and
//! `a/b/c`):
//!
//! ```text
//! <root>/certs/api.example.com/chain~rec        the record of certs/api.example.com/chain
//! <root>/certs/api.example.com/chain~lock       its lock (flock)
//! <root>/certs/api.example.com/chain~tmp.<hex>  a write in progress
//! ```
//!
//! A record is `"SBMSREC1" | version: u128 BE | expiry: u64 LE (unix ms,
//! 0 = none) | value`; the version is 128 random bits, so a key deleted and
//! created again never gets an old version back (no ABA between processes).
//!
//! # Atomicity
//!
//! Every write (put, create, compare-and-swap, delete, sweep) holds the
//! key's lock file under `flock`, which the kernel releases when a holder
//! dies, so no stale lock outlives a crashed process. Under it the writer
//! reads the current record, writes a temp file, fsyncs it, moves it in
//! place (`link` for a create, which fails if the target exists; `rename`
//! for a replace) and fsyncs the directory. Readers take no lock: `rename`
//! makes them see the old or the new record, never a mix.
//!
//! A fenced write (`put_fenced`) holds the locks of both its key and the
//! lock record's, taken in key order, while it checks both fences and
//! writes.
//!
//! The store's clock ([`Store::clock_offset_ms`], for lease expiry) is the
//! modification time the filesystem gives a probe file `<root>/~clock.<hex>`
//! written and removed at once: on NFS the file server sets it, so every
//! pod on the volume reads one clock whatever its own says.
//!
//! Sharing therefore needs a volume whose `flock` is coherent between its
//! clients: local filesystems, NFSv4 and CephFS are; an NFS mount with
//! `local_lock=flock` or `local_lock=all` is not.
//!
//! A lock file is removed with its record (on delete or sweep) by the
//! holder; a waiter that then wins the lock on the unlinked file notices,
//! because the path no longer names the file it locked, and tries again.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;

use super::clock::{ClockSync, Reading};
use super::{
    Entry, MAX_VALUE_BYTES, Store, StoreError, Version, expiry_from, lock, now_unix_ms,
    validate_key, validate_prefix, validate_value,
};

const BACKEND: &str = "file";

const RECORD_SUFFIX: &str = "~rec";
const LOCK_SUFFIX: &str = "~lock";
const TEMP_INFIX: &str = "~tmp.";
const MAGIC: &[u8; 8] = b"SBMSREC1";
const HEADER_LEN: usize = 8 + 16 + 8;
/// Longest key segment this backend accepts: file names are limited to 255
/// bytes, and the store appends up to 21.
pub(crate) const MAX_SEGMENT_LEN: usize = 200;
/// How long a write waits for its key's lock before giving up.
pub(crate) const LOCK_WAIT: Duration = Duration::from_secs(30);
/// Temp files older than this are debris of a crashed writer; the sweeper
/// removes them.
const STALE_TEMP_AGE: Duration = Duration::from_secs(600);

/// A store in a directory (`storage_backend: file`), shared by every
/// process that mounts it.
#[derive(Debug, Clone)]
pub struct FileStore {
    root: Arc<PathBuf>,
    clock: Arc<ClockSync>,
}

impl FileStore {
    /// Opens the store rooted at `dir`, creating the directory when missing.
    pub async fn open(dir: impl AsRef<Path>) -> Result<Self, StoreError> {
        let root = dir.as_ref().to_path_buf();
        let checked = root.clone();
        tokio::task::spawn_blocking(move || {
            fs::create_dir_all(&checked).map_err(|e| io_err(&checked, "creating", e))?;
            let meta = fs::metadata(&checked).map_err(|e| io_err(&checked, "reading", e))?;
            if meta.is_dir() {
                Ok(())
            } else {
                Err(StoreError::Config(format!(
                    "file store path {} is not a directory",
                    checked.display()
                )))
            }
        })
        .await
        .map_err(join_err)??;
        Ok(Self {
            root: Arc::new(root),
            clock: Arc::new(ClockSync::new()),
        })
    }

    /// The store's directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Runs `f` with the root on the blocking pool.
    async fn run<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Path) -> Result<T, StoreError> + Send + 'static,
    {
        let root = Arc::clone(&self.root);
        tokio::task::spawn_blocking(move || f(&root))
            .await
            .map_err(join_err)?
    }
}

fn join_err(e: tokio::task::JoinError) -> StoreError {
    StoreError::Backend {
        backend: BACKEND,
        message: format!("blocking task failed: {e}"),
    }
}

fn io_err(path: &Path, doing: &str, e: io::Error) -> StoreError {
    StoreError::Backend {
        backend: BACKEND,
        message: format!("{doing} {}: {e}", path.display()),
    }
}

/// Where one key lives.
struct KeyPaths {
    key: String,
    /// The directory of the key's files.
    dir: PathBuf,
    /// The key's segments before the last (the path of `dir` under root).
    parents: Vec<String>,
    /// The last segment.
    name: String,
}

impl KeyPaths {
    fn new(root: &Path, key: &str) -> Result<Self, StoreError> {
        validate_key(key)?;
        let invalid = |reason| StoreError::InvalidKey {
            key: key.chars().take(80).collect(),
            reason,
        };
        let mut parents: Vec<String> = Vec::new();
        for seg in key.split('/') {
            if seg.len() > MAX_SEGMENT_LEN {
                return Err(invalid(
                    "segment longer than 200 bytes (the file backend's limit)",
                ));
            }
            // validate_key already refuses these; a second check here keeps
            // a future change there from opening a path out of the root.
            let mut components = Path::new(seg).components();
            if !matches!(
                (components.next(), components.next()),
                (Some(Component::Normal(_)), None)
            ) || seg.contains('~')
            {
                return Err(invalid("segment is not a plain file name"));
            }
            parents.push(seg.to_owned());
        }
        let name = parents.pop().ok_or_else(|| invalid("empty"))?;
        let mut dir = root.to_path_buf();
        dir.extend(&parents);
        Ok(Self {
            key: key.to_owned(),
            dir,
            parents,
            name,
        })
    }

    fn record(&self) -> PathBuf {
        self.dir.join(format!("{}{RECORD_SUFFIX}", self.name))
    }

    fn lock_file(&self) -> PathBuf {
        self.dir.join(format!("{}{LOCK_SUFFIX}", self.name))
    }

    fn temp(&self) -> PathBuf {
        self.dir.join(format!(
            "{}{TEMP_INFIX}{:016x}",
            self.name,
            rand::random::<u64>()
        ))
    }
}

/// The fixed-size start of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    version: u128,
    expires_at_unix_ms: Option<u64>,
}

impl Header {
    fn fresh(ttl: Option<Duration>) -> Self {
        Self {
            version: rand::random::<u128>(),
            // 0 is "no expiry" on disk; a real expiry is always after 1970.
            expires_at_unix_ms: expiry_from(ttl).map(|at| at.max(1)),
        }
    }

    fn live(&self, now: u64) -> bool {
        self.expires_at_unix_ms.is_none_or(|at| at > now)
    }

    fn version(&self) -> Version {
        Version(format!("{:032x}", self.version))
    }

    fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[..8].copy_from_slice(MAGIC);
        out[8..24].copy_from_slice(&self.version.to_be_bytes());
        out[24..].copy_from_slice(&self.expires_at_unix_ms.unwrap_or(0).to_le_bytes());
        out
    }

    fn decode(key: &str, bytes: &[u8]) -> Result<Self, StoreError> {
        let corrupt = |message: &str| StoreError::Corrupt {
            key: key.to_owned(),
            message: message.to_owned(),
        };
        let short = || corrupt("file record shorter than its header");
        let (magic, rest) = bytes.split_first_chunk::<8>().ok_or_else(short)?;
        if magic != MAGIC {
            return Err(corrupt("file record does not start with SBMSREC1"));
        }
        let (version, rest) = rest.split_first_chunk::<16>().ok_or_else(short)?;
        let (expiry, _) = rest.split_first_chunk::<8>().ok_or_else(short)?;
        let expiry = u64::from_le_bytes(*expiry);
        Ok(Self {
            version: u128::from_be_bytes(*version),
            expires_at_unix_ms: (expiry != 0).then_some(expiry),
        })
    }
}

/// Reads a whole record; `None` when the file does not exist.
fn read_record(path: &Path, key: &str) -> Result<Option<(Header, Vec<u8>)>, StoreError> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(path, "opening", e)),
    };
    let limit = (HEADER_LEN + MAX_VALUE_BYTES) as u64;
    let mut buf = Vec::new();
    // Bounded read: a record larger than any the store writes is corrupt,
    // whatever the file's size.
    file.take(limit + 1)
        .read_to_end(&mut buf)
        .map_err(|e| io_err(path, "reading", e))?;
    if buf.len() as u64 > limit {
        return Err(StoreError::Corrupt {
            key: key.to_owned(),
            message: format!("file record is larger than {limit} bytes"),
        });
    }
    let header = Header::decode(key, &buf)?;
    let value = buf.split_off(HEADER_LEN);
    Ok(Some((header, value)))
}

/// Reads only a record's header (for listing and sweeping).
fn read_header(path: &Path, key: &str) -> Result<Option<Header>, StoreError> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(path, "opening", e)),
    };
    let mut buf = Vec::with_capacity(HEADER_LEN);
    file.take(HEADER_LEN as u64)
        .read_to_end(&mut buf)
        .map_err(|e| io_err(path, "reading", e))?;
    Header::decode(key, &buf).map(Some)
}

/// fsyncs a directory, so that renames and links in it are durable.
fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err(dir, "syncing directory", e))
}

/// Creates the key's directory one level at a time, fsyncing the parent of
/// each level it creates so the new entry survives a crash.
fn ensure_dir(root: &Path, parents: &[String]) -> Result<(), StoreError> {
    let mut dir = root.to_path_buf();
    for seg in parents {
        let parent = dir.clone();
        dir.push(seg);
        match fs::create_dir(&dir) {
            Ok(()) => sync_dir(&parent)?,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_err(&dir, "creating", e)),
        }
    }
    Ok(())
}

/// Removes the key's now-empty directories, deepest first. Best effort: a
/// directory another writer is using is not empty, and stays.
fn prune_dirs(root: &Path, parents: &[String]) {
    for depth in (1..=parents.len()).rev() {
        let mut dir = root.to_path_buf();
        dir.extend(&parents[..depth]);
        if fs::remove_dir(&dir).is_err() {
            break;
        }
    }
}

/// An exclusive `flock` on a key's lock file; released when dropped.
struct KeyLock {
    _file: File,
    path: PathBuf,
}

impl KeyLock {
    fn acquire(paths: &KeyPaths, root: &Path, op: &'static str) -> Result<Self, StoreError> {
        let path = paths.lock_file();
        let deadline = Instant::now() + LOCK_WAIT;
        let mut backoff = Duration::from_micros(50);
        loop {
            if Instant::now() >= deadline {
                return Err(StoreError::Timeout {
                    backend: BACKEND,
                    op,
                    after: LOCK_WAIT,
                });
            }
            let file = match OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
            {
                Ok(f) => f,
                // A concurrent delete pruned the directory: make it again.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    ensure_dir(root, &paths.parents)?;
                    continue;
                }
                Err(e) => return Err(io_err(&path, "opening lock", e)),
            };
            // Called through the trait: std has an inherent `File::try_lock`
            // from Rust 1.89, with another error type.
            match fs4::FileExt::try_lock(&file) {
                Ok(()) => {
                    if still_named(&file, &path) {
                        return Ok(Self { _file: file, path });
                    }
                    // The holder we waited for removed this lock file with
                    // its record: lock the current one instead.
                    continue;
                }
                Err(fs4::TryLockError::WouldBlock) => {}
                Err(fs4::TryLockError::Error(e)) => return Err(io_err(&path, "locking", e)),
            }
            let jitter = rand::random::<u64>() % (backoff.as_micros() as u64 + 1);
            std::thread::sleep(backoff + Duration::from_micros(jitter));
            backoff = (backoff * 2).min(Duration::from_millis(5));
        }
    }

    /// Removes the lock file, then releases the lock. Only after the
    /// holder's last change to the key.
    fn release_and_remove(self) {
        let _ = fs::remove_file(&self.path);
    }
}

/// Whether `path` still names the open `file` (it was not unlinked or
/// replaced since it was opened).
#[cfg(unix)]
fn still_named(file: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Elsewhere lock files are never removed (see [`REMOVES_LOCK_FILES`]), so
/// the path always names the file.
#[cfg(not(unix))]
fn still_named(_file: &File, _path: &Path) -> bool {
    true
}

/// Whether lock files may be removed with their record: only where
/// [`still_named`] can tell that a lock file was replaced.
const REMOVES_LOCK_FILES: bool = cfg!(unix);

/// How a new record replaces what is at its path.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Placement {
    /// Nothing is there: `link`, which refuses an existing target.
    Create,
    /// Replace whatever is there: `rename`.
    Replace,
}

/// Writes `header | value` to a temp file, fsyncs it and moves it to the
/// key's record. `Ok(false)` when a [`Placement::Create`] found the record
/// existing. The caller holds the key's lock.
fn install(
    paths: &KeyPaths,
    header: &Header,
    value: &[u8],
    placement: Placement,
) -> Result<bool, StoreError> {
    let temp = paths.temp();
    let record = paths.record();
    let result = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)
            .map_err(|e| io_err(&temp, "creating", e))?;
        file.write_all(&header.encode())
            .and_then(|()| file.write_all(value))
            .and_then(|()| file.sync_all())
            .map_err(|e| io_err(&temp, "writing", e))?;
        drop(file);
        let placed = match placement {
            Placement::Create => match fs::hard_link(&temp, &record) {
                Ok(()) => true,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => false,
                // Some network filesystems have no hard links; the key lock
                // already makes the create exclusive.
                Err(_) => {
                    fs::rename(&temp, &record).map_err(|e| io_err(&record, "renaming to", e))?;
                    true
                }
            },
            Placement::Replace => {
                fs::rename(&temp, &record).map_err(|e| io_err(&record, "renaming to", e))?;
                true
            }
        };
        if placed {
            sync_dir(&paths.dir)?;
        }
        Ok(placed)
    })();
    // After a link (or a failure) the temp name is still there.
    match fs::remove_file(&temp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound && result.is_ok() => {
            Err(io_err(&temp, "removing", e))
        }
        _ => result,
    }
}

/// What a write does given the record currently at the key.
enum Decision<T> {
    /// Write this header and value; answer `T` once written.
    Write(Header, Placement, T),
    /// Leave the key alone and answer `T`.
    Keep(T),
}

/// Locks the key, shows `decide` the live record (or `None`) and whether
/// any record file exists, and carries out its decision.
///
/// A corrupt record is an error, except for `op == "put"`, which replaces
/// it unconditionally like anything else.
fn locked_write<T>(
    root: &Path,
    paths: &KeyPaths,
    value: &[u8],
    op: &'static str,
    decide: impl FnOnce(Option<&Header>, bool) -> Decision<T>,
) -> Result<T, StoreError> {
    ensure_dir(root, &paths.parents)?;
    let _lock = KeyLock::acquire(paths, root, op)?;
    let (exists, live) = match read_header(&paths.record(), &paths.key) {
        Ok(current) => (current.is_some(), current.filter(|h| h.live(now_unix_ms()))),
        Err(StoreError::Corrupt { .. }) if op == "put" => (true, None),
        Err(e) => return Err(e),
    };
    match decide(live.as_ref(), exists) {
        Decision::Keep(out) => Ok(out),
        Decision::Write(header, placement, out) => {
            if install(paths, &header, value, placement)? {
                Ok(out)
            } else {
                Err(StoreError::Backend {
                    backend: BACKEND,
                    message: format!(
                        "{} appeared while its lock was held: another writer ignores the lock file",
                        paths.record().display()
                    ),
                })
            }
        }
    }
}

/// Removes the key's record if `should(header)` holds, under its lock;
/// `Ok(Some(was_live))` when something was removed.
fn locked_remove(
    root: &Path,
    paths: &KeyPaths,
    op: &'static str,
    should: impl FnOnce(&Header) -> bool,
) -> Result<Option<bool>, StoreError> {
    let record = paths.record();
    // Nothing to remove and no directory to lock in: done, without
    // creating directories just to find that out.
    if !paths.dir.is_dir() {
        return Ok(None);
    }
    let lock = KeyLock::acquire(paths, root, op)?;
    let (removed, live) = match read_header(&record, &paths.key) {
        Ok(None) => (false, false),
        Ok(Some(h)) if !should(&h) => return Ok(None),
        Ok(Some(h)) => {
            let live = h.live(now_unix_ms());
            (remove_record(&record, &paths.dir)?, live)
        }
        // An unreadable record is removed too, and counts as live.
        Err(StoreError::Corrupt { .. }) => (remove_record(&record, &paths.dir)?, true),
        Err(e) => return Err(e),
    };
    if REMOVES_LOCK_FILES {
        lock.release_and_remove();
        prune_dirs(root, &paths.parents);
    }
    Ok(removed.then_some(live))
}

fn remove_record(record: &Path, dir: &Path) -> Result<bool, StoreError> {
    match fs::remove_file(record) {
        Ok(()) => {
            sync_dir(dir)?;
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io_err(record, "removing", e)),
    }
}

/// Writes a probe file in the root and reads back the modification time
/// the filesystem gave it. `~` keeps its name out of the key space.
fn probe_mtime(root: &Path) -> Result<Reading, StoreError> {
    let path = root.join(format!("~clock.{:016x}", rand::random::<u64>()));
    let result = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| io_err(&path, "creating", e))?;
        file.write_all(b"clock probe")
            .map_err(|e| io_err(&path, "writing", e))?;
        let modified = file
            .metadata()
            .and_then(|m| m.modified())
            .map_err(|e| io_err(&path, "reading the modification time of", e))?;
        let ms = modified
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_err(|_| StoreError::Backend {
                backend: BACKEND,
                message: format!("{} has a modification time before 1970", path.display()),
            })?
            .as_millis();
        Ok(Reading {
            server_ms: u64::try_from(ms).unwrap_or(u64::MAX),
            // Coarse timestamps (a jiffy, or whole seconds on some file
            // servers) are not distinguishable from fine ones here;
            // narrowing over readings absorbs most of it.
            resolution_ms: 1,
        })
    })();
    let _ = fs::remove_file(&path);
    result
}

/// Whether a directory entry's name is a key segment (so not the store's
/// own files, nor strangers such as `lost+found`).
fn is_segment(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && name.len() <= MAX_SEGMENT_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// One record found by [`walk`].
struct Found {
    key: String,
    path: PathBuf,
}

/// Visits the records under `dir` (whose keys start with `base`) that could
/// start with `prefix`; temp files, lock files, symlinks and foreign names
/// are skipped. Also collects temp files older than [`STALE_TEMP_AGE`] into
/// `stale_temps` when given.
fn walk(
    dir: &Path,
    base: &str,
    prefix: &str,
    found: &mut Vec<Found>,
    mut stale_temps: Option<&mut Vec<PathBuf>>,
) -> Result<(), StoreError> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        // Removed by a concurrent delete.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err(dir, "listing", e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| io_err(dir, "listing", e))?;
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_dir() {
            if !is_segment(&name) {
                continue;
            }
            let sub = format!("{base}{name}/");
            if sub.starts_with(prefix) || prefix.starts_with(&sub) {
                walk(
                    &entry.path(),
                    &sub,
                    prefix,
                    found,
                    stale_temps.as_deref_mut(),
                )?;
            }
        } else if kind.is_file() {
            if let Some(seg) = name.strip_suffix(RECORD_SUFFIX) {
                let key = format!("{base}{seg}");
                if is_segment(seg) && key.starts_with(prefix) {
                    found.push(Found {
                        key,
                        path: entry.path(),
                    });
                }
            } else if name.contains(TEMP_INFIX)
                && let Some(stale) = stale_temps.as_deref_mut()
            {
                let old = entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| SystemTime::now().duration_since(t).ok())
                    .is_some_and(|age| age > STALE_TEMP_AGE);
                if old {
                    stale.push(entry.path());
                }
            }
        }
    }
    Ok(())
}

/// The records whose keys start with `prefix`, starting the walk at the
/// deepest directory the prefix pins down.
fn find(
    root: &Path,
    prefix: &str,
    stale_temps: Option<&mut Vec<PathBuf>>,
) -> Result<Vec<Found>, StoreError> {
    let (start, base) = match prefix.rsplit_once('/') {
        Some((dirs, _)) => {
            let mut start = root.to_path_buf();
            start.extend(dirs.split('/'));
            (start, format!("{dirs}/"))
        }
        None => (root.to_path_buf(), String::new()),
    };
    let mut found = Vec::new();
    walk(&start, &base, prefix, &mut found, stale_temps)?;
    Ok(found)
}

#[async_trait]
impl Store for FileStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn is_shared(&self) -> bool {
        true
    }

    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        let key = key.to_owned();
        self.run(move |root| {
            let paths = KeyPaths::new(root, &key)?;
            let Some((header, value)) = read_record(&paths.record(), &key)? else {
                return Ok(None);
            };
            Ok(header.live(now_unix_ms()).then(|| Entry {
                value,
                version: header.version(),
                expires_at_unix_ms: header.expires_at_unix_ms,
            }))
        })
        .await
    }

    async fn put(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Version, StoreError> {
        validate_key(key)?;
        validate_value(key, value)?;
        let (key, value) = (key.to_owned(), value.to_vec());
        self.run(move |root| {
            let paths = KeyPaths::new(root, &key)?;
            locked_write(root, &paths, &value, "put", |_, exists| {
                let header = Header::fresh(ttl);
                let placement = if exists {
                    Placement::Replace
                } else {
                    Placement::Create
                };
                Decision::Write(header, placement, header.version())
            })
        })
        .await
    }

    async fn put_if_absent(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Option<Version>, StoreError> {
        validate_key(key)?;
        validate_value(key, value)?;
        let (key, value) = (key.to_owned(), value.to_vec());
        self.run(move |root| {
            let paths = KeyPaths::new(root, &key)?;
            locked_write(root, &paths, &value, "put_if_absent", |live, exists| {
                if live.is_some() {
                    return Decision::Keep(None);
                }
                let header = Header::fresh(ttl);
                // Over an expired record: replace it; else create-only.
                let placement = if exists {
                    Placement::Replace
                } else {
                    Placement::Create
                };
                Decision::Write(header, placement, Some(header.version()))
            })
        })
        .await
    }

    async fn compare_and_swap(
        &self,
        key: &str,
        expected: &Version,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Option<Version>, StoreError> {
        validate_key(key)?;
        validate_value(key, value)?;
        let (key, value, expected) = (key.to_owned(), value.to_vec(), expected.clone());
        self.run(move |root| {
            let paths = KeyPaths::new(root, &key)?;
            locked_write(
                root,
                &paths,
                &value,
                "compare_and_swap",
                |live, _| match live {
                    Some(current) if current.version() == expected => {
                        let header = Header::fresh(ttl);
                        Decision::Write(header, Placement::Replace, Some(header.version()))
                    }
                    _ => Decision::Keep(None),
                },
            )
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let key = key.to_owned();
        self.run(move |root| {
            let paths = KeyPaths::new(root, &key)?;
            Ok(locked_remove(root, &paths, "delete", |_| true)?.unwrap_or(false))
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        validate_prefix(prefix)?;
        let prefix = prefix.to_owned();
        self.run(move |root| {
            let now = now_unix_ms();
            let mut keys = Vec::new();
            for found in find(root, &prefix, None)? {
                match read_header(&found.path, &found.key) {
                    Ok(Some(h)) if h.live(now) => keys.push(found.key),
                    Ok(_) => {}
                    // Listed, so that `get` reports what is wrong with it.
                    Err(StoreError::Corrupt { .. }) => keys.push(found.key),
                    Err(e) => return Err(e),
                }
            }
            keys.sort_unstable();
            Ok(keys)
        })
        .await
    }

    /// Under the locks of both keys (taken in key order, so two fenced
    /// writers never wait for each other in a cycle): the lock record's
    /// fence, the value's, and the write. A takeover replaces the lock
    /// record under its key lock, so it happens before or after, never in
    /// between.
    async fn put_fenced(
        &self,
        key: &str,
        value: &[u8],
        lock_key: &str,
        fence: u64,
    ) -> Result<Version, StoreError> {
        super::validate_fenced_write(key, value, lock_key)?;
        let (key, value, lock_key) = (key.to_owned(), value.to_vec(), lock_key.to_owned());
        self.run(move |root| {
            let paths = KeyPaths::new(root, &key)?;
            let lock_paths = KeyPaths::new(root, &lock_key)?;
            ensure_dir(root, &paths.parents)?;
            ensure_dir(root, &lock_paths.parents)?;
            let (first, second) = if lock_key < key {
                (&lock_paths, &paths)
            } else {
                (&paths, &lock_paths)
            };
            let _first = KeyLock::acquire(first, root, "put_fenced")?;
            let _second = if lock_key == key {
                None
            } else {
                Some(KeyLock::acquire(second, root, "put_fenced")?)
            };
            let now = now_unix_ms();
            let lock_record = read_record(&lock_paths.record(), &lock_key)?;
            let current = read_record(&paths.record(), &key)?;
            fn live(r: &Option<(Header, Vec<u8>)>, now: u64) -> Option<&[u8]> {
                r.as_ref()
                    .filter(|(header, _)| header.live(now))
                    .map(|(_, bytes)| bytes.as_slice())
            }
            lock::check_fence(
                &key,
                &lock_key,
                fence,
                live(&lock_record, now),
                live(&current, now),
            )?;
            let header = Header::fresh(None);
            let placement = if current.is_some() {
                Placement::Replace
            } else {
                Placement::Create
            };
            if install(&paths, &header, &value, placement)? {
                Ok(header.version())
            } else {
                Err(StoreError::Backend {
                    backend: BACKEND,
                    message: format!(
                        "{} appeared while its lock was held: another writer ignores the lock file",
                        paths.record().display()
                    ),
                })
            }
        })
        .await
    }

    /// The filesystem's clock: the modification time it gives a probe file
    /// just written (set by the file server on NFS, by the kernel on a local
    /// disk), so every pod sharing the volume reads one clock.
    async fn clock_offset_ms(&self) -> Result<i64, StoreError> {
        let root = Arc::clone(&self.root);
        self.clock
            .offset(BACKEND, || async move {
                tokio::task::spawn_blocking(move || probe_mtime(&root))
                    .await
                    .map_err(join_err)?
            })
            .await
    }

    async fn sweep_expired(&self) -> Result<usize, StoreError> {
        self.run(move |root| {
            let now = now_unix_ms();
            let mut stale_temps = Vec::new();
            let mut removed = 0;
            for found in find(root, "", Some(&mut stale_temps))? {
                let Ok(Some(h)) = read_header(&found.path, &found.key) else {
                    continue;
                };
                if h.live(now) {
                    continue;
                }
                let Ok(paths) = KeyPaths::new(root, &found.key) else {
                    continue;
                };
                // Re-checked under the lock: a writer may have replaced it.
                let gone = locked_remove(root, &paths, "sweep_expired", |cur| {
                    !cur.live(now_unix_ms())
                })?;
                removed += usize::from(gone.is_some());
            }
            for temp in stale_temps {
                let _ = fs::remove_file(temp);
            }
            Ok(removed)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn layout_keeps_keys_inside_the_root_and_apart() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("store");
        let store = FileStore::open(&root).await.unwrap();
        store.put("a/b", b"1", None).await.unwrap();
        store.put("a/b/c", b"2", None).await.unwrap();
        store.put("a/.lock", b"3", None).await.unwrap();
        assert!(root.join("a/b~rec").is_file());
        assert!(root.join("a/b/c~rec").is_file());
        assert!(root.join("a/.lock~rec").is_file());
        assert_eq!(
            store.list("").await.unwrap(),
            vec!["a/.lock", "a/b", "a/b/c"]
        );
        assert_eq!(store.get("a/b").await.unwrap().unwrap().value, b"1");
        // Nothing was written next to the root.
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
        assert!(matches!(
            store.put(&"x".repeat(201), b"", None).await,
            Err(StoreError::InvalidKey { .. })
        ));
    }

    #[tokio::test]
    async fn delete_removes_lock_files_and_empty_dirs() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::open(dir.path()).await.unwrap();
        store.put("x/y/z", b"1", None).await.unwrap();
        store.put("x/keep", b"1", None).await.unwrap();
        assert!(dir.path().join("x/y/z~lock").is_file());
        assert!(store.delete("x/y/z").await.unwrap());
        assert!(!dir.path().join("x/y").exists());
        assert!(dir.path().join("x/keep~rec").exists());
        assert!(store.delete("x/keep").await.unwrap());
        assert!(!dir.path().join("x").exists());
        assert!(!store.delete("x/y/z").await.unwrap());
        assert!(
            !dir.path().join("x").exists(),
            "delete of a missing key made directories"
        );
    }

    #[tokio::test]
    async fn foreign_and_partial_files_are_not_keys() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::open(dir.path()).await.unwrap();
        store.put("k/v", b"1", None).await.unwrap();
        fs::create_dir(dir.path().join("lost+found")).unwrap();
        fs::write(dir.path().join("k/w~tmp.0123456789abcdef"), b"partial").unwrap();
        fs::write(dir.path().join("k/notes.txt"), b"hello").unwrap();
        assert_eq!(store.list("").await.unwrap(), vec!["k/v"]);
        assert_eq!(store.get("k/w").await.unwrap(), None);
    }

    #[tokio::test]
    async fn corrupt_records_are_errors_not_garbage() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::open(dir.path()).await.unwrap();
        store.put("k/v", b"1", None).await.unwrap();
        let huge = vec![0u8; HEADER_LEN + MAX_VALUE_BYTES + 1];
        for bad in [
            &b""[..],
            b"SBMSREC1short",
            b"NOTMAGIC________________________value",
            &huge,
        ] {
            fs::write(dir.path().join("k/v~rec"), bad).unwrap();
            assert!(
                matches!(store.get("k/v").await, Err(StoreError::Corrupt { .. })),
                "{} bytes",
                bad.len()
            );
        }
        assert_eq!(store.list("k/").await.unwrap(), vec!["k/v"]);
        // A corrupt record can be replaced by a put, or deleted.
        assert!(matches!(
            store.put_if_absent("k/v", b"2", None).await,
            Err(StoreError::Corrupt { .. })
        ));
        store.put("k/v", b"3", None).await.unwrap();
        assert_eq!(store.get("k/v").await.unwrap().unwrap().value, b"3");
        fs::write(dir.path().join("k/v~rec"), b"").unwrap();
        assert!(store.delete("k/v").await.unwrap());
        assert_eq!(store.get("k/v").await.unwrap(), None);
    }

    #[tokio::test]
    async fn sweep_removes_expired_records_and_stale_temps() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::open(dir.path()).await.unwrap();
        store
            .put("t/gone", b"x", Some(Duration::from_millis(1)))
            .await
            .unwrap();
        store.put("t/kept", b"x", None).await.unwrap();
        let stale = dir.path().join("t/old~tmp.0000000000000000");
        let f = File::create(&stale).unwrap();
        f.set_modified(SystemTime::now() - 2 * STALE_TEMP_AGE)
            .unwrap();
        drop(f);
        let fresh = dir.path().join("t/new~tmp.0000000000000000");
        File::create(&fresh).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while store.get("t/gone").await.unwrap().is_some() {
            assert!(Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(store.sweep_expired().await.unwrap(), 1);
        assert_eq!(store.sweep_expired().await.unwrap(), 0);
        assert!(!dir.path().join("t/gone~rec").exists());
        assert!(!dir.path().join("t/gone~lock").exists());
        assert!(!stale.exists());
        assert!(fresh.exists(), "a write in progress was swept");
        assert_eq!(store.list("t/").await.unwrap(), vec!["t/kept"]);
    }

    #[test]
    fn header_round_trips() {
        let h = Header {
            version: 0x0123_4567_89ab_cdef_0011_2233_4455_6677,
            expires_at_unix_ms: Some(42),
        };
        assert_eq!(Header::decode("k", &h.encode()).unwrap(), h);
        assert_eq!(h.version().0, "0123456789abcdef0011223344556677");
    }
}
