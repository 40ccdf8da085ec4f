//! The step-log gateway's client: a [`StepStore`] that talks HTTP to the
//! controller's gateway (`src/controller/gateway.rs`) instead of to a
//! database. Step pods use it, so they hold no database credential, only a
//! bearer token bound to their one run (`AGENTRUN_STORE_TOKEN`).
//!
//! The wire format is JSON; errors come back as a [`WireError`] body that
//! maps one-to-one onto [`StoreError`], so the runner's handling of
//! conflicts, fencing and outages is the same as against a database.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::{Hash, Head, Lease, LeaseState, Record, StepStore, StoreError, StoredRecord};

/// Environment variable holding a step pod's gateway token.
pub const STORE_TOKEN_ENV: &str = "AGENTRUN_STORE_TOKEN";

/// The query of `GET /v1/runs/{run}/records` asking for the records as
/// stored ([`StoredRecord`]: their bodies byte for byte, which the reader
/// verifies), rather than decoded by the gateway (what runners of earlier
/// releases read).
pub const STORED_FORM: &str = "form=stored";

/// Body of `POST /v1/runs/{run}/lease`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AcquireBody {
    pub holder: String,
    pub ttl_millis: u64,
}

/// Body of `POST /v1/runs/{run}/lease/renew`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RenewBody {
    pub lease: Lease,
    pub ttl_millis: u64,
}

/// Body of `POST /v1/runs/{run}/records`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AppendBody {
    pub epoch: u64,
    pub record: Record,
}

/// An error as the gateway sends it: `code` is [`StoreError::metric_label`]
/// (or `unauthorized` / `forbidden`), the other fields those of the variant.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WireError {
    pub code: String,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub len: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current: Option<u64>,
    #[serde(default)]
    pub expired: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected: Option<Hash>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub got: Option<Hash>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recorded: Option<Box<Record>>,
}

impl WireError {
    /// A refusal by the gateway itself (`unauthorized`, `forbidden`).
    pub fn refusal(code: &str, message: String) -> WireError {
        WireError {
            code: code.into(),
            message,
            ..Default::default()
        }
    }

    /// The wire form of a store error (database URLs never leave the controller).
    pub fn from_store(e: &StoreError) -> WireError {
        let mut w = WireError {
            code: e.metric_label().into(),
            message: e.to_string(),
            ..Default::default()
        };
        match e {
            StoreError::Conflict { run, seq, recorded } => {
                (w.run, w.seq, w.recorded) = (Some(run.clone()), Some(*seq), Some(recorded.clone()))
            }
            StoreError::StaleEpoch {
                run,
                epoch,
                current,
                expired,
            } => {
                (w.run, w.epoch, w.current, w.expired) =
                    (Some(run.clone()), Some(*epoch), *current, *expired)
            }
            StoreError::LeaseHeld {
                run,
                holder,
                epoch,
                expires_at,
            } => {
                (w.run, w.holder, w.epoch, w.expires_at) = (
                    Some(run.clone()),
                    Some(holder.clone()),
                    Some(*epoch),
                    Some(*expires_at),
                )
            }
            StoreError::Gap { run, seq, len } => {
                (w.run, w.seq, w.len) = (Some(run.clone()), Some(*seq), Some(*len))
            }
            StoreError::PrevHashMismatch {
                run,
                seq,
                expected,
                got,
            } => {
                (w.run, w.seq, w.expected, w.got) =
                    (Some(run.clone()), Some(*seq), Some(*expected), Some(*got))
            }
            StoreError::ChainBroken { run, seq, .. } | StoreError::Corrupt { run, seq, .. } => {
                (w.run, w.seq) = (Some(run.clone()), Some(*seq))
            }
            // The backend's message names the database URL: say only what kind of failure.
            StoreError::Unavailable { .. } => w.message = "the step store is unavailable".into(),
            StoreError::PermissionDenied { .. }
            | StoreError::Schema { .. }
            | StoreError::Database { .. }
            | StoreError::InvalidUrl { .. } => {
                w.message = format!("the step store failed ({})", e.metric_label())
            }
            StoreError::InvalidRecord { .. } => {}
        }
        w
    }

