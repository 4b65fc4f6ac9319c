//! DNS messages, without I/O: the dynamic updates (RFC 2136) that add and
//! remove one TXT value, their TSIG signature (RFC 8945), the questions
//! the propagation check asks, and what the answers say. Messages are
//! hickory-proto's; the shells (`transport`, `lookup`, `rfc2136`) only
//! move their bytes.

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode, update_message};
use hickory_proto::rr::rdata::TXT;
use hickory_proto::rr::rdata::tsig::{self, TSIG, TsigError};
use hickory_proto::rr::{Name, RData, Record, RecordSet, RecordType};

use crate::config::TsigAlgorithm;

/// Seconds of clock difference the server accepts in a signature (RFC
/// 8945's recommended 300).
const FUDGE: u16 = 300;

/// TTL of a challenge record: short, as the CA must see the current value.
pub(crate) const CHALLENGE_TTL: u32 = 60;

/// A TSIG key: its name as the server knows it, its MAC and its secret.
#[derive(Clone)]
pub(crate) struct TsigKey {
    pub(crate) name: Name,
    pub(crate) algorithm: TsigAlgorithm,
    pub(crate) secret: Vec<u8>,
}

impl std::fmt::Debug for TsigKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TsigKey")
            .field("name", &self.name)
            .field("algorithm", &self.algorithm)
            .finish_non_exhaustive()
    }
}

/// What an update does to the TXT RRset at a name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Change {
    /// Adds one value (other values at the name stay: a wildcard and its
    /// apex share `_acme-challenge.<apex>`).
    Add,
    /// Removes exactly that value (nothing if it is not there).
    Remove,
}

/// The update that makes `change` of the TXT `value` at `fqdn` in `zone`
/// (which must contain `fqdn`; `None` when it does not).
pub(crate) fn update(
    id: u16,
    zone: &Name,
    fqdn: &Name,
    value: &str,
    change: Change,
) -> Option<Message> {
    if !zone.zone_of(fqdn) {
        return None;
    }
    let record = Record::from_rdata(
        fqdn.clone(),
        CHALLENGE_TTL,
        RData::TXT(TXT::new(vec![value.to_owned()])),
    );
    let mut rrset = RecordSet::new(fqdn.clone(), RecordType::TXT, 0);
    rrset.insert(record, 0);
    let mut message = match change {
        Change::Add => update_message::append(rrset, zone.clone(), false, false),
        Change::Remove => update_message::delete_by_rdata(rrset, zone.clone(), false),
    };
    message.metadata.id = id;
    Some(message)
}

/// Signs `message` with `key` at `now_unix` (seconds): the TSIG record
/// becomes its last additional record.
pub(crate) fn sign(message: &mut Message, key: &TsigKey, now_unix: u64) -> Result<(), String> {
    let algorithm = match key.algorithm {
        TsigAlgorithm::HmacSha256 => tsig::TsigAlgorithm::HmacSha256,
        TsigAlgorithm::HmacSha512 => tsig::TsigAlgorithm::HmacSha512,
        TsigAlgorithm::HmacMd5 => tsig::TsigAlgorithm::HmacMd5,
    };
    let stub = TSIG::new(
        algorithm,
        now_unix,
        FUDGE,
        Vec::new(),
        message.metadata.id,
        None,
        Vec::new(),
    );
    let tbs = tsig::message_tbs(message, &stub, &key.name).map_err(|e| e.to_string())?;
    let mac = mac(key.algorithm, &key.secret, &tbs);
    message.signature = Some(Box::new(tsig::make_tsig_record(
        key.name.clone(),
        stub.set_mac(mac),
    )));
    Ok(())
}

/// The HMAC of `data` under `secret`.
fn mac(algorithm: TsigAlgorithm, secret: &[u8], data: &[u8]) -> Vec<u8> {
    use aws_lc_rs::hmac as lc;
    let with = |alg| lc::sign(&lc::Key::new(alg, secret), data).as_ref().to_vec();
    match algorithm {
        TsigAlgorithm::HmacSha256 => with(lc::HMAC_SHA256),
        TsigAlgorithm::HmacSha512 => with(lc::HMAC_SHA512),
        TsigAlgorithm::HmacMd5 => {
            // aws-lc-rs has no HMAC-MD5: the RustCrypto pair, for old
            // servers only (the configuration must name it).
            use hmac::{KeyInit, Mac};
            let mut m = <hmac::Hmac<md5::Md5> as KeyInit>::new_from_slice(secret)
                .expect("HMAC takes a key of any length");
            m.update(data);
            m.finalize().into_bytes().to_vec()
        }
    }
}

