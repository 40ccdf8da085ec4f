//! Per-run credentials of step pods: `token = HMAC-SHA256(key, run uid)`,
//! hex. The key is shared by every controller replica (`--step-token-key`
//! or `--step-token-key-file`, from a Secret in the controller's own
//! namespace), so any replica's gateway accepts a token another minted. A
//! token names one run: it opens that run's log and nothing else.
//!
//! Rotation (`kubectl agentrun rotate-key`): a new key becomes current and
//! the earlier ones are listed as retired (`--step-token-retired-keys`, the
//! Secret's `retired`), each with the time it was retired. Tokens are
//! minted with the current key only. Every key has a validity window:
//!
//! - a retired key's token opens only runs the API server created at or
//!   before its retirement (`metadata.creationTimestamp`, which neither a
//!   run creator nor a database writer can move; the retirement time is in
//!   the Secret only the controller's administrators write). A run created
//!   after it, even one whose credential the controller minted with the old
//!   key before it restarted, gets a new credential from the new key (a
//!   credential Secret is per key);
//! - a retired key's signing key verifies a run's controller records only
//!   before the seq where the run's status records that the next key took
//!   over ([`crate::store::KeyWindows`]);
//! - `rotate-key --prune` replaces a retired key no step Job holds a token
//!   of by its public signing key alone (`ed25519:<hex>`): its tokens open
//!   nothing, what it signed still verifies.

use jiff::Timestamp;
use ring::hmac;

/// Domain separation: these tags authenticate step pods, nothing else.
const CONTEXT: &[u8] = b"agentrun.dev/step-token/v1\0";
/// Shortest key accepted (bytes).
pub const MIN_KEY_LEN: usize = 32;
/// Prefix of a pruned retired key's line: its public signing key (hex).
pub const PRUNED_PREFIX: &str = "ed25519:";

/// The HMAC keys step tokens are minted (current) and checked (current and
/// retired) with.
#[derive(Clone)]
pub struct TokenKey {
    current: hmac::Key,
    retired: Vec<RetiredKey>,
}

impl std::fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenKey(***)")
    }
}

/// A key a rotation retired: one line of the Secret's `retired`,
/// `<key> <RFC 3339 time it was retired>`, or once pruned
/// `ed25519:<public signing key, hex> <time>`.
#[derive(Clone)]
pub struct RetiredKey {
    /// The key's secret bytes; `None` once pruned.
    secret: Option<Vec<u8>>,
    /// Its signing key's public half (what verifies the records it signed).
    public: crate::store::PublicKey,
    /// When it was retired: its tokens open only runs created by then.
    pub retired_at: Timestamp,
}

impl std::fmt::Debug for RetiredKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RetiredKey({} at {}{})",
            self.public.id,
            self.retired_at,
            if self.secret.is_some() {
                ""
            } else {
                ", pruned"
            }
        )
    }
}

/// Why a step token key, a retired key or their flags do not make a key.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("the step token key has {0} bytes; at least {MIN_KEY_LEN} are required")]
    TooShort(usize),
    #[error(
        "no retirement time: a retired key is `<key> <RFC 3339 time it was retired>` \
         (as kubectl agentrun rotate-key writes it), so its tokens open only runs \
         created by then"
    )]
    NoRetirementTime,
    #[error("the retirement time {0:?} is not an RFC 3339 time (e.g. 2026-12-05T10:00:00Z)")]
    RetirementTime(String),
    #[error("the pruned key's public key is not hex")]
    PrunedNotHex,
    #[error("the pruned key's public key ({PRUNED_PREFIX}<hex>): {0}")]
    PrunedKey(crate::store::KeyError),
    #[error("retired key (line {line}): {error}")]
    RetiredLine { line: usize, error: Box<KeyError> },
    #[error(
        "no step token key: set --step-token-key-file or AGENTRUN_STEP_TOKEN_KEY \
         (the chart shares one from a Secret in the controller's namespace)"
    )]
    NoKey,
    #[error("reading {flag} {}: {error}", path.display())]
    ReadFile {
        flag: &'static str,
        path: std::path::PathBuf,
        error: std::io::Error,
    },
    #[error("{flag}: {error}")]
    Flag {
        flag: &'static str,
        error: Box<KeyError>,
    },
}

impl RetiredKey {
    /// `secret`, retired at `at`.
    pub fn new(secret: &[u8], at: Timestamp) -> Result<RetiredKey, KeyError> {
        let key = TokenKey::new(secret)?;
        Ok(RetiredKey {
            secret: Some(secret.trim_ascii().to_vec()),
            public: key.record_signer().public_key(true),
            retired_at: at,
        })
    }

