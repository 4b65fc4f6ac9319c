//! Cluster-key rotation without restarts (docs/operations.md#rotate-the-cluster-key), as a plan
//! computed from what the apiserver holds, with the clock passed in: the
//! reconciler reads, [`plan`] decides, the reconciler writes.
//!
//! `kubectl annotate sbproxy demo sbproxy.dev/rotate-cluster-key=<any new
//! value>` → the operator's Secret `<name>-cluster-key` holds `[new, old]`
//! (every sidecar re-reads its mounted file, seals with the new key and
//! still opens both) → after `spec.clustering.keyRotationGraceSeconds` it
//! holds `[new]`. The Secret remembers which annotation value it answered
//! and when ([`ROTATED_FOR_ANNOTATION`], [`ROTATED_AT_ANNOTATION`]), so a
//! repeated reconcile, an operator restart or a second replica of it
//! changes nothing. The pod template never changes: the Secret is mounted
//! as a directory, which the kubelet updates in place.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use crate::crd::ClusterKeyStatus;
use crate::render::CLUSTER_KEY_KEY;

/// On an SBProxy: a new value asks for a rotation.
pub const ROTATE_ANNOTATION: &str = "sbproxy.dev/rotate-cluster-key";
/// On the operator's Secret: the rotate-annotation value last acted on.
pub const ROTATED_FOR_ANNOTATION: &str = "sbproxy.dev/rotated-for";
/// On the operator's Secret: when its primary key became primary (RFC 3339).
pub const ROTATED_AT_ANNOTATION: &str = "sbproxy.dev/rotated-at";
/// `status.clusterKey.phase` values.
pub const STABLE: &str = "Stable";
pub const ROTATING: &str = "Rotating";

/// What a reconcile does about the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The Secret's new content, when it must change.
    pub write: Option<Write>,
    /// `status.clusterKey` once the write (if any) is done.
    pub status: ClusterKeyStatus,
    /// Look again then (the end of a grace period).
    pub recheck_in: Option<Duration>,
}

/// A change to the operator's cluster-key Secret (a merge patch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    /// The new `cluster-key` value: keys one per line, primary first.
    pub ring: String,
    /// Annotations to set on the Secret.
    pub annotations: BTreeMap<String, String>,
    /// The Event's reason and note.
    pub reason: &'static str,
    pub note: String,
}

