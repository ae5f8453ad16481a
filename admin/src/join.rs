//! Joining a host to a cluster with a one-time token, without copying the CA's key.
//!
//! A token is `kiln1-<cluster>-<id>-<expires>-<secret>`: the cluster's name, a random id, when
//! it expires (Unix seconds), and a secret that is an HMAC-SHA256 of those three under the
//! cluster CA's private key (its DER form, the same on every host that holds it). Every such
//! host can derive the secret of any token, so no host has to remember one, and nothing that
//! can read or write the configuration store can make or revive one: the expiry is under the
//! MAC, and a used token's id is recorded in the store until it expires.
//!
//! The joining host makes its own keys and sends a [`JoinClaim`] (its host name, the names
//! its bricks are reached at, signing requests for its host brick certificate and its
//! `admin` client certificate) sealed with the token's secret; a host with the CA's key checks
//! the seal, signs, and answers with a [`JoinGrant`] (the CA's certificate, the two signed
//! certificates, the cluster's etcd endpoints, the digest of the claim it answers) sealed the
//! same way, so the joining host knows the CA it is given is the cluster's. Neither the secret
//! nor any private key is ever sent.

use std::path::Path;
use std::time::Duration;

use ring::hmac;
use serde::{Deserialize, Serialize};

use crate::pki::{self, PkiError};

/// Bytes of a token's random id.
const TOKEN_ID_BYTES: usize = 8;
/// How a token starts; the number is the token format's version.
const TOKEN_PREFIX: &str = "kiln1";
/// How long a token is valid unless asked otherwise.
pub const TOKEN_VALIDITY: Duration = Duration::from_secs(3600);
/// Longest a token may be valid.
pub const TOKEN_VALIDITY_MAX: Duration = Duration::from_secs(7 * 24 * 3600);
/// Longest host name a join may claim, in bytes.
pub const HOST_NAME_MAX_BYTES: usize = pki::HOST_NAME_MAX_BYTES;
/// Most names a joining host may ask its brick certificate to carry.
pub const HOST_NAMES_MAX: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error(
        "not a join token (`kiln cluster token` prints one: kiln1-<cluster>-<id>-<expires>-<secret>)"
    )]
    BadToken,
    #[error("a token is valid for 1 s to {} s", TOKEN_VALIDITY_MAX.as_secs())]
    BadValidity,
    #[error("the seal does not match the token: a wrong token, or a message not made with it")]
    BadSeal,
    #[error("bad host name for a join: {0}")]
    BadHost(String),
    #[error(transparent)]
    Pki(#[from] PkiError),
    #[error("cannot decode the {what}: {error}")]
    Decode {
        what: &'static str,
        error: serde_json::Error,
    },
}

/// A one-time join token.
#[derive(Clone, PartialEq, Eq)]
pub struct Token {
    pub cluster: String,
    /// What the store records once the token is used.
    pub id: String,
    /// When it expires, in seconds since the Unix epoch.
    pub expires: u64,
    secret: [u8; 32],
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The secret is never printed by accident.
        f.debug_struct("Token")
            .field("cluster", &self.cluster)
            .field("id", &self.id)
            .field("expires", &self.expires)
            .finish()
    }
}

impl std::fmt::Display for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secret = hex::encode(self.secret);
        let (cluster, id, expires) = (&self.cluster, &self.id, self.expires);
        write!(f, "{TOKEN_PREFIX}-{cluster}-{id}-{expires}-{secret}")
    }
}

impl std::str::FromStr for Token {
    type Err = JoinError;

    fn from_str(text: &str) -> Result<Token, JoinError> {
        // (The cluster's name may hold '-'; the id, expiry and secret do not.)
        let mut parts = text.trim().rsplitn(4, '-');
        let (Some(secret), Some(expires), Some(id), Some(start)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(JoinError::BadToken);
        };
        let cluster = match start.split_once('-') {
            Some((TOKEN_PREFIX, cluster)) if !cluster.is_empty() => cluster,
            _ => return Err(JoinError::BadToken),
        };
        let id_ok = id.len() == 2 * TOKEN_ID_BYTES && id.bytes().all(|b| b.is_ascii_hexdigit());
        let expires = expires.parse().map_err(|_| JoinError::BadToken)?;
        let mut bytes = [0; 32];
        if !id_ok || hex::decode_to_slice(secret, &mut bytes).is_err() {
            return Err(JoinError::BadToken);
        }
        Ok(Token {
            cluster: cluster.to_owned(),
            id: id.to_ascii_lowercase(),
            expires,
            secret: bytes,
        })
    }
}

