//! The process's resident memory (BENCHMARKS.md, "RSS per sidecar").
//!
//! An idle sidecar's RSS is mostly file pages of its own binary, and most
//! of those only start-up ran: flag and YAML parsing, the store's open, TLS
//! set-up. glibc adds free heap it keeps for later. Both are handed back
//! here; a page still in use faults back in from the page cache or the file.

use std::time::Duration;

/// How long after start-up [`release_startup_pages`] runs: the store is
/// open, the mesh has joined and the first reads are done by then.
pub const STARTUP_SETTLE: Duration = Duration::from_secs(10);

/// Allocations of 128 KiB and more get their own mapping, returned to the
/// system when freed. glibc raises this threshold after the first such
/// free, and then the ~1 MiB redb allocates and frees around each commit
/// stays behind in the heap as free space (measured: 1.3 MiB of RssAnon).
pub fn fixed_mmap_threshold() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets a malloc parameter; called before any
    // thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
}

/// Hands back the pages of every read-only file mapping (the binary's code
/// and read-only data, the shared libraries') and free heap. Pages only this
/// process maps are reclaimed (MADV_PAGEOUT); pages others map too (the
/// same binary in another process, libc) are unmapped from this one
/// (MADV_DONTNEED), which is safe only where the mapping holds no private
/// copy (`Anonymous: 0 kB`, so not the relocated RELRO pages). Best effort:
/// a kernel without MADV_PAGEOUT (before 5.4) just skips that step.
pub fn release_startup_pages() {
    #[cfg(target_os = "linux")]
    {
        let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
            return;
        };
        for m in read_only_file_mappings(&smaps) {
            let addr = m.start as *mut libc::c_void;
            // SAFETY: the range is a read-only mapping of this process.
            // Paging out changes residency only; dropping pages of a mapping
            // without private copies refaults the same file content.
            unsafe {
                libc::madvise(addr, m.len, libc::MADV_PAGEOUT);
                if !m.private_copies {
                    libc::madvise(addr, m.len, libc::MADV_DONTNEED);
                }
            }
        }
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory of the allocator.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// A read-only file mapping of `/proc/self/smaps`.
#[derive(Debug, PartialEq, Eq)]
struct Mapping {
    start: usize,
    len: usize,
    /// Some page is a private (anonymous) copy, e.g. relocated at load.
    private_copies: bool,
}

/// The mappings of a file that are readable and not writable, from the text
/// of `/proc/self/smaps`; an `Anonymous:` line missing counts as copies.
fn read_only_file_mappings(smaps: &str) -> Vec<Mapping> {
    let mut out = Vec::new();
    let mut current: Option<Mapping> = None;
    for line in smaps.lines() {
        if let Some(m) = mapping_header(line) {
            out.extend(current.take());
            current = m;
        } else if let Some(kib) = line.strip_prefix("Anonymous:")
            && let Some(m) = current.as_mut()
        {
            m.private_copies = kib.trim() != "0 kB";
        }
    }
    out.extend(current);
    out
}

/// `Some(None)` for a mapping header line that is not a read-only file
/// mapping, `None` for any other line (a `Key: value` line).
fn mapping_header(line: &str) -> Option<Option<Mapping>> {
    let mut fields = line.split_whitespace();
    let (start, end) = fields.next()?.split_once('-')?;
    let start = usize::from_str_radix(start, 16).ok()?;
    let end = usize::from_str_radix(end, 16).ok()?;
    let perms = fields.next()?;
    // offset, device, inode, then the path.
    let path = fields.nth(3).unwrap_or("");
    let read_only_file = path.starts_with('/') && perms.starts_with('r') && !perms.contains('w');
    Some(
        end.checked_sub(start)
            .filter(|&len| len > 0 && read_only_file)
            .map(|len| Mapping {
                start,
                len,
                private_copies: true,
            }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_read_only_file_mappings_are_released() {
        let smaps = "\
55d0c0a00000-55d0c0b00000 r-xp 00001000 fd:01 123 /usr/bin/sbmesh-sidecar
Rss:                9236 kB
Anonymous:             0 kB
55d0c0b00000-55d0c0c00000 r--p 00101000 fd:01 123 /usr/bin/sbmesh-sidecar
Anonymous:           684 kB
55d0c0c00000-55d0c0c05000 rw-p 00201000 fd:01 123 /usr/bin/sbmesh-sidecar
Anonymous:            20 kB
5566389cb000-556638a02000 rw-p 00000000 00:00 0                          [heap]
Anonymous:           168 kB
7f5e3c86f000-7f5e3ca6f000 ---p 00000000 00:00 0
7f5e3ca6f000-7f5e3cc6f000 r--p 00000000 00:00 0
Anonymous:             0 kB
7f00-8000 r--p 0 fd:01 9 /var/lib/my lib.so
Anonymous:             0 kB
zz-10 r--p 0 0 0 /x
20-10 r--p 0 0 0 /y
7f5e3d503000-7f5e3d529000 r--p 00000000 fd:01 77 /usr/lib/libc.so.6
";
        assert_eq!(
            read_only_file_mappings(smaps),
            [
                Mapping {
                    start: 0x55d0c0a00000,
                    len: 0x100000,
                    private_copies: false
                },
                Mapping {
                    start: 0x55d0c0b00000,
                    len: 0x100000,
                    private_copies: true
                },
                Mapping {
                    start: 0x7f00,
                    len: 0x100,
                    private_copies: false
                },
                // No Anonymous line: assume copies, page out only.
                Mapping {
                    start: 0x7f5e3d503000,
                    len: 0x26000,
                    private_copies: true
                },
            ]
        );
        assert!(read_only_file_mappings("").is_empty());
    }

    #[test]
    fn releasing_keeps_the_process_running() {
        release_startup_pages();
        // Code and data paged out come back on the next touch.
        let v: Vec<u64> = (0..1000).collect();
        assert_eq!(v.iter().sum::<u64>(), 499_500);
    }
}
