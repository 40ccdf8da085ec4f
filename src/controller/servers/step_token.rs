//! Per-run credentials of step pods: `token = HMAC-SHA256(key, run uid)`,
//! hex. The key is shared by every controller replica (`--step-token-key`
//! or `--step-token-key-file`, from a Secret in the controller's own
//! namespace), so any replica's gateway accepts a token another minted. A
//! token names one run: it opens that run's log and nothing else.
//!
//! Rotation: a new key becomes current and the earlier ones are listed as
//! retired (`--step-token-retired-keys`, the Secret's `retired`, one per
//! line). Tokens are minted with the current key only; tokens of a retired
//! key (runs started before the rotation hold them in their credential
//! Secret) keep opening their run, and records signed with a retired key's
//! signing key keep verifying: its public key stays published.

use ring::hmac;

/// Domain separation: these tags authenticate step pods, nothing else.
const CONTEXT: &[u8] = b"agentrun.dev/step-token/v1\0";
/// Shortest key accepted (bytes).
pub const MIN_KEY_LEN: usize = 32;

/// The HMAC keys step tokens are minted (current) and checked (current and
/// retired) with.
#[derive(Clone)]
pub struct TokenKey {
    current: hmac::Key,
    retired: Vec<hmac::Key>,
}

impl std::fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenKey(***)")
    }
}

impl TokenKey {
    /// A key from its secret bytes (at least [`MIN_KEY_LEN`]; surrounding
    /// whitespace, as a file or Secret often has, is ignored).
    pub fn new(secret: &[u8]) -> Result<TokenKey, String> {
        let secret = secret.trim_ascii();
        if secret.len() < MIN_KEY_LEN {
            return Err(format!(
                "the step token key has {} bytes; at least {MIN_KEY_LEN} are required",
                secret.len()
            ));
        }
        Ok(TokenKey {
            current: hmac::Key::new(hmac::HMAC_SHA256, secret),
            retired: Vec::new(),
        })
    }

    /// This key with `retired` (keys a rotation replaced, one per line;
    /// blank lines ignored) still accepted for tokens and signatures.
    pub fn with_retired(mut self, retired: &[u8]) -> Result<TokenKey, String> {
        for (i, line) in retired.split(|b| *b == b'\n').enumerate() {
            if line.trim_ascii().is_empty() {
                continue;
            }
            let key =
                TokenKey::new(line).map_err(|e| format!("retired key (line {}): {e}", i + 1))?;
            self.retired.push(key.current);
        }
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
    ) -> anyhow::Result<TokenKey> {
        let secret = match (file, inline) {
            (Some(path), _) => read(path, "--step-token-key-file")?,
            (None, Some(key)) => key.as_bytes().to_vec(),
            (None, None) => anyhow::bail!(
                "no step token key: set --step-token-key-file or AGENTRUN_STEP_TOKEN_KEY \
                 (the chart shares one from a Secret in the controller's namespace)"
            ),
        };
        let retired = match (retired_file, retired_inline) {
            (Some(path), _) => read(path, "--step-token-retired-keys-file")?,
            (None, Some(keys)) => keys.as_bytes().to_vec(),
            (None, None) => Vec::new(),
        };
        TokenKey::new(&secret)
            .map_err(|e| anyhow::anyhow!("--step-token-key: {e}"))?
            .with_retired(&retired)
            .map_err(|e| anyhow::anyhow!("--step-token-retired-keys: {e}"))
    }

    /// The controller's record-signing key, derived from the current key (so
    /// the replicas share it without another Secret).
    pub fn record_signer(&self) -> crate::store::RecordSigner {
        signer_of(&self.current)
    }

    /// The public keys controller signatures are checked with: the current
    /// signing key's, then the retired keys' (marked retired).
    pub fn record_verifier(&self) -> crate::store::RecordVerifier {
        let mut keys = vec![self.record_signer().public_key(false)];
        for key in &self.retired {
            let public = signer_of(key).public_key(true);
            if !keys.iter().any(|k| k.id == public.id) {
                keys.push(public);
            }
        }
        crate::store::RecordVerifier::new(keys).expect("the current key is always there")
    }

    /// The token of run `uid` (by the current key).
    pub fn mint(&self, uid: &str) -> String {
        hex::encode(hmac::sign(&self.current, &message(uid)).as_ref())
    }

    /// Whether `token` is run `uid`'s under the current or a retired key,
    /// compared in constant time.
    pub fn verify(&self, uid: &str, token: &str) -> bool {
        let Ok(tag) = hex::decode(token.trim()) else {
            return false;
        };
        let m = message(uid);
        std::iter::once(&self.current)
            .chain(&self.retired)
            .any(|k| hmac::verify(k, &m, &tag).is_ok())
    }
}

fn read(path: &std::path::Path, flag: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| anyhow::anyhow!("reading {flag} {}: {e}", path.display()))
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

    #[test]
    fn a_token_opens_its_own_run_only() {
        let k = key(7);
        let t = k.mint("run-a");
        assert!(k.verify("run-a", &t));
        assert!(!k.verify("run-b", &t), "another run's uid");
        assert!(!k.verify("run-a", ""), "missing");
        assert!(!k.verify("run-a", "not hex"), "garbage");
        assert!(!k.verify("run-a", &t[..32]), "truncated");
        let mut flipped = t.clone().into_bytes();
        flipped[0] = if flipped[0] == b'0' { b'1' } else { b'0' };
        assert!(!k.verify("run-a", std::str::from_utf8(&flipped).unwrap()));
    }

    #[test]
    fn tokens_depend_on_the_key_and_are_stable_across_replicas() {
        assert_eq!(key(7).mint("r"), key(7).mint("r"), "replicas share the key");
        assert!(!key(8).verify("r", &key(7).mint("r")));
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
    fn a_rotation_keeps_old_tokens_and_signatures_and_mints_with_the_new_key() {
        let old = key(7);
        let old_token = old.mint("r");
        let old_signer = old.record_signer();
        let new = TokenKey::new(&[8; 32])
            .unwrap()
            .with_retired(&[b"\n".as_slice(), &[7; 32], b"\n"].concat())
            .unwrap();
        assert!(
            new.verify("r", &old_token),
            "a run started before the rotation"
        );
        assert_eq!(new.mint("r"), key(8).mint("r"), "minted with the new key");
        assert!(!key(8).verify("r", &old_token), "without the retired list");
        let v = new.record_verifier();
        let ids: Vec<(&str, bool)> = v
            .keys()
            .iter()
            .map(|k| (k.id.as_str(), k.retired))
            .collect();
        assert_eq!(
            ids,
            vec![
                (new.record_signer().key_id(), false),
                (old_signer.key_id(), true)
            ]
        );
        let sig = old_signer.sign_message(b"ctx", b"m");
        assert!(
            v.verify_message(b"ctx", b"m", &sig),
            "old signatures verify"
        );
        let e = key(8).with_retired(b"short").unwrap_err();
        assert!(e.contains("line 1") && e.contains("at least 32"), "{e}");
    }

    #[test]
    fn short_keys_are_refused() {
        assert!(TokenKey::new(b"short").unwrap_err().contains("at least 32"));
        assert!(TokenKey::new(format!("{}\n", "k".repeat(32)).as_bytes()).is_ok());
        let e = TokenKey::load(None, None, None, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--step-token-key-file"), "{e}");
    }
}