/// A question for `name`'s records of `rtype`; `recursion` asks a
/// resolver to find the answer (an authoritative server is asked without).
pub(crate) fn query(id: u16, name: &Name, rtype: RecordType, recursion: bool) -> Message {
    let mut message = Message::new(id, MessageType::Query, OpCode::Query);
    message.metadata.recursion_desired = recursion;
    message.add_query(Query::query(name.clone(), rtype));
    message
}

/// Why a server did not apply an update.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Refusal {
    /// The response code (`NOTAUTH`, `REFUSED`, `NOTZONE`, ...).
    pub(crate) rcode: ResponseCode,
    /// The TSIG error the server put in its signature, when it did
    /// (`BADSIG`, `BADKEY`, `BADTIME`).
    pub(crate) tsig: Option<TsigError>,
}

impl Refusal {
    /// The refusal in words: the codes, and what they usually mean.
    pub(crate) fn explain(&self) -> String {
        let tsig = self.tsig.map(|e| match e {
            TsigError::BadSig => "TSIG BADSIG: the secret does not match the server's key",
            TsigError::BadKey => "TSIG BADKEY: the server knows no key of this name and algorithm",
            TsigError::BadTime => {
                "TSIG BADTIME: this machine's clock and the server's differ by more than 300 s"
            }
            _ => "TSIG error",
        });
        let meaning = match self.rcode {
            ResponseCode::Refused => {
                "the server's update policy does not allow this key (or this address) to \
                 change this name"
            }
            ResponseCode::NotAuth => "the server does not accept this signature or zone",
            ResponseCode::NotZone => "the name is not in the zone the update named",
            ResponseCode::ServFail => "the server failed to apply it",
            _ => "",
        };
        let mut out = rcode_name(self.rcode);
        for part in [tsig.unwrap_or_default(), meaning] {
            if !part.is_empty() {
                out.push_str(" (");
                out.push_str(part);
                out.push(')');
            }
        }
        out
    }
}

/// The mnemonic of a response code, as `dig` prints it.
pub(crate) fn rcode_name(rcode: ResponseCode) -> String {
    let name = match rcode {
        ResponseCode::NoError => "NOERROR",
        ResponseCode::FormErr => "FORMERR",
        ResponseCode::ServFail => "SERVFAIL",
        ResponseCode::NXDomain => "NXDOMAIN",
        ResponseCode::NotImp => "NOTIMP",
        ResponseCode::Refused => "REFUSED",
        ResponseCode::YXDomain => "YXDOMAIN",
        ResponseCode::YXRRSet => "YXRRSET",
        ResponseCode::NXRRSet => "NXRRSET",
        ResponseCode::NotAuth => "NOTAUTH",
        ResponseCode::NotZone => "NOTZONE",
        other => return format!("RCODE {}", u16::from(other)),
    };
    name.to_owned()
}

/// What the answer to an update says: applied, or refused and why.
pub(crate) fn update_result(answer: &Message) -> Result<(), Refusal> {
    let rcode = answer.metadata.response_code;
    let tsig = tsig_of(answer).and_then(|t| t.error);
    if rcode == ResponseCode::NoError && tsig.is_none() {
        return Ok(());
    }
    Err(Refusal { rcode, tsig })
}

/// The TSIG record of a message, if it has one. (hickory-proto sets it
/// apart as the message's signature only with its DNSSEC features, which
/// this crate does without; it is then the last additional record.)
pub(crate) fn tsig_of(message: &Message) -> Option<&TSIG> {
    if let Some(sig) = message.signature() {
        return Some(&sig.data);
    }
    message
        .additionals
        .iter()
        .rev()
        .find_map(|r| match &r.data {
            RData::TSIG(t) => Some(t),
            _ => None,
        })
}

/// The zone an authoritative answer about `name` names: the owner of the
/// SOA record in its answer (`name` is the zone's apex) or authority
/// section (a name inside the zone). `None` without one.
pub(crate) fn soa_owner(answer: &Message) -> Option<Name> {
    answer
        .answers
        .iter()
        .chain(answer.authorities.iter())
        .find(|r| r.record_type() == RecordType::SOA)
        .map(|r| r.name.clone())
}

