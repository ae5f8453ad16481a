//! Acting as the caller: the brick runs as root, and a fop's user-visible steps run with the
//! caller's uid, gid and groups so the kernel checks permissions exactly as it would for a
//! local process (sticky directories, set-gid inheritance, ACLs included).
//!
//! On Linux credentials are per thread; these calls switch only the calling thread (rustix's
//! raw syscalls, not glibc's process-wide `setresuid`). Changing the effective uid from 0
//! clears the thread's effective capabilities and changing it back restores them, which is what
//! makes the kernel treat the thread as an ordinary user for the step. The io_uring engine
//! captures the same credentials once as a registered personality (see `exec::uring`).

use kiln_wire::Creds;
use rustix::io::Errno;
use rustix::process::{Gid, Uid};
use rustix::thread::{set_thread_groups, set_thread_res_gid, set_thread_res_uid};

/// While alive, the calling thread acts as `creds`; dropping it returns to root.
#[derive(Debug)]
pub struct ActAs {
    switched: bool,
}

impl ActAs {
    /// Switches the calling thread to `creds` (nothing to do for root).
    pub fn new(creds: &Creds) -> Result<ActAs, Errno> {
        if creds.uid == 0 {
            return Ok(ActAs { switched: false });
        }
        let groups: Vec<Gid> = creds
            .groups
            .as_slice()
            .iter()
            .map(|&g| Gid::from_raw(g))
            .collect();
        let guard = ActAs { switched: true };
        // Groups and gid first: changing them needs the capabilities the uid switch drops.
        set_thread_groups(&groups)?;
        set_thread_res_gid(Gid::ROOT, Gid::from_raw(creds.gid), Gid::ROOT)?;
        set_thread_res_uid(Uid::ROOT, Uid::from_raw(creds.uid), Uid::ROOT)?;
        Ok(guard)
    }
}

impl Drop for ActAs {
    fn drop(&mut self) {
        if !self.switched {
            return;
        }
        // Restoring root cannot fail while the saved uid is 0; if it ever did, continuing
        // would run brick-internal steps as a user, so stop the process instead.
        let restored = set_thread_res_uid(Uid::ROOT, Uid::ROOT, Uid::ROOT)
            .and_then(|()| set_thread_res_gid(Gid::ROOT, Gid::ROOT, Gid::ROOT))
            .and_then(|()| set_thread_groups(&[]));
        if let Err(e) = restored {
            eprintln!("kiln-brickd: cannot restore root credentials ({e}); aborting");
            std::process::abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_wire::Groups;

    #[test]
    fn acting_as_a_user_drops_and_restores_privilege() {
        let dir = tempfile::tempdir().expect("tempdir");
        let user = Creds {
            uid: 4321,
            gid: 4321,
            groups: Groups::default(),
            pid: 1,
        };
        {
            let _as = ActAs::new(&user).expect("switch");
            assert_eq!(rustix::process::geteuid().as_raw(), 4321);
            // A user cannot create files in a root-owned 0700 directory.
            let denied = std::fs::File::create(dir.path().join("x"));
            assert_eq!(
                denied.map_err(|e| e.kind()).err(),
                Some(std::io::ErrorKind::PermissionDenied)
            );
        }
        assert!(rustix::process::geteuid().is_root());
        std::fs::File::create(dir.path().join("x")).expect("root creates");
    }
}
