//! The distribution layer: one namespace over many bricks, placed as GlusterFS's DHT places
//! it, so the bricks of a distributed GlusterFS volume are served in place.
//!
//! * **Directories** exist on every brick with the same GFID; each copy carries its share of
//!   the directory's [`Layout`] (`trusted.glusterfs.dht`). A directory's layout is read from
//!   all bricks once and cached; one with no layout anywhere (a fresh root) gets one.
//! * **Files** (and symlinks, special files) live on the brick their name hashes to in the
//!   parent's layout — or elsewhere, with a **link file** on the hashed brick (mode
//!   `---------T`, size 0, the same GFID, `trusted.glusterfs.dht.linkto` naming the brick that
//!   holds the data), as a rename to a name hashed elsewhere leaves. Which brick holds an
//!   object is remembered by GFID.
//! * **LOOKUP** asks the hashed brick and follows a link file; a miss there is the answer
//!   when the layout has no holes and was committed (GlusterFS's `lookup-optimize`), else
//!   every brick is asked.
//! * **MKDIR** runs on the hashed brick first, then the others, and writes the new layout;
//!   **RMDIR** removes the other copies first and the hashed one last, and puts back the
//!   copies it removed when one brick still has entries. **RENAME** of a file renames it on
//!   the brick that holds it and leaves a link file on the new name's hashed brick; of a
//!   directory, on every brick.
//! * **READDIRP** lists brick after brick, each directory once (from the first brick) and no
//!   link files, with offsets of this layer's own that map to (brick, brick offset).
//! * **STATFS** sums the bricks. Leases are not offered through this layer (yet).
//! * **Heal.** A LOOKUP that finds a directory makes its copies missing on some brick, and
//!   rebuilds a layout with holes or overlaps, or one that leaves a brick out, over every
//!   brick (uncommitted, so names placed by the old one stay reachable);
//!   [`Distribute::heal_tree`] looks up every directory (`kiln volume heal`).
//!
//! Layouts are written as root: the client of a distributed volume must be trusted with root
//! by its bricks (`server.root-allow`), as GlusterFS's DHT writes them as root too.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use kiln_wire::{
    AccessMode, Batch, BatchReply, Creds, DirEntry, DirEntryXattrs, EntryReply, ErrorCode,
    FileType, FopCode, FopReply, FopRequest, FsStats, Gfid, Iatt, Mode, Name, NodeType, OpenFlags,
    ReaddirSize, ReaddirpXattrsReply, XattrName, XattrSetMode, XattrValue,
};
use tokio::sync::broadcast;

use super::{COMMIT_HASH_INVALID, DiskLayout, Layout, Munging, XATTR_NAME, first_brick};
use crate::layer::{FdFop, Layer, LayerEvent};
use crate::{Error, LayerExt, Paths};

/// The xattr of a link file: the name of the subvolume (brick) that holds the data.
pub const LINKTO_XATTR: &str = "trusted.glusterfs.dht.linkto";
/// Objects whose brick this layer remembers; the least recently used is forgotten first
/// (and found again by asking every brick).
const HOMES_MAX: usize = 1 << 20;
/// Directory layouts this layer keeps.
const LAYOUTS_MAX: usize = 64 * 1024;
/// The mode of a link file: the sticky bit alone (`---------T`).
const LINK_FILE_MODE: u32 = 0o1000;

/// Where an object lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Home {
    /// A directory: on every brick.
    Everywhere,
    /// Anything else: on this brick.
    Brick(usize),
}

/// A volume's bricks behind one namespace. `L` is the layer below, one per brick, in the
/// volume's brick order (GlusterFS's `VOLUME-client-N` is brick N).
#[derive(Debug)]
pub struct Distribute<L: Layer> {
    bricks: Vec<L>,
    /// The volume's name: link files name bricks `VOLUME-client-N`.
    volume: String,
    munging: Munging,
    layouts: Mutex<lru::LruCache<Gfid, Arc<Layout>>>,
    homes: Mutex<lru::LruCache<Gfid, Home>>,
    /// Never sent on: no leases through this layer.
    events: broadcast::Sender<LayerEvent>,
    healed: Healed,
}

/// What [`Distribute::heal_tree`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealReport {
    /// Directories walked.
    pub dirs: u64,
    /// Directory copies made on bricks that lacked them.
    pub copies_made: u64,
    /// Layouts rebuilt over every brick.
    pub layouts_healed: u64,
}

/// What the directory self-heal did, counted.
#[derive(Debug, Default)]
struct Healed {
    dirs: AtomicU64,
    layouts: AtomicU64,
}

/// This layer's handle on an open file (its brick's fd) or directory (every brick's).
#[derive(Debug)]
pub enum DistFd<F> {
    File { brick: usize, fd: F },
    Dir(DirFds<F>),
}

/// An open directory: its fd on each brick that has it, and the offsets given out.
#[derive(Debug)]
pub struct DirFds<F> {
    fds: Vec<Option<F>>,
    /// Offset `n` (from 1) continues listing brick `.0` after its offset `.1`.
    offsets: Mutex<Vec<(usize, u64)>>,
}

impl<L: Layer> Distribute<L> {
    /// The layer over `bricks` of volume `volume` (at least one).
    pub fn new(bricks: Vec<L>, volume: &str) -> Result<Distribute<L>, Error> {
        if bricks.is_empty() {
            return Err(Error::Misuse("a distributed volume needs a brick".into()));
        }
        Ok(Distribute {
            bricks,
            volume: volume.to_owned(),
            munging: Munging::default(),
            layouts: Mutex::new(lru::LruCache::new(capacity(LAYOUTS_MAX))),
            homes: Mutex::new(lru::LruCache::new(capacity(HOMES_MAX))),
            events: broadcast::channel(1).0,
            healed: Healed::default(),
        })
    }

    /// The bricks below, in order.
    pub fn bricks(&self) -> &[L] {
        &self.bricks
    }

