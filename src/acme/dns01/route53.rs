//! The `route53` provider: the AWS Route 53 API, signed with SigV4.
//!
//! Credentials are the AWS default chain as the S3 store reads it
//! (object_store's: `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, a web
//! identity token for IRSA, the container or instance role), and so is
//! the signer. The hosted zone is `hosted_zone_id`, else the one whose
//! name is the longest suffix of the record's. Route 53 keeps one RRset
//! per name: a value is added by an UPSERT of the set with it, removed by
//! an UPSERT without it (a DELETE of the last one), and the change is
//! waited for until Route 53 says it is `INSYNC` on all its servers (its
//! own propagation statement; the zone's servers are Route 53's).
//! Endpoint: `AWS_ENDPOINT_URL_ROUTE_53`, else `AWS_ENDPOINT_URL`, else
//! `https://route53.amazonaws.com`.

use std::time::Duration;

use bytes::Bytes;
use hickory_proto::rr::Name;
use hyper::Method;
use instant_acme::BodyWrapper;
use object_store::aws::{AmazonS3Builder, AwsAuthorizer};
use object_store::client::{HttpRequest, HttpRequestBody};
use serde::Deserialize;
use tokio::time::Instant;

use super::DnsError;
use crate::acme::http_client::AcmeHttpClient;
use crate::config::Dns01Section;

/// The region Route 53 signs in, whatever `region` says (a global service).
const SIGNING_REGION: &str = "us-east-1";
/// The API's path prefix.
const API: &str = "/2013-04-01";
/// The default `region`.
const DEFAULT_REGION: &str = "us-east-1";
/// The first pause between two questions about a change; doubled up to 5 s.
const FIRST_POLL: Duration = Duration::from_millis(500);
const MAX_POLL: Duration = Duration::from_secs(5);

pub(super) struct Route53 {
    endpoint: String,
    zone_id: Option<String>,
    credentials: object_store::aws::AwsCredentialProvider,
    http: AcmeHttpClient,
    insync_timeout: Duration,
}

impl Route53 {
    pub(super) fn new(section: &Dns01Section) -> Result<Self, DnsError> {
        let region = section.region.as_deref().unwrap_or(DEFAULT_REGION);
        // The S3 builder's credential chain; the bucket is never used.
        let s3 = AmazonS3Builder::from_env()
            .with_region(region)
            .with_bucket_name("sbmesh-route53")
            .build()
            .map_err(|e| DnsError::Config(format!("AWS credentials for route53: {e}")))?;
        let endpoint = ["AWS_ENDPOINT_URL_ROUTE_53", "AWS_ENDPOINT_URL"]
            .iter()
            .find_map(|v| std::env::var(v).ok().filter(|s| !s.trim().is_empty()))
            .unwrap_or_else(|| "https://route53.amazonaws.com".to_owned());
        Ok(Self {
            endpoint: endpoint.trim_end_matches('/').to_owned(),
            zone_id: section.hosted_zone_id.clone(),
            credentials: s3.credentials().clone(),
            http: AcmeHttpClient::new(None)
                .map_err(|e| DnsError::Config(format!("route53 HTTP client: {e}")))?,
            insync_timeout: section.propagation_timeout,
        })
    }

    fn failed(&self, op: &'static str, detail: String) -> DnsError {
        DnsError::Unreachable {
            server: self.endpoint.clone(),
            op,
            detail,
        }
    }

