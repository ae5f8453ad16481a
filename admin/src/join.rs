//! Joining a host to a cluster with a one-time token, without copying the CA's key.
//!
//! A token is `kiln1-<cluster>-<id>-<secret>`: the cluster's name, a random id, and a secret
//! that is a MAC of both under a key derived from the cluster CA's private key. Every host that holds the CA's key can
//! derive the secret of any id, so no host has to remember a token, and nothing that can read
//! the configuration store can forge one (the store holds only the id, under a lease: the
//! token's lifetime, and deleted when the token is used).
//!
//! The joining host makes its own keys and sends a [`JoinClaim`] (its host name, the names
//! its bricks are reached at, signing requests for its host brick certificate and its
//! `admin` client certificate) sealed with the token's secret; a host with the CA's key checks
//! the seal, signs, and answers with a [`JoinGrant`] (the CA's certificate, the two signed
//! certificates, the cluster's etcd endpoints) sealed the same way, so the joining host knows
//! the CA it is given is the cluster's. Neither the secret nor any private key is ever sent.

use ring::hmac;
use serde::{Deserialize, Serialize};

use crate::pki::{self, PkiError};

/// Bytes of a token's random id.
const TOKEN_ID_BYTES: usize = 8;
/// How a token starts; the number is the token format's version.
const TOKEN_PREFIX: &str = "kiln1";
/// Longest host name a join may claim, in bytes (a DNS name's limit).
pub const HOST_NAME_MAX_BYTES: usize = 253;
/// Most names a joining host may ask its brick certificate to carry.
pub const HOST_NAMES_MAX: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("not a join token (`kiln cluster token` prints one: kiln1-<cluster>-<id>-<secret>)")]
    BadToken,
    #[error("the seal does not match the token: a wrong token, or a message not made with it")]
    BadSeal,
    #[error("bad host name {0:?} for a join")]
    BadHost(String),
    #[error(transparent)]
    Pki(#[from] PkiError),
    #[error("cannot decode {what}: {error}")]
    Decode {
        what: &'static str,
        error: serde_json::Error,
    },
}

/// A one-time join token: the cluster it joins, its id (what the store keeps) and its secret.
#[derive(Clone, PartialEq, Eq)]
pub struct Token {
    pub cluster: String,
    pub id: String,
    secret: [u8; 32],
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The secret is never printed by accident.
        f.debug_struct("Token")
            .field("cluster", &self.cluster)
            .field("id", &self.id)
            .finish()
    }
}

impl std::fmt::Display for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{TOKEN_PREFIX}-{}-{}-{}",
            self.cluster,
            self.id,
            hex::encode(self.secret)
        )
    }
}

impl std::str::FromStr for Token {
    type Err = JoinError;

    fn from_str(text: &str) -> Result<Token, JoinError> {
        // (The cluster's name may hold '-'; the id and secret do not.)
        let mut parts = text.trim().rsplitn(3, '-');
        let (Some(secret), Some(id), Some(start)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(JoinError::BadToken);
        };
        let cluster = match start.split_once('-') {
            Some((TOKEN_PREFIX, cluster)) if !cluster.is_empty() => cluster,
            _ => return Err(JoinError::BadToken),
        };
        let id_ok = id.len() == 2 * TOKEN_ID_BYTES && id.bytes().all(|b| b.is_ascii_hexdigit());
        let mut bytes = [0; 32];
        if !id_ok || hex::decode_to_slice(secret, &mut bytes).is_err() {
            return Err(JoinError::BadToken);
        }
        Ok(Token {
            cluster: cluster.to_owned(),
            id: id.to_ascii_lowercase(),
            secret: bytes,
        })
    }
}

impl Token {
    /// A new token for `cluster`, of the CA in `tls_dir` (which must hold its key).
    pub fn new(tls_dir: &std::path::Path, cluster: &str) -> Result<Token, JoinError> {
        let mut id = [0; TOKEN_ID_BYTES];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut id)
            .expect("the kernel gives random bytes");
        Token::of_ca(tls_dir, cluster, &hex::encode(id))
    }

    /// The token with id `id` for `cluster` of the CA in `tls_dir`: its secret derived from
    /// the CA's key.
    pub fn of_ca(tls_dir: &std::path::Path, cluster: &str, id: &str) -> Result<Token, JoinError> {
        let ca_key = pki::ca_key_pem(tls_dir)?;
        let derive = hmac::Key::new(hmac::HMAC_SHA256, ca_key.as_bytes());
        let tag = hmac::sign(
            &derive,
            format!("kiln join token {cluster} {id}").as_bytes(),
        );
        let mut secret = [0; 32];
        secret.copy_from_slice(tag.as_ref());
        Ok(Token {
            cluster: cluster.to_owned(),
            id: id.to_owned(),
            secret,
        })
    }

    /// `message` sealed with this token's secret.
    pub fn seal<T: Serialize>(&self, message: &T) -> Sealed {
        let body = serde_json::to_string(message).expect("join messages encode");
        let tag = hmac::sign(&self.key(), body.as_bytes());
        Sealed {
            body,
            tag: hex::encode(tag.as_ref()),
        }
    }

    /// The message in `sealed`, if this token's secret sealed it.
    pub fn open<T: for<'de> Deserialize<'de>>(
        &self,
        sealed: &Sealed,
        what: &'static str,
    ) -> Result<T, JoinError> {
        let tag = hex::decode(&sealed.tag).map_err(|_| JoinError::BadSeal)?;
        hmac::verify(&self.key(), sealed.body.as_bytes(), &tag).map_err(|_| JoinError::BadSeal)?;
        serde_json::from_str(&sealed.body).map_err(|error| JoinError::Decode { what, error })
    }

    fn key(&self) -> hmac::Key {
        hmac::Key::new(hmac::HMAC_SHA256, &self.secret)
    }
}

