//! The distribution layer: one namespace over many bricks, placed as GlusterFS's DHT places
//! it, so the bricks of a distributed GlusterFS volume are served in place.
//!
//! * **Directories** exist on every brick with the same GFID; each copy carries its share of
//!   the directory's [`Layout`] (`trusted.glusterfs.dht`). A directory's layout is read from
//!   all bricks and kept for [`LAYOUT_TTL`], or while a lease on it is held ([`layouts`]);
//!   one with no layout anywhere (a fresh root) gets one.
//! * **Files** (and symlinks, special files) live on the brick their name hashes to in the
//!   parent's layout — or elsewhere, with a **link file** on the hashed brick (mode
//!   `---------T`, size 0, the same GFID, `trusted.glusterfs.dht.linkto` naming the brick that
//!   holds the data), as a rename to a name hashed elsewhere leaves. Which brick holds an
//!   object is remembered by GFID.
//! * **LOOKUP** asks the hashed brick and follows a link file; a miss there is the answer
//!   when the layout has no holes and was committed (GlusterFS's `lookup-optimize`), else
//!   every brick is asked. A link file whose object is gone from the brick it points to is
//!   stale (a move that raced an unlink, a crash) and removed — by the lookup that follows
//!   it, by a make of its name that the hashed brick refused with EEXIST (which then runs
//!   again), and by an RMDIR a brick refused only because of such link files.
//! * **MKDIR** runs on the hashed brick first, then the others, and writes the new layout;
//!   **RMDIR** removes the other copies first (at once) and the hashed one last, and puts back the
//!   copies it removed when one brick still has entries. **RENAME** of a file renames it on
//!   the brick that holds it and leaves a link file on the new name's hashed brick; of a
//!   directory, on every brick.
//! * **READDIRP** lists brick after brick, each directory once (from the first brick) and no
//!   link files, with offsets of this layer's own that map to (brick, brick offset); a
//!   directory opened with its listing is one OPENDIR_LIST on every brick at once.
//! * **BATCH** runs in waves of fops that cannot see each other ([`batch`]).
//! * **STATFS** sums the bricks.
//! * **Leases** on a directory are held on every brick's copy, and a recall from any brick is
//!   passed up ([`leases`]).
//! * **Heal.** A LOOKUP that finds a directory makes its copies missing on some brick, and
//!   rebuilds a layout with holes or overlaps, or one that leaves a brick out, over every
//!   brick (uncommitted, so names placed by the old one stay reachable);
//!   [`Distribute::heal_tree`] looks up every directory (`kiln volume heal`).
//!
//! Layouts are written as root: the client of a distributed volume must be trusted with root
//! by its bricks (`server.root-allow`), as GlusterFS's DHT writes them as root too.
//!
//! Here: the layer, its routing of each fop and the caches; [`namespace`] where a name is and
//! the namespace fops; [`heal`] layouts written and directories healed; [`layouts`] the
//! layouts kept; [`listing`] open directories; [`batch`] BATCH; [`leases`] leases.

use std::fmt::Debug;
use std::future::Future;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kiln_wire::{
    AccessMode, Batch, BatchReply, Creds, DirEntry, DirEntryXattrs, EntryReply, ErrorCode,
    FileType, FopCode, FopReply, FopRequest, FsStats, Gfid, Iatt, LeaseKind, Mode, Name, NodeType,
    OpenFlags, PutSynced, ReaddirSize, ReaddirpXattrsReply, RenameMode, XattrName, XattrSetMode,
    XattrValue,
};
use tokio::sync::broadcast;

use super::{
    COMMIT_HASH_COMMITTED, COMMIT_HASH_INVALID, DiskLayout, Layout, Munging, XATTR_NAME,
    first_brick,
};
use crate::layer::{FdFop, Layer, LayerEvent};
use crate::{Error, LayerExt, Paths};

mod batch;
mod bricks;
mod files;
mod heal;
mod layouts;
mod leases;
mod listing;
mod migrate;
mod namespace;

use bricks::Bricks;
pub use bricks::{BRICKS_REFRESH, BrickSource, Listed, Member};
pub use files::FileFd;
pub use heal::HealReport;
use heal::Healed;
pub use listing::DirFds;
pub use migrate::RebalanceReport;
use namespace::Located;