    /// The layout of directory `dir`: cached, else read from every brick; a directory with
    /// no layout on any brick (a volume's fresh root) is given one.
    pub async fn layout(&self, dir: Gfid) -> Result<Arc<Layout>, Error> {
        if let Some(layout) = lock(&self.layouts).get(&dir) {
            return Ok(layout.clone());
        }
        let mut disks = Vec::with_capacity(self.bricks.len());
        for brick in &self.bricks {
            disks.push(read_disk_layout(brick, dir).await?);
        }
        let layout = if disks.iter().all(Option::is_none) {
            self.write_new_layout(dir).await?
        } else {
            Layout::from_disk(&disks).map_err(|e| layout_error(dir, &e))?
        };
        let layout = Arc::new(layout);
        lock(&self.layouts).put(dir, layout.clone());
        Ok(layout)
    }

    /// Gives directory `dir` a new layout over every brick, equal shares.
    async fn write_new_layout(&self, dir: Gfid) -> Result<Layout, Error> {
        let n = self.bricks.len();
        let first =
            first_brick(dir.to_string().as_bytes(), n).map_err(|e| layout_error(dir, &e))?;
        let layout =
            Layout::new_directory(&vec![1; n], first, 0).map_err(|e| layout_error(dir, &e))?;
        self.store_layout(dir, &layout).await?;
        Ok(layout)
    }

    /// Writes `layout` of directory `dir` to every brick's copy, and keeps it.
    async fn store_layout(&self, dir: Gfid, layout: &Layout) -> Result<(), Error> {
        for brick in 0..self.bricks.len() {
            if let Some(disk) = layout.disk_layout(brick) {
                self.set_disk_layout(brick, dir, disk).await?;
            }
        }
        lock(&self.layouts).put(dir, Arc::new(layout.clone()));
        Ok(())
    }

    /// Replaces the layout of directory `dir`, which has holes or overlaps or leaves a brick
    /// out, by one over every brick that keeps as many hashes where they are as it can. It
    /// is written uncommitted: names placed by the old one are still found (a miss on the
    /// hashed brick asks every brick) until a rebalance moves them.
    async fn heal_layout(&self, dir: Gfid, old: &Layout) -> Result<(), Error> {
        let weights = vec![1; self.bricks.len()];
        let healed = old
            .rebalanced(&weights)
            .map_err(|e| layout_error(dir, &e))?
            .with_commit_hash(COMMIT_HASH_INVALID);
        self.store_layout(dir, &healed).await?;
        self.healed.layouts.fetch_add(1, Ordering::Relaxed);
        tracing::info!(%dir, "healed a directory's layout");
        Ok(())
    }

    /// The brick `name` hashes to in directory `parent`.
    async fn hashed(&self, parent: Gfid, name: &Name) -> Result<(usize, Arc<Layout>), Error> {
        let layout = self.layout(parent).await?;
        match layout.hashed_brick(name.as_bytes(), self.munging) {
            Some(brick) => Ok((brick, layout)),
            // A hole: GlusterFS answers EIO until the layout is healed.
            None => Err(Error::Fop(ErrorCode::Io)),
        }
    }

    /// Remembers where the object `iatt` describes lives, found on brick `brick`.
    fn note_home(&self, iatt: &Iatt, brick: usize) -> Home {
        let home = match iatt.file_type {
            FileType::Directory => Home::Everywhere,
            _ => Home::Brick(brick),
        };
        lock(&self.homes).put(iatt.gfid, home);
        home
    }

    /// Where object `gfid` lives: remembered, else found by asking every brick.
    async fn home(&self, creds: &Creds, gfid: Gfid) -> Result<Home, Error> {
        if gfid.is_root() {
            return Ok(Home::Everywhere);
        }
        if let Some(home) = lock(&self.homes).get(&gfid) {
            return Ok(*home);
        }
        let mut failure = Error::Fop(ErrorCode::Stale);
        for (i, brick) in self.bricks.iter().enumerate() {
            match brick.stat(creds, gfid).await {
                Ok(iatt) if !is_link_file(&iatt) => return Ok(self.note_home(&iatt, i)),
                Ok(_) | Err(Error::Fop(ErrorCode::Stale | ErrorCode::NoEnt)) => {}
                Err(e) => failure = e,
            }
        }
        Err(failure)
    }

    /// The entry `name` in `parent`: its attributes and the brick holding it (following a
    /// link file), with `fop` (a LOOKUP or LOOKUP_XATTRS of it) answered there.
    async fn locate(
        &self,
        creds: &Creds,
        parent: Gfid,
        name: &Name,
        fop: FopRequest,
    ) -> Result<Located, Error> {
        let (hashed, layout) = self.hashed(parent, name).await?;
        match self.bricks[hashed].call(creds, fop.clone()).await {
            Ok(reply) => {
                let iatt = entry_iatt(&reply)?.clone();
                if !is_link_file(&iatt) {
                    self.note_home(&iatt, hashed);
                    return Ok(Located {
                        hashed,
                        home: hashed,
                        reply,
                        iatt,
                    });
                }
                let home = self.link_target(hashed, iatt.gfid).await?;
                let reply = self.bricks[home].call(creds, fop).await?;
                let iatt = entry_iatt(&reply)?.clone();
                self.note_home(&iatt, home);
                Ok(Located {
                    hashed,
                    home,
                    reply,
                    iatt,
                })
            }
            // Authoritative when every hash has a brick and the layout was committed
            // (GlusterFS's lookup-optimize): a volume's root, whose layout GlusterFS writes
            // uncommitted, may hold names a client in another locale hashed elsewhere.
            Err(Error::Fop(ErrorCode::NoEnt))
                if layout.check().is_ok() && layout.commit_hash() != COMMIT_HASH_INVALID =>
            {
                Err(Error::Fop(ErrorCode::NoEnt))
            }
            Err(Error::Fop(ErrorCode::NoEnt)) => self.locate_everywhere(creds, hashed, fop).await,
            Err(e) => Err(e),
        }
    }