/// A message and its MAC under a token's secret (hex), as they travel through the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sealed {
    /// The message as JSON text: the seal covers these exact bytes.
    pub body: String,
    pub tag: String,
}

/// What a joining host asks for (sealed with the token into a [`JoinRequest`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinClaim {
    /// The host's name in the cluster (`kiln-mgmtd --host`).
    pub host: String,
    /// The names and addresses its bricks are reached at (their certificate's SANs).
    pub names: Vec<String>,
    /// A signing request for its brick certificate ([`pki::HOST_IDENTITY`]).
    pub brick_csr: String,
    /// A signing request for its `admin` client certificate.
    pub client_csr: String,
}

impl JoinClaim {
    /// Checks what a claim asks before anything is signed for it.
    pub fn check(&self) -> Result<(), JoinError> {
        let host_ok = |name: &str| {
            !name.is_empty()
                && name.len() <= HOST_NAME_MAX_BYTES
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':'))
        };
        if !host_ok(&self.host) {
            return Err(JoinError::BadHost(self.host.clone()));
        }
        if self.names.len() > HOST_NAMES_MAX {
            return Err(JoinError::BadHost(format!(
                "{} names (at most {HOST_NAMES_MAX})",
                self.names.len()
            )));
        }
        match self.names.iter().find(|name| !host_ok(name)) {
            Some(bad) => Err(JoinError::BadHost(bad.clone())),
            None => Ok(()),
        }
    }
}

/// A join request as the store holds it: the token's id and the sealed [`JoinClaim`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinRequest {
    pub token_id: String,
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
}

/// A host of the cluster's answer to a [`JoinRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum JoinAnswer {
    Granted(Sealed),
    /// Why not (not sealed: a refusal gives nothing away, and a forged one only fails a join).
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
        let token = Token::new(&tls, "c-1").expect("token");
        let text = token.to_string();
        assert!(text.starts_with("kiln1-c-1-"), "{text}");
        assert_eq!(text.parse::<Token>().expect("parse"), token);
        assert_eq!(Token::of_ca(&tls, "c-1", &token.id).expect("derive"), token);
        let secret = text.rsplit('-').next().expect("secret");
        assert!(!format!("{token:?}").contains(secret), "secret in Debug");
        assert_ne!(Token::of_ca(&tls, "c-2", &token.id).expect("derive"), token);
        let no_cluster = text.replace("-c-1-", "--");
        for bad in [
            "",
            "kiln1",
            "kiln1-c-xyz-00",
            &no_cluster,
            &text.replace("kiln1", "kiln2"),
        ] {
            assert!(bad.parse::<Token>().is_err(), "{bad:?} parsed");
        }
        // Another CA derives another secret for the same id.
        let (_other_dir, other) = new_ca();
        assert_ne!(
            Token::of_ca(&other, "c-1", &token.id).expect("derive"),
            token
        );
    }

    #[test]
    fn a_seal_opens_only_with_its_token_and_unchanged() {
        let (_dir, tls) = new_ca();
        let token = Token::new(&tls, "c-1").expect("token");
        let claim = JoinClaim {
            host: "10.0.0.2".into(),
            names: vec!["10.0.0.2".into(), "node2".into()],
            brick_csr: "csr".into(),
            client_csr: "csr".into(),
        };
        let sealed = token.seal(&claim);
        assert_eq!(
            token.open::<JoinClaim>(&sealed, "claim").expect("open"),
            claim
        );
        let other = Token::new(&tls, "c-1").expect("token");
        assert!(matches!(
            other.open::<JoinClaim>(&sealed, "claim"),
            Err(JoinError::BadSeal)
        ));
        let forged = Sealed {
            body: sealed.body.replace("node2", "evil"),
            tag: sealed.tag.clone(),
        };
        assert!(matches!(
            token.open::<JoinClaim>(&forged, "claim"),
            Err(JoinError::BadSeal)
        ));
    }

    #[test]
    fn a_claim_with_bad_names_is_refused() {
        let claim = |host: &str, names: Vec<String>| JoinClaim {
            host: host.into(),
            names,
            brick_csr: String::new(),
            client_csr: String::new(),
        };
        assert!(claim("node-2.example", vec!["::1".into()]).check().is_ok());
        assert!(claim("", vec![]).check().is_err());
        assert!(claim("a/b", vec![]).check().is_err());
        assert!(claim("a", vec!["x y".into()]).check().is_err());
        assert!(
            claim("a", vec!["n".into(); HOST_NAMES_MAX + 1])
                .check()
                .is_err()
        );
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
        // A request whose signature does not hold is refused.
        let mut tampered = csr.clone().into_bytes();
        let in_signature = csr.rfind("-----END").expect("PEM") - 8;
        tampered[in_signature] = if tampered[in_signature] == b'A' {
            b'B'
        } else {
            b'A'
        };
        let tampered = String::from_utf8(tampered).expect("ASCII");
        assert!(pki::sign_request(&tls, &role, "x", &tampered, 30).is_err());
        // Another cluster's CA is not installed over this one.
        let (_other_dir, other) = new_ca();
        let other_ca = std::fs::read_to_string(pki::ca_files(&other).cert).expect("ca");
        assert!(matches!(
            pki::install_ca_cert(joined.path(), &other_ca),
            Err(PkiError::OtherCa(_))
        ));
    }
}
