//! The cluster's identities: one CA, and brick and client certificates signed by it.
//!
//! A TLS directory holds PEM files, each written atomically with mode 0600 in a 0700
//! directory:
//!
//! ```text
//! ca.crt  ca.key                       the cluster CA (`kiln ca init`)
//! brick-NAME.crt  brick-NAME.key       a brick's server identity (`kiln cert issue --brick`)
//! client-NAME.crt client-NAME.key      a client identity (`kiln cert issue --client`)
//! ```
//!
//! The client name is the certificate's common name; bricks read it from the peer's
//! certificate to apply `auth.allow`. Client certificates carry only the client-auth usage
//! and brick certificates only the server-auth usage, so neither can stand in for the other.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::durable;

/// Validity of a newly issued certificate, in days, unless asked otherwise.
pub const CERT_VALIDITY_DAYS: u32 = 825;
/// Validity of the cluster CA, in days.
pub const CA_VALIDITY_DAYS: u32 = 3650;
/// The client certificate `kiln-mgmtd` makes for the local administrator: the default
/// client of the `kiln` command, trusted with root on the volume `kiln up` makes.
pub const ADMIN_CLIENT: &str = "admin";
/// The brick certificate a host that joined a cluster holds (`brick-host.crt`): issued at the
/// join with the host's names, it serves the host's bricks where the CA's key is not kept.
/// (No brick is named so: brick names end in `-b<index>`.)
pub const HOST_IDENTITY: &str = "host";

/// Longest host name a brick certificate may carry, in bytes (a DNS name's limit).
pub const HOST_NAME_MAX_BYTES: usize = 253;
/// Longest client or brick name, in bytes.
pub const IDENTITY_NAME_MAX_BYTES: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("a cluster CA already exists at {0}; remove it to start a new cluster")]
    CaExists(PathBuf),
    #[error("{0} holds the CA of another cluster: remove it (and its key) to join this one")]
    OtherCa(PathBuf),
    #[error("no cluster CA at {0}; create one with `kiln ca init`")]
    NoCa(PathBuf),
    #[error(
        "bad identity name {0:?}: use 1 to {IDENTITY_NAME_MAX_BYTES} letters, digits, '.', '_' or '-'"
    )]
    BadName(String),
    #[error("bad host {0:?} for a brick certificate")]
    BadHost(String),
    #[error("cannot read {path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path} holds no {what}")]
    Pem { path: PathBuf, what: &'static str },
    #[error("cannot write {path}: {error}")]
    Write {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("certificate generation failed: {0}")]
    Generate(#[from] rcgen::Error),
}

/// Whom a certificate identifies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// A brick, reachable under these host names or addresses (the certificate's SANs).
    Brick { hosts: Vec<String> },
    /// A client, named by the certificate's common name (what `auth.allow` lists).
    Client,
}

impl Role {
    fn file_prefix(&self) -> &'static str {
        match self {
            Role::Brick { .. } => "brick",
            Role::Client => "client",
        }
    }
}

/// Where a certificate and its key live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The files of the cluster CA in `dir`.
pub fn ca_files(dir: &Path) -> CertFiles {
    CertFiles {
        cert: dir.join("ca.crt"),
        key: dir.join("ca.key"),
    }
}

/// The files of identity `name` with `role` in `dir`.
pub fn identity_files(dir: &Path, role: &Role, name: &str) -> CertFiles {
    let stem = format!("{}-{name}", role.file_prefix());
    CertFiles {
        cert: dir.join(format!("{stem}.crt")),
        key: dir.join(format!("{stem}.key")),
    }
}

/// Creates the cluster CA in `dir` (created 0700 if missing). Refuses to replace one.
pub fn init_ca(dir: &Path) -> Result<CertFiles, PkiError> {
    let files = ca_files(dir);
    if files.cert.exists() || files.key.exists() {
        return Err(PkiError::CaExists(files.cert));
    }
    let mut params = CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, "Kiln cluster CA");
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let (not_before, not_after) = validity(CA_VALIDITY_DAYS);
    params.not_before = not_before;
    params.not_after = not_after;
    let key = KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    create_dir(dir)?;
    write_secret(&files.key, key.serialize_pem().as_bytes())?;
    write_secret(&files.cert, cert.pem().as_bytes())?;
    Ok(files)
}

/// Issues a certificate for `name` with `role`, valid for `days` from now, signed by the CA
/// in `dir`; replaces an earlier one of the same name.
pub fn issue(dir: &Path, role: &Role, name: &str, days: u32) -> Result<CertFiles, PkiError> {
    let (not_before, not_after) = validity(days);
    issue_valid_between(dir, role, name, not_before, not_after)
}