impl Token {
    /// A new token for `cluster`, valid for `valid`, of the CA in `tls_dir` (which must hold
    /// its key).
    pub fn new(tls_dir: &Path, cluster: &str, valid: Duration) -> Result<Token, JoinError> {
        if valid.is_zero() || valid > TOKEN_VALIDITY_MAX {
            return Err(JoinError::BadValidity);
        }
        let mut id = [0; TOKEN_ID_BYTES];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut id)
            .expect("the kernel gives random bytes");
        Token::of_ca(
            tls_dir,
            cluster,
            &hex::encode(id),
            unix_now() + valid.as_secs(),
        )
    }

    /// The token `id` of `cluster` expiring at `expires`, of the CA in `tls_dir`: its secret
    /// derived from the CA's key.
    pub fn of_ca(
        tls_dir: &Path,
        cluster: &str,
        id: &str,
        expires: u64,
    ) -> Result<Token, JoinError> {
        let ca_key =
            rcgen::KeyPair::from_pem(&pki::ca_key_pem(tls_dir)?).map_err(PkiError::from)?;
        let derive = hmac::Key::new(hmac::HMAC_SHA256, &ca_key.serialize_der());
        let what = format!("kiln join token {cluster} {id} {expires}");
        let mut secret = [0; 32];
        secret.copy_from_slice(hmac::sign(&derive, what.as_bytes()).as_ref());
        Ok(Token {
            cluster: cluster.to_owned(),
            id: id.to_owned(),
            expires,
            secret,
        })
    }

    pub fn has_expired(&self) -> bool {
        unix_now() >= self.expires
    }

    /// `message` sealed with this token's secret as a `label` (a claim is not a grant).
    pub fn seal<T: Serialize>(&self, label: &'static str, message: &T) -> Sealed {
        let body = serde_json::to_string(message).expect("join messages encode");
        let tag = hmac::sign(&self.key(), &labelled(label, &body));
        Sealed {
            body,
            tag: hex::encode(tag.as_ref()),
        }
    }

    /// The `label` message in `sealed`, if this token's secret sealed it as one.
    pub fn open<T: for<'de> Deserialize<'de>>(
        &self,
        label: &'static str,
        sealed: &Sealed,
    ) -> Result<T, JoinError> {
        let tag = hex::decode(&sealed.tag).map_err(|_| JoinError::BadSeal)?;
        hmac::verify(&self.key(), &labelled(label, &sealed.body), &tag)
            .map_err(|_| JoinError::BadSeal)?;
        serde_json::from_str(&sealed.body).map_err(|error| JoinError::Decode { what: label, error })
    }

    fn key(&self) -> hmac::Key {
        hmac::Key::new(hmac::HMAC_SHA256, &self.secret)
    }
}

fn labelled(label: &str, body: &str) -> Vec<u8> {
    [label.as_bytes(), b"\n", body.as_bytes()].concat()
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A message and its MAC under a token's secret (hex), as they travel through the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sealed {
    /// The message as JSON text: the seal covers these exact bytes.
    pub body: String,
    pub tag: String,
}

impl Sealed {
    /// The SHA-256 of the body, hex: how a grant names the claim it answers.
    pub fn digest(&self) -> String {
        hex::encode(ring::digest::digest(
            &ring::digest::SHA256,
            self.body.as_bytes(),
        ))
    }
}

/// What a joining host asks for (sealed with the token into a [`JoinRequest`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinClaim {
    /// The host's name in the cluster (`kiln-mgmtd --host`).
    pub host: String,
    /// The names and addresses its bricks are reached at (their certificate's SANs), its
    /// host name among them.
    pub names: Vec<String>,
    /// A signing request for its brick certificate ([`pki::HOST_IDENTITY`]).
    pub brick_csr: String,
    /// A signing request for its `admin` client certificate.
    pub client_csr: String,
}

