//! A host's certificate as kept in the shared store: chain, private key and
//! the facts the scheduler needs, sealed at rest with the cluster key.

use serde::{Deserialize, Serialize};

use crate::keyring::KeyRing;
use crate::store::StoreError;
use crate::store::sealed::{open_record, seal_record};

/// The record at [`crate::acme::layout::certificate`]`(host)`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CertRecord {
    /// The hostname this record is filed under (lowercase).
    pub host: String,
    /// Every identifier of the certificate, `host` included.
    pub hosts: Vec<String>,
    /// Leaf first, then the chain, PEM.
    pub chain_pem: String,
    /// PKCS#8 PEM of the leaf's private key.
    pub key_pem: String,
    /// Leaf notBefore, unix seconds.
    pub not_before_unix: u64,
    /// Leaf notAfter, unix seconds.
    pub not_after_unix: u64,
    /// Leaf serial number, lowercase hex without separators.
    pub serial: String,
    /// When the record was stored, unix seconds.
    pub issued_at_unix: u64,
    /// Node id of the replica that ordered it.
    pub issued_by: String,
}

impl std::fmt::Debug for CertRecord {
    // Never print the private key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertRecord")
            .field("host", &self.host)
            .field("hosts", &self.hosts)
            .field("not_before_unix", &self.not_before_unix)
            .field("not_after_unix", &self.not_after_unix)
            .field("serial", &self.serial)
            .field("issued_at_unix", &self.issued_at_unix)
            .field("issued_by", &self.issued_by)
            .finish_non_exhaustive()
    }
}

impl CertRecord {
    /// The bytes to store at `store_key`: JSON sealed under the ring's
    /// primary key (plain when there is no cluster key).
    pub fn encode(&self, ring: Option<&KeyRing>, store_key: &str) -> Result<Vec<u8>, StoreError> {
        let json = serde_json::to_vec(self).map_err(|e| StoreError::Corrupt {
            key: store_key.to_owned(),
            message: format!("cannot encode certificate record: {e}"),
        })?;
        seal_record(ring, store_key, &json)
    }

    /// Opens and decodes bytes read from `store_key`.
    pub(crate) fn decode(
        ring: Option<&KeyRing>,
        store_key: &str,
        bytes: &[u8],
    ) -> Result<Self, StoreError> {
        let json = open_record(ring, store_key, bytes)?;
        serde_json::from_slice(&json).map_err(|e| StoreError::Corrupt {
            key: store_key.to_owned(),
            message: format!("not a certificate record: {e}"),
        })
    }
}

/// Largest certificate chain or key file read (a chain is a few KiB).
pub(crate) const MAX_PEM_BYTES: usize = 1 << 20;

/// What is wrong with a certificate chain or a private key.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// Nothing that looks like a PEM certificate.
    #[error(
        "no certificate found: expected PEM, leaf first, starting with '-----BEGIN CERTIFICATE-----'"
    )]
    NoCertificate,
    /// The text is over [`MAX_PEM_BYTES`].
    #[error("PEM text is {len} bytes; the limit is {MAX_PEM_BYTES}")]
    TooLarge {
        /// Its length.
        len: usize,
    },
    /// A PEM block cannot be read.
    #[error(
        "PEM block {position} is unreadable ({message}); each block needs its BEGIN and END lines around base64 content"
    )]
    Pem {
        /// 1-based position of the block (1 is the leaf in a chain).
        position: usize,
        /// What the parser said.
        message: String,
    },
    /// A block of a chain is not a certificate.
    #[error(
        "PEM block {position} of the chain is a {label:?}, not a CERTIFICATE; a chain holds certificates only (the key goes in its own file)"
    )]
    NotACertificate {
        /// 1-based position of the block.
        position: usize,
        /// Its label.
        label: String,
    },
    /// A certificate does not parse as X.509.
    #[error("certificate {position} of the chain (1 is the leaf) is not valid X.509: {message}")]
    X509 {
        /// 1-based position in the chain.
        position: usize,
        /// What the parser said.
        message: String,
    },
    /// The private key cannot be used.
    #[error("private key: {0}")]
    Key(String),
}

/// One PEM block: its label (`CERTIFICATE`, `PRIVATE KEY`, ...) and the
/// decoded DER.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct PemBlock {
    /// The word(s) after `BEGIN`.
    pub label: String,
    /// The decoded content.
    pub der: Vec<u8>,
}

