//! Which replica orders a hostname: rendezvous (highest random weight)
//! hashing over the alive mesh members. Every replica computes the same
//! owner from the same view without talking to the others; when a member
//! joins or leaves only the hostnames it wins or owned move, so a scale
//! event does not start a herd of orders. Views can differ for a moment:
//! the store's order lock (a lease) keeps that safe, this only spreads the
//! load.
//!
//! The weight of `(member, host)` is the first 8 bytes (big-endian) of
//! `sha256(member || 0x00 || lowercase(host))`: stable across versions,
//! platforms and processes, so replicas of different versions agree. Equal
//! weights (practically never) go to the smallest member name.

use aws_lc_rs::digest;

/// The weight of `member` for `host` (`host` already lowercase).
fn weight(member: &str, host_lower: &str) -> u64 {
    let mut ctx = digest::Context::new(&digest::SHA256);
    ctx.update(member.as_bytes());
    ctx.update(&[0]);
    ctx.update(host_lower.as_bytes());
    let d = ctx.finish();
    let mut first = [0u8; 8];
    first.copy_from_slice(&d.as_ref()[..8]);
    u64::from_be_bytes(first)
}

/// The member that orders `host` (case-insensitive), or `None` when there
/// are no members. The order of `members` does not matter; duplicates are
/// harmless.
pub fn owner<'a>(host: &str, members: &[&'a str]) -> Option<&'a str> {
    let host = host.to_ascii_lowercase();
    members
        .iter()
        .map(|m| (weight(m, &host), *m))
        // Highest weight; on a tie the smallest name (hence the reversed
        // comparison of names).
        .max_by(|(wa, a), (wb, b)| wa.cmp(wb).then_with(|| b.cmp(a)))
        .map(|(_, m)| m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn hosts(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("host-{i}.example.com")).collect()
    }

    #[test]
    fn empty_and_single() {
        assert_eq!(owner("a.example.com", &[]), None);
        assert_eq!(owner("a.example.com", &["only"]), Some("only"));
    }

    #[test]
    fn stable_weights() {
        // Pinned: a change here would make replicas of different versions
        // disagree on owners.
        assert_eq!(weight("demo-proxy-0", "api.example.com"), {
            let d = digest::digest(&digest::SHA256, b"demo-proxy-0\0api.example.com");
            u64::from_be_bytes(d.as_ref()[..8].try_into().unwrap())
        });
        // `printf 'a\0b' | sha256sum`: 59b271ae1bbcb1d3...
        assert_eq!(weight("a", "b"), 0x59b2_71ae_1bbc_b1d3);
    }

    #[test]
    fn deterministic_case_insensitive_and_order_free() {
        let members = ["demo-proxy-0", "demo-proxy-1", "demo-proxy-2"];
        let reversed = ["demo-proxy-2", "demo-proxy-1", "demo-proxy-0"];
        let rotated = ["demo-proxy-1", "demo-proxy-2", "demo-proxy-0"];
        for host in hosts(500) {
            let o = owner(&host, &members);
            assert!(o.is_some());
            assert_eq!(o, owner(&host, &members));
            assert_eq!(o, owner(&host, &reversed));
            assert_eq!(o, owner(&host, &rotated));
            assert_eq!(o, owner(&host.to_ascii_uppercase(), &members));
        }
    }

    #[test]
    fn fair_share() {
        let members = ["demo-proxy-0", "demo-proxy-1", "demo-proxy-2"];
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for host in hosts(3000) {
            *counts.entry(owner(&host, &members).unwrap()).or_default() += 1;
        }
        for m in members {
            let n = counts.get(m).copied().unwrap_or(0);
            assert!(
                (850..=1150).contains(&n),
                "{m} owns {n} of 3000: {counts:?}"
            );
        }
    }

    #[test]
    fn removing_a_member_moves_only_its_hosts() {
        let before = ["a", "b", "c", "d"];
        let after = ["a", "b", "d"];
        let mut moved = 0;
        for host in hosts(2000) {
            let o1 = owner(&host, &before).unwrap();
            let o2 = owner(&host, &after).unwrap();
            if o1 == "c" {
                moved += 1;
                assert_ne!(o2, "c");
            } else {
                assert_eq!(o1, o2, "{host} moved from {o1} to {o2}");
            }
        }
        assert!(moved > 0);
        // Adding it back restores the original owners exactly.
        for host in hosts(2000) {
            assert_eq!(owner(&host, &before), owner(&host, &["d", "c", "b", "a"]));
        }
    }

    #[test]
    fn ties_go_to_the_smallest_name() {
        // Duplicates have equal weights: still one answer.
        assert_eq!(owner("x", &["m", "m"]), Some("m"));
    }
}