/// [`issue`] with an explicit validity window (tests use it to make an expired certificate).
pub fn issue_valid_between(
    dir: &Path,
    role: &Role,
    name: &str,
    not_before: time::OffsetDateTime,
    not_after: time::OffsetDateTime,
) -> Result<CertFiles, PkiError> {
    let issuer = ca_issuer(dir)?;
    let params = identity_params(role, name, not_before, not_after)?;
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer)?;
    install(dir, role, name, &key.serialize_pem(), &cert.pem())
}

/// A new key for an identity named `name`, and a request to sign it: the key stays on this
/// host, the request goes to a holder of the CA's key ([`sign_request`]).
pub fn request(name: &str) -> Result<(String, String), PkiError> {
    check_name(name)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, name);
    let key = KeyPair::generate()?;
    let csr = params.serialize_request(&key)?;
    Ok((key.serialize_pem(), csr.pem()?))
}

/// Signs the key of request `csr` (PEM, whose signature must hold: its sender has the key)
/// as identity `name` with `role` for `days`, with the CA in `dir`. Only the key is taken from
/// the request; names, usages and validity are what `role` gives, as [`issue`] would.
pub fn sign_request(
    dir: &Path,
    role: &Role,
    name: &str,
    csr: &str,
    days: u32,
) -> Result<String, PkiError> {
    let issuer = ca_issuer(dir)?;
    let request = rcgen::CertificateSigningRequestParams::from_pem(csr)?;
    let (not_before, not_after) = validity(days);
    let params = identity_params(role, name, not_before, not_after)?;
    Ok(params.signed_by(&request.public_key, &issuer)?.pem())
}

/// Writes identity `name`'s key and certificate (PEM) into `dir`, the key first.
pub fn install(
    dir: &Path,
    role: &Role,
    name: &str,
    key: &str,
    cert: &str,
) -> Result<CertFiles, PkiError> {
    let files = identity_files(dir, role, name);
    write_secret(&files.key, key.as_bytes())?;
    write_secret(&files.cert, cert.as_bytes())?;
    Ok(files)
}

/// Writes the cluster CA's certificate (without its key: this host cannot issue) into `dir`;
/// refuses to replace a different one.
pub fn install_ca_cert(dir: &Path, cert: &str) -> Result<(), PkiError> {
    let path = ca_files(dir).cert;
    match std::fs::read(&path) {
        Ok(held) if held == cert.as_bytes() => Ok(()),
        Ok(_) => Err(PkiError::OtherCa(path)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => write_secret(&path, cert.as_bytes()),
        Err(error) => Err(PkiError::Read { path, error }),
    }
}

/// Whether `dir` holds the CA's key: this host may issue certificates.
pub fn holds_ca_key(dir: &Path) -> bool {
    ca_files(dir).key.exists()
}

/// The CA's key as PEM text.
pub(crate) fn ca_key_pem(dir: &Path) -> Result<String, PkiError> {
    let key = ca_files(dir).key;
    read_to_string(&key).map_err(|e| match e {
        PkiError::Read { error, .. } if error.kind() == std::io::ErrorKind::NotFound => {
            PkiError::NoCa(key.clone())
        }
        e => e,
    })
}

/// The CA in `dir` as an issuer of certificates.
fn ca_issuer(dir: &Path) -> Result<Issuer<'static, KeyPair>, PkiError> {
    let ca_key = KeyPair::from_pem(&ca_key_pem(dir)?)?;
    Ok(Issuer::from_ca_cert_pem(
        &read_to_string(&ca_files(dir).cert)?,
        ca_key,
    )?)
}

/// What a certificate for identity `name` with `role` says, valid in the given window.
fn identity_params(
    role: &Role,
    name: &str,
    not_before: time::OffsetDateTime,
    not_after: time::OffsetDateTime,
) -> Result<CertificateParams, PkiError> {
    check_name(name)?;
    let mut params = match role {
        Role::Brick { hosts } => {
            for host in hosts {
                if host.is_empty() || host.len() > HOST_NAME_MAX_BYTES {
                    return Err(PkiError::BadHost(host.clone()));
                }
            }
            CertificateParams::new(hosts.clone()).map_err(|_| PkiError::BadHost(hosts.join(",")))?
        }
        Role::Client => CertificateParams::default(),
    };
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![match role {
        Role::Brick { .. } => ExtendedKeyUsagePurpose::ServerAuth,
        Role::Client => ExtendedKeyUsagePurpose::ClientAuth,
    }];
    params.use_authority_key_identifier_extension = true;
    params.not_before = not_before;
    params.not_after = not_after;
    Ok(params)
}