/// The xattr of a link file: the name of the subvolume (brick) that holds the data.
pub const LINKTO_XATTR: &str = "trusted.glusterfs.dht.linkto";
/// Objects whose brick this layer remembers; the least recently used is forgotten first
/// (and found again by asking every brick).
const HOMES_MAX: usize = 1 << 20;
/// Directory layouts this layer keeps.
const LAYOUTS_MAX: usize = 64 * 1024;
/// How long a directory's layout is used before it is read again: how long this layer may
/// place new names by a layout another client (a fix-layout, a rebalance) has replaced. One
/// read under a lease this layer holds is used until the lease goes.
pub const LAYOUT_TTL: Duration = Duration::from_secs(1);
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
    bricks: Arc<Bricks<L>>,
    /// The volume's name: link files name bricks `VOLUME-client-N`.
    volume: String,
    munging: Munging,
    layouts: Arc<layouts::Layouts>,
    homes: Mutex<lru::LruCache<Gfid, Home>>,
    /// Every brick's events, passed on as they come ([`leases`]).
    events: broadcast::Sender<LayerEvent>,
    /// Whether they are: the layer was made in a runtime to run the tasks passing them.
    passes_events: bool,
    healed: Healed,
}

/// This layer's handle on an open file (its brick's fd) or directory (every brick's).
#[derive(Debug)]
pub enum DistFd<F> {
    File(FileFd<F>),
    Dir(DirFds<F>),
}

impl<L: Layer> Distribute<L> {
    /// The layer over `bricks` of volume `volume` (at least one), all serving.
    pub fn new(bricks: Vec<L>, volume: &str) -> Result<Distribute<L>, Error> {
        Distribute::of_members(bricks.into_iter().map(Member::Serving).collect(), volume)
    }

    /// The layer over the bricks of volume `volume` (at least one in service), in order.
    /// Made in a tokio runtime, it passes the bricks' events on, and grants leases where they
    /// all do.
    pub fn of_members(members: Vec<Member<L>>, volume: &str) -> Result<Distribute<L>, Error> {
        let events = broadcast::Sender::new(leases::EVENTS_QUEUED_MAX);
        let layouts = Arc::new(layouts::Layouts::new());
        let runtime = tokio::runtime::Handle::try_current().ok();
        let passes_events = runtime.is_some();
        let joined =
            runtime.map(|runtime| leases::pass_events_on(runtime, events.clone(), layouts.clone()));
        Ok(Distribute {
            bricks: Arc::new(Bricks::new(members, joined)?),
            volume: volume.to_owned(),
            munging: Munging::default(),
            layouts,
            homes: Mutex::new(lru::LruCache::new(capacity(HOMES_MAX))),
            events,
            passes_events,
            healed: Healed::default(),
        })
    }

    /// The layer that learns of bricks added to the volume, and of bricks leaving or removed,
    /// from `source`: every [`BRICKS_REFRESH`] ([`Distribute::refresh_forever`]), and when a
    /// layout has a hole or does not fit the roles, a link file names a brick it does not
    /// know or an object is on none it knows (at most once per [`BRICKS_REFRESH`] in vain).
    pub fn with_source(mut self, source: impl BrickSource<L>) -> Distribute<L> {
        Arc::get_mut(&mut self.bricks)
            .expect("the bricks are shared only once the layer is made")
            .set_source(Box::new(source));
        self
    }

