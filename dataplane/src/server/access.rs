//! Who gets in, and as whom their calls run: `auth.allow`, root squashing
//! (`server.root-squash`, `server.root-allow`, `server.anonuid`, `server.anongid`), and the
//! caps on connections per brick and per client certificate.
//!
//! A client certificate proves who the client is (a cluster node or user named in it), not
//! that it may act as root: unless its name is in `root-allow`, uid and gid 0 in a call's
//! credentials become the anonymous ids, as NFS's `root_squash` does.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use kiln_admin::pki;
use kiln_wire::Creds;

/// Client names allowed on this brick (`auth.allow`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum AuthAllow {
    /// Every client with a certificate from the cluster CA (the default).
    #[default]
    All,
    /// Only these client names.
    Names(Vec<String>),
}

impl AuthAllow {
    /// Parses `*` or a comma-separated list of client names.
    pub fn parse(list: &str) -> Result<AuthAllow, pki::PkiError> {
        if list.trim() == "*" {
            return Ok(AuthAllow::All);
        }
        parse_names(list).map(AuthAllow::Names)
    }

    pub fn allows(&self, name: &str) -> bool {
        match self {
            AuthAllow::All => true,
            AuthAllow::Names(names) => names.iter().any(|n| n == name),
        }
    }
}

/// A comma-separated list of identity names (empty: none).
pub fn parse_names(list: &str) -> Result<Vec<String>, pki::PkiError> {
    list.split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(|n| pki::check_name(n).map(|()| n.to_owned()))
        .collect()
}

/// Root squashing: what uid and gid 0 become for clients not trusted with root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootSquash {
    /// `server.root-squash`: on by default.
    pub enabled: bool,
    /// `server.anonuid`, `server.anongid`: 65534 (nobody, nogroup) by default.
    pub anon_uid: u32,
    pub anon_gid: u32,
    /// `server.root-allow`: client names whose root stays root.
    pub root_allow: Vec<String>,
}

impl Default for RootSquash {
    fn default() -> Self {
        RootSquash {
            enabled: true,
            anon_uid: 65534,
            anon_gid: 65534,
            root_allow: Vec::new(),
        }
    }
}

impl RootSquash {
    /// Whether `client`'s calls keep uid and gid 0.
    pub fn trusts(&self, client: &str) -> bool {
        !self.enabled || self.root_allow.iter().any(|n| n == client)
    }

    /// `creds` as a call from `client` runs: uid 0, gid 0 and group 0 squashed unless the
    /// client is trusted with root.
    pub fn apply(&self, client: &str, mut creds: Creds) -> Creds {
        if self.trusts(client) {
            return creds;
        }
        if creds.uid == 0 {
            creds.uid = self.anon_uid;
        }
        if creds.gid == 0 {
            creds.gid = self.anon_gid;
        }
        if creds.groups.as_slice().contains(&0) {
            let groups = creds
                .groups
                .as_slice()
                .iter()
                .map(|&g| if g == 0 { self.anon_gid } else { g })
                .collect();
            // Same length, so within the limit.
            creds.groups = kiln_wire::Groups::new(groups).unwrap_or_default();
        }
        creds
    }
}

/// Caps on open connections (each one a session with its own fd table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// `network.connections-max`: on the whole brick.
    pub per_brick: usize,
    /// `network.connections-per-client-max`: per client certificate name.
    pub per_client: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            per_brick: 1024,
            per_client: 256,
        }
    }
}

/// Counts connections against [`ConnectionLimits`]; a slot is held by an [`Admitted`].
#[derive(Debug, Clone, Default)]
pub(super) struct Admission(Arc<Mutex<Counts>>);

#[derive(Debug, Default)]
struct Counts {
    total: usize,
    per_client: HashMap<String, usize>,
}

/// Why a connection was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Full {
    Brick,
    Client,
}

/// A connection's slot; given back when dropped.
#[derive(Debug)]
pub(super) struct Admitted {
    admission: Admission,
    client: String,
}

impl Admission {
    /// Whether the brick as a whole is at its limit (checked before the TLS handshake).
    pub(super) fn brick_full(&self, limits: ConnectionLimits) -> bool {
        self.lock().total >= limits.per_brick
    }

    /// Takes a slot for `client`, or says which limit it hit.
    pub(super) fn admit(&self, client: &str, limits: ConnectionLimits) -> Result<Admitted, Full> {
        let mut counts = self.lock();
        if counts.total >= limits.per_brick {
            return Err(Full::Brick);
        }
        let mine = counts.per_client.entry(client.to_owned()).or_insert(0);
        if *mine >= limits.per_client {
            return Err(Full::Client);
        }
        *mine += 1;
        counts.total += 1;
        Ok(Admitted {
            admission: self.clone(),
            client: client.to_owned(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Counts> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut counts = self.admission.lock();
        counts.total -= 1;
        if let Some(n) = counts.per_client.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                counts.per_client.remove(&self.client);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds(uid: u32, gid: u32, groups: Vec<u32>) -> Creds {
        Creds {
            uid,
            gid,
            groups: kiln_wire::Groups::new(groups).expect("few"),
            pid: 1,
        }
    }

    #[test]
    fn root_is_squashed_unless_trusted() {
        let squash = RootSquash {
            root_allow: vec!["admin".into()],
            ..RootSquash::default()
        };
        let root = creds(0, 0, vec![0, 10]);
        assert_eq!(
            squash.apply("alice", root.clone()),
            creds(65534, 65534, vec![65534, 10])
        );
        assert_eq!(squash.apply("admin", root.clone()), root);
        assert_eq!(
            squash.apply("alice", creds(1000, 100, vec![])),
            creds(1000, 100, vec![])
        );
        let off = RootSquash {
            enabled: false,
            ..RootSquash::default()
        };
        assert_eq!(off.apply("alice", root.clone()), root);
    }

    #[test]
    fn admission_counts_per_brick_and_per_client() {
        let limits = ConnectionLimits {
            per_brick: 3,
            per_client: 2,
        };
        let admission = Admission::default();
        let a1 = admission.admit("alice", limits).expect("first");
        let _a2 = admission.admit("alice", limits).expect("second");
        assert_eq!(admission.admit("alice", limits).err(), Some(Full::Client));
        let _b = admission.admit("bob", limits).expect("bob");
        assert!(admission.brick_full(limits));
        assert_eq!(admission.admit("carol", limits).err(), Some(Full::Brick));
        drop(a1);
        admission.admit("carol", limits).expect("a slot came back");
    }
}