    /// LOOKUP `fop` on every brick but `hashed`: the first that has the entry (not a link
    /// file).
    async fn locate_everywhere(
        &self,
        creds: &Creds,
        hashed: usize,
        fop: FopRequest,
    ) -> Result<Located, Error> {
        for (i, brick) in self.bricks.iter().enumerate().filter(|(i, _)| *i != hashed) {
            match brick.call(creds, fop.clone()).await {
                Ok(reply) => {
                    let iatt = entry_iatt(&reply)?.clone();
                    if !is_link_file(&iatt) {
                        self.note_home(&iatt, i);
                        return Ok(Located {
                            hashed,
                            home: i,
                            reply,
                            iatt,
                        });
                    }
                }
                Err(Error::Fop(ErrorCode::NoEnt)) => {}
                Err(e) => return Err(e),
            }
        }
        Err(Error::Fop(ErrorCode::NoEnt))
    }

    /// The brick a link file on brick `on` (object `gfid`) points to.
    async fn link_target(&self, on: usize, gfid: Gfid) -> Result<usize, Error> {
        let get = kiln_wire::Getxattr {
            gfid,
            name: xattr_name(LINKTO_XATTR),
        };
        let value = match self.bricks[on].call(&Creds::root(), get.into()).await? {
            FopReply::Getxattr(r) => r.value,
            other => return Err(unexpected(&other)),
        };
        self.brick_named(value.as_bytes())
            .ok_or_else(|| Error::Protocol(format!("a link file points to unknown {value:?}")))
    }

    /// The index of the brick a link file names (`VOLUME-client-N`, maybe NUL-ended).
    fn brick_named(&self, name: &[u8]) -> Option<usize> {
        let name = name.strip_suffix(b"\0").unwrap_or(name);
        let (_, n) = std::str::from_utf8(name).ok()?.rsplit_once("-client-")?;
        n.parse().ok().filter(|&n| n < self.bricks.len())
    }

    /// What a link file to brick `brick` says.
    fn link_value(&self, brick: usize) -> XattrValue {
        let name = format!("{}-client-{brick}\0", self.volume);
        XattrValue::new(Bytes::from(name.into_bytes()))
            .unwrap_or_else(|_| unreachable!("a volume name is at most 64 bytes"))
    }

    /// Makes a link file `name` in `parent` on brick `on`, pointing to brick `home` where
    /// object `gfid` lives.
    async fn make_link_file(
        &self,
        on: usize,
        parent: Gfid,
        name: &Name,
        gfid: Gfid,
        home: usize,
    ) -> Result<(), Error> {
        let root = Creds::root();
        // Another name of the object has a link file there already: one more name for it
        // (a GFID is one object per brick).
        if let Ok(iatt) = self.bricks[on].stat(&root, gfid).await
            && is_link_file(&iatt)
        {
            let link = kiln_wire::Link {
                gfid,
                new_parent: parent,
                new_name: name.clone(),
            };
            return self.bricks[on].call(&root, link.into()).await.map(drop);
        }
        let mknod = kiln_wire::Mknod {
            parent,
            name: name.clone(),
            gfid,
            node_type: NodeType::Regular,
            mode: Mode::new(LINK_FILE_MODE).unwrap_or(Mode::from_st_mode(0)),
            umask: Mode::from_st_mode(0),
            rdev: 0,
        };
        self.bricks[on].call(&root, mknod.into()).await?;
        let set = kiln_wire::Setxattr {
            gfid,
            name: xattr_name(LINKTO_XATTR),
            value: self.link_value(home),
            mode: XattrSetMode::Create,
        };
        self.bricks[on].call(&root, set.into()).await.map(drop)
    }