    /// Asks the brick source every [`BRICKS_REFRESH`] while this layer lives, so a brick
    /// removed from the volume is left alone within that time (a mount spawns it).
    pub fn refresh_forever(&self) -> impl Future<Output = ()> + Send + 'static {
        let bricks = Arc::downgrade(&self.bricks);
        async move {
            loop {
                tokio::time::sleep(BRICKS_REFRESH).await;
                let Some(bricks) = bricks.upgrade() else {
                    return;
                };
                if let Err(e) = bricks.ask_source().await {
                    tracing::debug!(error = %e, "the volume's bricks could not be asked for");
                }
            }
        }
    }

    /// The bricks below in service, in order.
    pub fn bricks(&self) -> impl Iterator<Item = &L> {
        self.bricks.in_service().map(|(_, brick)| brick)
    }

    /// Asks the brick source for bricks added to the volume and roles changed; whether
    /// anything changed (the layouts read before are read again then). A source out of reach
    /// changes nothing (logged): the layer goes on with the bricks it knows.
    async fn refresh_bricks(&self) -> bool {
        self.bricks.refresh().await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "the volume's bricks could not be asked for");
            false
        })
    }

    /// The layout of directory `dir`: cached (for [`LAYOUT_TTL`]), else read from every
    /// brick; a directory with no layout on any brick (a volume's fresh root) is given one.
    pub async fn layout(&self, dir: Gfid) -> Result<Arc<Layout>, Error> {
        let stale = match self.cached_layout(dir) {
            Some((layout, true)) => return Ok(layout),
            Some((layout, false)) => Some(layout),
            None => None,
        };
        let generation = self.bricks.generation();
        let read = futures_util::future::try_join_all(self.bricks.indexes().map(|i| async move {
            match self.bricks.get(i) {
                Ok(brick) => read_disk_layout(brick, dir).await,
                Err(_) => Ok(None),
            }
        }))
        .await;
        let disks = match (read, stale) {
            (Ok(disks), _) => disks,
            // A brick out of reach: the layout read last is still the best there is, and the
            // names on the other bricks stay reachable. Kept for another lifetime, so the
            // fops meanwhile do not each wait for the brick to fail.
            (Err(e), Some(stale)) => {
                tracing::debug!(%dir, error = %e, "a layout not read again; the last one kept");
                self.keep_layout(dir, stale.clone(), generation);
                return Ok(stale);
            }
            (Err(e), None) => return Err(e),
        };
        if disks.iter().all(Option::is_none) {
            return self.write_new_layout(dir, &[]).await;
        }
        let layout = Arc::new(Layout::from_disk(&disks).map_err(|e| layout_error(dir, &e))?);
        self.keep_layout(dir, layout.clone(), generation);
        Ok(layout)
    }

    /// The layout of `dir` read last, and whether it is fresh ([`layouts`]).
    fn cached_layout(&self, dir: Gfid) -> Option<(Arc<Layout>, bool)> {
        self.layouts.get(dir, self.bricks.generation())
    }

    /// Keeps `layout` of `dir`, made or read under the bricks' `generation`.
    fn keep_layout(&self, dir: Gfid, layout: Arc<Layout>, generation: u64) {
        self.layouts.keep(dir, layout, generation);
    }

    fn forget_layout(&self, dir: Gfid) {
        self.layouts.forget(dir);
    }

    /// The brick `name` hashes to in directory `parent`. A name in a hole of the layout reads
    /// it again (it may have been read while another client wrote it) after asking for bricks
    /// added to the volume: the hole may be a new brick's share.
    async fn hashed(&self, parent: Gfid, name: &Name) -> Result<(usize, Arc<Layout>), Error> {
        let layout = self.layout(parent).await?;
        if let Some(brick) = layout.hashed_brick(name.as_bytes(), self.munging) {
            return Ok((brick, layout));
        }
        self.refresh_bricks().await;
        self.forget_layout(parent);
        let layout = self.layout(parent).await?;
        match layout.hashed_brick(name.as_bytes(), self.munging) {
            Some(brick) => Ok((brick, layout)),
            // GlusterFS answers EIO until the layout is healed.
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

    /// Where object `gfid` lives: remembered, else found by asking every brick (and, found
    /// on none, the bricks added to the volume).
    async fn home(&self, creds: &Creds, gfid: Gfid) -> Result<Home, Error> {
        if gfid.is_root() {
            return Ok(Home::Everywhere);
        }
        if let Some(home) = lock(&self.homes).get(&gfid) {
            return Ok(*home);
        }
        let known = self.bricks.len();
        match self.find_home(creds, gfid, 0).await {
            Err(Error::Fop(ErrorCode::Stale)) if self.refresh_bricks().await => {
                self.find_home(creds, gfid, known).await
            }
            found => found,
        }
    }

    /// Where object `gfid` lives, asking bricks `from` on.
    async fn find_home(&self, creds: &Creds, gfid: Gfid, from: usize) -> Result<Home, Error> {
        let mut failure = Error::Fop(ErrorCode::Stale);
        for (i, brick) in self.bricks.in_service().skip_while(|(i, _)| *i < from) {
            match brick.stat(creds, gfid).await {
                Ok(iatt) if self.link_file_target(i, &iatt).await?.is_none() => {
                    return Ok(self.note_home(&iatt, i));
                }
                Ok(_) | Err(Error::Fop(ErrorCode::Stale | ErrorCode::NoEnt)) => {}
                Err(e) => failure = e,
            }
        }
        Err(failure)
    }

    /// Runs `fop` on brick `home` of the object it names, or for a directory on every brick
    /// that has a copy when it changes the directory, else on the first: the first copy's
    /// answer (a brick without a copy, as one that was full at the MKDIR, is skipped; none
    /// with a copy is the first brick's error).
    async fn on_object(
        &self,
        creds: &Creds,
        gfid: Gfid,
        fop: FopRequest,
    ) -> Result<FopReply, Error> {
        let changes = match self.home(creds, gfid).await? {
            Home::Brick(b) => return self.call_on_file(creds, gfid, b, fop).await,
            Home::Everywhere => changes_object(&fop),
        };
        let (mut answer, mut missing) = (None, None);
        for (i, brick) in self.bricks.in_service() {
            match brick.call(creds, fop.clone()).await {
                Ok(reply) if answer.is_none() => answer = Some((reply, i)),
                Ok(_) => {}
                Err(e @ Error::Fop(ErrorCode::NoEnt | ErrorCode::Stale)) => {
                    missing = missing.or(Some(e));
                }
                Err(e) => return Err(e),
            }
            if answer.is_some() && !changes {
                break;
            }
        }
        match answer {
            Some((reply, from)) if !changes => self.merged_dir(creds, reply, from).await,
            Some((reply, _)) => Ok(reply),
            None => Err(missing.unwrap_or(Error::Fop(ErrorCode::NotConnected))),
        }
    }

    /// STATFS: the bricks' sums, in the first brick's block size.
    async fn statfs(&self, creds: &Creds, fop: FopRequest) -> Result<FopReply, Error> {
        let each = self.statfs_of_each(creds, fop).await?;
        let stats = each.into_iter().reduce(|sum, more| add_stats(&sum, &more));
        let stats = stats.ok_or(Error::Fop(ErrorCode::Io))?;
        Ok(FopReply::Statfs(kiln_wire::StatfsReply { stats }))
    }

    /// STATFS `fop` on each brick in service.
    async fn statfs_of_each(&self, creds: &Creds, fop: FopRequest) -> Result<Vec<FsStats>, Error> {
        let mut each = Vec::new();
        for (_, brick) in self.bricks.in_service() {
            let FopReply::Statfs(r) = brick.call(creds, fop.clone()).await? else {
                return Err(Error::Protocol("a STATFS answered otherwise".into()));
            };
            each.push(r.stats);
        }
        Ok(each)
    }
}

/// Each fop runs from the heap (`Box::pin`): its state, the largest of every way it may go
/// through the bricks, stays out of the futures of the layers above, which the mount moves
/// whole into a task for every request, answered in memory or not (34 KiB each before).
impl<L: Layer> Layer for Distribute<L> {
    type Fd = DistFd<L::Fd>;

    fn call(
        &self,
        creds: &Creds,
        fop: FopRequest,
    ) -> impl Future<Output = Result<FopReply, Error>> + Send {
        Box::pin(async move {
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
                Q::Put(ref r) | Q::PutSynced(PutSynced { put: ref r }) => {
                    let (parent, name) = (r.parent, r.name.clone());
                    self.make_file(creds, parent, &name, fop).await
                }
                Q::Mkdir(r) => self.mkdir(creds, r).await,
                Q::Rmdir(r) => self.rmdir(creds, r).await,
                Q::Unlink(r) => self.unlink(creds, r).await,
                Q::Rename(r) => self.rename(creds, r).await,
                Q::Link(r) => self.link(creds, r).await,
                Q::Statfs(_) => self.statfs(creds, fop).await,
                Q::Lease(r) => self.lease(creds, r).await,
                Q::Stat(ref r) => self.on_object(creds, r.gfid, fop.clone()).await,
                Q::Access(ref r) => self.on_object(creds, r.gfid, fop.clone()).await,
                Q::Readlink(ref r) => self.on_object(creds, r.gfid, fop.clone()).await,
                // The layouts and link files are this layer's to write.
                Q::Setxattr(ref r) if is_dht_xattr(&r.name) => Err(Error::Fop(ErrorCode::Perm)),
                Q::Removexattr(ref r) if is_dht_xattr(&r.name) => Err(Error::Fop(ErrorCode::Perm)),
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
        })
    }

    fn open(
        &self,
        creds: &Creds,
        gfid: Gfid,
        access: AccessMode,
        flags: OpenFlags,
    ) -> impl Future<Output = Result<Self::Fd, Error>> + Send {
        Box::pin(async move {
            let mut brick = match self.home(creds, gfid).await? {
                Home::Brick(b) => b,
                Home::Everywhere => return Err(Error::Fop(ErrorCode::IsDir)),
            };
            let fd = match self
                .bricks
                .get(brick)?
                .open(creds, gfid, access, flags)
                .await
            {
                // Moved since this layer last saw it (a rebalance): looked for again.
                Err(Error::Fop(code @ (ErrorCode::NoEnt | ErrorCode::Stale))) => {
                    lock(&self.homes).pop(&gfid);
                    match self.home(creds, gfid).await? {
                        Home::Brick(b) if b != brick => brick = b,
                        _ => return Err(Error::Fop(code)),
                    }
                    self.bricks
                        .get(brick)?
                        .open(creds, gfid, access, flags)
                        .await?
                }
                opened => opened?,
            };
            Ok(DistFd::File(FileFd::new(gfid, brick, fd, access, flags)))
        })
    }

    fn create(
        &self,
        creds: &Creds,
        create: kiln_wire::Create,
    ) -> impl Future<Output = Result<(Self::Fd, EntryReply), Error>> + Send {
        Box::pin(async move {
            let (brick, layout) = self.hashed(create.parent, &create.name).await?;
            // A name placed by an older layout gets a link file here first, which the create
            // opens (or, exclusive, fails on).
            self.exists_unseen(creds, create.parent, &create.name, &layout)
                .await?;
            let (access, flags) = (create.access, create.flags);
            let (parent, name) = (create.parent, create.name.clone());
            let on_hashed = self.bricks.get(brick)?;
            let make = || on_hashed.create(creds, create.clone());
            let (mut fd, mut entry) = self.making(brick, parent, &name, make).await?;
            // A create without EXCL opens a name that exists: one that is a link file is the
            // file on another brick (the caller's kernel still thought the name free) — or
            // stale, and then removed and the file made.
            if self.is_stale_link_file(brick, &entry.iatt).await? {
                let _ = on_hashed.release(creds, fd).await;
                self.remove_link_file_of(brick, parent, &name, entry.iatt.gfid)
                    .await?;
                (fd, entry) = on_hashed.create(creds, create).await?;
            }
            if let Some(home) = self.link_file_target(brick, &entry.iatt).await? {
                let _ = self.bricks.get(brick)?.release(creds, fd).await;
                let gfid = entry.iatt.gfid;
                let fd = self
                    .bricks
                    .get(home)?
                    .open(creds, gfid, access, flags)
                    .await?;
                let iatt = self.bricks.get(home)?.stat(creds, gfid).await?;
                self.note_home(&iatt, home);
                return Ok((
                    DistFd::File(FileFd::new(gfid, home, fd, access, flags)),
                    EntryReply { iatt, ..entry },
                ));
            }
            self.note_home(&entry.iatt, brick);
            let gfid = entry.iatt.gfid;
            Ok((
                DistFd::File(FileFd::new(gfid, brick, fd, access, flags)),
                entry,
            ))
        })
    }

    /// On every brick at once ([`Distribute::open_listed`]).
    fn opendir_list(
        &self,
        creds: &Creds,
        gfid: Gfid,
        size: ReaddirSize,
        lease: LeaseKind,
    ) -> impl Future<Output = Result<(Self::Fd, LeaseKind, ReaddirpXattrsReply), Error>> + Send
    {
        Box::pin(self.open_listed(creds, gfid, size, lease))
    }

    fn opendir(
        &self,
        creds: &Creds,
        gfid: Gfid,
    ) -> impl Future<Output = Result<Self::Fd, Error>> + Send {
        Box::pin(async move {
            let (fds, _) = self
                .open_everywhere(|brick| brick.opendir(creds, gfid))
                .await?;
            Ok(DistFd::Dir(DirFds::new(fds)))
        })
    }

    fn call_fd(
        &self,
        creds: &Creds,
        fd: &Self::Fd,
        fop: FdFop,
    ) -> impl Future<Output = Result<FopReply, Error>> + Send {
        Box::pin(async move {
            match fd {
                DistFd::File(file) => self.call_file(creds, file, fop).await,
                DistFd::Dir(fds) => self.call_dir(creds, fds, fop).await,
            }
        })
    }

    fn release(
        &self,
        creds: &Creds,
        fd: Self::Fd,
    ) -> impl Future<Output = Result<(), Error>> + Send {
        Box::pin(async move {
            match fd {
                // (An fd on a brick removed since is gone with its brick.)
                DistFd::File(file) => {
                    let mut result = Ok(());
                    for (brick, fd) in file.into_fds() {
                        if let Ok(brick) = self.bricks.get(brick) {
                            result = result.and(brick.release(creds, fd).await);
                        }
                    }
                    result
                }
                DistFd::Dir(fds) => {
                    let mut result = Ok(());
                    for (brick, fd) in fds.fds.into_iter().enumerate() {
                        if let (Some(fd), Ok(brick)) = (fd, self.bricks.get(brick)) {
                            result = result.and(brick.release(creds, fd).await);
                        }
                    }
                    result
                }
            }
        })
    }

    /// Through [`Layer::call`], in waves of fops that cannot see each other ([`batch`]).
    fn batch(&self, batch: Batch) -> impl Future<Output = Result<BatchReply, Error>> + Send {
        Box::pin(async move { self.batch_in_waves(&batch).await })
    }

    fn leases(&self) -> bool {
        self.bricks_lease()
    }

    fn listed_attrs(&self) -> bool {
        self.bricks_cover_listed_attrs()
    }

    fn file_leases(&self) -> bool {
        self.bricks_lease() && self.bricks.in_service().all(|(_, b)| b.file_leases())
    }

    fn statfs_each(
        &self,
        creds: &Creds,
    ) -> impl Future<Output = Result<Vec<FsStats>, Error>> + Send {
        let statfs = kiln_wire::Statfs { gfid: Gfid::ROOT };
        self.statfs_of_each(creds, statfs.into())
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

/// Whether `name` is one of DHT's own xattrs (a layout, a link file's target).
fn is_dht_xattr(name: &XattrName) -> bool {
    name.as_bytes() == XATTR_NAME.as_bytes() || name.as_bytes() == LINKTO_XATTR.as_bytes()
}

/// Whether `iatt` has a link file's looks: a regular file with the sticky bit and no
/// permission bits (one is a link file if it also has the `linkto` xattr). A link file may
/// hold data: the destination of a file a rebalance is copying.
fn looks_like_link_file(iatt: &Iatt) -> bool {
    iatt.file_type == FileType::Regular && iatt.mode.bits() == LINK_FILE_MODE
}

/// The entry a LOOKUP or a create answered with.
fn entry_iatt(reply: &FopReply) -> Result<&Iatt, Error> {
    match reply {
        FopReply::Lookup(r) => Ok(&r.iatt),
        FopReply::LookupXattrs(r) => Ok(&r.iatt),
        FopReply::Mknod(r) | FopReply::Symlink(r) | FopReply::Put(r) | FopReply::PutSynced(r) => {
            Ok(&r.iatt)
        }
        other => Err(unexpected(other)),
    }
}

/// The layout one brick's copy of directory `dir` carries, if any.
async fn read_disk_layout<L: Layer>(brick: &L, dir: Gfid) -> Result<Option<DiskLayout>, Error> {
    disk_layout_read(dir, brick.call(&Creds::root(), layout_read(dir)).await)
}

/// The read of directory `dir`'s layout xattr.
fn layout_read(dir: Gfid) -> FopRequest {
    kiln_wire::Getxattr {
        gfid: dir,
        name: xattr_name(XATTR_NAME),
    }
    .into()
}

/// The layout one brick's copy of directory `dir` carries, if any, from its `read`.
fn disk_layout_read(dir: Gfid, read: Result<FopReply, Error>) -> Result<Option<DiskLayout>, Error> {
    match read {
        Ok(FopReply::Getxattr(r)) => DiskLayout::decode(r.value.as_bytes())
            .map(Some)
            .map_err(|e| layout_error(dir, &e)),
        Ok(other) => Err(unexpected(&other)),
        Err(Error::Fop(ErrorCode::NoData | ErrorCode::NoEnt | ErrorCode::Stale)) => Ok(None),
        Err(e) => Err(e),
    }
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

    /// Attributes of an object of `file_type` and `mode`, the rest made up.
    pub(super) fn iatt(file_type: FileType, mode: u32) -> Iatt {
        Iatt {
            gfid: Gfid::ROOT,
            ino: 1,
            file_type,
            mode: Mode::new(mode).expect("mode"),
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
        }
    }

    #[test]
    fn link_files_look_like_sticky_files_with_no_permissions() {
        let mut iatt = iatt(FileType::Regular, LINK_FILE_MODE);
        assert!(looks_like_link_file(&iatt));
        iatt.size = 1;
        assert!(looks_like_link_file(&iatt), "a destination being copied");
        iatt.mode = Mode::new(0o1644).expect("mode");
        assert!(!looks_like_link_file(&iatt));
    }
}
