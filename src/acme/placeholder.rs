//! Self-signed placeholders (docs/reference.md#certificate-files): before the first real
//! certificate for a name (or the SAN set) exists, the sidecar writes one
//! for the same names, so that a proxy that needs its files at start-up
//! (sbproxy with `tls_cert_file`) can start. Clients do not trust it; it
//! only lets the listener come up until the CA's certificate arrives.
//!
//! A placeholder is recognisable on disk, so a restarted pod never takes
//! it for the CA's certificate: it is self-signed, and its subject and
//! issuer are both `CN=`[`PLACEHOLDER_CN`]`, O=`[`PLACEHOLDER_ORG`]. It is
//! ECDSA P-256 and valid for [`PLACEHOLDER_VALIDITY_SECS`]; the manager
//! writes a fresh one when it is within [`PLACEHOLDER_REFRESH_SECS`] of
//! expiry and still no real certificate has come.

use crate::acme::certs::{CertError, pem_blocks};

/// Common name of every placeholder's subject and issuer.
pub(crate) const PLACEHOLDER_CN: &str = "sbmesh placeholder (not issued by a CA)";
/// Organization of every placeholder's subject and issuer.
pub(crate) const PLACEHOLDER_ORG: &str = "sbmesh";
/// How long a placeholder is valid.
pub(crate) const PLACEHOLDER_VALIDITY_SECS: u64 = 7 * 24 * 3600;
/// A placeholder this close to its notAfter is written anew.
pub(crate) const PLACEHOLDER_REFRESH_SECS: u64 = 24 * 3600;

/// A placeholder for `names` valid from an hour before `now_unix` for
/// `PLACEHOLDER_VALIDITY_SECS`: `(chain_pem, key_pem)`, the key PKCS#8
/// PEM as the CA's certificates are written.
pub fn generate(names: &[String], now_unix: u64) -> Result<(String, String), CertError> {
    use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, PKCS_ECDSA_P256_SHA256};
    let fail = |e: rcgen::Error| CertError::Key(format!("cannot make a placeholder: {e}"));
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(fail)?;
    let mut params = CertificateParams::new(names.to_vec()).map_err(fail)?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, PLACEHOLDER_CN);
    dn.push(DnType::OrganizationName, PLACEHOLDER_ORG);
    params.distinguished_name = dn;
    let at = |unix: u64| {
        time::OffsetDateTime::from_unix_timestamp(i64::try_from(unix).unwrap_or(i64::MAX))
            .map_err(|e| CertError::Key(format!("cannot make a placeholder: {e}")))
    };
    params.not_before = at(now_unix.saturating_sub(3600))?;
    params.not_after = at(now_unix + PLACEHOLDER_VALIDITY_SECS)?;
    let mut serial = [0u8; 16];
    serial[1..].copy_from_slice(&rand::random::<[u8; 15]>());
    params.serial_number = Some(rcgen::SerialNumber::from_slice(&serial));
    let cert = params.self_signed(&key).map_err(fail)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Whether the leaf of `chain_pem` is a placeholder of ours: self-signed
/// (subject = issuer) with the placeholder's name. `false` for anything
/// that does not parse.
pub fn is_placeholder(chain_pem: &str) -> bool {
    let Ok(blocks) = pem_blocks(chain_pem) else {
        return false;
    };
    let Some(leaf) = blocks.first().filter(|b| b.label == "CERTIFICATE") else {
        return false;
    };
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(&leaf.der) else {
        return false;
    };
    let named = |name: &x509_parser::x509::X509Name<'_>| {
        let cn = name.iter_common_name().next().and_then(|a| a.as_str().ok());
        let org = name
            .iter_organization()
            .next()
            .and_then(|a| a.as_str().ok());
        cn == Some(PLACEHOLDER_CN) && org == Some(PLACEHOLDER_ORG)
    };
    cert.subject() == cert.issuer() && named(cert.subject())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::acme::certs::{key_matches, parse_chain};

    #[test]
    fn a_placeholder_names_the_set_and_is_recognised() {
        let names = vec!["a.example.com".to_owned(), "b.example.com".to_owned()];
        let now = 1_800_000_000;
        let (chain, key) = generate(&names, now).unwrap();
        let facts = parse_chain(&chain).unwrap();
        assert_eq!(facts.dns_names, names);
        assert_eq!(facts.not_after_unix, now + PLACEHOLDER_VALIDITY_SECS);
        assert!(facts.not_before_unix < now);
        assert!(key_matches(&chain, &key).unwrap());
        assert!(key.starts_with("-----BEGIN PRIVATE KEY-----"), "{key}");
        assert!(is_placeholder(&chain));
        // Two placeholders never share a serial.
        let (other, _) = generate(&names, now).unwrap();
        assert_ne!(parse_chain(&other).unwrap().serial, facts.serial);
    }

    #[test]
    fn a_certificate_from_a_ca_is_not_a_placeholder() {
        use rcgen::{CertificateParams, DnType, Issuer, KeyPair};
        // A CA whose subject even borrows the placeholder's name: its leaf
        // is not self-signed, so it is not taken for one.
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, PLACEHOLDER_CN);
        ca.distinguished_name
            .push(DnType::OrganizationName, PLACEHOLDER_ORG);
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca, ca_key);
        let leaf_key = KeyPair::generate().unwrap();
        let mut leaf = CertificateParams::new(vec!["a.example.com".to_owned()]).unwrap();
        leaf.distinguished_name
            .push(DnType::CommonName, "a.example.com");
        let leaf = leaf.signed_by(&leaf_key, &issuer).unwrap();
        let chain = format!("{}{}", leaf.pem(), ca_cert.pem());
        assert!(!is_placeholder(&chain));
        // A self-signed certificate of someone else is not ours either.
        let own = CertificateParams::new(vec!["a.example.com".to_owned()])
            .unwrap()
            .self_signed(&KeyPair::generate().unwrap())
            .unwrap();
        assert!(!is_placeholder(&own.pem()));
        assert!(!is_placeholder("not a certificate"));
        assert!(!is_placeholder(""));
    }
}