    /// One line of `retired` (surrounding whitespace ignored).
    pub fn parse(line: &[u8]) -> Result<RetiredKey, KeyError> {
        let line = line.trim_ascii();
        let Some(split) = line.iter().rposition(u8::is_ascii_whitespace) else {
            return Err(KeyError::NoRetirementTime);
        };
        let (key, at) = (line[..split].trim_ascii(), &line[split + 1..]);
        let at = std::str::from_utf8(at)
            .ok()
            .and_then(|t| t.parse::<Timestamp>().ok())
            .ok_or_else(|| KeyError::RetirementTime(String::from_utf8_lossy(at).into_owned()))?;
        match key.strip_prefix(PRUNED_PREFIX.as_bytes()) {
            Some(public) => {
                let public = std::str::from_utf8(public)
                    .map_err(|_| KeyError::PrunedNotHex)
                    .and_then(|hex| {
                        crate::store::PublicKey::from_hex(hex, true).map_err(KeyError::PrunedKey)
                    })?;
                Ok(RetiredKey {
                    secret: None,
                    public,
                    retired_at: at,
                })
            }
            None => RetiredKey::new(key, at),
        }
    }

    /// Its line in `retired`.
    pub fn line(&self) -> Vec<u8> {
        let mut line = match &self.secret {
            Some(secret) => secret.clone(),
            None => format!("{PRUNED_PREFIX}{}", self.public.to_hex()).into_bytes(),
        };
        line.push(b' ');
        line.extend_from_slice(self.retired_at.to_string().as_bytes());
        line
    }

    /// The key's id (its signing key's, as published).
    pub fn id(&self) -> &str {
        &self.public.id
    }

    /// Whether its tokens still open runs (not pruned).
    pub fn opens(&self) -> bool {
        self.secret.is_some()
    }

    /// The same key with only its public signing key kept.
    pub fn pruned(&self) -> RetiredKey {
        RetiredKey {
            secret: None,
            ..self.clone()
        }
    }

    fn token_key(&self) -> Option<hmac::Key> {
        self.secret
            .as_ref()
            .map(|s| hmac::Key::new(hmac::HMAC_SHA256, s))
    }
}

/// The lines of `retired` (blank lines ignored); an error names the line.
pub fn parse_retired(retired: &[u8]) -> Result<Vec<RetiredKey>, KeyError> {
    let mut keys = Vec::new();
    for (i, line) in retired.split(|b| *b == b'\n').enumerate() {
        if line.trim_ascii().is_empty() {
            continue;
        }
        keys.push(RetiredKey::parse(line).map_err(|e| KeyError::RetiredLine {
            line: i + 1,
            error: Box::new(e),
        })?);
    }
    Ok(keys)
}

/// `retired` holding `keys`, one per line.
pub fn retired_text(keys: &[RetiredKey]) -> Vec<u8> {
    let mut text = Vec::new();
    for k in keys {
        text.extend_from_slice(&k.line());
        text.push(b'\n');
    }
    text
}

/// Which key a token is of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenCheck {
    /// The current key's: it opens its run.
    Current,
    /// A retired key's: it opens its run only if the run was created at or
    /// before `retired_at`.
    Retired { key: String, retired_at: Timestamp },
    /// No key's token for this run.
    Invalid,
}

impl TokenCheck {
    /// Whether the token opens a run the API server created at `created`
    /// (`None`: not known, so no retired key's token opens it).
    pub fn opens(&self, created: Option<Timestamp>) -> bool {
        match self {
            TokenCheck::Current => true,
            TokenCheck::Retired { retired_at, .. } => created.is_some_and(|c| c <= *retired_at),
            TokenCheck::Invalid => false,
        }
    }
}

impl TokenKey {
    /// A key from its secret bytes (at least [`MIN_KEY_LEN`]; surrounding
    /// whitespace, as a file or Secret often has, is ignored).
    pub fn new(secret: &[u8]) -> Result<TokenKey, KeyError> {
        let secret = secret.trim_ascii();
        if secret.len() < MIN_KEY_LEN {
            return Err(KeyError::TooShort(secret.len()));
        }
        Ok(TokenKey {
            current: hmac::Key::new(hmac::HMAC_SHA256, secret),
            retired: Vec::new(),
        })
    }

    /// This key with `retired` (keys a rotation replaced, one per line with
    /// the time each was retired; blank lines ignored).
    pub fn with_retired(mut self, retired: &[u8]) -> Result<TokenKey, KeyError> {
        self.retired = parse_retired(retired)?;
        Ok(self)
    }

