//! What a fop touches (`docs/wire.md`, "Conflicts"): the directories it looks at or changes,
//! before ([`Touches`]) and after ([`Targets`]) its fd and the directory it would remove are
//! resolved.

use kiln_wire::{FdId, FopRequest, Gfid, Name, OpenFlags, PutSynced, RenameMode};

/// How a fop uses a directory it touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Reads it, or names something in it, or works on it without changing it.
    Look,
    /// Makes, removes or renames an entry there, sets its attributes or xattrs, removes it.
    Change,
}

/// What a fop touches, before its fd and the directory it would remove are resolved.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Touches {
    /// Parents of entry fops and the objects of GFID fops.
    pub dirs: Vec<(Gfid, Access)>,
    /// The open fd of an fd fop, whose object is touched.
    pub fd: Option<(FdId, Access)>,
    /// The entry (parent, name) the fop would remove: an RMDIR's, an UNLINK's, a replacing
    /// RENAME's target.
    pub removes: Option<(Gfid, Name)>,
    /// The entries (parent, name) a RENAME moves — its source, and an exchange's target:
    /// their objects change (their ctime), which a listing of another of their names, or a
    /// lease on the object itself, shows.
    pub moves: Vec<(Gfid, Name)>,
}

/// What `fop` touches (`docs/wire.md`, "Conflicts"). LEASE touches nothing: it has rules of
/// its own.
pub fn touches(fop: &FopRequest) -> Touches {
    use Access::{Change, Look};
    use FopRequest as Q;
    let dirs = |list: &[(Gfid, Access)]| Touches {
        dirs: list.to_vec(),
        ..Touches::default()
    };
    let fd = |fd: FdId, access: Access| Touches {
        fd: Some((fd, access)),
        ..Touches::default()
    };
    match fop {
        Q::Lookup(r) => dirs(&[(r.parent, Look)]),
        Q::LookupXattrs(r) => dirs(&[(r.parent, Look)]),
        Q::Mknod(r) => dirs(&[(r.parent, Change)]),
        Q::Mkdir(r) => dirs(&[(r.parent, Change)]),
        Q::Symlink(r) => dirs(&[(r.parent, Change)]),
        Q::Create(r) => dirs(&[(r.parent, Change)]),
        Q::Put(r) | Q::PutSynced(PutSynced { put: r }) => dirs(&[(r.parent, Change)]),
        // A name gone changes its object's link count: the object is looked up when another
        // session's lease may be on it (`Targets::unresolved`).
        Q::Unlink(r) => Touches {
            removes: Some((r.parent, r.name.clone())),
            ..dirs(&[(r.parent, Change)])
        },
        Q::UnlinkSettled(r) => Touches {
            removes: Some((r.parent, r.name.clone())),
            ..dirs(&[(r.parent, Change)])
        },
        Q::Rmdir(r) => Touches {
            removes: Some((r.parent, r.name.clone())),
            ..dirs(&[(r.parent, Change)])
        },
        Q::Rename(r) => Touches {
            removes: (r.mode == RenameMode::Replace).then(|| (r.new_parent, r.new_name.clone())),
            moves: match r.mode {
                RenameMode::Exchange => vec![
                    (r.old_parent, r.old_name.clone()),
                    (r.new_parent, r.new_name.clone()),
                ],
                _ => vec![(r.old_parent, r.old_name.clone())],
            },
            ..dirs(&[(r.old_parent, Change), (r.new_parent, Change)])
        },
        // A new name changes the object's link count.
        Q::Link(r) => dirs(&[(r.gfid, Change), (r.new_parent, Change)]),
        Q::Stat(r) => dirs(&[(r.gfid, Look)]),
        Q::Access(r) => dirs(&[(r.gfid, Look)]),
        Q::Readlink(r) => dirs(&[(r.gfid, Look)]),
        Q::Statfs(r) => dirs(&[(r.gfid, Look)]),
        Q::Getxattr(r) => dirs(&[(r.gfid, Look)]),
        Q::Listxattr(r) => dirs(&[(r.gfid, Look)]),
        Q::Open(r) if r.flags.contains(OpenFlags::TRUNC) => dirs(&[(r.gfid, Change)]),
        Q::Open(r) => dirs(&[(r.gfid, Look)]),
        Q::Get(r) => dirs(&[(r.gfid, Look)]),
        Q::Opendir(r) => dirs(&[(r.gfid, Look)]),
        Q::OpendirList(r) => dirs(&[(r.gfid, Look)]),
        Q::Setattr(r) => dirs(&[(r.gfid, Change)]),
        Q::Truncate(r) => dirs(&[(r.gfid, Change)]),
        Q::Setxattr(r) => dirs(&[(r.gfid, Change)]),
        Q::Removexattr(r) => dirs(&[(r.gfid, Change)]),
        Q::Lease(_) => Touches::default(),
        Q::Write(r) => fd(r.fd, Change),
        Q::Ftruncate(r) => fd(r.fd, Change),
        Q::Fallocate(r) => fd(r.fd, Change),
        Q::Discard(r) => fd(r.fd, Change),
        Q::Zerofill(r) => fd(r.fd, Change),
        Q::Fsetxattr(r) => fd(r.fd, Change),
        Q::Fremovexattr(r) => fd(r.fd, Change),
        Q::Fsetattr(r) => fd(r.fd, Change),
        // Every other fop names an fd and only reads through it (or releases it).
        other => other.fd().map_or_else(Touches::default, |f| fd(f, Look)),
    }
}