/// The plan for the operator's Secret `secret`, given the SBProxy's
/// rotate annotation `requested`. `fresh` makes a new key (64 hex chars).
/// An `Err` is a Secret whose key does not parse (edited by hand): nothing
/// is written, the message says what is wrong.
pub fn plan(
    requested: Option<&str>,
    secret: &Secret,
    grace: Duration,
    now: Timestamp,
    fresh: &dyn Fn() -> String,
) -> Result<Plan, String> {
    let name = secret.metadata.name.as_deref().unwrap_or_default();
    let text = secret
        .data
        .as_ref()
        .and_then(|d| d.get(CLUSTER_KEY_KEY))
        .map(|v| String::from_utf8_lossy(&v.0).into_owned())
        .ok_or_else(|| format!("Secret {name} has no {CLUSTER_KEY_KEY:?} key"))?;
    let ring = sbmesh::parse_key_ring(&text)
        .map_err(|e| format!("Secret {name}, key {CLUSTER_KEY_KEY:?}: {e}"))?;
    let annotation = |key: &str| {
        secret
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(key))
            .map(String::as_str)
    };
    let rotated_for = annotation(ROTATED_FOR_ANNOTATION);
    let rotated_at = annotation(ROTATED_AT_ANNOTATION).and_then(|t| t.parse::<Timestamp>().ok());
    let primary = sbmesh::key_to_hex(&ring[0]);
    let primary_id = sbmesh::display_key_id(&ring[0]);
    let status = |key_id: String, phase: &str, at: Option<Timestamp>| ClusterKeyStatus {
        key_id,
        phase: phase.to_string(),
        rotated_at: at.map(|t| t.to_string()),
    };
    let grace_signed = SignedDuration::try_from(grace).unwrap_or(SignedDuration::MAX);
    let grace_left = |at: Timestamp| {
        let passed = now.duration_since(at);
        (passed < grace_signed)
            .then(|| Duration::try_from(grace_signed - passed).unwrap_or_default())
    };

    // A rotation under way finishes first, whatever is asked meanwhile:
    // dropping its old key before every pod has the new file would cut
    // those pods off.
    if ring.len() > 1
        && let Some(at) = rotated_at
    {
        return Ok(match grace_left(at) {
            Some(left) => Plan {
                write: None,
                status: status(primary_id, ROTATING, Some(at)),
                recheck_in: Some(left),
            },
            None => Plan {
                write: Some(Write {
                    ring: format!("{primary}\n"),
                    annotations: BTreeMap::new(),
                    reason: "ClusterKeyRotated",
                    note: format!(
                        "Secret {name}: the previous cluster key dropped after the grace; key {primary_id} only"
                    ),
                }),
                status: status(primary_id, STABLE, Some(at)),
                recheck_in: None,
            },
        });
    }
    if let Some(request) = requested.filter(|r| Some(*r) != rotated_for) {
        let new = fresh();
        let new_id = key_id(&new);
        return Ok(Plan {
            write: Some(Write {
                ring: format!("{new}\n{primary}\n"),
                annotations: BTreeMap::from([
                    (ROTATED_FOR_ANNOTATION.to_string(), request.to_string()),
                    (ROTATED_AT_ANNOTATION.to_string(), now.to_string()),
                ]),
                reason: "ClusterKeyRotating",
                note: format!(
                    "Secret {name}: new cluster key {new_id} first, {primary_id} kept for {} s",
                    grace.as_secs()
                ),
            }),
            status: status(new_id, ROTATING, Some(now)),
            recheck_in: Some(grace),
        });
    }
    // Settled, or a ring written by hand (no rotation time): left as it is.
    Ok(Plan {
        write: None,
        status: status(primary_id, STABLE, rotated_at),
        recheck_in: None,
    })
}

/// `status.clusterKey.keyId` of a key written as 64 hex chars.
pub fn key_id(key_hex: &str) -> String {
    let ids = ring_ids(key_hex);
    ids.split(',').next().unwrap_or_default().to_string()
}