/// The target of the CNAME at `name` in `answer`, if there is one.
pub(crate) fn cname_target(answer: &Message, name: &Name) -> Option<Name> {
    answer.answers.iter().find_map(|r| match &r.data {
        RData::CNAME(target) if r.name == *name => Some(target.0.clone()),
        _ => None,
    })
}

/// The name servers an answer to an NS question names.
pub(crate) fn ns_names(answer: &Message) -> Vec<Name> {
    answer
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::NS(ns) => Some(ns.0.clone()),
            _ => None,
        })
        .collect()
}

/// The addresses of `name` among `answer`'s records (answer and
/// additional sections: glue).
pub(crate) fn addresses(answer: &Message, name: &Name) -> Vec<std::net::IpAddr> {
    answer
        .answers
        .iter()
        .chain(answer.additionals.iter())
        .filter(|r| r.name == *name)
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(std::net::IpAddr::V4(a.0)),
            RData::AAAA(a) => Some(std::net::IpAddr::V6(a.0)),
            _ => None,
        })
        .collect()
}

/// The TXT values at `name` in `answer` (each record's strings joined, as
/// the CA reads them).
pub(crate) fn txt_values(answer: &Message, name: &Name) -> Vec<String> {
    answer
        .answers
        .iter()
        .filter(|r| r.name == *name)
        .filter_map(|r| match &r.data {
            RData::TXT(txt) => Some(
                txt.txt_data
                    .iter()
                    .map(|part| String::from_utf8_lossy(part))
                    .collect::<String>(),
            ),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> Name {
        Name::from_ascii(s).unwrap()
    }

    #[test]
    fn an_update_adds_or_removes_one_value_in_its_zone() {
        let zone = name("example.test.");
        let fqdn = name("_acme-challenge.example.test.");
        let add = update(7, &zone, &fqdn, "v1", Change::Add).unwrap();
        assert_eq!(add.metadata.op_code, OpCode::Update);
        assert_eq!(add.metadata.id, 7);
        assert_eq!(add.queries[0].name(), &zone, "the zone section");
        let bytes = add.to_vec().unwrap();
        let back = Message::from_vec(&bytes).unwrap();
        assert_eq!(back.authorities.len(), 1, "one update record");
        assert_eq!(txt_values(&back, &fqdn).len(), 0, "updates are not answers");
        let remove = update(8, &zone, &fqdn, "v1", Change::Remove).unwrap();
        let rr = &remove.authorities[0];
        assert_eq!(rr.dns_class, hickory_proto::rr::DNSClass::NONE);
        assert_eq!(rr.ttl, 0);
        // A name outside the zone is never sent.
        assert!(update(9, &name("other.test."), &fqdn, "v", Change::Add).is_none());
    }

    #[test]
    fn a_signed_update_carries_its_tsig_last() {
        let zone = name("example.test.");
        let fqdn = name("_acme-challenge.example.test.");
        for algorithm in TsigAlgorithm::ALL {
            let key = TsigKey {
                name: name("sbmesh-acme."),
                algorithm,
                secret: b"0123456789abcdef".to_vec(),
            };
            let mut m = update(1, &zone, &fqdn, "v", Change::Add).unwrap();
            sign(&mut m, &key, 1_800_000_000).unwrap();
            let bytes = m.to_vec().unwrap();
            let back = Message::from_vec(&bytes).unwrap();
            let sig = tsig_of(&back).expect("a TSIG record");
            assert_eq!(sig.time, 1_800_000_000);
            assert_eq!(back.additionals.last().map(|r| &r.name), Some(&key.name));
            let len = match algorithm {
                TsigAlgorithm::HmacSha256 => 32,
                TsigAlgorithm::HmacSha512 => 64,
                TsigAlgorithm::HmacMd5 => 16,
            };
            assert_eq!(sig.mac.len(), len, "{algorithm:?}");
        }
    }

    #[test]
    fn a_refusal_names_its_codes_and_their_meaning() {
        let r = Refusal {
            rcode: ResponseCode::NotAuth,
            tsig: Some(TsigError::BadSig),
        };
        let text = r.explain();
        assert!(text.starts_with("NOTAUTH"), "{text}");
        assert!(text.contains("BADSIG"), "{text}");
        let r = Refusal {
            rcode: ResponseCode::Refused,
            tsig: None,
        };
        assert!(r.explain().contains("update policy"), "{}", r.explain());
    }
}