/// The directories one fop touches, resolved: what the check looks at.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Targets {
    pub(super) dirs: Vec<(Gfid, Access)>,
    /// The directory the fop would remove (also among `dirs`, as a change).
    pub(super) removed: Option<Gfid>,
    /// The directories where a listing under a lease returned an object the fop changes
    /// (`listed`): changed too, for the leases there, but never stale for its own session.
    pub(super) listed_in: Vec<Gfid>,
    /// The fop removes or moves a name whose object (not a directory) was not looked up, as
    /// no other session held a lease then: checked again under the lock, and a grant to another
    /// session waits until it ends.
    pub(super) unresolved: bool,
}

impl Targets {
    pub fn new(mut dirs: Vec<(Gfid, Access)>, removed: Option<Gfid>) -> Targets {
        if let Some(gfid) = removed {
            dirs.push((gfid, Access::Change));
        }
        Targets {
            dirs,
            removed,
            listed_in: Vec::new(),
            unresolved: false,
        }
    }

    /// These targets, for a fop that removes or moves a name whose object was not looked up.
    pub fn unresolved(self) -> Targets {
        Targets {
            unresolved: true,
            ..self
        }
    }

    /// Every directory touched, with how.
    pub(super) fn all(&self) -> impl Iterator<Item = (Gfid, Access)> + '_ {
        let listed_in = self.listed_in.iter().map(|&g| (g, Access::Change));
        self.dirs.iter().copied().chain(listed_in)
    }

    /// The objects the fop changes.
    pub(super) fn changed(&self) -> impl Iterator<Item = &Gfid> {
        let changes = self.dirs.iter().filter(|(_, a)| *a == Access::Change);
        changes.map(|(g, _)| g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gfid(n: u8) -> Gfid {
        Gfid::from_bytes([n; 16]).expect("not null")
    }

    #[test]
    fn fops_touch_what_the_contract_says() {
        use kiln_wire::{Lookup, Rename, Rmdir, Setattr, Write as WriteFop};
        let (p, q) = (gfid(1), gfid(2));
        let n = Name::new("x".to_owned()).expect("name");
        let lookup = touches(
            &Lookup {
                parent: p,
                name: n.clone(),
            }
            .into(),
        );
        assert_eq!(lookup.dirs, [(p, Access::Look)]);
        let rmdir = touches(
            &Rmdir {
                parent: p,
                name: n.clone(),
            }
            .into(),
        );
        assert_eq!(rmdir.dirs, [(p, Access::Change)]);
        assert_eq!(rmdir.removes, Some((p, n.clone())));
        let unlink = touches(
            &kiln_wire::Unlink {
                parent: p,
                name: n.clone(),
            }
            .into(),
        );
        assert_eq!(unlink.dirs, [(p, Access::Change)]);
        assert_eq!(unlink.removes, Some((p, n.clone())));
        let rename = |mode| Rename {
            old_parent: p,
            old_name: n.clone(),
            new_parent: q,
            new_name: n.clone(),
            mode,
        };
        let replace = touches(&rename(RenameMode::Replace).into());
        assert_eq!(replace.dirs, [(p, Access::Change), (q, Access::Change)]);
        assert_eq!(replace.removes, Some((q, n.clone())));
        assert_eq!(replace.moves, [(p, n.clone())]);
        let exchange = touches(&rename(RenameMode::Exchange).into());
        assert_eq!(exchange.removes, None);
        assert_eq!(exchange.moves, [(p, n.clone()), (q, n.clone())]);
        let setattr = Setattr {
            gfid: p,
            attr: Default::default(),
        };
        assert_eq!(touches(&setattr.into()).dirs, [(p, Access::Change)]);
        let fd = FdId {
            slot: 7,
            generation: 1,
        };
        let write = WriteFop {
            fd,
            offset: 0,
            data: kiln_wire::Payload::new(bytes::Bytes::new()).expect("empty"),
        };
        assert_eq!(touches(&write.into()).fd, Some((fd, Access::Change)));
        let fstat = kiln_wire::Fstat { fd };
        assert_eq!(touches(&fstat.into()).fd, Some((fd, Access::Look)));
    }
}
