//! Per-run credentials of step pods: `token = HMAC-SHA256(key, run uid)`,
//! hex. The key is shared by every controller replica (`--step-token-key`
//! or `--step-token-key-file`, from a Secret in the controller's own
//! namespace), so any replica's gateway accepts a token another minted. A
//! token names one run: it opens that run's log and nothing else.

use ring::hmac;

/// Domain separation: these tags authenticate step pods, nothing else.
const CONTEXT: &[u8] = b"agentrun.dev/step-token/v1\0";
/// Shortest key accepted (bytes).
pub const MIN_KEY_LEN: usize = 32;

/// The HMAC key step tokens are minted and checked with.
#[derive(Clone)]
pub struct TokenKey(hmac::Key);

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
        Ok(TokenKey(hmac::Key::new(hmac::HMAC_SHA256, secret)))
    }

    /// Reads the key from `--step-token-key-file` or `--step-token-key`.
    pub fn load(file: Option<&std::path::Path>, inline: Option<&str>) -> anyhow::Result<TokenKey> {
        let secret = match (file, inline) {
            (Some(path), _) => std::fs::read(path).map_err(|e| {
                anyhow::anyhow!("reading --step-token-key-file {}: {e}", path.display())
            })?,
            (None, Some(key)) => key.as_bytes().to_vec(),
            (None, None) => anyhow::bail!(
                "no step token key: set --step-token-key-file or AGENTRUN_STEP_TOKEN_KEY \
                 (the chart shares one from a Secret in the controller's namespace)"
            ),
        };
        TokenKey::new(&secret).map_err(|e| anyhow::anyhow!("--step-token-key: {e}"))
    }

    /// The controller's record-signing key, derived from this key (so the
    /// replicas share it without another Secret).
    pub fn record_signer(&self) -> crate::store::RecordSigner {
        let tag = hmac::sign(&self.0, b"agentrun.dev/record-signing-seed/v1");
        let seed: [u8; 32] = tag.as_ref()[..32]
            .try_into()
            .expect("HMAC-SHA256 gives 32 bytes");
        crate::store::RecordSigner::from_seed(&seed)
    }

    /// The token of run `uid`.
    pub fn mint(&self, uid: &str) -> String {
        hex::encode(hmac::sign(&self.0, &message(uid)).as_ref())
    }

    /// Whether `token` is run `uid`'s, compared in constant time.
    pub fn verify(&self, uid: &str, token: &str) -> bool {
        let Ok(tag) = hex::decode(token.trim()) else {
            return false;
        };
        hmac::verify(&self.0, &message(uid), &tag).is_ok()
    }
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
    fn short_keys_are_refused() {
        assert!(TokenKey::new(b"short").unwrap_err().contains("at least 32"));
        assert!(TokenKey::new(format!("{}\n", "k".repeat(32)).as_bytes()).is_ok());
        let e = TokenKey::load(None, None).unwrap_err().to_string();
        assert!(e.contains("--step-token-key-file"), "{e}");
    }
}