    /// One signed API call; the body of a 2xx answer.
    pub(super) async fn call(
        &self,
        op: &'static str,
        method: Method,
        path: &str,
        body: Option<String>,
    ) -> Result<Bytes, DnsError> {
        let credential = self
            .credentials
            .get_credential()
            .await
            .map_err(|e| DnsError::Config(format!("AWS credentials for route53: {e}")))?;
        let body = Bytes::from(body.unwrap_or_default());
        let mut request: HttpRequest = hyper::Request::builder()
            .method(method)
            .uri(format!("{}{API}{path}", self.endpoint))
            .header("content-type", "application/xml")
            .body(HttpRequestBody::from(body.clone()))
            .map_err(|e| self.failed(op, e.to_string()))?;
        AwsAuthorizer::new(&credential, "route53", SIGNING_REGION)
            .try_authorize(&mut request, None)
            .map_err(|e| self.failed(op, format!("cannot sign: {e}")))?;
        let (parts, _) = request.into_parts();
        let request = hyper::Request::from_parts(parts, BodyWrapper::from(body.to_vec()));
        let (parts, bytes) = self
            .http
            .send(request)
            .await
            .map_err(|e| self.failed(op, e.to_string()))?;
        if parts.status.is_success() {
            return Ok(bytes);
        }
        let error: Option<ErrorResponse> = quick_xml::de::from_reader(bytes.as_ref()).ok();
        let detail = match error {
            Some(e) => format!("{}: {}", e.error.code, e.error.message),
            None => String::from_utf8_lossy(&bytes).chars().take(300).collect(),
        };
        Err(DnsError::Provider {
            provider: "route53",
            op,
            detail: format!("HTTP {}: {detail}", parts.status.as_u16()),
        })
    }

    /// The hosted zone holding `fqdn`: `hosted_zone_id`, else the zone
    /// whose name is the longest suffix of it.
    async fn zone_for(&self, fqdn: &Name) -> Result<String, DnsError> {
        if let Some(id) = &self.zone_id {
            return Ok(id.clone());
        }
        let mut candidate = fqdn.clone();
        while candidate.num_labels() > 0 {
            let name = candidate.to_ascii();
            let path = format!("/hostedzonesbyname?dnsname={name}&maxitems=1");
            let bytes = self
                .call("find the hosted zone", Method::GET, &path, None)
                .await?;
            let list: ZonesByName = parse(&bytes, "find the hosted zone")?;
            if let Some(zone) = list
                .zones
                .zones
                .first()
                .filter(|z| same_name(&z.name, &name))
            {
                return Ok(zone.id.trim_start_matches("/hostedzone/").to_owned());
            }
            candidate = candidate.base_name();
        }
        Err(DnsError::Provider {
            provider: "route53",
            op: "find the hosted zone",
            detail: format!(
                "no hosted zone of this account holds {fqdn}; create one, or give dns01.hosted_zone_id"
            ),
        })
    }

    /// The TXT values at `fqdn` in `zone`, unquoted.
    pub(super) async fn values(&self, zone: &str, fqdn: &str) -> Result<Vec<String>, DnsError> {
        let path = format!("/hostedzone/{zone}/rrset?name={fqdn}&type=TXT&maxitems=1");
        let bytes = self
            .call("read the TXT record", Method::GET, &path, None)
            .await?;
        let list: RecordSets = parse(&bytes, "read the TXT record")?;
        Ok(list
            .sets
            .sets
            .into_iter()
            .filter(|s| s.kind == "TXT" && same_name(&s.name, fqdn))
            .flat_map(|s| s.records.records)
            .map(|r| r.value.trim_matches('"').to_owned())
            .collect())
    }

