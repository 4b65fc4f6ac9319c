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

/// Asks the kernel to reclaim the pages of every read-only file mapping
/// (the binary's code and read-only data, the shared libraries') and gives
/// free heap back. Pages another process maps too are left alone by the
/// kernel. Best effort: before Linux 5.4 (no MADV_PAGEOUT) it does nothing.
pub fn release_startup_pages() {
    #[cfg(target_os = "linux")]
    {
        let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
            return;
        };
        for (start, len) in maps.lines().filter_map(read_only_file_mapping) {
            // SAFETY: the range is a mapping of this process; paging out
            // read-only file pages changes no content, only residency.
            unsafe {
                libc::madvise(start as *mut libc::c_void, len, libc::MADV_PAGEOUT);
            }
        }
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory of the allocator.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// `start` and length of a `/proc/self/maps` line that maps a file
/// read-only (private or shared); `None` for anything else.
fn read_only_file_mapping(line: &str) -> Option<(usize, usize)> {
    let mut fields = line.split_whitespace();
    let (start, end) = fields.next()?.split_once('-')?;
    let perms = fields.next()?;
    // offset, device, inode, then the path.
    let path = fields.nth(3)?;
    if !path.starts_with('/') || !perms.starts_with('r') || perms.contains('w') {
        return None;
    }
    let start = usize::from_str_radix(start, 16).ok()?;
    let end = usize::from_str_radix(end, 16).ok()?;
    Some((start, end.checked_sub(start).filter(|&len| len > 0)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_read_only_file_mappings_are_released() {
        let text = "55d0c0a00000-55d0c0b00000 r-xp 00001000 fd:01 123 /usr/bin/sbmesh-sidecar";
        assert_eq!(
            read_only_file_mapping(text),
            Some((0x55d0c0a00000, 0x100000))
        );
        let with_space = "7f00-8000 r--p 0 fd:01 9 /var/lib/my lib.so";
        assert_eq!(read_only_file_mapping(with_space), Some((0x7f00, 0x100)));
        for line in [
            "55d0c0a00000-55d0c0b00000 rw-p 00001000 fd:01 123 /usr/bin/sbmesh-sidecar",
            "5566389cb000-556638a02000 rw-p 00000000 00:00 0 [heap]",
            "7ffc18820000-7ffc18841000 r--p 00000000 00:00 0 [vvar]",
            "7f5e3c86f000-7f5e3ca6f000 ---p 00000000 00:00 0",
            "7f5e3c86f000-7f5e3ca6f000 r--p 00000000 00:00 0",
            "zz-10 r--p 0 0 0 /x",
            "20-10 r--p 0 0 0 /x",
            "",
        ] {
            assert_eq!(read_only_file_mapping(line), None, "{line}");
        }
    }

    #[test]
    fn releasing_keeps_the_process_running() {
        release_startup_pages();
        // Code and data paged out come back on the next touch.
        let v: Vec<u64> = (0..1000).collect();
        assert_eq!(v.iter().sum::<u64>(), 499_500);
    }
}