    /// Reads the key from `--step-token-key-file` or `--step-token-key`,
    /// and the retired ones from `--step-token-retired-keys-file` or
    /// `--step-token-retired-keys` (optional).
    pub fn load(
        file: Option<&std::path::Path>,
        inline: Option<&str>,
        retired_file: Option<&std::path::Path>,
        retired_inline: Option<&str>,
    ) -> Result<TokenKey, KeyError> {
        let secret = match (file, inline) {
            (Some(path), _) => read(path, "--step-token-key-file")?,
            (None, Some(key)) => key.as_bytes().to_vec(),
            (None, None) => return Err(KeyError::NoKey),
        };
        let retired = match (retired_file, retired_inline) {
            (Some(path), _) => read(path, "--step-token-retired-keys-file")?,
            (None, Some(keys)) => keys.as_bytes().to_vec(),
            (None, None) => Vec::new(),
        };
        let flag = |flag| {
            move |e| KeyError::Flag {
                flag,
                error: Box::new(e),
            }
        };
        TokenKey::new(&secret)
            .map_err(flag("--step-token-key"))?
            .with_retired(&retired)
            .map_err(flag("--step-token-retired-keys"))
    }

    /// The controller's record-signing key, derived from the current key (so
    /// the replicas share it without another Secret).
    pub fn record_signer(&self) -> crate::store::RecordSigner {
        signer_of(&self.current)
    }

    /// The keys a rotation retired, newest first.
    pub fn retired(&self) -> &[RetiredKey] {
        &self.retired
    }

    /// The public keys controller signatures are checked with: the current
    /// signing key's, then the retired keys' (marked retired).
    pub fn record_verifier(&self) -> crate::store::RecordVerifier {
        let mut keys = vec![self.record_signer().public_key(false)];
        for key in &self.retired {
            if !keys.iter().any(|k| k.id == key.public.id) {
                keys.push(key.public.clone());
            }
        }
        crate::store::RecordVerifier::new(keys).expect("the current key is always there")
    }

    /// The token of run `uid` (by the current key).
    pub fn mint(&self, uid: &str) -> String {
        hex::encode(hmac::sign(&self.current, &message(uid)).as_ref())
    }

    /// Which key `token` is run `uid`'s token of, compared in constant time.
    /// A retired key's token opens the run only if the run was created by
    /// its retirement ([`TokenCheck::opens`]).
    pub fn check(&self, uid: &str, token: &str) -> TokenCheck {
        let Ok(tag) = hex::decode(token.trim()) else {
            return TokenCheck::Invalid;
        };
        let m = message(uid);
        if hmac::verify(&self.current, &m, &tag).is_ok() {
            return TokenCheck::Current;
        }
        self.retired
            .iter()
            .find(|r| {
                r.token_key()
                    .is_some_and(|k| hmac::verify(&k, &m, &tag).is_ok())
            })
            .map_or(TokenCheck::Invalid, |r| TokenCheck::Retired {
                key: r.public.id.clone(),
                retired_at: r.retired_at,
            })
    }
}

fn read(path: &std::path::Path, flag: &'static str) -> Result<Vec<u8>, KeyError> {
    std::fs::read(path).map_err(|error| KeyError::ReadFile {
        flag,
        path: path.to_path_buf(),
        error,
    })
}

fn signer_of(key: &hmac::Key) -> crate::store::RecordSigner {
    let tag = hmac::sign(key, b"agentrun.dev/record-signing-seed/v1");
    let seed: [u8; 32] = tag.as_ref()[..32]
        .try_into()
        .expect("HMAC-SHA256 gives 32 bytes");
    crate::store::RecordSigner::from_seed(&seed)
}