/// An identity is issued again when its certificate expires within this many days.
pub const RENEW_BEFORE_DAYS: i64 = 30;

/// Whether identity `name` with `role` in `dir` can be kept as it is: its key is there and is
/// its certificate's, the certificate was signed by the CA there now (its authority key id
/// is the CA's subject key id; a CA without one, not made by `kiln ca init`, never matches),
/// is valid for more than [`RENEW_BEFORE_DAYS`] and, for a brick, names every one of
/// `hosts`. Anything unreadable counts as not current.
pub fn is_current(dir: &Path, role: &Role, name: &str) -> bool {
    let files = identity_files(dir, role, name);
    let (Ok(ca), Ok(cert)) = (load_certs(&ca_files(dir).cert), load_certs(&files.cert)) else {
        return false;
    };
    let (Some(ca), Some(cert)) = (ca.first(), cert.first()) else {
        return false;
    };
    let (Ok((_, ca)), Ok((_, cert))) = (
        x509_parser::parse_x509_certificate(ca),
        x509_parser::parse_x509_certificate(cert),
    ) else {
        return false;
    };
    key_matches(&cert, &files.key)
        && signed_by(&cert, &ca)
        && lasts(&cert)
        && names_hosts(&cert, role)
}

/// Whether the key in `key` is the certificate's (an issue cut short between writing the
/// key and the certificate leaves a new key beside the old certificate).
fn key_matches(cert: &x509_parser::certificate::X509Certificate<'_>, key: &Path) -> bool {
    let Ok(pem) = read_to_string(key) else {
        return false;
    };
    KeyPair::from_pem(&pem)
        .is_ok_and(|key| key.public_key_raw() == cert.public_key().subject_public_key.data.as_ref())
}

fn signed_by(
    cert: &x509_parser::certificate::X509Certificate<'_>,
    ca: &x509_parser::certificate::X509Certificate<'_>,
) -> bool {
    use x509_parser::extensions::ParsedExtension;
    let ca_key_id = ca
        .extensions()
        .iter()
        .find_map(|e| match e.parsed_extension() {
            ParsedExtension::SubjectKeyIdentifier(id) => Some(id.0),
            _ => None,
        });
    let issuer_key_id = cert
        .extensions()
        .iter()
        .find_map(|e| match e.parsed_extension() {
            ParsedExtension::AuthorityKeyIdentifier(aki) => {
                aki.key_identifier.as_ref().map(|id| id.0)
            }
            _ => None,
        });
    ca_key_id.is_some() && ca_key_id == issuer_key_id
}

fn lasts(cert: &x509_parser::certificate::X509Certificate<'_>) -> bool {
    let renew_at = time::OffsetDateTime::now_utc() + time::Duration::days(RENEW_BEFORE_DAYS);
    cert.validity().not_after.to_datetime() > renew_at
}

fn names_hosts(cert: &x509_parser::certificate::X509Certificate<'_>, role: &Role) -> bool {
    use x509_parser::extensions::GeneralName;
    let Role::Brick { hosts } = role else {
        return true;
    };
    let Ok(Some(names)) = cert.subject_alternative_name() else {
        return hosts.is_empty();
    };
    let names = &names.value.general_names;
    let ips: Vec<std::net::IpAddr> = names
        .iter()
        .filter_map(|name| match name {
            GeneralName::IPAddress(ip) => match ip.len() {
                4 => <[u8; 4]>::try_from(*ip).ok().map(std::net::IpAddr::from),
                _ => <[u8; 16]>::try_from(*ip).ok().map(std::net::IpAddr::from),
            },
            _ => None,
        })
        .collect();
    hosts
        .iter()
        .all(|host| match host.parse::<std::net::IpAddr>() {
            Ok(ip) => ips.contains(&ip),
            Err(_) => names
                .iter()
                .any(|name| matches!(name, GeneralName::DNSName(dns) if dns == host)),
        })
}

/// A loaded identity: the trusted CA, this party's certificate chain and its private key.
#[derive(Debug)]
pub struct Identity {
    pub ca: CertificateDer<'static>,
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Identity {
            ca: self.ca.clone(),
            chain: self.chain.clone(),
            key: self.key.clone_key(),
        }
    }
}