    /// Back to the store error the caller would have had from a database.
    pub fn into_store(self, url: &str, run: &str) -> StoreError {
        let run_of = |r: Option<String>| r.unwrap_or_else(|| run.to_string());
        let url = url.to_string();
        match self.code.as_str() {
            "conflict" if self.recorded.is_some() => StoreError::Conflict {
                run: run_of(self.run),
                seq: self.seq.unwrap_or_default(),
                recorded: self.recorded.expect("checked"),
            },
            "stale_epoch" => StoreError::StaleEpoch {
                run: run_of(self.run),
                epoch: self.epoch.unwrap_or_default(),
                current: self.current,
                expired: self.expired,
            },
            "lease_held" => StoreError::LeaseHeld {
                run: run_of(self.run),
                holder: self.holder.unwrap_or_default(),
                epoch: self.epoch.unwrap_or_default(),
                expires_at: self.expires_at.unwrap_or_else(Utc::now),
            },
            "gap" => StoreError::Gap {
                run: run_of(self.run),
                seq: self.seq.unwrap_or_default(),
                len: self.len.unwrap_or_default(),
            },
            "prev_hash_mismatch" => StoreError::PrevHashMismatch {
                run: run_of(self.run),
                seq: self.seq.unwrap_or_default(),
                expected: self.expected.unwrap_or_default(),
                got: self.got.unwrap_or_default(),
            },
            "chain_broken" | "corrupt" => StoreError::ChainBroken {
                run: run_of(self.run),
                seq: self.seq.unwrap_or_default(),
                reason: self.message,
            },
            "invalid_record" => StoreError::InvalidRecord {
                reason: self.message,
            },
            "unavailable" => StoreError::Unavailable {
                url,
                reason: self.message,
            },
            "unauthorized" | "forbidden" | "run_finished" | "run_deleted" => {
                StoreError::PermissionDenied {
                    url,
                    reason: self.message,
                }
            }
            _ => StoreError::Database {
                url,
                reason: format!("{}: {}", self.code, self.message),
            },
        }
    }
}

/// The gateway client.
#[derive(Debug)]
pub struct RemoteStore {
    base: String,
    token: String,
    http: reqwest::Client,
}