impl std::fmt::Debug for PemBlock {
    // A block may be a private key: print its label and size only.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PemBlock")
            .field("label", &self.label)
            .field("der_len", &self.der.len())
            .finish()
    }
}

/// Every PEM block of `text`, in order (text outside blocks is ignored).
pub(crate) fn pem_blocks(text: &str) -> Result<Vec<PemBlock>, CertError> {
    if text.len() > MAX_PEM_BYTES {
        return Err(CertError::TooLarge { len: text.len() });
    }
    x509_parser::pem::Pem::iter_from_buffer(text.as_bytes())
        .enumerate()
        .map(|(i, block)| {
            block
                .map(|pem| PemBlock {
                    label: pem.label,
                    der: pem.contents,
                })
                .map_err(|e| CertError::Pem {
                    position: i + 1,
                    message: e.to_string(),
                })
        })
        .collect()
}

/// What the scheduler and the status need to know of a certificate (its
/// leaf).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertFacts {
    /// notBefore, unix seconds (0 if before 1970).
    pub not_before_unix: u64,
    /// notAfter, unix seconds (0 if before 1970).
    pub not_after_unix: u64,
    /// Serial number, lowercase hex without separators, without the DER
    /// sign-padding byte (as `openssl x509 -serial` prints it).
    pub serial: String,
    /// The subjectAltName DNS names, lowercase, in certificate order.
    pub dns_names: Vec<String>,
}

fn x509_error(position: usize, e: impl std::fmt::Display) -> CertError {
    CertError::X509 {
        position,
        message: e.to_string(),
    }
}

/// The DER of every certificate of a chain, leaf first; an error names the
/// first block that is not a certificate.
fn chain_ders(chain_pem: &str) -> Result<Vec<Vec<u8>>, CertError> {
    let blocks = pem_blocks(chain_pem)?;
    if blocks.is_empty() {
        return Err(CertError::NoCertificate);
    }
    blocks
        .into_iter()
        .enumerate()
        .map(|(i, block)| {
            if block.label == "CERTIFICATE" {
                Ok(block.der)
            } else {
                Err(CertError::NotACertificate {
                    position: i + 1,
                    label: block.label,
                })
            }
        })
        .collect()
}

fn parse_der(
    position: usize,
    der: &[u8],
) -> Result<x509_parser::certificate::X509Certificate<'_>, CertError> {
    match x509_parser::parse_x509_certificate(der) {
        Ok((rest, _)) if !rest.is_empty() => Err(x509_error(
            position,
            format!("{} bytes after the certificate", rest.len()),
        )),
        Ok((_, cert)) => Ok(cert),
        Err(e) => Err(x509_error(position, e)),
    }
}

/// Reads the facts of the leaf (the first PEM block) of `chain_pem`. Every
/// block must be a certificate that parses.
pub fn parse_chain(chain_pem: &str) -> Result<CertFacts, CertError> {
    let ders = chain_ders(chain_pem)?;
    for (i, der) in ders.iter().enumerate().skip(1) {
        parse_der(i + 1, der)?;
    }
    let leaf = parse_der(1, &ders[0])?;
    let validity = leaf.validity();
    let unix = |t: i64| u64::try_from(t).unwrap_or(0);
    let raw = leaf.raw_serial();
    let significant = raw
        .iter()
        .position(|b| *b != 0)
        .map_or(&raw[raw.len().saturating_sub(1)..], |i| &raw[i..]);
    let dns_names = match leaf
        .subject_alternative_name()
        .map_err(|e| x509_error(1, e))?
    {
        Some(san) => san
            .value
            .general_names
            .iter()
            .filter_map(|name| match name {
                x509_parser::extensions::GeneralName::DNSName(dns) => {
                    Some(dns.to_ascii_lowercase())
                }
                _ => None,
            })
            .collect(),
        None => Vec::new(),
    };
    Ok(CertFacts {
        not_before_unix: unix(validity.not_before.timestamp()),
        not_after_unix: unix(validity.not_after.timestamp()),
        serial: hex::encode(significant),
        dns_names,
    })
}