    /// Removes the link file `name` in `parent` on brick `on`; one already gone is fine.
    async fn remove_link_file(&self, on: usize, parent: Gfid, name: &Name) -> Result<(), Error> {
        let unlink = kiln_wire::Unlink {
            parent,
            name: name.clone(),
        };
        match self.bricks[on].call(&Creds::root(), unlink.into()).await {
            Ok(_) | Err(Error::Fop(ErrorCode::NoEnt)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Runs `fop` on brick `home` of the object it names, or on every brick for a directory
    /// (the first brick's answer; a directory missing on another brick is skipped).
    async fn on_object(
        &self,
        creds: &Creds,
        gfid: Gfid,
        fop: FopRequest,
    ) -> Result<FopReply, Error> {
        match self.home(creds, gfid).await? {
            Home::Brick(b) => self.bricks[b].call(creds, fop).await,
            Home::Everywhere if changes_object(&fop) => {
                let first = self.bricks[0].call(creds, fop.clone()).await?;
                for brick in &self.bricks[1..] {
                    match brick.call(creds, fop.clone()).await {
                        Ok(_) | Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(first)
            }
            Home::Everywhere => {
                let reply = self.bricks[0].call(creds, fop).await?;
                self.merged_dir(creds, reply, 0).await
            }
        }
    }

    /// A directory's attributes as one: those in `reply` (from brick `from`) with the latest
    /// times of every copy, so that a change on any brick shows in the directory's mtime and
    /// ctime (GlusterFS's `dht_iatt_merge`). Any other reply is returned as it is.
    async fn merged_dir(
        &self,
        creds: &Creds,
        mut reply: FopReply,
        from: usize,
    ) -> Result<FopReply, Error> {
        let iatt = match &mut reply {
            FopReply::Lookup(r) => &mut r.iatt,
            FopReply::LookupXattrs(r) => &mut r.iatt,
            FopReply::Stat(r) => &mut r.iatt,
            _ => return Ok(reply),
        };
        if iatt.file_type != FileType::Directory {
            return Ok(reply);
        }
        for (_, brick) in self.bricks.iter().enumerate().filter(|(i, _)| *i != from) {
            if let Ok(copy) = brick.stat(creds, iatt.gfid).await {
                merge_times(iatt, &copy);
            }
        }
        Ok(reply)
    }

    /// The answer to a LOOKUP that found `found` (`name` in `parent`); a directory is made
    /// whole first (GlusterFS's directory self-heal): its copies missing on some brick are
    /// made again (same GFID, mode and owner), a layout with holes or overlaps, or one that
    /// leaves a brick out, is rebuilt over every brick, and its times are merged from
    /// every copy.
    async fn looked_up(
        &self,
        creds: &Creds,
        parent: Gfid,
        name: &Name,
        found: Located,
    ) -> Result<FopReply, Error> {
        let mut reply = found.reply;
        if found.iatt.file_type != FileType::Directory {
            return Ok(reply);
        }
        let iatt = match &mut reply {
            FopReply::Lookup(r) => &mut r.iatt,
            FopReply::LookupXattrs(r) => &mut r.iatt,
            other => return Err(unexpected(other)),
        };
        let mut missing = Vec::new();
        for (i, brick) in self
            .bricks
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != found.home)
        {
            match brick.stat(creds, iatt.gfid).await {
                Ok(copy) => merge_times(iatt, &copy),
                Err(Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) => missing.push(i),
                // A brick out of reach has nothing to heal now.
                Err(_) => {}
            }
        }
        for &brick in &missing {
            self.make_dir_copy(brick, parent, name, &found.iatt).await?;
            self.healed.dirs.fetch_add(1, Ordering::Relaxed);
            tracing::info!(dir = %found.iatt.gfid, brick, "made a directory's missing copy");
        }
        let layout = self.layout(found.iatt.gfid).await?;
        let covers_every_brick = (0..self.bricks.len()).all(|b| layout.range(b).is_some());
        if layout.check().is_err() || !covers_every_brick {
            self.heal_layout(found.iatt.gfid, &layout).await?;
        }
        Ok(reply)
    }

    /// Makes the copy of directory `iatt` (`name` in `parent`) on brick `brick`: same GFID,
    /// mode and owner.
    async fn make_dir_copy(
        &self,
        brick: usize,
        parent: Gfid,
        name: &Name,
        iatt: &Iatt,
    ) -> Result<(), Error> {
        let root = Creds::root();
        let mkdir = kiln_wire::Mkdir {
            parent,
            name: name.clone(),
            gfid: iatt.gfid,
            mode: iatt.mode,
            umask: Mode::from_st_mode(0),
        };
        match self.bricks[brick].call(&root, mkdir.into()).await {
            Ok(_) | Err(Error::Fop(ErrorCode::Exist)) => {}
            Err(e) => return Err(e),
        }
        let owner = kiln_wire::Setattr {
            gfid: iatt.gfid,
            attr: kiln_wire::SetAttr {
                uid: Some(iatt.uid),
                gid: Some(iatt.gid),
                ..kiln_wire::SetAttr::default()
            },
        };
        self.bricks[brick].call(&root, owner.into()).await.map(drop)
    }

    /// Walks the whole tree, looking up every directory, so each is healed (see
    /// [`Layer::call`] of LOOKUP): what `kiln volume heal` runs. A directory whose first
    /// brick lacks it is not listed, and so not reached, by this walk.
    pub async fn heal_tree(&self, creds: &Creds) -> Result<HealReport, Error> {
        let before = self.healed();
        let root = self.layout(Gfid::ROOT).await?;
        let covers_every_brick = (0..self.bricks.len()).all(|b| root.range(b).is_some());
        if root.check().is_err() || !covers_every_brick {
            self.heal_layout(Gfid::ROOT, &root).await?;
        }
        let (mut pending, mut dirs) = (vec![Gfid::ROOT], 0);
        while let Some(dir) = pending.pop() {
            dirs += 1;
            for entry in self.read_dir(creds, dir).await? {
                if entry.iatt.file_type == FileType::Directory {
                    let lookup = kiln_wire::Lookup {
                        parent: dir,
                        name: entry.name,
                    };
                    self.call(creds, lookup.into()).await?;
                    pending.push(entry.iatt.gfid);
                }
            }
        }
        let after = self.healed();
        Ok(HealReport {
            dirs,
            copies_made: after.0 - before.0,
            layouts_healed: after.1 - before.1,
        })
    }

    /// How many directory copies and layouts this layer has healed.
    pub fn healed(&self) -> (u64, u64) {
        (
            self.healed.dirs.load(Ordering::Relaxed),
            self.healed.layouts.load(Ordering::Relaxed),
        )
    }

    /// A new name made on its hashed brick (MKNOD, SYMLINK, PUT).
    async fn make_file(
        &self,
        creds: &Creds,
        parent: Gfid,
        name: &Name,
        fop: FopRequest,
    ) -> Result<FopReply, Error> {
        let (hashed, _) = self.hashed(parent, name).await?;
        let reply = self.bricks[hashed].call(creds, fop).await?;
        self.note_home(entry_iatt(&reply)?, hashed);
        Ok(reply)
    }

    async fn mkdir(&self, creds: &Creds, r: kiln_wire::Mkdir) -> Result<FopReply, Error> {
        let (hashed, _) = self.hashed(r.parent, &r.name).await?;
        let reply = self.bricks[hashed].call(creds, r.clone().into()).await?;
        for (i, brick) in self.bricks.iter().enumerate().filter(|(i, _)| *i != hashed) {
            if let Err(e) = brick.call(creds, r.clone().into()).await {
                // GlusterFS heals a copy missing on a brick at its next lookup; this layer
                // does not heal yet, so the gap stays until `kiln volume heal` exists.
                tracing::warn!(brick = i, error = %e, "mkdir did not reach every brick");
            }
        }
        let layout = self.write_new_layout(r.gfid).await?;
        lock(&self.layouts).put(r.gfid, Arc::new(layout));
        lock(&self.homes).put(r.gfid, Home::Everywhere);
        Ok(reply)
    }

    /// RMDIR: the copies on other bricks first, the hashed brick's last; when a brick still
    /// has entries, the copies removed are put back (same GFID, mode and layout) and the
    /// answer is ENOTEMPTY.
    async fn rmdir(&self, creds: &Creds, r: kiln_wire::Rmdir) -> Result<FopReply, Error> {
        let lookup = kiln_wire::Lookup {
            parent: r.parent,
            name: r.name.clone(),
        };
        let found = self.locate(creds, r.parent, &r.name, lookup.into()).await?;
        if found.iatt.file_type != FileType::Directory {
            return Err(Error::Fop(ErrorCode::NotDir));
        }
        let order = (0..self.bricks.len())
            .filter(|&i| i != found.hashed)
            .chain([found.hashed]);
        let mut removed = Vec::new();
        for i in order {
            match self.bricks[i].call(creds, r.clone().into()).await {
                Ok(reply) if i == found.hashed => {
                    lock(&self.layouts).pop(&found.iatt.gfid);
                    lock(&self.homes).pop(&found.iatt.gfid);
                    return Ok(reply);
                }
                Ok(_) => removed.push(i),
                Err(Error::Fop(ErrorCode::NoEnt)) if i != found.hashed => {}
                Err(e) => {
                    self.put_back_dir(&r, &found.iatt, &removed).await;
                    return Err(e);
                }
            }
        }
        Err(Error::Fop(ErrorCode::NoEnt))
    }

    /// Makes the removed copies of directory `iatt` (`r.name` in `r.parent`) again on
    /// `bricks`, with its layout.
    async fn put_back_dir(&self, r: &kiln_wire::Rmdir, iatt: &Iatt, bricks: &[usize]) {
        let layout = lock(&self.layouts).get(&iatt.gfid).cloned();
        for &i in bricks {
            let mut made = self.make_dir_copy(i, r.parent, &r.name, iatt).await;
            if let (Ok(()), Some(disk)) = (&made, layout.as_ref().and_then(|l| l.disk_layout(i))) {
                made = self.set_disk_layout(i, iatt.gfid, disk).await;
            }
            if let Err(e) = made {
                tracing::warn!(brick = i, error = %e, "a directory copy removed by a failed rmdir could not be put back");
            }
        }
    }

    async fn set_disk_layout(
        &self,
        brick: usize,
        dir: Gfid,
        disk: DiskLayout,
    ) -> Result<(), Error> {
        let set = kiln_wire::Setxattr {
            gfid: dir,
            name: xattr_name(XATTR_NAME),
            value: XattrValue::new(Bytes::copy_from_slice(&disk.encode()))
                .map_err(|e| Error::Protocol(e.to_string()))?,
            mode: XattrSetMode::Upsert,
        };
        self.bricks[brick]
            .call(&Creds::root(), set.into())
            .await
            .map(drop)
    }

    /// UNLINK on the brick holding the entry, and its link file on the hashed brick.
    async fn unlink(&self, creds: &Creds, r: kiln_wire::Unlink) -> Result<FopReply, Error> {
        let lookup = kiln_wire::Lookup {
            parent: r.parent,
            name: r.name.clone(),
        };
        let found = self.locate(creds, r.parent, &r.name, lookup.into()).await?;
        self.unlink_located(creds, r.parent, &r.name, &found).await
    }

    /// UNLINK of the entry `found` (`name` in `parent`) where it lives, then of its link
    /// file.
    async fn unlink_located(
        &self,
        creds: &Creds,
        parent: Gfid,
        name: &Name,
        found: &Located,
    ) -> Result<FopReply, Error> {
        let unlink = kiln_wire::Unlink {
            parent,
            name: name.clone(),
        };
        let reply = self.bricks[found.home].call(creds, unlink.into()).await?;
        if found.home != found.hashed {
            self.remove_link_file(found.hashed, parent, name).await?;
        }
        if found.iatt.nlink <= 1 {
            lock(&self.homes).pop(&found.iatt.gfid);
        }
        Ok(reply)
    }

    /// RENAME. A directory is renamed on every brick; a file on the brick that holds it
    /// (its data never moves), with a link file on the new name's hashed brick made first
    /// when that is another one, and the old name's link file removed after.
    async fn rename(&self, creds: &Creds, r: kiln_wire::Rename) -> Result<FopReply, Error> {
        let lookup = |parent, name: &Name| -> FopRequest {
            kiln_wire::Lookup {
                parent,
                name: name.clone(),
            }
            .into()
        };
        let source = self
            .locate(
                creds,
                r.old_parent,
                &r.old_name,
                lookup(r.old_parent, &r.old_name),
            )
            .await?;
        if source.iatt.file_type == FileType::Directory {
            return self.rename_dir(creds, r).await;
        }
        let (new_hashed, _) = self.hashed(r.new_parent, &r.new_name).await?;
        let target = self
            .locate(
                creds,
                r.new_parent,
                &r.new_name,
                lookup(r.new_parent, &r.new_name),
            )
            .await;
        match target {
            // Two names of one file: nothing moves.
            Ok(target) if target.iatt.gfid == source.iatt.gfid => {
                return self.bricks[source.home].call(creds, r.into()).await;
            }
            // A target on another brick is removed first; the rest of the rules (a
            // directory in the way, NOREPLACE) are the source brick's to apply.
            Ok(target) if target.home != source.home => {
                if r.mode == kiln_wire::RenameMode::NoReplace {
                    return Err(Error::Fop(ErrorCode::Exist));
                }
                if target.iatt.file_type == FileType::Directory {
                    return Err(Error::Fop(ErrorCode::IsDir));
                }
                self.unlink_located(creds, r.new_parent, &r.new_name, &target)
                    .await?;
            }
            Ok(_) | Err(Error::Fop(ErrorCode::NoEnt)) => {}
            Err(e) => return Err(e),
        }
        let linked = new_hashed != source.home;
        if linked {
            self.remove_link_file(new_hashed, r.new_parent, &r.new_name)
                .await?;
            let gfid = source.iatt.gfid;
            self.make_link_file(new_hashed, r.new_parent, &r.new_name, gfid, source.home)
                .await?;
        }
        let reply = match self.bricks[source.home].call(creds, r.clone().into()).await {
            Ok(reply) => reply,
            Err(e) => {
                if linked {
                    let _ = self
                        .remove_link_file(new_hashed, r.new_parent, &r.new_name)
                        .await;
                }
                return Err(e);
            }
        };
        if source.hashed != source.home {
            self.remove_link_file(source.hashed, r.old_parent, &r.old_name)
                .await?;
        }
        Ok(reply)
    }

    /// A directory renamed on every brick, the new name's hashed brick first. A directory
    /// it would replace must be empty on every brick (each brick only sees its own copy).
    async fn rename_dir(&self, creds: &Creds, r: kiln_wire::Rename) -> Result<FopReply, Error> {
        let (hashed, _) = self.hashed(r.new_parent, &r.new_name).await?;
        let lookup = kiln_wire::Lookup {
            parent: r.new_parent,
            name: r.new_name.clone(),
        };
        match self
            .locate(creds, r.new_parent, &r.new_name, lookup.into())
            .await
        {
            Ok(target) if target.iatt.file_type == FileType::Directory => {
                if !self.read_dir(creds, target.iatt.gfid).await?.is_empty() {
                    return Err(Error::Fop(ErrorCode::NotEmpty));
                }
            }
            Ok(_) | Err(Error::Fop(ErrorCode::NoEnt)) => {}
            Err(e) => return Err(e),
        }
        let reply = self.bricks[hashed].call(creds, r.clone().into()).await?;
        for (i, brick) in self.bricks.iter().enumerate().filter(|(i, _)| *i != hashed) {
            match brick.call(creds, r.clone().into()).await {
                Ok(_) | Err(Error::Fop(ErrorCode::NoEnt)) => {}
                Err(e) => {
                    tracing::warn!(brick = i, error = %e, "rename of a directory did not reach every brick");
                }
            }
        }
        Ok(reply)
    }

    /// LINK on the brick holding the object, with a link file on the new name's hashed
    /// brick (made first) when that is another one.
    async fn link(&self, creds: &Creds, r: kiln_wire::Link) -> Result<FopReply, Error> {
        let home = match self.home(creds, r.gfid).await? {
            Home::Brick(b) => b,
            Home::Everywhere => return Err(Error::Fop(ErrorCode::Perm)),
        };
        let (hashed, _) = self.hashed(r.new_parent, &r.new_name).await?;
        if hashed == home {
            return self.bricks[home].call(creds, r.into()).await;
        }
        self.make_link_file(hashed, r.new_parent, &r.new_name, r.gfid, home)
            .await?;
        let linked = self.bricks[home].call(creds, r.clone().into()).await;
        if linked.is_err() {
            let _ = self
                .remove_link_file(hashed, r.new_parent, &r.new_name)
                .await;
        }
        linked
    }

    /// STATFS: the bricks' sums, in the first brick's block size.
    async fn statfs(&self, creds: &Creds, fop: FopRequest) -> Result<FopReply, Error> {
        let mut total: Option<FsStats> = None;
        for brick in &self.bricks {
            let FopReply::Statfs(r) = brick.call(creds, fop.clone()).await? else {
                return Err(Error::Protocol("a STATFS answered otherwise".into()));
            };
            total = Some(match total {
                None => r.stats,
                Some(sum) => add_stats(&sum, &r.stats),
            });
        }
        let stats = total.ok_or(Error::Fop(ErrorCode::Io))?;
        Ok(FopReply::Statfs(kiln_wire::StatfsReply { stats }))
    }

    /// The entries of directory `fds` from this layer's `offset`.
    async fn list(
        &self,
        creds: &Creds,
        fds: &DirFds<L::Fd>,
        offset: u64,
        size: ReaddirSize,
    ) -> Result<ReaddirpXattrsReply, Error> {
        let (mut brick, mut from) = match offset {
            // A listing from the start: the offsets of earlier ones go.
            0 => {
                lock(&fds.offsets).clear();
                (0, 0)
            }
            n => {
                let offsets = lock(&fds.offsets);
                let index = usize::try_from(n - 1).map_err(|_| Error::Fop(ErrorCode::Inval))?;
                *offsets.get(index).ok_or(Error::Fop(ErrorCode::Inval))?
            }
        };
        let first = fds.fds.iter().position(Option::is_some);
        while brick < fds.fds.len() {
            let Some(fd) = &fds.fds[brick] else {
                (brick, from) = (brick + 1, 0);
                continue;
            };
            let fop = FdFop::new(|fd| {
                kiln_wire::ReaddirpXattrs {
                    fd,
                    offset: from,
                    size,
                }
                .into()
            });
            let FopReply::ReaddirpXattrs(reply) =
                self.bricks[brick].call_fd(creds, fd, fop).await?
            else {
                return Err(Error::Protocol("a READDIRP answered otherwise".into()));
            };
            let last = reply.entries.last().map(|e| e.offset);
            let mut entries = Vec::new();
            for e in reply.entries {
                let is_dir = e.iatt.file_type == FileType::Directory;
                if is_link_file(&e.iatt) || (is_dir && Some(brick) != first) {
                    continue;
                }
                self.note_home(&e.iatt, brick);
                let mut offsets = lock(&fds.offsets);
                offsets.push((brick, e.offset));
                entries.push(DirEntryXattrs {
                    offset: offsets.len() as u64,
                    ..e
                });
            }
            if !entries.is_empty() {
                let eof = reply.eof && brick + 1 == fds.fds.len();
                return Ok(ReaddirpXattrsReply { entries, eof });
            }
            (brick, from) = match (reply.eof, last) {
                (false, Some(last)) => (brick, last),
                _ => (brick + 1, 0),
            };
        }
        Ok(ReaddirpXattrsReply {
            entries: Vec::new(),
            eof: true,
        })
    }

    /// A fop on an open directory.
    async fn call_dir(
        &self,
        creds: &Creds,
        fds: &DirFds<L::Fd>,
        fop: FdFop,
    ) -> Result<FopReply, Error> {
        match fop.request().clone() {
            FopRequest::ReaddirpXattrs(r) => Ok(FopReply::ReaddirpXattrs(
                self.list(creds, fds, r.offset, r.size).await?,
            )),
            FopRequest::Readdirp(r) => {
                let reply = self.list(creds, fds, r.offset, r.size).await?;
                let entries = reply.entries.into_iter().map(|e| kiln_wire::DirEntryPlus {
                    offset: e.offset,
                    name: e.name,
                    iatt: e.iatt,
                });
                Ok(FopReply::Readdirp(kiln_wire::ReaddirpReply {
                    entries: entries.collect(),
                    eof: reply.eof,
                }))
            }
            FopRequest::Readdir(r) => {
                let reply = self.list(creds, fds, r.offset, r.size).await?;
                let entries = reply.entries.into_iter().map(|e| DirEntry {
                    offset: e.offset,
                    ino: e.iatt.ino,
                    file_type: e.iatt.file_type,
                    name: e.name,
                });
                Ok(FopReply::Readdir(kiln_wire::ReaddirReply {
                    entries: entries.collect(),
                    eof: reply.eof,
                }))
            }
            FopRequest::Fsyncdir(_) => {
                let mut answer = None;
                for (brick, fd) in self.dir_fds(fds) {
                    answer = Some(self.bricks[brick].call_fd(creds, fd, fop.clone()).await?);
                }
                answer.ok_or(Error::Fop(ErrorCode::BadFd))
            }
            // Anything else on a directory asks its first copy.
            _ => {
                let (brick, fd) = self
                    .dir_fds(fds)
                    .next()
                    .ok_or(Error::Fop(ErrorCode::BadFd))?;
                self.bricks[brick].call_fd(creds, fd, fop).await
            }
        }
    }

    fn dir_fds<'a>(&self, fds: &'a DirFds<L::Fd>) -> impl Iterator<Item = (usize, &'a L::Fd)> {
        fds.fds
            .iter()
            .enumerate()
            .filter_map(|(i, fd)| fd.as_ref().map(|fd| (i, fd)))
    }
}

/// An entry found: where its name hashes, where it lives, and the LOOKUP's answer there.
#[derive(Debug)]
struct Located {
    hashed: usize,
    home: usize,
    reply: FopReply,
    iatt: Iatt,
}

impl<L: Layer> Layer for Distribute<L> {
    type Fd = DistFd<L::Fd>;

    async fn call(&self, creds: &Creds, fop: FopRequest) -> Result<FopReply, Error> {
        use FopRequest as Q;
        match fop {
            Q::Lookup(ref r) => {
                let (parent, name) = (r.parent, r.name.clone());
                let found = self.locate(creds, parent, &name, fop).await?;
                self.looked_up(creds, parent, &name, found).await
            }
            Q::LookupXattrs(ref r) => {
                let (parent, name) = (r.parent, r.name.clone());
                let found = self.locate(creds, parent, &name, fop).await?;
                self.looked_up(creds, parent, &name, found).await
            }
            Q::Mknod(ref r) => {
                let (parent, name) = (r.parent, r.name.clone());
                self.make_file(creds, parent, &name, fop).await
            }
            Q::Symlink(ref r) => {
                let (parent, name) = (r.parent, r.name.clone());
                self.make_file(creds, parent, &name, fop).await
            }
            Q::Put(ref r) => {
                let (parent, name) = (r.parent, r.name.clone());
                self.make_file(creds, parent, &name, fop).await
            }
            Q::Mkdir(r) => self.mkdir(creds, r).await,
            Q::Rmdir(r) => self.rmdir(creds, r).await,
            Q::Unlink(r) => self.unlink(creds, r).await,
            Q::Rename(r) => self.rename(creds, r).await,
            Q::Link(r) => self.link(creds, r).await,
            Q::Statfs(_) => self.statfs(creds, fop).await,
            Q::Lease(_) => Err(Error::Fop(ErrorCode::NotSupported)),
            Q::Stat(ref r) => self.on_object(creds, r.gfid, fop.clone()).await,
            Q::Access(ref r) => self.on_object(creds, r.gfid, fop.clone()).await,
            Q::Readlink(ref r) => self.on_object(creds, r.gfid, fop.clone()).await,
            Q::Setxattr(ref r) => self.on_object(creds, r.gfid, fop.clone()).await,
            Q::Getxattr(ref r) => self.on_object(creds, r.gfid, fop.clone()).await,
            Q::Listxattr(ref r) => self.on_object(creds, r.gfid, fop.clone()).await,
            Q::Removexattr(ref r) => self.on_object(creds, r.gfid, fop.clone()).await,
            Q::Setattr(ref r) => self.on_object(creds, r.gfid, fop.clone()).await,
            Q::Truncate(ref r) => self.on_object(creds, r.gfid, fop.clone()).await,
            Q::Get(ref r) => self.on_object(creds, r.gfid, fop.clone()).await,
            other => Err(Error::Misuse(format!(
                "{} through Layer::call, which takes fops that name no fd and open nothing",
                other.code().name()
            ))),
        }
    }

    async fn open(
        &self,
        creds: &Creds,
        gfid: Gfid,
        access: AccessMode,
        flags: OpenFlags,
    ) -> Result<Self::Fd, Error> {
        let brick = match self.home(creds, gfid).await? {
            Home::Brick(b) => b,
            Home::Everywhere => return Err(Error::Fop(ErrorCode::IsDir)),
        };
        let fd = self.bricks[brick].open(creds, gfid, access, flags).await?;
        Ok(DistFd::File { brick, fd })
    }

    async fn create(
        &self,
        creds: &Creds,
        create: kiln_wire::Create,
    ) -> Result<(Self::Fd, EntryReply), Error> {
        let (brick, _) = self.hashed(create.parent, &create.name).await?;
        let (fd, entry) = self.bricks[brick].create(creds, create).await?;
        self.note_home(&entry.iatt, brick);
        Ok((DistFd::File { brick, fd }, entry))
    }

    async fn opendir(&self, creds: &Creds, gfid: Gfid) -> Result<Self::Fd, Error> {
        let mut fds = Vec::with_capacity(self.bricks.len());
        let mut failure = None;
        for brick in &self.bricks {
            match brick.opendir(creds, gfid).await {
                Ok(fd) => fds.push(Some(fd)),
                Err(e) => {
                    fds.push(None);
                    failure = Some(e);
                }
            }
        }
        match (fds.iter().any(Option::is_some), failure) {
            (false, Some(e)) => Err(e),
            _ => Ok(DistFd::Dir(DirFds {
                fds,
                offsets: Mutex::new(Vec::new()),
            })),
        }
    }

    async fn call_fd(&self, creds: &Creds, fd: &Self::Fd, fop: FdFop) -> Result<FopReply, Error> {
        match fd {
            DistFd::File { brick, fd } => self.bricks[*brick].call_fd(creds, fd, fop).await,
            DistFd::Dir(fds) => self.call_dir(creds, fds, fop).await,
        }
    }

    async fn release(&self, creds: &Creds, fd: Self::Fd) -> Result<(), Error> {
        match fd {
            DistFd::File { brick, fd } => self.bricks[brick].release(creds, fd).await,
            DistFd::Dir(fds) => {
                let mut result = Ok(());
                for (brick, fd) in fds.fds.into_iter().enumerate() {
                    if let Some(fd) = fd {
                        result = result.and(self.bricks[brick].release(creds, fd).await);
                    }
                }
                result
            }
        }
    }

    /// One fop after another through [`Layer::call`]: each may need several bricks.
    async fn batch(&self, batch: Batch) -> Result<BatchReply, Error> {
        let mut results = Vec::with_capacity(batch.len());
        for fop in batch.fops() {
            results.push(match self.call(&batch.creds, fop.clone()).await {
                Ok(reply) => Ok(reply),
                Err(Error::Fop(code)) => Err(code),
                Err(e) => return Err(e),
            });
        }
        Ok(BatchReply { results })
    }

    fn leases(&self) -> bool {
        false
    }

    fn events(&self) -> broadcast::Receiver<LayerEvent> {
        self.events.subscribe()
    }
}

/// Whether `fop` changes the object it names (and so must reach every copy of a directory).
fn changes_object(fop: &FopRequest) -> bool {
    matches!(
        fop.code(),
        FopCode::Setattr | FopCode::Setxattr | FopCode::Removexattr | FopCode::Truncate
    )
}

/// A link file: a regular file with the sticky bit and no permission bits, and no data.
fn is_link_file(iatt: &Iatt) -> bool {
    iatt.file_type == FileType::Regular && iatt.mode.bits() == LINK_FILE_MODE && iatt.size == 0
}

/// The entry a LOOKUP or a create answered with.
fn entry_iatt(reply: &FopReply) -> Result<&Iatt, Error> {
    match reply {
        FopReply::Lookup(r) => Ok(&r.iatt),
        FopReply::LookupXattrs(r) => Ok(&r.iatt),
        FopReply::Mknod(r) | FopReply::Symlink(r) | FopReply::Put(r) => Ok(&r.iatt),
        other => Err(unexpected(other)),
    }
}

/// The layout one brick's copy of directory `dir` carries, if any.
async fn read_disk_layout<L: Layer>(brick: &L, dir: Gfid) -> Result<Option<DiskLayout>, Error> {
    let get = kiln_wire::Getxattr {
        gfid: dir,
        name: xattr_name(XATTR_NAME),
    };
    match brick.call(&Creds::root(), get.into()).await {
        Ok(FopReply::Getxattr(r)) => DiskLayout::decode(r.value.as_bytes())
            .map(Some)
            .map_err(|e| layout_error(dir, &e)),
        Ok(other) => Err(unexpected(&other)),
        Err(Error::Fop(ErrorCode::NoData | ErrorCode::NoEnt | ErrorCode::Stale)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Keeps the latest of each time of `iatt` and `copy` (two copies of one directory).
fn merge_times(iatt: &mut Iatt, copy: &Iatt) {
    iatt.atime = iatt.atime.max(copy.atime);
    iatt.mtime = iatt.mtime.max(copy.mtime);
    iatt.ctime = iatt.ctime.max(copy.ctime);
}

fn add_stats(sum: &FsStats, more: &FsStats) -> FsStats {
    // In the first brick's fragment size.
    let scale = |blocks: u64| {
        let bytes = u128::from(blocks) * u128::from(more.frsize.max(1));
        u64::try_from(bytes / u128::from(sum.frsize.max(1))).unwrap_or(u64::MAX)
    };
    FsStats {
        blocks: sum.blocks.saturating_add(scale(more.blocks)),
        bfree: sum.bfree.saturating_add(scale(more.bfree)),
        bavail: sum.bavail.saturating_add(scale(more.bavail)),
        files: sum.files.saturating_add(more.files),
        ffree: sum.ffree.saturating_add(more.ffree),
        favail: sum.favail.saturating_add(more.favail),
        namemax: sum.namemax.min(more.namemax),
        ..*sum
    }
}

fn xattr_name(name: &'static str) -> XattrName {
    XattrName::new(Bytes::from_static(name.as_bytes()))
        .unwrap_or_else(|_| unreachable!("{name} is a valid xattr name"))
}

fn layout_error(dir: Gfid, e: &super::Error) -> Error {
    tracing::warn!(%dir, error = %e, "a directory's layout is unusable");
    Error::Fop(ErrorCode::Io)
}

fn unexpected(reply: &FopReply) -> Error {
    Error::Protocol(format!("an unexpected {} reply", reply.code().name()))
}

fn capacity(entries: usize) -> NonZeroUsize {
    NonZeroUsize::new(entries).unwrap_or(NonZeroUsize::MIN)
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every update is one step: a panic elsewhere leaves the caches consistent.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_files_are_told_by_mode_and_size() {
        let mut iatt = Iatt {
            gfid: Gfid::ROOT,
            ino: 1,
            file_type: FileType::Regular,
            mode: Mode::new(LINK_FILE_MODE).expect("mode"),
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            size: 0,
            blocks: 0,
            blksize: 4096,
            atime: kiln_wire::Timespec::default(),
            mtime: kiln_wire::Timespec::default(),
            ctime: kiln_wire::Timespec::default(),
        };
        assert!(is_link_file(&iatt));
        iatt.size = 1;
        assert!(!is_link_file(&iatt));
        iatt.size = 0;
        iatt.mode = Mode::new(0o1644).expect("mode");
        assert!(!is_link_file(&iatt));
    }
}