impl JoinClaim {
    /// Checks what a claim asks before anything is signed for it: names a certificate can
    /// carry, its host among them. (The error repeats no more than one bounded name.)
    pub fn check(&self) -> Result<(), JoinError> {
        let name_ok = |name: &str| {
            !name.is_empty()
                && name.len() <= HOST_NAME_MAX_BYTES
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':'))
        };
        if !name_ok(&self.host) {
            return Err(JoinError::BadHost("the host's name".to_owned()));
        }
        if self.names.len() > HOST_NAMES_MAX {
            return Err(JoinError::BadHost(format!(
                "{} names (at most {HOST_NAMES_MAX})",
                self.names.len()
            )));
        }
        if let Some(bad) = self.names.iter().find(|name| !name_ok(name)) {
            return Err(JoinError::BadHost(format!("{} bytes of name", bad.len())));
        }
        if !self.names.contains(&self.host) {
            return Err(JoinError::BadHost(format!(
                "{} is not among the names its bricks are reached at",
                self.host
            )));
        }
        Ok(())
    }
}

/// A join request as the store holds it: the token's id and expiry, and the sealed
/// [`JoinClaim`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinRequest {
    pub token_id: String,
    pub expires: u64,
    pub claim: Sealed,
}

/// What a joining host is given (sealed with the token into [`JoinAnswer::Granted`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinGrant {
    pub cluster: String,
    /// The cluster's etcd client URLs.
    pub endpoints: Vec<String>,
    /// The CA's certificate (PEM).
    pub ca_cert: String,
    /// The host's brick certificate (PEM).
    pub host_cert: String,
    /// The host's `admin` client certificate (PEM).
    pub client_cert: String,
    /// The [`Sealed::digest`] of the claim it answers: a grant is for one request.
    pub claim: String,
}