    /// Adds (`add`) or removes the TXT `value` at `fqdn`, and waits until
    /// Route 53 says the change is on all its servers.
    pub(super) async fn change(&self, fqdn: &Name, value: &str, add: bool) -> Result<(), DnsError> {
        let zone = self.zone_for(fqdn).await?;
        let name = fqdn.to_ascii();
        let before = self.values(&zone, &name).await?;
        let mut after: Vec<String> = before.iter().filter(|v| *v != value).cloned().collect();
        if add {
            after.push(value.to_owned());
        }
        if after == before {
            return Ok(());
        }
        let (action, values) = if after.is_empty() {
            ("DELETE", &before)
        } else {
            ("UPSERT", &after)
        };
        let records: String = values
            .iter()
            .map(|v| format!("<ResourceRecord><Value>\"{v}\"</Value></ResourceRecord>"))
            .collect();
        let body = format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\
             <ChangeResourceRecordSetsRequest xmlns=\"https://route53.amazonaws.com/doc/2013-04-01/\">\
             <ChangeBatch><Comment>sbmesh DNS-01</Comment><Changes><Change><Action>{action}</Action>\
             <ResourceRecordSet><Name>{name}</Name><Type>TXT</Type><TTL>{}</TTL>\
             <ResourceRecords>{records}</ResourceRecords></ResourceRecordSet></Change></Changes>\
             </ChangeBatch></ChangeResourceRecordSetsRequest>",
            super::wire::CHALLENGE_TTL
        );
        let op = if add {
            "add the TXT value"
        } else {
            "remove the TXT value"
        };
        let path = format!("/hostedzone/{zone}/rrset");
        let bytes = self.call(op, Method::POST, &path, Some(body)).await?;
        let info: ChangeResponse = parse(&bytes, op)?;
        self.wait_insync(&info.info).await
    }

    /// Asks about `change` until it is `INSYNC`, within the propagation
    /// time-out.
    async fn wait_insync(&self, change: &ChangeInfo) -> Result<(), DnsError> {
        let deadline = Instant::now() + self.insync_timeout;
        let id = change.id.trim_start_matches("/change/");
        let mut status = change.status.clone();
        let mut pause = FIRST_POLL;
        while status != "INSYNC" {
            if Instant::now() + pause > deadline {
                return Err(DnsError::NotPropagated {
                    fqdn: format!("route53 change {id}"),
                    timeout: self.insync_timeout,
                    pending: format!("still {status}"),
                });
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_POLL);
            let bytes = self
                .call(
                    "wait for the change",
                    Method::GET,
                    &format!("/change/{id}"),
                    None,
                )
                .await?;
            status = parse::<ChangeResponse>(&bytes, "wait for the change")?
                .info
                .status;
        }
        Ok(())
    }
}

/// Two DNS names written alike but for case and the trailing dot.
fn same_name(a: &str, b: &str) -> bool {
    a.trim_end_matches('.')
        .eq_ignore_ascii_case(b.trim_end_matches('.'))
}

fn parse<T: serde::de::DeserializeOwned>(bytes: &[u8], op: &'static str) -> Result<T, DnsError> {
    quick_xml::de::from_reader(bytes).map_err(|e| DnsError::Provider {
        provider: "route53",
        op,
        detail: format!("an answer this client cannot read: {e}"),
    })
}

#[derive(Deserialize)]
struct ErrorResponse {
    #[serde(rename = "Error")]
    error: ErrorBody,
}

#[derive(Deserialize)]
struct ErrorBody {
    #[serde(rename = "Code", default)]
    code: String,
    #[serde(rename = "Message", default)]
    message: String,
}

#[derive(Deserialize)]
struct ZonesByName {
    #[serde(rename = "HostedZones", default)]
    zones: HostedZones,
}

#[derive(Deserialize, Default)]
struct HostedZones {
    #[serde(rename = "HostedZone", default)]
    zones: Vec<HostedZone>,
}

#[derive(Deserialize)]
struct HostedZone {
    #[serde(rename = "Id")]
    id: String,
    #[serde(rename = "Name")]
    name: String,
}

#[derive(Deserialize)]
struct RecordSets {
    #[serde(rename = "ResourceRecordSets", default)]
    sets: ResourceRecordSets,
}

#[derive(Deserialize, Default)]
struct ResourceRecordSets {
    #[serde(rename = "ResourceRecordSet", default)]
    sets: Vec<ResourceRecordSet>,
}

#[derive(Deserialize)]
struct ResourceRecordSet {
    #[serde(rename = "Name")]
    name: String,
    #[serde(rename = "Type")]
    kind: String,
    #[serde(rename = "ResourceRecords", default)]
    records: ResourceRecords,
}

#[derive(Deserialize, Default)]
struct ResourceRecords {
    #[serde(rename = "ResourceRecord", default)]
    records: Vec<ResourceRecord>,
}

#[derive(Deserialize)]
struct ResourceRecord {
    #[serde(rename = "Value")]
    value: String,
}

#[derive(Deserialize)]
struct ChangeResponse {
    #[serde(rename = "ChangeInfo")]
    info: ChangeInfo,
}

#[derive(Deserialize)]
struct ChangeInfo {
    #[serde(rename = "Id")]
    id: String,
    #[serde(rename = "Status")]
    status: String,
}