fn message(uid: &str) -> Vec<u8> {
    let mut m = Vec::with_capacity(CONTEXT.len() + uid.len());
    m.extend_from_slice(CONTEXT);
    m.extend_from_slice(uid.as_bytes());
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> TokenKey {
        TokenKey::new(&[b; 32]).unwrap()
    }

    fn t(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    /// Key 8, with key 7 retired at `at`.
    fn rotated(at: &str) -> TokenKey {
        key(8)
            .with_retired(&[b"\n".as_slice(), &[7; 32], b" ", at.as_bytes(), b"\n"].concat())
            .unwrap()
    }

    #[test]
    fn a_token_opens_its_own_run_only() {
        let k = key(7);
        let tok = k.mint("run-a");
        assert_eq!(k.check("run-a", &tok), TokenCheck::Current);
        assert_eq!(
            k.check("run-b", &tok),
            TokenCheck::Invalid,
            "another run's uid"
        );
        assert_eq!(k.check("run-a", ""), TokenCheck::Invalid, "missing");
        assert_eq!(k.check("run-a", "not hex"), TokenCheck::Invalid);
        assert_eq!(k.check("run-a", &tok[..32]), TokenCheck::Invalid);
        let mut flipped = tok.clone().into_bytes();
        flipped[0] = if flipped[0] == b'0' { b'1' } else { b'0' };
        let flipped = std::str::from_utf8(&flipped).unwrap();
        assert_eq!(k.check("run-a", flipped), TokenCheck::Invalid);
        assert!(!TokenCheck::Invalid.opens(Some(t("2026-01-01T00:00:00Z"))));
    }

    #[test]
    fn tokens_depend_on_the_key_and_are_stable_across_replicas() {
        assert_eq!(key(7).mint("r"), key(7).mint("r"), "replicas share the key");
        assert_eq!(key(8).check("r", &key(7).mint("r")), TokenCheck::Invalid);
        // A uid that is a prefix of another gives an unrelated token.
        assert_ne!(key(7).mint("ab"), key(7).mint("abc"));
    }

    #[test]
    fn replicas_derive_one_signing_key() {
        assert_eq!(
            key(7).record_signer().public_key_hex(),
            key(7).record_signer().public_key_hex()
        );
        assert_ne!(
            key(7).record_signer().public_key_hex(),
            key(8).record_signer().public_key_hex()
        );
    }

    #[test]
    fn a_rotation_mints_with_the_new_key_and_publishes_both() {
        let new = rotated("2026-12-05T10:00:00Z");
        assert_eq!(new.mint("r"), key(8).mint("r"), "minted with the new key");
        let ids: Vec<(String, bool)> = new
            .record_verifier()
            .keys()
            .iter()
            .map(|k| (k.id.clone(), k.retired))
            .collect();
        assert_eq!(
            ids,
            vec![
                (new.record_signer().key_id().to_string(), false),
                (key(7).record_signer().key_id().to_string(), true)
            ]
        );
    }

    /// Mallory holds the retired key (leaked) and mints a token for a run
    /// created after the rotation: it opens nothing; the runs that were
    /// there before keep working on their old tokens.
    #[test]
    fn a_retired_keys_token_opens_only_runs_created_before_its_retirement() {
        let new = rotated("2026-12-05T10:00:00Z");
        let mallory = key(7).mint("after");
        let check = new.check("after", &mallory);
        assert_eq!(
            check,
            TokenCheck::Retired {
                key: key(7).record_signer().key_id().into(),
                retired_at: t("2026-12-05T10:00:00Z")
            }
        );
        assert!(
            !check.opens(Some(t("2026-12-05T10:00:01Z"))),
            "created after"
        );
        assert!(!check.opens(None), "creation not known");
        let before = new.check("before", &key(7).mint("before"));
        assert!(
            before.opens(Some(t("2026-12-05T09:59:59Z"))),
            "created before"
        );
        assert!(
            before.opens(Some(t("2026-12-05T10:00:00Z"))),
            "the same second"
        );
        // The current key's tokens open any run.
        assert!(new.check("after", &new.mint("after")).opens(None));
    }

    #[test]
    fn retired_lines_carry_their_time_round_trip_and_prune_to_the_public_key() {
        let new = rotated("2026-12-05T10:00:00Z");
        let old = &new.retired()[0];
        assert!(old.opens());
        let text = retired_text(new.retired());
        assert_eq!(
            parse_retired(&text).unwrap()[0].line(),
            old.line(),
            "round trip"
        );
        // Pruned: the token opens nothing, the signing key still verifies.
        let pruned = retired_text(&[old.pruned()]);
        assert!(pruned.starts_with(PRUNED_PREFIX.as_bytes()));
        let after = key(8).with_retired(&pruned).unwrap();
        assert_eq!(
            after.check("before", &key(7).mint("before")),
            TokenCheck::Invalid
        );
        assert_eq!(after.record_verifier().keys(), new.record_verifier().keys());
        assert_eq!(
            parse_retired(&pruned).unwrap()[0].line(),
            pruned[..pruned.len() - 1]
        );
        // Bad lines are named, with the reason.
        let e = key(8).with_retired(&[7; 32]).unwrap_err().to_string();
        assert!(
            e.contains("line 1") && e.contains("no retirement time"),
            "{e}"
        );
        let e = key(8)
            .with_retired(b"\nshort 2026-12-05T10:00:00Z")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2") && e.contains("at least 32"), "{e}");
        let e = key(8)
            .with_retired(&[[7; 32].as_slice(), b" yesterday"].concat())
            .unwrap_err()
            .to_string();
        assert!(e.contains("not an RFC 3339 time"), "{e}");
        let e = key(8)
            .with_retired(b"ed25519:abcd 2026-12-05T10:00:00Z")
            .unwrap_err()
            .to_string();
        assert!(e.contains("pruned key's public key"), "{e}");
    }

    #[test]
    fn short_keys_are_refused() {
        assert!(
            TokenKey::new(b"short")
                .unwrap_err()
                .to_string()
                .contains("at least 32")
        );
        assert!(TokenKey::new(format!("{}\n", "k".repeat(32)).as_bytes()).is_ok());
        let e = TokenKey::load(None, None, None, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--step-token-key-file"), "{e}");
    }
}