/// The public key of a private key, as it appears in a certificate's
/// subjectPublicKey: the uncompressed point (ECDSA), the `RSAPublicKey`
/// DER (RSA) or the 32 raw bytes (Ed25519).
fn public_key_of(block: &PemBlock) -> Result<Vec<u8>, CertError> {
    use aws_lc_rs::signature::{self, KeyPair};
    let ec_algs = [
        &signature::ECDSA_P256_SHA256_ASN1_SIGNING,
        &signature::ECDSA_P384_SHA384_ASN1_SIGNING,
        &signature::ECDSA_P521_SHA512_ASN1_SIGNING,
    ];
    match block.label.as_str() {
        "PRIVATE KEY" => {
            for alg in ec_algs {
                if let Ok(k) = signature::EcdsaKeyPair::from_pkcs8(alg, &block.der) {
                    return Ok(k.public_key().as_ref().to_vec());
                }
            }
            if let Ok(k) = signature::RsaKeyPair::from_pkcs8(&block.der) {
                return Ok(k.public_key().as_ref().to_vec());
            }
            if let Ok(k) = signature::Ed25519KeyPair::from_pkcs8_maybe_unchecked(&block.der) {
                return Ok(k.public_key().as_ref().to_vec());
            }
            Err(CertError::Key(
                "the PKCS#8 key is not an ECDSA (P-256, P-384, P-521), RSA or Ed25519 key, or is malformed"
                    .to_owned(),
            ))
        }
        "EC PRIVATE KEY" => {
            for alg in ec_algs {
                if let Ok(k) = signature::EcdsaKeyPair::from_private_key_der(alg, &block.der) {
                    return Ok(k.public_key().as_ref().to_vec());
                }
            }
            Err(CertError::Key(
                "the SEC1 EC key is not on P-256, P-384 or P-521, or is malformed".to_owned(),
            ))
        }
        "RSA PRIVATE KEY" => signature::RsaKeyPair::from_der(&block.der)
            .map(|k| k.public_key().as_ref().to_vec())
            .map_err(|e| CertError::Key(format!("the PKCS#1 RSA key is malformed: {e}"))),
        "ENCRYPTED PRIVATE KEY" => Err(CertError::Key(
            "the key is encrypted; write it unencrypted (PKCS#8 'PRIVATE KEY')".to_owned(),
        )),
        other => Err(CertError::Key(format!(
            "expected a 'PRIVATE KEY' PEM block, found {other:?}"
        ))),
    }
}