/// Loads the CA certificate and one identity's certificate and key.
pub fn load_identity(ca_cert: &Path, files: &CertFiles) -> Result<Identity, PkiError> {
    let ca = load_certs(ca_cert)?
        .into_iter()
        .next()
        .ok_or_else(|| PkiError::Pem {
            path: ca_cert.to_owned(),
            what: "certificate",
        })?;
    let chain = load_certs(&files.cert)?;
    if chain.is_empty() {
        return Err(PkiError::Pem {
            path: files.cert.clone(),
            what: "certificate",
        });
    }
    let key =
        PrivateKeyDer::from_pem_slice(read(&files.key)?.as_slice()).map_err(|_| PkiError::Pem {
            path: files.key.clone(),
            what: "private key",
        })?;
    Ok(Identity { ca, chain, key })
}

fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, PkiError> {
    CertificateDer::pem_slice_iter(read(path)?.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| PkiError::Pem {
            path: path.to_owned(),
            what: "certificate",
        })
}

/// The identity name (common name) in a peer's certificate.
pub fn peer_name(cert: &CertificateDer<'_>) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert).ok()?;
    let name = parsed
        .subject()
        .iter_common_name()
        .next()?
        .as_str()
        .ok()?
        .to_owned();
    Some(name)
}

/// A certificate's serial number as `auth.revoked` lists it: lowercase hex, no leading zero
/// byte, no separators.
pub fn peer_serial(cert: &CertificateDer<'_>) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert).ok()?;
    let raw = parsed.tbs_certificate.raw_serial();
    let raw = match raw {
        [0, rest @ ..] if !rest.is_empty() => rest,
        raw => raw,
    };
    Some(raw.iter().map(|b| format!("{b:02x}")).collect())
}

/// The serial number of the (first) certificate in PEM file `path`, as [`peer_serial`]
/// writes it: what an operator puts in `auth.revoked` to revoke it.
pub fn serial_of(path: &Path) -> Result<String, PkiError> {
    let certs = load_certs(path)?;
    certs
        .first()
        .and_then(peer_serial)
        .ok_or_else(|| PkiError::Pem {
            path: path.to_owned(),
            what: "certificate",
        })
}

/// Checks a client or brick name: it becomes part of a file name and an `auth.allow` entry.
pub fn check_name(name: &str) -> Result<(), PkiError> {
    let ok = !name.is_empty()
        && name.len() <= IDENTITY_NAME_MAX_BYTES
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(PkiError::BadName(name.to_owned()))
    }
}

fn validity(days: u32) -> (time::OffsetDateTime, time::OffsetDateTime) {
    let now = time::OffsetDateTime::now_utc();
    // A little slack before now for clocks that differ between hosts.
    (
        now - time::Duration::hours(1),
        now + time::Duration::days(i64::from(days)),
    )
}

fn read(path: &Path) -> Result<Vec<u8>, PkiError> {
    std::fs::read(path).map_err(|error| PkiError::Read {
        path: path.to_owned(),
        error,
    })
}

fn read_to_string(path: &Path) -> Result<String, PkiError> {
    String::from_utf8(read(path)?).map_err(|_| PkiError::Pem {
        path: path.to_owned(),
        what: "PEM text",
    })
}

fn create_dir(dir: &Path) -> Result<(), PkiError> {
    durable::private_dir(dir).map_err(|e| PkiError::Write {
        path: e.path,
        error: e.error,
    })
}