/// A host of the cluster's answer to a [`JoinRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum JoinAnswer {
    Granted(Sealed),
    /// Why not, in a few words that repeat nothing of the request (not sealed: a forged
    /// refusal only fails a join).
    Refused(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new_ca() -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let tls = dir.path().join("tls");
        pki::init_ca(&tls).expect("ca");
        (dir, tls)
    }

    #[test]
    fn a_token_prints_parses_and_is_derived_again_from_the_ca_key_alone() {
        let (_dir, tls) = new_ca();
        let token = Token::new(&tls, "c-1", TOKEN_VALIDITY).expect("token");
        let text = token.to_string();
        assert!(text.starts_with("kiln1-c-1-"), "{text}");
        assert_eq!(text.parse::<Token>().expect("parse"), token);
        assert_eq!(
            Token::of_ca(&tls, "c-1", &token.id, token.expires).expect("derive"),
            token
        );
        assert!(!token.has_expired());
        let secret = text.rsplit('-').next().expect("secret");
        assert!(!format!("{token:?}").contains(secret), "secret in Debug");
        // The cluster, the id and the expiry are all under the secret.
        let other = |cluster: &str, id: &str, expires| {
            Token::of_ca(&tls, cluster, id, expires)
                .expect("derive")
                .secret
        };
        assert_ne!(other("c-2", &token.id, token.expires), token.secret);
        assert_ne!(
            other("c-1", "00000000000000ff", token.expires),
            token.secret
        );
        assert_ne!(other("c-1", &token.id, token.expires + 1), token.secret);
        let no_cluster = text.replace("-c-1-", "--");
        for bad in [
            "",
            "kiln1",
            "kiln1-c-xyz-1-00",
            &no_cluster,
            &text.replace("kiln1", "kiln2"),
        ] {
            assert!(bad.parse::<Token>().is_err(), "{bad:?} parsed");
        }
        assert!(matches!(
            Token::new(&tls, "c", Duration::ZERO),
            Err(JoinError::BadValidity)
        ));
        // Another CA derives another secret for the same token.
        let (_other_dir, other_ca) = new_ca();
        assert_ne!(
            Token::of_ca(&other_ca, "c-1", &token.id, token.expires).expect("derive"),
            token
        );
    }

    #[test]
    fn a_seal_opens_only_with_its_token_label_and_body() {
        let (_dir, tls) = new_ca();
        let token = Token::new(&tls, "c", TOKEN_VALIDITY).expect("token");
        let claim = JoinClaim {
            host: "10.0.0.2".into(),
            names: vec!["10.0.0.2".into(), "node2".into()],
            brick_csr: "csr".into(),
            client_csr: "csr".into(),
        };
        let sealed = token.seal("claim", &claim);
        assert_eq!(
            token.open::<JoinClaim>("claim", &sealed).expect("open"),
            claim
        );
        assert!(matches!(
            token.open::<JoinClaim>("grant", &sealed),
            Err(JoinError::BadSeal)
        ));
        let other = Token::new(&tls, "c", TOKEN_VALIDITY).expect("token");
        assert!(matches!(
            other.open::<JoinClaim>("claim", &sealed),
            Err(JoinError::BadSeal)
        ));
        let forged = Sealed {
            body: sealed.body.replace("node2", "evil"),
            tag: sealed.tag.clone(),
        };
        assert!(matches!(
            token.open::<JoinClaim>("claim", &forged),
            Err(JoinError::BadSeal)
        ));
        assert_ne!(forged.digest(), sealed.digest());
    }

    #[test]
    fn a_claim_with_bad_names_is_refused() {
        let claim = |host: &str, names: &[&str]| JoinClaim {
            host: host.into(),
            names: names.iter().map(|n| (*n).to_owned()).collect(),
            brick_csr: String::new(),
            client_csr: String::new(),
        };
        assert!(
            claim("node-2.example", &["node-2.example", "::1"])
                .check()
                .is_ok()
        );
        assert!(
            claim("node-2", &["::1"]).check().is_err(),
            "its own name missing"
        );
        assert!(claim("", &[""]).check().is_err());
        assert!(claim("a/b", &["a/b"]).check().is_err());
        assert!(claim("a", &["a", "x y"]).check().is_err());
        let many = vec!["a"; HOST_NAMES_MAX + 1];
        assert!(claim("a", &many).check().is_err());
        let long = "a".repeat(10_000);
        let said = claim("a", &["a", &long])
            .check()
            .expect_err("too long")
            .to_string();
        assert!(said.len() < 100, "the error repeats the name: {said}");
    }

    #[test]
    fn a_signed_request_is_a_certificate_for_the_requesters_key() {
        let (_dir, tls) = new_ca();
        let (key, csr) = pki::request(pki::HOST_IDENTITY).expect("request");
        let role = pki::Role::Brick {
            hosts: vec!["10.0.0.2".into()],
        };
        let cert = pki::sign_request(&tls, &role, pki::HOST_IDENTITY, &csr, 90).expect("sign");
        let joined = tempfile::tempdir().expect("tempdir");
        let ca = std::fs::read_to_string(pki::ca_files(&tls).cert).expect("ca");
        pki::install_ca_cert(joined.path(), &ca).expect("ca cert");
        pki::install(joined.path(), &role, pki::HOST_IDENTITY, &key, &cert).expect("install");
        assert!(pki::is_current(joined.path(), &role, pki::HOST_IDENTITY));
        assert!(!pki::holds_ca_key(joined.path()));
        // A request whose signature does not hold is refused as such.
        use rustls_pki_types::pem::PemObject as _;
        let der = rustls_pki_types::CertificateSigningRequestDer::from_pem_slice(csr.as_bytes())
            .expect("a PEM request");
        let mut bytes = der.as_ref().to_vec();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        let tampered = rcgen::CertificateSigningRequestParams::from_der(&bytes.into());
        assert!(matches!(
            tampered,
            Err(rcgen::Error::InvalidCertificationRequestSignature)
        ));
        // Another cluster's CA is not installed over this one.
        let (_other_dir, other) = new_ca();
        let other_ca = std::fs::read_to_string(pki::ca_files(&other).cert).expect("ca");
        assert!(matches!(
            pki::install_ca_cert(joined.path(), &other_ca),
            Err(PkiError::OtherCa(_))
        ));
    }
}