/// The key ids of a ring written as hex lines, primary first, joined by
/// `,`: what the pods are told of a written ring.
pub fn ring_ids(ring: &str) -> String {
    match sbmesh::parse_key_ring(ring) {
        Ok(keys) => keys
            .iter()
            .map(sbmesh::display_key_id)
            .collect::<Vec<_>>()
            .join(","),
        Err(_) => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    const OLD: &str = "1111111111111111111111111111111111111111111111111111111111111111";
    const NEW: &str = "2222222222222222222222222222222222222222222222222222222222222222";
    const GRACE: Duration = Duration::from_secs(300);

    fn secret(ring: &str, annotations: &[(&str, &str)]) -> Secret {
        Secret {
            metadata: ObjectMeta {
                name: Some("demo-cluster-key".into()),
                annotations: (!annotations.is_empty()).then(|| {
                    annotations
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect()
                }),
                ..ObjectMeta::default()
            },
            data: Some(BTreeMap::from([(
                CLUSTER_KEY_KEY.to_string(),
                ByteString(ring.as_bytes().to_vec()),
            )])),
            ..Secret::default()
        }
    }

    fn at(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn fresh() -> String {
        NEW.to_string()
    }

    #[test]
    fn a_rings_ids_are_its_keys_ids_primary_first() {
        let (new, old) = (key_id(NEW), key_id(OLD));
        assert_eq!(new.len(), 8);
        assert_ne!(new, old);
        assert_eq!(ring_ids(&format!("{NEW}\n{OLD}\n")), format!("{new},{old}"));
        assert_eq!(ring_ids(&format!("{NEW}\n")), new);
        assert_eq!(ring_ids("not a key"), "");
    }

    #[test]
    fn a_new_annotation_value_writes_new_then_old_and_waits_the_grace() {
        let now = at("2026-12-02T10:00:00Z");
        let p = plan(Some("1"), &secret(OLD, &[]), GRACE, now, &fresh).unwrap();
        let w = p.write.expect("a write");
        assert_eq!(w.ring, format!("{NEW}\n{OLD}\n"));
        assert_eq!(w.annotations[ROTATED_FOR_ANNOTATION], "1");
        assert_eq!(w.annotations[ROTATED_AT_ANNOTATION], "2026-12-02T10:00:00Z");
        assert_eq!(p.status.phase, ROTATING);
        assert_eq!(p.status.key_id, key_id(NEW));
        assert_ne!(key_id(NEW), key_id(OLD));
        assert_eq!(p.recheck_in, Some(GRACE));
    }

    #[test]
    fn inside_the_grace_nothing_changes_and_after_it_the_old_key_goes() {
        let ring = format!("{NEW}\n{OLD}\n");
        let marks = [
            (ROTATED_FOR_ANNOTATION, "1"),
            (ROTATED_AT_ANNOTATION, "2026-12-02T10:00:00Z"),
        ];
        let s = secret(&ring, &marks);
        let p = plan(Some("1"), &s, GRACE, at("2026-12-02T10:04:00Z"), &fresh).unwrap();
        assert_eq!(p.write, None);
        assert_eq!(p.status.phase, ROTATING);
        assert_eq!(p.recheck_in, Some(Duration::from_secs(60)));
        // A newer request waits for this rotation to end.
        let p = plan(Some("2"), &s, GRACE, at("2026-12-02T10:04:00Z"), &fresh).unwrap();
        assert_eq!(p.write, None);

        let p = plan(Some("1"), &s, GRACE, at("2026-12-02T10:05:00Z"), &fresh).unwrap();
        let w = p.write.expect("the old key dropped");
        assert_eq!(w.ring, format!("{NEW}\n"));
        assert!(w.annotations.is_empty(), "the marks stay as they are");
        assert_eq!(p.status.phase, STABLE);
        assert_eq!(p.status.key_id, key_id(NEW));
        assert_eq!(p.status.rotated_at.as_deref(), Some("2026-12-02T10:00:00Z"));

        // Settled: the same annotation does nothing more.
        let done = secret(&format!("{NEW}\n"), &marks);
        let p = plan(Some("1"), &done, GRACE, at("2026-12-02T11:00:00Z"), &fresh).unwrap();
        assert_eq!(p.write, None);
        assert_eq!(p.status.phase, STABLE);
        assert_eq!(p.recheck_in, None);
    }

    #[test]
    fn no_annotation_and_a_hand_written_ring_are_left_alone() {
        let now = at("2026-12-02T10:00:00Z");
        let p = plan(None, &secret(OLD, &[]), GRACE, now, &fresh).unwrap();
        assert_eq!((p.write, p.status.phase.as_str()), (None, STABLE));
        let p = plan(
            None,
            &secret(&format!("{OLD},{NEW}"), &[]),
            GRACE,
            now,
            &fresh,
        )
        .unwrap();
        assert_eq!(p.write, None);
        assert_eq!(p.status.key_id, key_id(OLD));
    }

    #[test]
    fn a_secret_that_does_not_parse_is_an_error_naming_it() {
        let now = at("2026-12-02T10:00:00Z");
        let e = plan(Some("1"), &secret("nothex", &[]), GRACE, now, &fresh).unwrap_err();
        assert!(
            e.starts_with("Secret demo-cluster-key, key \"cluster-key\": "),
            "{e}"
        );
    }
}