/// Whether `key_pem` (PKCS#8 PEM; SEC1 `EC PRIVATE KEY` and PKCS#1
/// `RSA PRIVATE KEY` are accepted too) is the private key of the leaf of
/// `chain_pem`. `Ok(false)` for a well-formed key of another certificate;
/// an error when either side cannot be read.
pub(crate) fn key_matches(chain_pem: &str, key_pem: &str) -> Result<bool, CertError> {
    let ders = chain_ders(chain_pem)?;
    let leaf = parse_der(1, &ders[0])?;
    let blocks = pem_blocks(key_pem)?;
    let block = blocks
        .iter()
        .find(|b| b.label.ends_with("PRIVATE KEY"))
        .or(blocks.first())
        .ok_or_else(|| {
            CertError::Key("no PEM block: expected '-----BEGIN PRIVATE KEY-----'".to_owned())
        })?;
    let public = public_key_of(block)?;
    Ok(leaf.public_key().subject_public_key.data.as_ref() == public.as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{
        BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SerialNumber,
        SignatureAlgorithm, date_time_ymd,
    };

    /// A CA-signed leaf for `names` with a key of `alg`: (chain PEM leaf
    /// first, key PEM).
    fn issue(names: &[&str], alg: &'static SignatureAlgorithm) -> (String, String) {
        let ca_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_cert = ca_params.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);

        let key = KeyPair::generate_for(alg).unwrap();
        let mut params =
            CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap();
        params.not_before = date_time_ymd(2025, 1, 1);
        params.not_after = date_time_ymd(2025, 4, 1);
        params.serial_number = Some(SerialNumber::from_slice(&[0x8a, 0x01, 0xff]));
        let leaf = params.signed_by(&key, &issuer).unwrap();
        (
            format!("{}{}", leaf.pem(), ca_cert.pem()),
            key.serialize_pem(),
        )
    }

    #[test]
    fn facts_of_the_leaf() {
        let (chain, _) = issue(
            &["API.example.com", "www.example.com"],
            &rcgen::PKCS_ECDSA_P256_SHA256,
        );
        let facts = parse_chain(&chain).unwrap();
        assert_eq!(facts.not_before_unix, 1_735_689_600); // 2025-01-01
        assert_eq!(facts.not_after_unix, 1_743_465_600); // 2025-04-01
        assert_eq!(facts.serial, "8a01ff");
        assert_eq!(facts.dns_names, ["api.example.com", "www.example.com"]);
        assert_eq!(pem_blocks(&chain).unwrap().len(), 2);
    }

    #[test]
    fn keys_match_their_leaf_only() {
        for alg in [
            &rcgen::PKCS_ECDSA_P256_SHA256,
            &rcgen::PKCS_ECDSA_P384_SHA384,
            &rcgen::PKCS_RSA_SHA256,
            &rcgen::PKCS_ED25519,
        ] {
            let (chain, key) = issue(&["a.example.com"], alg);
            assert!(key_matches(&chain, &key).unwrap(), "{alg:?}");
            let (other_chain, other_key) = issue(&["a.example.com"], alg);
            assert!(!key_matches(&chain, &other_key).unwrap(), "{alg:?}");
            assert!(!key_matches(&other_chain, &key).unwrap(), "{alg:?}");
        }
        // Another key type entirely.
        let (ec_chain, _) = issue(&["a.example.com"], &rcgen::PKCS_ECDSA_P256_SHA256);
        let (_, rsa_key) = issue(&["a.example.com"], &rcgen::PKCS_RSA_SHA256);
        assert!(!key_matches(&ec_chain, &rsa_key).unwrap());
    }

    #[test]
    fn errors_name_the_problem() {
        let (chain, key) = issue(&["a.example.com"], &rcgen::PKCS_ECDSA_P256_SHA256);
        assert!(matches!(parse_chain(""), Err(CertError::NoCertificate)));
        assert!(matches!(
            parse_chain("hello"),
            Err(CertError::NoCertificate)
        ));
        // Key first: block 1 is not a certificate.
        let swapped = format!("{key}{chain}");
        let err = parse_chain(&swapped).unwrap_err();
        assert!(
            matches!(&err, CertError::NotACertificate { position: 1, label } if label == "PRIVATE KEY"),
            "{err}"
        );
        assert!(err.to_string().contains("not a CERTIFICATE"));
        // Truncated.
        let cut = &chain[..chain.len() / 3];
        assert!(parse_chain(cut).is_err());
        // Broken base64.
        let garbled = chain.replacen("MII", "M!I", 1);
        assert!(matches!(
            parse_chain(&garbled),
            Err(CertError::Pem { position: 1, .. })
        ));
        // Valid PEM, not X.509 (in the second position).
        let junk =
            format!("{chain}-----BEGIN CERTIFICATE-----\naGVsbG8=\n-----END CERTIFICATE-----\n");
        let err = parse_chain(&junk).unwrap_err();
        assert!(matches!(err, CertError::X509 { position: 3, .. }), "{err}");
        // Oversized.
        let huge = "x".repeat(MAX_PEM_BYTES + 1);
        assert!(matches!(
            parse_chain(&huge),
            Err(CertError::TooLarge { .. })
        ));
        // Keys.
        assert!(matches!(key_matches(&chain, ""), Err(CertError::Key(_))));
        assert!(matches!(
            key_matches(&chain, &chain),
            Err(CertError::Key(_))
        ));
        let bad_key = "-----BEGIN PRIVATE KEY-----\naGVsbG8=\n-----END PRIVATE KEY-----\n";
        assert!(matches!(
            key_matches(&chain, bad_key),
            Err(CertError::Key(_))
        ));
        let enc = "-----BEGIN ENCRYPTED PRIVATE KEY-----\naGVsbG8=\n-----END ENCRYPTED PRIVATE KEY-----\n";
        assert!(
            key_matches(&chain, enc)
                .unwrap_err()
                .to_string()
                .contains("encrypted")
        );
        assert!(key_matches("", &key).is_err());
    }

    #[test]
    fn pem_block_debug_hides_key_bytes() {
        let (_, key) = issue(&["a.example.com"], &rcgen::PKCS_ECDSA_P256_SHA256);
        let blocks = pem_blocks(&key).unwrap();
        let shown = format!("{blocks:?}");
        assert!(shown.contains("PRIVATE KEY") && shown.contains("der_len"));
    }
}