/// Writes `bytes` to `path` with mode 0600, durably ([`durable::replace_file`]): a crash
/// leaves the old file or the new one, never a torn one.
fn write_secret(path: &Path, bytes: &[u8]) -> Result<(), PkiError> {
    create_dir(path.parent().unwrap_or(Path::new(".")))?;
    durable::replace_file(path, bytes, 0o600).map_err(|e| PkiError::Write {
        path: e.path,
        error: e.error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn ca_then_certs_with_private_modes() {
        let dir = tempfile::tempdir().expect("test setup");
        let tls = dir.path().join("tls");
        let ca = init_ca(&tls).expect("test setup");
        assert!(matches!(init_ca(&tls), Err(PkiError::CaExists(_))));
        let brick = Role::Brick {
            hosts: vec!["localhost".into(), "127.0.0.1".into()],
        };
        let b = issue(&tls, &brick, "b1", 30).expect("test setup");
        let c = issue(&tls, &Role::Client, "alice", 30).expect("test setup");
        for f in [&ca.cert, &ca.key, &b.cert, &b.key, &c.cert, &c.key] {
            let mode = std::fs::metadata(f)
                .expect("test setup")
                .permissions()
                .mode()
                & 0o777;
            assert_eq!(mode, 0o600, "{}", f.display());
        }
        let dir_mode = std::fs::metadata(&tls)
            .expect("test setup")
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dir_mode, 0o700);
        let id = load_identity(&ca.cert, &c).expect("test setup");
        assert_eq!(peer_name(&id.chain[0]).as_deref(), Some("alice"));
        let id = load_identity(&ca.cert, &b).expect("test setup");
        assert_eq!(peer_name(&id.chain[0]).as_deref(), Some("b1"));
    }

    /// A brick's certificate is kept while it serves, and issued again when it does not.
    #[test]
    fn a_certificate_is_current_until_it_no_longer_serves() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tls = dir.path().join("tls");
        let ca = init_ca(&tls).expect("ca");
        let hosts = vec!["localhost".into(), "127.0.0.1".into(), "::1".into()];
        let spelled = Role::Brick {
            hosts: vec!["0:0:0:0:0:0:0:1".into()],
        };
        let brick = Role::Brick {
            hosts: hosts.clone(),
        };
        assert!(!is_current(&tls, &brick, "b"), "none issued yet");
        let files = issue(&tls, &brick, "b", CERT_VALIDITY_DAYS).expect("issue");
        assert!(is_current(&tls, &brick, "b"));
        let fewer = Role::Brick {
            hosts: vec!["localhost".into()],
        };
        assert!(is_current(&tls, &fewer, "b"), "a subset of its names");
        assert!(
            is_current(&tls, &spelled, "b"),
            "an address however written"
        );
        let more = Role::Brick {
            hosts: [hosts.clone(), vec!["10.0.0.7".into()]].concat(),
        };
        assert!(!is_current(&tls, &more, "b"), "a host it does not name");
        assert!(!is_current(&tls, &Role::Client, "alice"), "never issued");

        // Expiring within the renewal window.
        let now = time::OffsetDateTime::now_utc();
        let soon = now + time::Duration::days(RENEW_BEFORE_DAYS - 1);
        issue_valid_between(&tls, &brick, "b", now, soon).expect("issue");
        assert!(!is_current(&tls, &brick, "b"));

        // Its key gone or another, or signed by a CA that is no longer the cluster's.
        issue(&tls, &brick, "b", CERT_VALIDITY_DAYS).expect("issue");
        let other_key = KeyPair::generate().expect("key").serialize_pem();
        std::fs::write(&files.key, other_key).expect("replace key");
        assert!(!is_current(&tls, &brick, "b"));
        std::fs::remove_file(&files.key).expect("remove key");
        assert!(!is_current(&tls, &brick, "b"));
        issue(&tls, &brick, "b", CERT_VALIDITY_DAYS).expect("issue");
        std::fs::remove_file(&ca.cert).expect("remove CA");
        std::fs::remove_file(&ca.key).expect("remove CA key");
        init_ca(&tls).expect("another CA");
        assert!(!is_current(&tls, &brick, "b"));
    }

    #[test]
    fn serials_name_certificates_one_to_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        init_ca(dir.path()).expect("ca");
        let a = issue(dir.path(), &Role::Client, "alice", 1).expect("alice");
        let first = serial_of(&a.cert).expect("serial");
        assert!(
            first
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        );
        assert!(!first.starts_with("00") && first.len() <= 40, "{first}");
        let again = issue(dir.path(), &Role::Client, "alice", 1).expect("re-issued");
        assert_ne!(
            serial_of(&again.cert).expect("serial"),
            first,
            "a new key, a new serial"
        );
        let chain = load_certs(&again.cert).expect("pem");
        assert_eq!(
            peer_serial(&chain[0]),
            Some(serial_of(&again.cert).expect("serial"))
        );
    }

    #[test]
    fn bad_names_and_missing_ca_are_refused() {
        let dir = tempfile::tempdir().expect("test setup");
        for bad in ["", ".hidden", "a/b", "a b", &"x".repeat(65)] {
            assert!(
                matches!(check_name(bad), Err(PkiError::BadName(_))),
                "{bad:?}"
            );
        }
        assert!(matches!(
            issue(dir.path(), &Role::Client, "alice", 1),
            Err(PkiError::NoCa(_))
        ));
        let files = identity_files(dir.path(), &Role::Client, "nobody");
        assert!(matches!(
            load_identity(&dir.path().join("ca.crt"), &files),
            Err(PkiError::Read { .. })
        ));
    }
}