impl RemoteStore {
    /// A client of the gateway at `url` (`http://host:port`), authenticating
    /// with `token`.
    pub fn new(url: &str, token: &str, timeout: Duration) -> Result<RemoteStore, StoreError> {
        let parsed = url::Url::parse(url).map_err(|e| StoreError::InvalidUrl {
            url: super::redact_url(url),
            reason: e.to_string(),
        })?;
        if parsed.password().is_some() || !parsed.username().is_empty() {
            return Err(StoreError::InvalidUrl {
                url: super::redact_url(url),
                reason: format!(
                    "a gateway URL carries no credentials; the token comes from {STORE_TOKEN_ENV}"
                ),
            });
        }
        // reqwest is built without a default TLS provider: the process uses ring.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(timeout)
            // The step token goes to the gateway only, never where a reply points.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| StoreError::InvalidUrl {
                url: url.to_string(),
                reason: format!("building the HTTP client: {e}"),
            })?;
        Ok(RemoteStore {
            base: url.trim_end_matches('/').to_string(),
            token: token.to_string(),
            http,
        })
    }

    /// Opened by [`super::open`]: the token comes from [`STORE_TOKEN_ENV`].
    pub fn from_env(url: &str, timeout: Duration) -> Result<RemoteStore, StoreError> {
        let token = std::env::var(STORE_TOKEN_ENV).map_err(|_| StoreError::InvalidUrl {
            url: super::redact_url(url),
            reason: format!("{STORE_TOKEN_ENV} is not set (the run's gateway token)"),
        })?;
        Self::new(url, &token, timeout)
    }

    fn path(&self, run: &str, rest: &str) -> String {
        format!("{}/v1/runs/{run}{rest}", self.base)
    }

    async fn call<T: serde::de::DeserializeOwned>(
        &self,
        run: &str,
        what: &str,
        req: reqwest::RequestBuilder,
    ) -> Result<T, StoreError> {
        let unavailable = |reason: String| StoreError::Unavailable {
            url: self.base.clone(),
            reason,
        };
        let resp = req
            .bearer_auth(&self.token)
            .send()
            .await
            .map_err(|e| unavailable(format!("{what}: {e}")))?;
        let status = resp.status();
        let body = resp
            .bytes()
            .await
            .map_err(|e| unavailable(format!("{what}: reading the reply: {e}")))?;
        if status.is_success() {
            return serde_json::from_slice(&body).map_err(|e| StoreError::Database {
                url: self.base.clone(),
                reason: format!("{what}: undecodable gateway reply: {e}"),
            });
        }
        match serde_json::from_slice::<WireError>(&body) {
            Ok(w) => Err(w.into_store(&self.base, run)),
            // A proxy or an overloaded gateway: treat 5xx as an outage.
            Err(_) if status.is_server_error() => Err(unavailable(format!(
                "{what}: HTTP {status}: {}",
                String::from_utf8_lossy(&body)
            ))),
            Err(_) => Err(StoreError::PermissionDenied {
                url: self.base.clone(),
                reason: format!("{what}: HTTP {status}: {}", String::from_utf8_lossy(&body)),
            }),
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[async_trait]
impl StepStore for RemoteStore {
    fn backend(&self) -> &'static str {
        "gateway"
    }

    fn url(&self) -> &str {
        &self.base
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        Err(StoreError::PermissionDenied {
            url: self.base.clone(),
            reason: "the step-log gateway does not migrate schemas".into(),
        })
    }

    async fn append(&self, run: &str, epoch: u64, record: &Record) -> Result<Record, StoreError> {
        let body = AppendBody {
            epoch,
            record: record.clone(),
        };
        let req = self.http.post(self.path(run, "/records")).json(&body);
        self.call(run, "append", req).await
    }

    /// Page by page ([`super::PAGE_BYTES`] each): neither the gateway nor
    /// this reader holds a response of the whole log at once.
    async fn read_stored(
        &self,
        run: &str,
        from: u64,
        to: Option<u64>,
    ) -> Result<Vec<StoredRecord>, StoreError> {
        let mut out = Vec::new();
        let mut next = from;
        loop {
            let page = self
                .read_stored_page(run, next, to, super::PAGE_BYTES)
                .await?;
            let Some(last) = page.last() else {
                return Ok(out);
            };
            next = last.seq + 1;
            out.extend(page);
        }
    }

    async fn read_stored_page(
        &self,
        run: &str,
        from: u64,
        to: Option<u64>,
        max_bytes: usize,
    ) -> Result<Vec<StoredRecord>, StoreError> {
        let mut url = format!(
            "{}?from={from}&{STORED_FORM}&maxBytes={max_bytes}",
            self.path(run, "/records")
        );
        if let Some(to) = to {
            url.push_str(&format!("&to={to}"));
        }
        let req = self.http.get(url);
        self.call(run, "read records", req).await
    }

    async fn head(&self, run: &str) -> Result<Head, StoreError> {
        let req = self.http.get(self.path(run, "/head"));
        self.call(run, "read head", req).await
    }

    async fn acquire(&self, run: &str, holder: &str, ttl: Duration) -> Result<Lease, StoreError> {
        let body = AcquireBody {
            holder: holder.to_string(),
            ttl_millis: millis(ttl),
        };
        let req = self.http.post(self.path(run, "/lease")).json(&body);
        self.call(run, "acquire lease", req).await
    }

    async fn renew(&self, lease: &Lease, ttl: Duration) -> Result<Lease, StoreError> {
        let body = RenewBody {
            lease: lease.clone(),
            ttl_millis: millis(ttl),
        };
        let req = self
            .http
            .post(self.path(&lease.run, "/lease/renew"))
            .json(&body);
        self.call(&lease.run, "renew lease", req).await
    }

    async fn lease(&self, run: &str) -> Result<Option<LeaseState>, StoreError> {
        Err(StoreError::PermissionDenied {
            url: self.base.clone(),
            reason: format!(
                "the step-log gateway does not show run {run}'s lease: the controller reads it from the store"
            ),
        })
    }

    async fn request_yield(&self, run: &str) -> Result<(), StoreError> {
        Err(StoreError::PermissionDenied {
            url: self.base.clone(),
            reason: format!(
                "the step-log gateway does not take yield requests for run {run}: only the controller asks"
            ),
        })
    }

    async fn lapsed_leases(
        &self,
        _since: DateTime<Utc>,
    ) -> Result<(Vec<String>, DateTime<Utc>), StoreError> {
        Err(StoreError::PermissionDenied {
            url: self.base.clone(),
            reason: "the step-log gateway does not list leases: the controller reads them from the store".into(),
        })
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        let req = self
            .http
            .post(self.path(&lease.run, "/lease/release"))
            .json(lease);
        self.call::<serde_json::Value>(&lease.run, "release lease", req)
            .await
            .map(|_| ())
    }

    async fn close(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_wire_errors_round_trip() {
        let e = StoreError::StaleEpoch {
            run: "r".into(),
            epoch: 3,
            current: Some(4),
            expired: false,
        };
        let back = WireError::from_store(&e).into_store("http://gw", "r");
        assert_eq!(back.to_string(), e.to_string());
        let e = StoreError::Unavailable {
            url: "postgres://u:pw@db/x".into(),
            reason: "password authentication failed for pw".into(),
        };
        let w = WireError::from_store(&e);
        assert!(!w.message.contains("pw"), "{w:?}");
        assert!(w.into_store("http://gw", "r").is_retryable());
        let refused = WireError::refusal("forbidden", "another run".into());
        assert_eq!(
            refused.into_store("http://gw", "r").metric_label(),
            "permission_denied"
        );
    }

    #[test]
    fn store_gateway_urls_carry_no_credentials() {
        let e = RemoteStore::new("http://u:pw@gw:8081", "t", Duration::from_secs(1)).unwrap_err();
        assert_eq!(e.metric_label(), "invalid_url");
        assert!(!e.to_string().contains("pw@"), "{e}");
    }
}
